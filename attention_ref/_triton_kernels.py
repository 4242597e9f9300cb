"""The Triton kernels behind ``attention_ref.triton_flash`` (read that module's docstring first).

Not imported by anything at start-up: ``attention_ref.triton_flash`` loads this file on
first use, once per mode, under its own module name (``..._compiled`` or ``..._interpreted``),
because ``triton.jit`` decides when a kernel is *defined* whether it will be compiled for the
GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``). Loading a fresh copy per mode
keeps that decision independent of import order (and the interpreter, which adds names of
its own to the globals of the kernels it runs, touches only its private copy).

Names follow the FlashAttention literature: ``m_i`` running row max, ``l_i`` running row
sum, ``acc`` unnormalised output accumulator. Scores are kept in base-2 units
(``scale * log2(e) * q.k``) so that the exponentials are ``exp2``; the saved log-sum-exp
``lse`` is in the same units. Shape comments use ``BLOCK_*`` tile sizes.

Compile-time options (``tl.constexpr``, so a launch without them runs none of their code):
``IS_CAUSAL`` (key ``j`` takes part for query ``i`` when ``j <= i``), ``WINDOW_LEFT`` /
``WINDOW_RIGHT`` (the two sides of a sliding window: ``j >= i + win_lo`` /
``j <= i + win_hi``, with the runtime diagonals ``win_lo = offset - left`` and
``win_hi = offset + right``), ``HAS_KPM`` (a key-padding mask) and ``HAS_SOFTCAP``
(logit soft-capping: the base-2 score is ``qk_scale * tanh(tanh_scale * q.k)`` with
``tanh_scale = scale / cap`` and ``qk_scale = cap * log2(e)``; without it it is
``qk_scale * q.k`` with ``qk_scale = scale * log2(e)``). Masks (causal, window, padding)
are applied after the soft-capping, as in the reference.
"""

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only tools that import every module get here

    class _Stub:
        """Stand-in so that tools importing every module (doctest collection, API docs)
        can import this file without triton; triton_flash never loads it without triton."""

        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _Stub()
    INTERPRETED = None
else:
    # True when these kernels were defined under TRITON_INTERPRET=1 (run by the interpreter).
    if hasattr(triton, "knobs"):  # triton >= 3.4
        INTERPRETED = bool(triton.knobs.runtime.interpret)
    else:
        INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _load_2d(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Load a tile; out-of-range rows/columns (only checked where they can occur) read 0.
    if CHECK_ROWS:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) (1 - z) / (1 + z) with z = e^(-2|x|) = 2^(-2 log2(e) |x|) in (0, 1]:
    # finite for every finite or infinite x, and exp2 is one instruction on a GPU
    z = tl.math.exp2(-2.8853900817779268 * tl.abs(x))
    t = (1.0 - z) / (1.0 + z)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _allowed(ok, i, j, win_lo, win_hi,
             IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    # ok AND "query i sees key j" (i, j broadcasting index tiles): j <= i under
    # is_causal, and i + win_lo <= j <= i + win_hi for the sides of the window
    if IS_CAUSAL:
        ok = ok & (i >= j)  # top-left aligned: j <= i
    if WINDOW_LEFT:
        ok = ok & (j >= i + win_lo)
    if WINDOW_RIGHT:
        ok = ok & (j <= i + win_hi)
    return ok


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    k_base, v_base, kpm_base, stride_kn, stride_vn, k_desc, v_desc,
    offs_m, offs_d, lo, hi, S, D, qk_scale, tanh_scale, win_lo, win_hi,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # Stream key/value blocks [lo, hi) through the online softmax of one query tile.
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S
        d_ok = offs_d < D
        # K^T tile (BLOCK_D, BLOCK_N) and V tile (BLOCK_N, BLOCK_D)
        if USE_TMA:
            # tensor descriptors (Hopper's TMA on a GPU): the hardware computes the addresses
            # and fills rows past S and columns past D with 0, so no mask is needed to load
            kT = tl.trans(k_desc.load([start_n, 0]))  # (BLOCK_N, BLOCK_D) -> (BLOCK_D, BLOCK_N)
            v = v_desc.load([start_n, 0])
        else:
            kT = _load_2d(k_base + offs_d[:, None] + offs_n[None, :] * stride_kn, d_ok, n_ok,
                          not EVEN_D, MASKED)
            v = _load_2d(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], n_ok, d_ok,
                         MASKED, not EVEN_D)
        # (BLOCK_M, BLOCK_D) x (BLOCK_D, BLOCK_N) -> (BLOCK_M, BLOCK_N) scores, in base-2 units
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            s = _tanh(qk * tanh_scale) * qk_scale  # cap * tanh(scale * q.k / cap), before any mask
        else:
            # raw scores: qk_scale (> 0) multiplies them inside the exponent below, one FMA per
            # score, and the row max, since max(c x) = c max(x) for c > 0
            s = qk
        if MASKED:
            ok = _allowed(n_ok[None, :], offs_m[:, None], offs_n[None, :], win_lo, win_hi,
                          IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
            if HAS_KPM:
                keep = tl.load(kpm_base + offs_n, mask=n_ok, other=0)
                ok = ok & (keep[None, :] != 0)
            s = tl.where(ok, s, float("-inf"))
        elif HAS_KPM:
            keep = tl.load(kpm_base + offs_n)
            s = tl.where(keep[None, :] != 0, s, float("-inf"))
        # new running max m_i: the largest scaled score seen so far in each row
        if HAS_SOFTCAP:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED or HAS_KPM:
            # a row with no key so far has max -inf: shift it by 0 so exp2 gives 0, not NaN
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        # probabilities of this block, relative to the new max
        if HAS_SOFTCAP:
            p = tl.math.exp2(s - m_shift[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - m_shift[:, None])  # fused into one FMA
        # alpha rescales what was accumulated under the old max
        alpha = tl.math.exp2(m_i - m_shift)
        # running sum l_i: old sum rescaled plus this block's row sums
        l_i = l_i * alpha + tl.sum(p, 1)
        # accumulator acc: rescaled, plus P V: (BLOCK_M, BLOCK_N) x (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_blocks(start_m, L, S, win_lo, win_hi,
                IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key range of query tile ``start_m`` (rows start_m * BLOCK_M ..), as ``(lo, full_lo, full_hi, hi)``:
    keys in [lo, hi) are visited, the others skipped; the blocks in [full_lo, full_hi) are whole (every key
    exists) and seen by every row of the tile, so they need no mask. The forward kernel and dQ's share it."""
    if IS_CAUSAL:
        hi = tl.minimum(S, (start_m + 1) * BLOCK_M)
        full_hi = tl.minimum(start_m * BLOCK_M, (S // BLOCK_N) * BLOCK_N)
    else:
        hi = S
        full_hi = (S // BLOCK_N) * BLOCK_N
    lo = 0
    full_lo = 0
    if WINDOW_LEFT or WINDOW_RIGHT:
        # The tile's rows first..last see the keys first + win_lo .. last + win_hi
        # between them.
        first = start_m * BLOCK_M
        last = tl.minimum(first + BLOCK_M, L) - 1
        if IS_CAUSAL:
            # (the causal bound above counts rows past L too)
            hi = tl.minimum(hi, last + 1)
        # j <= i + win_hi: the last row reaches furthest right, the first least
        if WINDOW_RIGHT:
            hi = tl.minimum(hi, last + win_hi + 1)
            full_hi = tl.minimum(
                full_hi, tl.maximum(first + win_hi + 1, 0) // BLOCK_N * BLOCK_N)
        # j >= i + win_lo: the first row reaches furthest left, the last least
        if WINDOW_LEFT:
            lo = tl.maximum(first + win_lo, 0) // BLOCK_N * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(last + win_lo, 0), BLOCK_N) * BLOCK_N
            # lo is rounded down: a tile that sees no key visits no block
            hi = tl.where(first + win_lo < hi, hi, 0)
    return lo, full_lo, full_hi, hi


@triton.jit
def _attn_fwd(
    Q, K, V, KPM, O, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_lb, stride_lh, L, S, D, qk_scale, tanh_scale, win_lo, win_hi,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, GROUP: tl.constexpr,
):
    # grid (cdiv(L, BLOCK_M), B, H): one program per query tile of one (batch, head); query
    # head h reads key/value head h // GROUP (grouped-query attention; GROUP = 1 otherwise)
    if IS_CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    else:
        start_m = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    off_h = tl.program_id(2).to(tl.int64)
    off_hk = off_h // GROUP
    q_base = Q + off_b * stride_qb + off_h * stride_qh  # O shares Q's layout
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    kpm_base = KPM + off_b * stride_mb
    if USE_TMA:  # this head's keys and values as (S, D) row-major tensors (16-byte aligned rows)
        k_desc = tl.make_tensor_descriptor(k_base, shape=[S, D], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[S, D], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = k_base  # unused
        v_desc = v_base
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < L
    d_ok = offs_d < D
    q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = _load_2d(q_ptrs, m_ok, d_ok, True, not EVEN_D)  # (BLOCK_M, BLOCK_D), stays on chip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # unnormalised output
    lo, full_lo, full_hi, hi = _key_blocks(start_m, L, S, win_lo, win_hi, IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                                           BLOCK_M, BLOCK_N)
    if WINDOW_LEFT:  # masked blocks left of the unmasked ones
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_vn, k_desc, v_desc,
            offs_m, offs_d, lo, tl.minimum(full_lo, hi), S, D, qk_scale, tanh_scale, win_lo, win_hi,
            IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_KPM, HAS_SOFTCAP, True, BLOCK_N, EVEN_D, DOT_PRECISION, USE_TMA,
        )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_vn, k_desc, v_desc,
        offs_m, offs_d, full_lo, full_hi, S, D, qk_scale, tanh_scale, win_lo, win_hi,
        IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_KPM, HAS_SOFTCAP, False, BLOCK_N, EVEN_D, DOT_PRECISION, USE_TMA,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_vn, k_desc, v_desc,
        offs_m, offs_d, tl.maximum(full_lo, full_hi), hi, S, D, qk_scale, tanh_scale, win_lo, win_hi,
        IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_KPM, HAS_SOFTCAP, True, BLOCK_N, EVEN_D, DOT_PRECISION, USE_TMA,
    )
    # Normalise; a row where no key took part (l_i = 0) gets output 0 and lse +inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))  # base 2
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + offs_m, lse, mask=m_ok)
    o_ptrs = O + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_bwd_preprocess(
    O, DO, DELTA, stride_qb, stride_qh, stride_qm, stride_lb, stride_lh, L, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # delta_i = sum_d dO_id * O_id, in float32: grid (cdiv(L, BLOCK_M), B, H)
    off_b = tl.program_id(1).to(tl.int64)
    off_h = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < L
    mask = m_ok[:, None] & (offs_d[None, :] < D)
    offs = off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + off_b * stride_lb + off_h * stride_lh + offs_m, tl.sum(o * do, 1), mask=m_ok)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, q_desc, do_desc,
    offs_n, offs_d, lo, hi, L, D, qk_scale, tanh_scale, win_lo, win_hi,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_M1: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # Accumulate dk, dv of one key block over the query blocks [lo, hi).
    for start_m in range(lo, hi, BLOCK_M1):
        offs_m = start_m + tl.arange(0, BLOCK_M1)
        m_ok = offs_m < L
        d_ok = offs_d < D
        # Q^T tile (BLOCK_D, BLOCK_M1) and dO tile (BLOCK_M1, BLOCK_D)
        if USE_TMA:  # tensor descriptors: rows past L and columns past D come back as 0
            qT = tl.trans(q_desc.load([start_m, 0]))  # (BLOCK_M1, BLOCK_D) -> (BLOCK_D, BLOCK_M1)
            do = do_desc.load([start_m, 0])
        else:
            qT = _load_2d(q_base + offs_d[:, None] + offs_m[None, :] * stride_qm, d_ok, m_ok,
                          not EVEN_D, MASKED)
            do = _load_2d(do_base + offs_m[:, None] * stride_qm + offs_d[None, :], m_ok, d_ok,
                          MASKED, not EVEN_D)
        if MASKED:
            # rows past L: lse = +inf makes their P exactly 0
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # P^T recomputed from the saved log-sum-exp:
        # (BLOCK_N1, BLOCK_D) x (BLOCK_D, BLOCK_M1) -> (BLOCK_N1, BLOCK_M1)
        qkT = tl.dot(k, qT, input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            tT = _tanh(qkT * tanh_scale)
            pT = tl.math.exp2(tT * qk_scale - lse[None, :])
        else:
            pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if MASKED and (IS_CAUSAL or WINDOW_LEFT or WINDOW_RIGHT):
            ok = _allowed(m_ok[None, :], offs_m[None, :], offs_n[:, None], win_lo, win_hi,
                          IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
            pT = tl.where(ok, pT, 0.0)
        # dV += P^T dO: (BLOCK_N1, BLOCK_M1) x (BLOCK_M1, BLOCK_D)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        # dP^T = V dO^T: (BLOCK_N1, BLOCK_D) x (BLOCK_D, BLOCK_M1) -> (BLOCK_N1, BLOCK_M1)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        # dS^T = P^T * (dP^T - delta): the softmax backward, row by row
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)  # d tanh(x) / dx = 1 - tanh(x)^2
        # dK += dS^T Q: (BLOCK_N1, BLOCK_M1) x (BLOCK_M1, BLOCK_D)  (times scale at the end)
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, KPM, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_mb, stride_lb, stride_lh, L, S, D, sm_scale, qk_scale, tanh_scale, win_lo, win_hi,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, GROUP: tl.constexpr,
):
    # grid (cdiv(S, BLOCK_N1), B, Hkv): one program per key block of one key/value head,
    # summing over the GROUP query heads that read it; DO, DQ share Q's layout, V, DK, DV
    # share K's layout.
    start_n = tl.program_id(0) * BLOCK_N1
    off_b = tl.program_id(1).to(tl.int64)
    off_hk = tl.program_id(2).to(tl.int64)
    kv_off = off_b * stride_kb + off_hk * stride_kh
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < S
    d_ok = offs_d < D
    kv_offs = kv_off + offs_n[:, None] * stride_kn + offs_d[None, :]
    k = _load_2d(K + kv_offs, n_ok, d_ok, True, not EVEN_D)  # (BLOCK_N1, BLOCK_D)
    v = _load_2d(V + kv_offs, n_ok, d_ok, True, not EVEN_D)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    # Query rows in [lo, hi) are visited, the others skipped. Query blocks: [lo, mid) are
    # masked (they straddle the diagonal or the window's right edge); [mid, full_hi) see
    # every key of the block -> unmasked; [max(mid, full_hi), hi) -> masked tail.
    if IS_CAUSAL:
        lo = start_n  # queries i < start_n see none of these keys: skipped
        mid = start_n + BLOCK_N1
    else:
        lo = 0
        mid = 0
    full_hi = (L // BLOCK_M1) * BLOCK_M1
    hi = L
    if WINDOW_LEFT or WINDOW_RIGHT:
        # The block's keys start_n..last are seen by the rows start_n - win_hi .. last - win_lo.
        last = tl.minimum(start_n + BLOCK_N1, S) - 1
        if WINDOW_LEFT:  # i <= j - win_lo: the last key is seen furthest down, the first least
            hi = tl.minimum(hi, last - win_lo + 1)
            full_hi = tl.minimum(full_hi, tl.maximum(start_n - win_lo + 1, 0) // BLOCK_M1 * BLOCK_M1)
        if WINDOW_RIGHT:  # i >= j - win_hi: the first key is seen furthest up, the last least
            lo = tl.maximum(lo, tl.maximum(start_n - win_hi, 0) // BLOCK_M1 * BLOCK_M1)
            mid = tl.maximum(mid, tl.cdiv(tl.maximum(last - win_hi, 0), BLOCK_M1) * BLOCK_M1)
            hi = tl.where(start_n - win_hi < hi, hi, 0)  # lo is rounded down: no row sees, no block
    for g in range(0, GROUP):  # the query heads of this key/value head
        off_h = off_hk * GROUP + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_qb + off_h * stride_qh
        lse_base = LSE + off_b * stride_lb + off_h * stride_lh  # DELTA shares LSE's layout
        delta_base = DELTA + off_b * stride_lb + off_h * stride_lh
        if USE_TMA:  # this head's queries and output gradients as (L, D) row-major tensors
            q_desc = tl.make_tensor_descriptor(q_base, shape=[L, D], strides=[stride_qm, 1],
                                               block_shape=[BLOCK_M1, BLOCK_D])
            do_desc = tl.make_tensor_descriptor(do_base, shape=[L, D], strides=[stride_qm, 1],
                                                block_shape=[BLOCK_M1, BLOCK_D])
        else:
            q_desc = q_base  # unused
            do_desc = do_base
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, q_desc, do_desc,
            offs_n, offs_d, lo, tl.minimum(mid, hi), L, D, qk_scale, tanh_scale, win_lo, win_hi,
            IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, True, BLOCK_M1, EVEN_D, DOT_PRECISION, USE_TMA,
        )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, q_desc, do_desc,
            offs_n, offs_d, mid, full_hi, L, D, qk_scale, tanh_scale, win_lo, win_hi,
            IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, False, BLOCK_M1, EVEN_D, DOT_PRECISION, USE_TMA,
        )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, q_desc, do_desc,
            offs_n, offs_d, tl.maximum(mid, full_hi), hi, L, D, qk_scale, tanh_scale, win_lo, win_hi,
            IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, True, BLOCK_M1, EVEN_D, DOT_PRECISION, USE_TMA,
        )
    dk = dk * sm_scale
    if HAS_KPM:
        # a padded key takes part in no row: its gradients are 0 (the loop above
        # computed its rows as if unmasked; they are row-local, so dropping them is exact)
        keep = tl.load(KPM + off_b * stride_mb + offs_n, mask=n_ok, other=0) != 0
        dk = tl.where(keep[:, None], dk, 0.0)
        dv = tl.where(keep[:, None], dv, 0.0)
    store_ok = n_ok[:, None] & d_ok[None, :]
    tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=store_ok)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=store_ok)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse, delta, k_base, v_base, kpm_base, stride_kn, k_desc, v_desc,
    offs_m, offs_d, lo, hi, S, D, qk_scale, tanh_scale, win_lo, win_hi,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_N2: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # Accumulate dq of one query block over the key blocks [lo, hi).
    for start_n in range(lo, hi, BLOCK_N2):
        offs_n = start_n + tl.arange(0, BLOCK_N2)
        n_ok = offs_n < S
        d_ok = offs_d < D
        kv_offs = offs_d[:, None] + offs_n[None, :] * stride_kn
        # K^T and V^T tiles (BLOCK_D, BLOCK_N2)
        if USE_TMA:  # tensor descriptors: rows past S and columns past D come back as 0
            kT = tl.trans(k_desc.load([start_n, 0]))  # (BLOCK_N2, BLOCK_D) -> (BLOCK_D, BLOCK_N2)
            vT = tl.trans(v_desc.load([start_n, 0]))
        else:
            kT = _load_2d(k_base + kv_offs, d_ok, n_ok, not EVEN_D, MASKED)
            vT = _load_2d(v_base + kv_offs, d_ok, n_ok, not EVEN_D, MASKED)
        # P: (BLOCK_M2, BLOCK_D) x (BLOCK_D, BLOCK_N2) -> (BLOCK_M2, BLOCK_N2)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            t = _tanh(qk * tanh_scale)
            p = tl.math.exp2(t * qk_scale - lse[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            ok = _allowed(n_ok[None, :], offs_m[:, None], offs_n[None, :], win_lo, win_hi,
                          IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
            if HAS_KPM:
                keep = tl.load(kpm_base + offs_n, mask=n_ok, other=0)
                ok = ok & (keep[None, :] != 0)
            p = tl.where(ok, p, 0.0)
        elif HAS_KPM:
            keep = tl.load(kpm_base + offs_n)
            p = tl.where(keep[None, :] != 0, p, 0.0)
        # dP = dO V^T: (BLOCK_M2, BLOCK_D) x (BLOCK_D, BLOCK_N2) -> (BLOCK_M2, BLOCK_N2)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)  # d tanh(x) / dx = 1 - tanh(x)^2
        # dQ += dS K: (BLOCK_M2, BLOCK_N2) x (BLOCK_N2, BLOCK_D)  (times scale at the end)
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, KPM, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_mb, stride_lb, stride_lh, L, S, D, sm_scale, qk_scale, tanh_scale, win_lo, win_hi,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, GROUP: tl.constexpr,
):
    # grid (cdiv(L, BLOCK_M2), B, H): one program per query block; key/value head h // GROUP
    if IS_CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    else:
        start_m = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    off_h = tl.program_id(2).to(tl.int64)
    q_off = off_b * stride_qb + off_h * stride_qh
    kv_off = off_b * stride_kb + (off_h // GROUP) * stride_kh
    offs_m = start_m * BLOCK_M2 + tl.arange(0, BLOCK_M2)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < L
    d_ok = offs_d < D
    q_offs = q_off + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = _load_2d(Q + q_offs, m_ok, d_ok, True, not EVEN_D)  # (BLOCK_M2, BLOCK_D)
    do = _load_2d(DO + q_offs, m_ok, d_ok, True, not EVEN_D)
    row = off_b * stride_lb + off_h * stride_lh + offs_m  # DELTA shares LSE's layout
    lse = tl.load(LSE + row, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    # the forward kernel's key blocks: [lo, hi) visited, [full_lo, full_hi) unmasked
    lo, full_lo, full_hi, hi = _key_blocks(start_m, L, S, win_lo, win_hi, IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                                           BLOCK_M2, BLOCK_N2)
    kpm_base = KPM + off_b * stride_mb
    if USE_TMA:  # this head's keys and values as (S, D) row-major tensors
        k_desc = tl.make_tensor_descriptor(K + kv_off, shape=[S, D], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N2, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V + kv_off, shape=[S, D], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N2, BLOCK_D])
    else:
        k_desc = K + kv_off  # unused
        v_desc = V + kv_off
    if WINDOW_LEFT:
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse, delta, K + kv_off, V + kv_off, kpm_base, stride_kn, k_desc, v_desc,
            offs_m, offs_d, lo, tl.minimum(full_lo, hi), S, D, qk_scale, tanh_scale, win_lo, win_hi,
            IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_KPM, HAS_SOFTCAP, True, BLOCK_N2, EVEN_D, DOT_PRECISION, USE_TMA,
        )
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, K + kv_off, V + kv_off, kpm_base, stride_kn, k_desc, v_desc,
        offs_m, offs_d, full_lo, full_hi, S, D, qk_scale, tanh_scale, win_lo, win_hi,
        IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_KPM, HAS_SOFTCAP, False, BLOCK_N2, EVEN_D, DOT_PRECISION, USE_TMA,
    )
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, K + kv_off, V + kv_off, kpm_base, stride_kn, k_desc, v_desc,
        offs_m, offs_d, tl.maximum(full_lo, full_hi), hi, S, D, qk_scale, tanh_scale, win_lo, win_hi,
        IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_KPM, HAS_SOFTCAP, True, BLOCK_N2, EVEN_D, DOT_PRECISION, USE_TMA,
    )
    dq = dq * sm_scale
    tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
