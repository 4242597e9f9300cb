r"""Linear attention: the delta-rule family of today's hybrid models, recurrent and chunked.

Softmax attention keeps every past key and value (a cache that grows with the
sequence). Linear attention keeps a fixed-size *state* per head instead, a
matrix ``S`` of shape ``(E, Ev)`` that each token updates and each query reads:

$$
S_t = \alpha_t S_{t-1} + k_t u_t^\top, \qquad o_t = S_t^\top q_t .
$$

The family differs only in the decay ``alpha_t`` and in what is written, ``u_t``:

| function | decay ``alpha_t`` | written ``u_t`` |
| --- | --- | --- |
| `linear_attention` | 1 | ``v_t`` |
| `gated_linear_attention` | ``exp(g_t)``, per head | ``v_t`` |
| `ssd` (Mamba-2) | ``exp(dt_t A)``, per head | ``dt_t x_t`` (``q = C``, ``k = B``) |
| `gated_delta_rule` | ``exp(g_t)``, per head | ``beta_t (v_t - (alpha_t S_{t-1})^T k_t)`` |
| `kimi_delta_attention` | ``diag(exp(g_t))``, per key channel | as `gated_delta_rule` |

The delta rule (Gated DeltaNet, [Yang et al. 2024](https://arxiv.org/abs/2412.06464),
used by Qwen3-Next and Qwen3.5) writes only the error of the state's own
prediction of ``v_t`` from ``k_t``: one step of online least squares with step
size ``beta_t``. Kimi Delta Attention (Kimi Linear) gives each key channel its
own decay.

Every function has a *recurrent* form (a loop over tokens, what decoding runs)
and a parallel form that must agree with it: the quadratic form
``(M * Q K^T) V``, ``M`` the causal decay matrix, for the gated linear family, and the chunked form with the
WY/UT transform ([Yang et al. 2024](https://arxiv.org/abs/2406.06484)) for the
delta rule. Per chunk of ``C`` tokens with entry state ``S_0``, in-chunk
cumulative log-decay ``Gamma_i = g_1 + ... + g_i`` and decay-aware mask
``D_ij = exp(Gamma_i - Gamma_j)`` for ``j <= i`` (0 above the diagonal):

$$
\begin{aligned}
A &= I + \operatorname{strictly\_lower}(\operatorname{diag}(\beta) K K^\top \odot D), &
U &= A^{-1} (\beta \odot V), \quad W = A^{-1} (\beta \odot K \odot e^{\Gamma}), \\
V_\text{new} &= U - W S_0, &
O &= (Q \odot e^{\Gamma}) S_0 + (Q K^\top \odot D)\, V_\text{new}, \\
S_C &= e^{\Gamma_C} S_0 + (K \odot e^{\Gamma_C - \Gamma})^\top V_\text{new}.
\end{aligned}
$$

A plain causal mask in place of ``D`` is the classic bug: the tests hold the two
forms equal in float64 for every chunk size, values and gradients.

**Layout.** The functions take the layout of flash-linear-attention and of
transformers' Qwen3-Next and Kimi Linear code, tokens before heads:
``(B, L, H, E)``, where the softmax core of this package takes ``(B, H, L, E)``
(``x.transpose(1, 2)`` converts). Shape legend (the package's): ``B`` batch,
``L`` tokens, ``H`` query/key heads, ``Hv`` value heads (a multiple of ``H``;
value head ``j`` reads query/key head ``j // (Hv // H)``, "grouped value
attention", as ``repeat_interleave`` does), ``E`` query/key size, ``Ev`` value
size, ``N`` sequences of a packed batch.

**State.** ``(B, Hv, E, Ev)``: key channels by value channels, "K x V", the
layout of fla and transformers, read as ``o = S^T q``. Mamba-2's cache and
flashinfer store the transpose, ``(..., Ev, E)`` ("V x K"):
`state_kv_to_vk` and `state_vk_to_kv` convert at the boundary.

**Gates.** ``g`` is the *log* of the decay (``g <= 0``, decay ``exp(g)`` in
``(0, 1]``); a decay given in linear space (``alpha``, flashinfer's convention)
is ``g = torch.log(alpha)``. A positive ``g`` raises, since it is almost always a
linear gate read as a log one. ``beta`` is the delta rule's step size, usually
``sigmoid(b)`` in ``(0, 1)``.

**Precision.** Everything is computed in at least float32 (float64 stays
float64); the output has ``v``'s dtype and the final state stays in the compute
dtype (the "float32 state" contract: a float16 state overflows).

Examples:
    >>> import torch
    >>> from attention_ref.linear import gated_delta_rule
    >>> B, L, H, Hv, E, Ev = 1, 7, 1, 2, 4, 3
    >>> q, k = torch.randn(B, L, H, E), torch.randn(B, L, H, E)
    >>> v = torch.randn(B, L, Hv, Ev)
    >>> g = -torch.rand(B, L, Hv)                 # log decay, <= 0
    >>> beta = torch.rand(B, L, Hv)
    >>> out, state = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    >>> out.shape, state.shape
    (torch.Size([1, 7, 2, 3]), torch.Size([1, 2, 4, 3]))
    >>> chunked, _ = gated_delta_rule(q, k, v, g, beta, mode="chunked", chunk_size=4)
    >>> torch.allclose(chunked, out, atol=1e-5)
    True
"""

from __future__ import annotations

import math

import torch

from attention_ref._inputs import check_bool
from attention_ref._validation import (
    check_cu_seqlens,
    check_dense,
    check_positive_int,
    check_scale,
    fmt_shape,
    require_float_tensor,
    require_same_dtype_and_device,
    require_tensor,
)

__all__ = [
    "gated_delta_rule",
    "gated_linear_attention",
    "kimi_delta_attention",
    "l2_normalize",
    "linear_attention",
    "ssd",
    "state_kv_to_vk",
    "state_vk_to_kv",
]

L2NORM_EPS = 1e-6
"""The ``eps`` of `l2_normalize`, inside the square root (fla and transformers use 1e-6)."""

_DELTA_MODES = ("recurrent", "chunked")
_GLA_MODES = ("recurrent", "quadratic", "chunked")


# --- argument checks -----------------------------------------------------------------------------


def _check_mode(mode: object, allowed: tuple[str, ...]) -> str:
    if mode not in allowed:
        raise ValueError(f"mode must be one of {', '.join(map(repr, allowed))}, got {mode!r}")
    return mode


def _check_qkv(q: object, k: object, v: object) -> tuple[int, int, int, int, int, int]:
    """q, k ``(B, L, H, E)`` and v ``(B, L, Hv, Ev)`` with ``Hv`` a multiple of ``H``."""
    q = require_float_tensor("q", q, 4, "(B, L, H, E)")
    k = require_float_tensor("k", k, 4, "(B, L, H, E)")
    v = require_float_tensor("v", v, 4, "(B, L, Hv, Ev)")
    for name, t, layout in (("q", q, "(B, L, H, E)"), ("k", k, "(B, L, H, E)"), ("v", v, "(B, L, Hv, Ev)")):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {layout}, got shape {fmt_shape(t.shape)}")
    require_same_dtype_and_device(q=q, k=k, v=v)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape (B, L, H, E)={fmt_shape(q.shape)}, got {fmt_shape(k.shape)}")
    B, L, H, E = q.shape
    Hv, Ev = v.shape[2], v.shape[3]
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have q's (B, L)={fmt_shape(q.shape[:2])}, got {fmt_shape(v.shape[:2])}")
    if Hv % H != 0:
        raise ValueError(f"v's heads Hv={Hv} must be a multiple of q's and k's heads H={H}")
    return B, L, H, Hv, E, Ev


def _check_like(name: str, value: object, shape: tuple[int, ...], layout: str, ref: torch.Tensor) -> torch.Tensor:
    tensor = require_tensor(name, value)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {layout}={fmt_shape(shape)}, got {fmt_shape(tensor.shape)}")
    if tensor.device != ref.device:
        raise ValueError(f"{name} must be on the same device as q ({ref.device}), got {tensor.device}")
    return tensor


def _check_log_gate(name: str, g: torch.Tensor) -> None:
    if g.numel() and not g.is_meta and bool((g > 0).any()):  # meta: shapes only, no values
        raise ValueError(
            f"{name} is the log of the decay and must be <= 0, got a maximum of {g.max().item():.4g}; "
            f"a decay alpha in (0, 1] given in linear space converts with torch.log(alpha)"
        )


def _packed_bounds(cu_seqlens: object, B: int, L: int, device: torch.device) -> list[int] | None:
    """The sequences' bounds from ``cu_seqlens`` (`check_cu_seqlens`: 0 to ``L``, on ``device``), which
    packs them along ``L`` with ``B == 1``; None without it."""
    if cu_seqlens is None:
        return None
    bounds = check_cu_seqlens("cu_seqlens", cu_seqlens, L, "L", device).tolist()
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along L and B must be 1, got B={B}")
    return bounds


def _check_state(initial_state: object, N: int, Hv: int, E: int, Ev: int, ref: torch.Tensor, varlen: bool):
    if initial_state is None:
        return None
    n = "N" if varlen else "B"
    return _check_like("initial_state", initial_state, (N, Hv, E, Ev), f"({n}, Hv, E, Ev)", ref)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrences run in at least float32."""
    return torch.promote_types(dtype, torch.float32)


# --- building blocks -----------------------------------------------------------------------------


def _segment_sum(g: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = g_{j+1} + ... + g_i`` for ``j <= i`` (0 on the diagonal), ``-inf`` above.

    ``exp`` of it is the 1-semiseparable decay matrix of SSD. Summing the segment
    directly, as Mamba-2's ``segment_sum`` does, instead of subtracting two long
    cumulative sums, keeps its precision over long sequences.
    """
    T = g.shape[-1]
    x = g[..., :, None].expand(*g.shape, T)  # (..., T, T): x[i, j] = g_i
    below = torch.ones(T, T, dtype=torch.bool, device=g.device).tril(-1)
    x = x.masked_fill(~below, 0.0)
    out = x.cumsum(dim=-2)  # out[i, j] = sum of g_k for j < k <= i
    return out.masked_fill(~below.logical_or(torch.eye(T, dtype=torch.bool, device=g.device)), float("-inf"))


def _decay(gamma: torch.Tensor) -> torch.Tensor:
    """``exp(gamma_i - gamma_j)`` for ``j <= i``, 0 above: ``(..., C, 1 or E)`` -> ``(..., C, C, 1 or E)``.

    The decay between two tokens of a chunk, from the cumulative log decays ``gamma``;
    the difference is taken before ``exp`` (never ``exp(gamma_i) / exp(gamma_j)``, which
    overflows over long chunks of strong decay), and ``-inf`` above the diagonal gives 0.
    """
    C = gamma.shape[-2]
    above = torch.ones(C, C, dtype=torch.bool, device=gamma.device).triu(1)[:, :, None]  # (C, C, 1)
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]  # (..., C, C, 1 or E)
    return diff.masked_fill_(above, float("-inf")).exp_()  # in place on its own diff (autograd allows it)


_DIFFERENCE_FLOOR = -1e3
"""The least log decay of a chunk for which `_chunk_systems` takes ``exp(Gamma_i - Gamma_j)`` from the
differences: their rounding is at most ``u * 1e3`` (float32: 6e-5) there."""


def _segment_decay(g: torch.Tensor) -> torch.Tensor:
    """``exp(g_{j+1} + ... + g_i)`` for ``j <= i``, 0 above: ``(..., C, 1 or E)`` -> ``(..., C, C, 1 or E)``.

    What `_decay` gives from the cumulative sums, but summed segment by segment: a gate of
    ``-inf`` (a full reset) makes ``Gamma_i - Gamma_j`` ``-inf - (-inf) = NaN`` for two tokens
    after it, while the segment sum of the gates between them is finite (issue 39).
    """
    C = g.shape[-2]
    below = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)[:, :, None]  # (C, C, 1): j < i
    x = g[..., :, None, :].expand(*g.shape[:-2], C, C, g.shape[-1])  # (..., C, C, F): x[i, j] = g_i
    x = x.masked_fill(~below, 0.0).cumsum(dim=-3)  # x[i, j] = sum of g_k for j < k <= i
    diagonal_or_below = below | torch.eye(C, dtype=torch.bool, device=g.device)[:, :, None]
    return x.masked_fill_(~diagonal_or_below, float("-inf")).exp_()


def _tracks_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records operations on any of ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _scaled(x: torch.Tensor, factor: torch.Tensor, own: bool) -> torch.Tensor:
    """``x * factor``, written over ``x`` when ``own``: ``x`` is a tensor the caller made and
    no longer needs, and no gradient is recorded (`_tracks_grad`). The same numbers either
    way; in place saves a fresh tensor, which on CPU costs about as much as the product."""
    return x.mul_(factor) if own else x * factor


def _added_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, own: bool, alpha: float = 1.0
                   ) -> torch.Tensor:
    """``x + alpha a @ b`` for batches of matrices, added into ``x`` when ``own`` (as in `_scaled`)."""
    return x.baddbmm_(a, b, alpha=alpha) if own else torch.baddbmm(x, a, b, alpha=alpha)


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``sum_e a_ie b_je decay_ije``: ``(..., C, E)`` twice and `_decay`'s ``(..., C, C, 1 or E)`` -> ``(..., C, C)``.

    For a scalar gate the decay ``D_ij`` multiplies the plain scores; for a per-channel
    one (Kimi Delta Attention) it weighs each channel's product. ``out``: a `_Scratch`
    tensor to write the result into, or None for a new one.
    """
    if decay.shape[-1] == 1:  # (..., C, E) x (..., E, C) -> (..., C, C)
        return _scaled(torch.matmul(a, b.transpose(-1, -2), out=out), decay[..., 0], out is not None)
    return torch.sum(a[..., :, None, :] * b[..., None, :, :] * decay, dim=-1, out=out)  # (..., C, C, E) -> (..., C, C)


_SUB_CHUNK = 16
"""Rows per block of `_channel_scores` where a chunk's decay is too strong to factor whole."""

_FACTOR_RANGE = 40.0
"""How far (in log decay) `_channel_scores` factors ``exp(Gamma_i - Gamma_j)`` into
``exp(Gamma_i - r) * exp(r - Gamma_j)``: each factor then lies in ``[e^-40, e^40]``
(about ``4e-18`` to ``2e17``), far inside float32's range, so neither under- nor overflows."""


def _factored_scores(a: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``(a e^{Gamma - r}) (b e^{r - Gamma_b})^T``: ``(..., m, E)``, ``(..., n, E)`` with their ``gamma``
    rows, ``r`` ``(..., 1, E)`` -> ``(..., m, n)``: one matmul where `_decayed_scores` multiplies
    ``(m, n, E)`` numbers. ``gamma`` is the pair ``(gamma_a, gamma_b)``."""
    gamma_a, gamma_b = gamma
    return (a * (gamma_a - r).exp()) @ (b * (r - gamma_b).exp()).transpose(-1, -2)


def _channel_scores(a: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``sum_e a_ie b_je exp(Gamma_ie - Gamma_je)`` for ``j <= i``, 0 above: `_decayed_scores` with a decay
    per channel, without its ``(C, C, E)`` tensor. ``(..., C, E)`` twice and ``gamma`` ``(..., C, E)``
    (cumulative log decays from the chunk's entry, finite) -> ``(..., C, C)``.

    ``exp(Gamma_i - Gamma_j) = exp(Gamma_i - r) exp(r - Gamma_j)`` turns the sum into a matmul of
    rescaled rows (as fla's chunked KDA does). Where the chunk's log decay stays within
    `_FACTOR_RANGE`, with ``r = 0``, for the whole chunk at once, then the upper triangle zeroed.
    Else in blocks of `_SUB_CHUNK` rows: against the earlier keys ``j < s`` with ``r = Gamma_{s-1}``
    (both factors at most 1, since ``Gamma`` only falls); within the block the same way from its
    own entry where its decay stays within range, else the exact decays ``(16, 16, E)``.
    ``out``: a `_Scratch` tensor to write into, or None for a new one.
    """
    C = a.shape[-2]
    out = a.new_empty(*a.shape[:-1], C) if out is None else out  # (..., C, C)
    above = torch.ones(C, C, dtype=torch.bool, device=a.device).triu(1)
    if gamma.is_meta or bool((gamma[..., -1, :] >= -_FACTOR_RANGE).all()):  # meta: shapes only
        out[...] = _factored_scores(a, b, (gamma, gamma), gamma.new_zeros(1))
        return out.masked_fill_(above, 0.0)
    out.zero_()
    for start in range(0, C, _SUB_CHUNK):
        rows = slice(start, min(start + _SUB_CHUNK, C))
        g_rows = gamma[..., rows, :]  # (..., c, E)
        entry = gamma[..., start - 1:start, :] if start else gamma.new_zeros(1)  # (..., 1, E): just before
        if bool((g_rows[..., -1, :] - (entry if start else 0) >= -_FACTOR_RANGE).all()):
            block = _factored_scores(a[..., rows, :], b[..., rows, :], (g_rows, g_rows), entry)
            out[..., rows, rows] = block.masked_fill_(above[:rows.stop - start, :rows.stop - start], 0.0)
        else:
            out[..., rows, rows] = _decayed_scores(a[..., rows, :], b[..., rows, :], _decay(g_rows))
        if start:  # the earlier keys: both factors at most 1
            out[..., rows, :start] = _factored_scores(a[..., rows, :], b[..., :start, :],
                                                      (g_rows, gamma[..., :start, :]), entry)
    return out


# --- the two forms of the delta rule, on (B, Hv, L, .) tensors -----------------------------------


def _delta_rule_recurrent(q, k, v, g, beta, state, out):
    """The token-by-token loop.

    q, k: ``(B, Hv, L, E)``; v: ``(B, Hv, L, Ev)``; g: ``(B, Hv, L, 1 or E)`` log decay;
    beta: ``(B, Hv, L)`` or None (no delta term: gated linear attention);
    state: ``(B, Hv, E, Ev)``; out: ``(B, Hv, L, Ev)``, filled. Returns the state after the last token.
    """
    B, Hv, L, E = q.shape
    own = not _tracks_grad(q, k, v, g, beta, state)  # then the state is updated in place (`_scaled`)
    state = state.reshape(B * Hv, E, -1)  # (B, Hv, E, Ev) -> (B Hv, E, Ev): baddbmm takes 3 dims
    if own:
        state = state.clone()  # never the caller's tensor
    q, k, v = (x.reshape(B * Hv, L, -1) for x in (q, k, v))  # (B, Hv, L, .) -> (B Hv, L, .)
    decay = g.exp().reshape(B * Hv, L, -1, 1)  # (B Hv, L, 1 or E, 1): every step's factor, at once
    step = None if beta is None else beta.reshape(B * Hv, L, 1, 1)  # (B, Hv, L) -> (B Hv, L, 1, 1)
    outs = []
    for t in range(L):
        state = _scaled(state, decay[:, t], own)  # decay first: rows of (B Hv, E, Ev) scaled
        u_t = v[:, t, None, :]  # (B Hv, 1, Ev): linear attention writes the value itself
        if beta is not None:
            predicted = k[:, t, None, :] @ state  # (B Hv, 1, E) x (B Hv, E, Ev) -> (B Hv, 1, Ev)
            u_t = step[:, t] * (u_t - predicted)  # delta rule: write the error, a step of beta
        state = _added_product(state, k[:, t, :, None], u_t, own)  # outer product (B Hv, E, 1) x (B Hv, 1, Ev)
        outs.append(q[:, t, None, :] @ state)  # (B Hv, 1, E) x (B Hv, E, Ev) -> (B Hv, 1, Ev): the UPDATED state
    if outs:
        out.copy_(torch.cat(outs, dim=1).view(B, Hv, L, -1))  # L x (B Hv, 1, Ev) -> (B, Hv, L, Ev)
    return state.view(B, Hv, E, -1)  # (B Hv, E, Ev) -> (B, Hv, E, Ev)


_SPAN_ELEMENTS = 2**18
"""About how many elements of one input (``B * Hv * tokens * E``) `_run` prepares at once for
the recurrence and the chunked form: 1 MiB in float32, so that the span's tensors come from
the allocator's reuse, not fresh pages (see `_run`)."""

_BLOCK_ELEMENTS = 2**19
"""How many decay factors or decayed scores (``C * C`` per chunk and head, a decay per channel
factored into the rows by `_channel_scores`) one call of `_delta_rule_chunked` builds: with
`_SPAN_ELEMENTS`, `_run_delta` bounds the span by it."""


def _span_tokens(B: int, Hv: int, width: int) -> int:
    """Tokens per span of `_run`: `_SPAN_ELEMENTS` over ``B * Hv * width``, at least one."""
    return max(1, _SPAN_ELEMENTS // (B * Hv * width))


def _chunk_systems(q, k, v, g, beta, memory=None):
    """The part of the chunked form that does not depend on the entry state, for many chunks at once.

    q, k: ``(..., C, E)``; v: ``(..., C, Ev)``; g: ``(..., C, 1 or E)`` log decay; beta:
    ``(..., C)``; ``...`` may hold a chunk axis. ``memory``: a `_Scratch` to take the
    results from; when it is enabled (no gradient recorded), ``q`` and ``k`` are the
    caller's own copies and are overwritten. Returns, each with the same leading dims:
    ``U = A^-1 (beta V)`` ``(..., C, Ev)``; ``W = A^-1 (beta K exp(Gamma))`` ``(..., C, E)``;
    ``Q exp(Gamma)`` ``(..., C, E)``; the decayed scores ``Q K^T * D`` ``(..., C, C)``;
    ``K exp(Gamma_C - Gamma)`` ``(..., C, E)``; ``exp(Gamma_C)`` ``(..., 1, 1 or E)``.
    """
    memory = memory or _Scratch(False)
    own = memory.enabled
    C, E, Ev = k.shape[-2], k.shape[-1], v.shape[-1]
    lead = tuple(k.shape[:-2])
    gamma = g.cumsum(dim=-2)  # (..., C, 1 or E): log decay from the chunk's entry to token i
    decay_in = gamma.exp()  # (..., C, 1 or E)
    beta = beta[..., None]  # (..., C, 1)
    # (..., C, C, 1 or E): from the differences of gamma while the chunk's log decay is moderate (it is
    # monotone, so its last row is its least); else segment by segment: past -1e3 the difference of two
    # large gammas loses the small gates between them (-1e38 + g - (-1e38) = 0), and -inf - -inf is NaN
    moderate = gamma.is_meta or bool((gamma[..., -1:, :] >= _DIFFERENCE_FLOOR).all())  # meta: either form's shapes
    if moderate and gamma.shape[-1] > 1:  # per channel: blocks of rows, never a (C, C, E) decay
        scores = _channel_scores(q, k, gamma, memory.get("scores", (*lead, C, C), q))  # (..., C, C)
        kk = _channel_scores(k, k, gamma, memory.get("kk", (*lead, C, C), q))  # (..., C, C)
    else:
        decay = _decay(gamma) if moderate else _segment_decay(g)
        scores = _decayed_scores(q, k, decay, memory.get("scores", (*lead, C, C), q))  # (..., C, C)
        kk = _decayed_scores(k, k, decay, memory.get("kk", (*lead, C, C), q))  # (..., C, C)
    # the UT system: A = I + strictly_lower(diag(beta) K K^T * D); the inverse reads only that part
    kk = _scaled(kk, beta, own)  # (..., C, C)
    # forward substitution against I, differentiable: the whole chunked call ran 2-8% faster on CPU
    # with it than with an inverse by doubling blocks in batched matmuls (log2(C) rounds)
    eye = torch.eye(C, dtype=kk.dtype, device=kk.device).expand_as(kk)  # (..., C, C)
    A_inv = torch.linalg.solve_triangular(kk, eye, upper=False, unitriangular=True)  # reads kk below the diagonal
    A_beta = _scaled(A_inv, beta.transpose(-1, -2), own)  # A^-1 diag(beta): columns scaled
    U = torch.matmul(A_beta, v, out=memory.get("U", (*lead, C, Ev), q))  # (..., C, C) x (..., C, Ev)
    if gamma.shape[-1] == 1:  # a scalar gate folds into the columns too: A^-1 diag(beta exp(Gamma)) K
        A_w, k_w = _scaled(A_beta, decay_in.transpose(-1, -2), own), k
    else:  # per channel: A^-1 diag(beta) (K exp(Gamma))
        A_w, k_w = A_beta, k * decay_in  # (..., C, E)
    W = torch.matmul(A_w, k_w, out=memory.get("W", (*lead, C, E), q))  # (..., C, C) x (..., C, E) -> (..., C, E)
    gamma_last = gamma[..., -1:, :]  # (..., 1, 1 or E): the whole chunk's log decay
    # each write's log decay to the chunk's end, g_{i+1} + ... + g_C: summed from the end, not as
    # gamma_last - gamma (NaN after a gate of -inf)
    to_end = torch.cat([g[..., 1:, :].flip(-2).cumsum(dim=-2).flip(-2), torch.zeros_like(g[..., :1, :])], dim=-2)
    k_out = _scaled(k, to_end.exp_(), own)  # (..., C, E): each write's decay to the chunk's end
    return U, W, _scaled(q, decay_in, own), scores, k_out, gamma_last.exp()


def _delta_rule_chunked(q, k, v, g, beta, state, out, chunk_size, scratch=None):
    """The chunked (WY/UT) form: equal to `_delta_rule_recurrent`, with matmuls inside each chunk.

    Same arguments (``beta`` required; ``q``, ``k``, ``v``, ``g``, ``beta`` contiguous, and
    the caller's own to overwrite when ``scratch``, a `_Scratch`, is enabled); the last chunk
    is shorter when ``L`` is not a multiple of ``chunk_size`` (no padding), so no chunk reads
    past the sequence. What does not depend on the state (the UT system, its inverse, the
    decayed scores) is computed for all the chunks at once (`_chunk_systems`; `_run_delta`
    bounds how many tokens come in one call); only the state's pass from chunk to chunk loops.
    """
    memory = scratch or _Scratch(False)
    B, Hv, L, E = q.shape
    Ev = v.shape[-1]
    C = chunk_size
    full = L // C  # whole chunks; a shorter one follows when C does not divide L
    blocks = [(0, full, C)] if full else []
    if L % C:
        blocks.append((full * C, 1, L % C))
    state = state.reshape(B * Hv, E, Ev)  # (B, Hv, E, Ev) -> (B Hv, E, Ev): baddbmm takes 3 dims
    kept = memory.get("state", (B * Hv, E, Ev), v)  # or None
    for start, n, size in blocks:
        # (B, Hv, n * C, .) -> (B Hv, n, C, .): a view, each chunk's rows contiguous
        parts = (x[:, :, start:start + n * size].reshape(B * Hv, n, size, *x.shape[3:]) for x in (q, k, v, g, beta))
        systems = (x.unbind(1) for x in _chunk_systems(*parts, memory=memory))  # n chunks of (B Hv, C, .) each
        chunk = (B * Hv, size, Ev)
        for c, (U, W, q_in, scores, k_out, decay) in enumerate(zip(*systems)):
            v_new = _added_product(U, W, state, memory.enabled, alpha=-1)  # U - W S: (B Hv, C, E) x (B Hv, E, Ev)
            # the entry state's share: (B Hv, C, E) x (B Hv, E, Ev) -> (B Hv, C, Ev)
            o = torch.bmm(q_in, state, out=memory.get("o", chunk, v))
            o = _added_product(o, scores, v_new, memory.enabled)  # + (B Hv, C, C) x (B Hv, C, Ev) -> (B Hv, C, Ev)
            out[:, :, start + c * size:start + (c + 1) * size] = o.view(B, Hv, size, Ev)  # (B Hv, .) -> (B, Hv, .)
            # rows of (B Hv, E, Ev) decay (into the kept state: in place after the first chunk), then
            # + (B Hv, E, C) x (B Hv, C, Ev)
            state = torch.mul(decay.transpose(-1, -2), state, out=kept)
            state = _added_product(state, k_out.transpose(-1, -2), v_new, memory.enabled)
    return state.view(B, Hv, E, Ev)  # (B Hv, E, Ev) -> (B, Hv, E, Ev)


def _gated_linear_quadratic(q, k, v, g, state, out):
    """``(L * Q K^T) V`` with ``L_ij = exp(g_{j+1} + ... + g_i)``, plus the entry state's share, into ``out``.

    q, k: ``(B, Hv, L, E)``; v: ``(B, Hv, L, Ev)``; g: ``(B, Hv, L)``; state ``(B, Hv, E, Ev)``;
    out: ``(B, Hv, L, Ev)``. Returns the state after the last token.
    """
    B, Hv, L = q.shape[:3]
    check_dense("the quadratic form", (B, Hv, L, L), q.dtype, q.device, noun="the (B, Hv, L, L) decay and scores",
                instead="mode='recurrent' keeps a fixed state")
    decay = _segment_sum(g).exp()  # (B, Hv, L, L), lower-triangular, 1 on the diagonal
    scores = (q @ k.transpose(-1, -2)) * decay  # (B, Hv, L, E) x (B, Hv, E, L) -> (B, Hv, L, L)
    gamma = g.cumsum(dim=-1)[..., None]  # (B, Hv, L, 1): log decay from the start to token i
    out.copy_(scores @ v + (q * gamma.exp()) @ state)  # (B, Hv, L, L) x (B, Hv, L, Ev) + (B, Hv, L, E) x (E, Ev)
    if q.shape[2] == 0:
        return state
    to_end = decay[:, :, -1, :, None]  # (B, Hv, L, 1): exp(g_{j+1} + ... + g_L), decay of token j's write
    return gamma[:, :, -1:].exp() * state + (k * to_end).transpose(-1, -2) @ v  # (B, Hv, E, L) x (B, Hv, L, Ev)


def _gated_linear_chunked(q, k, v, g, state, out, chunk_size):
    """Gated linear attention chunk by chunk: the quadratic form inside each chunk of ``chunk_size``
    tokens, the state from one chunk to the next. Equal to `_delta_rule_recurrent` without ``beta``.

    q, k: ``(B, Hv, L, E)``; v: ``(B, Hv, L, Ev)``; g: ``(B, Hv, L, 1 or E)`` log decay (one per head or
    one per key channel); state ``(B, Hv, E, Ev)``; out: ``(B, Hv, L, Ev)``, filled. The last chunk is
    shorter when ``chunk_size`` does not divide ``L``. Returns the state after the last token.
    """
    L = q.shape[2]
    for start in range(0, L, chunk_size):
        stop = min(start + chunk_size, L)
        qc, kc, vc, gc = (x[:, :, start:stop] for x in (q, k, v, g))  # (B, Hv, c, .)
        gamma = gc.cumsum(dim=-2)  # (B, Hv, c, 1 or E): log decay from the chunk's entry to token i
        # exp(Gamma_i - Gamma_j) from the differences while the chunk's log decay is moderate, else
        # segment by segment (as `_chunk_systems`: no NaN after a gate of -inf, no precision lost)
        moderate = gamma.is_meta or bool((gamma[..., -1:, :] >= _DIFFERENCE_FLOOR).all())
        decay = _decay(gamma) if moderate else _segment_decay(gc)  # (B, Hv, c, c, 1 or E)
        scores = _decayed_scores(qc, kc, decay)  # (B, Hv, c, c)
        # within the chunk, plus the entry state's share: (B, Hv, c, c) x (B, Hv, c, Ev) + (B, Hv, c, E) x (E, Ev)
        out[:, :, start:stop] = scores @ vc + (qc * gamma.exp()) @ state
        # each write's log decay to the chunk's end, g_{i+1} + ... + g_c, summed from the end
        to_end = torch.cat([gc[..., 1:, :].flip(-2).cumsum(dim=-2).flip(-2), torch.zeros_like(gc[..., :1, :])],
                           dim=-2)  # (B, Hv, c, 1 or E)
        # rows of the state (key channels) decay by the whole chunk's gate: (B, Hv, 1 or E, 1) * (B, Hv, E, Ev)
        state = gamma[..., -1:, :].exp().transpose(-1, -2) * state + (kc * to_end.exp()).transpose(-1, -2) @ vc
    return state


# --- dispatch: layouts, heads, dtypes, packed sequences ------------------------------------------


class _Scratch:
    """Tensors that `_run` and `_delta_rule_chunked` reuse from one span to the next.

    On CPU a fresh tensor of a few hundred KiB or more is often fresh pages from the kernel:
    glibc gives freed memory back and faults it in again on the next span, which cost more
    than the arithmetic (36 000 to 52 000 page faults and 65 to 107 ms of system time per
    call at the benchmark's 8192 tokens, benchmarks/linear_bench.py). Only where no gradient is recorded
    (`_tracks_grad`), since autograd keeps the results it needs: otherwise `get` returns None
    and each operation allocates its result as usual, the same numbers either way.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """A ``shape`` tensor of ``like``'s dtype and device, the same memory on every call with
        ``name`` (grown when a larger one is asked for); None when disabled."""
        if not self.enabled:
            return None
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name] = like.new_empty(numel)
        return buffer[:numel].view(shape)


def _run(form, q, k, v, g, beta, initial_state, output_final_state, bounds, scale, use_qk_l2norm, *, block=None,
         scratch=False, **kw):
    """Bring the public ``(B, L, H, .)`` tensors to ``(B, Hv, L, .)`` in the compute dtype, run
    ``form`` per sequence (``bounds`` from ``cu_seqlens``, or the whole batch) and bring the
    output back.

    With ``block`` (tokens), each sequence goes to ``form`` in spans of ``block`` tokens, the
    state carried from one to the next (which the recurrence and the chunked form allow,
    ``block`` a multiple of the chunk size): the inputs are converted, normalised and laid out
    a span at a time, and each span's output written into the one output tensor. On CPU,
    tensors of the whole sequence (32 MiB each at the benchmark's 8192 tokens) are fresh
    pages from the kernel on every call, which cost more than the arithmetic on them. With
    ``scratch``, the span's tensors are reused too (`_Scratch`, passed on to ``form``).
    """
    B, L, H, E = q.shape
    Hv, Ev = v.shape[2], v.shape[3]
    out_dtype, dtype = v.dtype, _compute_dtype(v.dtype)
    if B == 0:  # an empty batch: nothing to run (the spans below would divide by B)
        return _empty_batch(q, v, output_final_state)
    group = Hv // H
    scale = E**-0.5 if scale is None else scale
    memory = _Scratch(scratch and not _tracks_grad(q, k, v, g, beta, initial_state))
    if scratch:
        kw["scratch"] = memory
    like = q.new_empty(0, dtype=dtype)  # the compute dtype and device, for new tensors

    def laid_out(name: str, x: torch.Tensor) -> torch.Tensor:
        """``(B, n, heads, .)`` -> a copy ``(B, heads, n, .)``, contiguous, in the compute dtype."""
        shape = (x.shape[0], x.shape[2], x.shape[1], *x.shape[3:])
        target = memory.get(name, shape, like)
        if target is None:
            target = like.new_empty(shape)
        return target.copy_(x.transpose(1, 2))  # always a copy: later written in place

    def span(lo: int, hi: int) -> list[torch.Tensor | None]:
        """Tokens ``lo:hi`` of each input, ``(B, Hv, hi - lo, .)`` in the compute dtype."""
        qs, ks, vs, gs = (laid_out(name, x[:, lo:hi]) for name, x in zip("qkvg", (q, k, v, g)))
        if use_qk_l2norm:
            qs, ks = (_l2_normalize(x, memory.enabled, square=memory.get("square", x.shape, like)) for x in (qs, ks))
        qs = _scaled(qs, scale, memory.enabled)
        if group > 1:  # repeat_interleave copies even for a group of 1
            qs, ks = (x.repeat_interleave(group, dim=1) for x in (qs, ks))  # (B, H, n, E) -> (B, Hv, n, E)
        return [qs, ks, vs, gs] + ([] if beta is None else [laid_out("beta", beta[:, lo:hi])])

    if bounds is None:
        bounds, batch_states = [0, L], [initial_state]
    else:
        batch_states = [None if initial_state is None else initial_state[n:n + 1] for n in range(len(bounds) - 1)]
    out = v.new_empty(B, L, Hv, Ev, dtype=out_dtype)  # (B, L, Hv, Ev), filled span by span
    finals = []
    for n, state in enumerate(batch_states):
        state = q.new_zeros(B if len(batch_states) == 1 else 1, Hv, E, Ev, dtype=dtype) if state is None \
            else state.to(dtype)  # (B or 1, Hv, E, Ev)
        first, last = bounds[n], bounds[n + 1]
        step = max(last - first, 1) if block is None else block
        for lo in range(first, last, step):
            hi = min(lo + step, last)
            # the form writes its output into the span's (B, n, Hv, Ev) -> (B, Hv, n, Ev) view, cast to v's dtype
            state = form(*span(lo, hi), state, out[:, lo:hi].transpose(1, 2), **kw)
        finals.append(state.clone() if memory.enabled else state)  # the next sequence reuses the scratch
    return out, (torch.cat(finals, dim=0) if output_final_state else None)


def _empty_batch(q, v, output_final_state):
    """The output ``(0, L, Hv, Ev)`` and final state ``(0, Hv, E, Ev)`` (or None) of an empty batch."""
    _, L, _, E = q.shape
    Hv, Ev = v.shape[2], v.shape[3]
    state = q.new_zeros(0, Hv, E, Ev, dtype=_compute_dtype(v.dtype)) if output_final_state else None
    return v.new_zeros(0, L, Hv, Ev), state


def _run_delta(mode, chunk_size, *args):
    """`_run` with the delta rule's form for ``mode``: the token loop, or the chunks of ``chunk_size``,
    a span of `_span_tokens` at a time."""
    q, v, g = args[0], args[2], args[3]  # (B, L, H, E), (B, L, Hv, Ev), (B, L, Hv, 1 or E)
    B, Hv = v.shape[0], v.shape[2]
    if B == 0:  # an empty batch: no spans to size
        return _empty_batch(q, v, args[6])  # args[6]: output_final_state
    if mode == "recurrent":
        return _run(_delta_rule_recurrent, *args, block=_span_tokens(B, Hv, max(q.shape[-1], v.shape[-1])))
    C = chunk_size
    chunks = _span_tokens(B, Hv, max(q.shape[-1], v.shape[-1])) // C  # whole chunks per span ...
    # ... and C x C scores per chunk (a decay per channel is factored into rows, `_channel_scores`; only
    # where a chunk's decay is too strong to factor does it build (16, 16, E) blocks, one at a time)
    chunks = max(1, min(chunks, _BLOCK_ELEMENTS // (B * Hv * C * C)))
    return _run(_delta_rule_chunked, *args, chunk_size=C, block=chunks * C, scratch=True)


def _prepare_delta(name_g, q, k, v, g, beta, g_shape, g_layout, initial_state, mode, chunk_size, cu_seqlens,
                   scale, output_final_state, use_qk_l2norm):
    B, L, _, Hv, E, Ev = _check_qkv(q, k, v)
    check_bool("output_final_state", output_final_state)
    check_bool("use_qk_l2norm", use_qk_l2norm)
    g = _check_like(name_g, g, g_shape(B, L, Hv, E), g_layout, q)
    _check_log_gate(name_g, g)
    beta = _check_like("beta", beta, (B, L, Hv), "(B, L, Hv)", q)
    _check_mode(mode, _DELTA_MODES)
    check_positive_int("chunk_size", chunk_size)
    check_scale(scale)
    bounds = _packed_bounds(cu_seqlens, B, L, q.device)
    N = B if bounds is None else len(bounds) - 1
    initial_state = _check_state(initial_state, N, Hv, E, Ev, q, bounds is not None)
    return g, beta, initial_state, bounds


# --- public functions ----------------------------------------------------------------------------


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "recurrent",
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the delta rule with a scalar decay per head.

    For each batch row and value head, from ``S_0 = initial_state`` (zeros if None):

    $$
    S \leftarrow e^{g_t} S_{t-1}, \qquad
    u_t = \beta_t\,(v_t - S^\top k_t), \qquad
    S_t = S + k_t u_t^\top, \qquad
    o_t = S_t^\top q_t ,
    $$

    that is ``S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, with
    ``q`` and ``k`` first L2-normalised (`l2_normalize`, when ``use_qk_l2norm``) and
    ``q`` multiplied by ``scale``. The output reads the *updated* state, so token
    ``t`` sees itself. ``mode="recurrent"`` runs this loop (what decoding runs);
    ``mode="chunked"`` computes the same numbers with the WY/UT transform of the
    module docstring, ``chunk_size`` tokens at a time. The two are equal up to
    rounding (the tests hold them to 1e-12 in float64, gradients included).

    Equals transformers' ``torch_recurrent_gated_delta_rule`` and
    ``torch_chunk_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=True``, in the
    same layout.

    Args:
        q: ``(B, L, H, E)`` queries.
        k: ``(B, L, H, E)`` keys.
        v: ``(B, L, Hv, Ev)`` values; ``Hv`` a multiple of ``H``, value head ``j`` reads
            query/key head ``j // (Hv // H)``.
        g: ``(B, L, Hv)`` log decay, ``<= 0``: the state is multiplied by ``exp(g_t)``.
        beta: ``(B, L, Hv)`` step size of the delta rule, usually in ``(0, 1)``.
        initial_state: ``(B, Hv, E, Ev)`` state before the first token (``(N, Hv, E, Ev)``
            with ``cu_seqlens``: one per sequence); zeros if None.
        output_final_state: also return the state after the last token.
        mode: ``"recurrent"`` or ``"chunked"``.
        chunk_size: tokens per chunk in chunked mode; the last chunk may be shorter.
        cu_seqlens: ``(N + 1,)`` cumulative lengths of ``N`` sequences packed along ``L``
            (``B`` must be 1): each starts from its own initial state and no chunk
            crosses a boundary.
        scale: multiplies the queries; ``E ** -0.5`` if None.
        use_qk_l2norm: L2-normalise ``q`` and ``k`` first (as Qwen3-Next does).

    Returns:
        ``(out, final_state)``: ``out`` ``(B, L, Hv, Ev)`` in ``v``'s dtype;
        ``final_state`` ``(B, Hv, E, Ev)`` (``(N, Hv, E, Ev)`` with ``cu_seqlens``) in at
        least float32, or None unless ``output_final_state``.

    Raises:
        TypeError: an argument is not a tensor, not floating point (``cu_seqlens``: not
            integer), or ``q``, ``k``, ``v`` differ in dtype.
        ValueError: a shape does not match the ones above, ``Hv`` is not a multiple of
            ``H``, ``g`` has a positive entry (a linear-space gate), ``mode`` is unknown,
            ``chunk_size`` or ``scale`` is not positive, or ``cu_seqlens`` is not
            ``0 <= ... <= L`` with ``B == 1``.

    Example:
        >>> import torch
        >>> q, k = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
        >>> v, g, beta = torch.randn(1, 5, 2, 3), -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
        >>> out, state = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        >>> out.shape, state.shape
        (torch.Size([1, 5, 2, 3]), torch.Size([1, 2, 4, 3]))
    """
    g, beta, initial_state, bounds = _prepare_delta(
        "g", q, k, v, g, beta, lambda B, L, Hv, E: (B, L, Hv), "(B, L, Hv)", initial_state, mode, chunk_size,
        cu_seqlens, scale, output_final_state, use_qk_l2norm)
    g = g[..., None]  # (B, L, Hv) -> (B, L, Hv, 1): one decay for all key channels
    return _run_delta(mode, chunk_size, q, k, v, g, beta, initial_state, output_final_state, bounds, scale,
                      use_qk_l2norm)


def kimi_delta_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "recurrent",
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Kimi Delta Attention (Kimi Linear): `gated_delta_rule` with a decay per key channel.

    $$
    S_t = (I - \beta_t k_t k_t^\top)\, \operatorname{diag}(e^{g_t})\, S_{t-1}
          + \beta_t k_t v_t^\top, \qquad o_t = S_t^\top q_t ,
    $$

    ``g_t`` has one log decay per key channel, so row ``e`` of the state fades at its
    own rate. With all channels equal it is `gated_delta_rule`. The chunked form
    is the same as there, with the decay ``D`` of each score taken per channel,
    ``sum_e q_ie k_je exp(Gamma_ie - Gamma_je)``.

    Equals transformers' ``recurrent_kimi_delta_attention`` and
    ``chunk_kimi_delta_attention`` (Kimi Linear) with ``use_qk_l2norm_in_kernel=True``.

    Args:
        q: ``(B, L, H, E)`` queries.
        k: ``(B, L, H, E)`` keys.
        v: ``(B, L, Hv, Ev)`` values; ``Hv`` a multiple of ``H`` (Kimi Linear has ``Hv == H``).
        g: ``(B, L, Hv, E)`` log decay per key channel, ``<= 0``.
        beta: ``(B, L, Hv)`` step size of the delta rule.
        initial_state: ``(B, Hv, E, Ev)`` (``(N, Hv, E, Ev)`` with ``cu_seqlens``); zeros if None.
        output_final_state: also return the state after the last token.
        mode: ``"recurrent"`` or ``"chunked"``.
        chunk_size: tokens per chunk in chunked mode.
        cu_seqlens: ``(N + 1,)`` cumulative lengths of sequences packed along ``L`` (``B == 1``).
        scale: multiplies the queries; ``E ** -0.5`` if None.
        use_qk_l2norm: L2-normalise ``q`` and ``k`` first.

    Returns:
        ``(out, final_state)`` as in `gated_delta_rule`.

    Raises:
        TypeError: as in `gated_delta_rule`.
        ValueError: as in `gated_delta_rule`; ``g`` must be ``(B, L, Hv, E)``.

    Example:
        >>> import torch
        >>> q, k = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
        >>> v, beta = torch.randn(1, 5, 2, 3), torch.rand(1, 5, 2)
        >>> g = -torch.rand(1, 5, 2, 4)                 # one decay per key channel
        >>> out, _ = kimi_delta_attention(q, k, v, g, beta, mode="chunked", chunk_size=2)
        >>> out.shape
        torch.Size([1, 5, 2, 3])
    """
    g, beta, initial_state, bounds = _prepare_delta(
        "g", q, k, v, g, beta, lambda B, L, Hv, E: (B, L, Hv, E), "(B, L, Hv, E)", initial_state, mode,
        chunk_size, cu_seqlens, scale, output_final_state, use_qk_l2norm)
    return _run_delta(mode, chunk_size, q, k, v, g, beta, initial_state, output_final_state, bounds, scale,
                      use_qk_l2norm)


def _gated_linear_recurrent(q, k, v, g, state, out):
    return _delta_rule_recurrent(q, k, v, g, None, state, out)  # no beta: no delta term


def _quadratic_form(q, k, v, g, state, out):
    if g.shape[-1] == 1:
        return _gated_linear_quadratic(q, k, v, g[..., 0], state, out)  # g: (B, Hv, L, 1) -> (B, Hv, L)
    # one decay per key channel: the chunked form with the whole sequence as one chunk
    B, Hv, L, E = q.shape
    check_dense("the quadratic form", (B, Hv, L, L, E), q.dtype, q.device,
                noun="the (B, Hv, L, L, E) decay of each channel", instead="mode='chunked' bounds it by chunk_size")
    return _gated_linear_chunked(q, k, v, g, state, out, max(L, 1))


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "recurrent",
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Causal linear attention with a decay per head (fla's ``simple_gla``; SSD's core) or per key
    channel (fla's ``gla``, [Yang et al. 2024](https://arxiv.org/abs/2312.06635)).

    $$
    S_t = e^{g_t} S_{t-1} + k_t v_t^\top, \qquad o_t = S_t^\top q_t
    \qquad\Longleftrightarrow\qquad
    O = (\mathcal{L} \odot Q K^\top) V, \quad
    \mathcal{L}_{ij} = e^{g_{j+1} + \dots + g_i}\ (j \le i), \ 0\ (j > i),
    $$

    plus ``(Q * exp(Gamma)) S_0`` for an initial state. With a decay per key channel
    ``g_t`` is a vector and ``e^{g_t}`` scales row ``e`` of the state by its own
    ``e^{g_{t,e}}``; the matrix form's score is then ``sum_e q_ie k_je exp(Gamma_ie - Gamma_je)``.
    ``mode="recurrent"`` runs the loop, ``mode="quadratic"`` the matrix form (``L x L``
    scores, like softmax attention without the softmax; ``L x L x E`` decays per
    channel), ``mode="chunked"`` the matrix form inside chunks of ``chunk_size``
    tokens and the state from one chunk to the next (the memory of the first, the
    matmuls of the second). No normalisation of ``q`` and ``k``. It is
    `gated_delta_rule` (per channel: `kimi_delta_attention`) without the delta term,
    and its limit for ``beta -> 0``: ``gated_delta_rule(..., beta=eps) / eps ->
    gated_linear_attention(...)``.

    Args:
        q: ``(B, L, H, E)`` queries.
        k: ``(B, L, H, E)`` keys.
        v: ``(B, L, Hv, Ev)`` values, ``Hv`` a multiple of ``H``.
        g: ``(B, L, Hv)`` log decay per head, or ``(B, L, Hv, E)`` per key channel, ``<= 0``.
        initial_state: ``(B, Hv, E, Ev)`` (``(N, Hv, E, Ev)`` with ``cu_seqlens``); zeros if None.
        output_final_state: also return the state after the last token.
        mode: ``"recurrent"``, ``"quadratic"`` or ``"chunked"``.
        chunk_size: tokens per chunk in chunked mode; the last chunk may be shorter.
        cu_seqlens: ``(N + 1,)`` cumulative lengths of sequences packed along ``L`` (``B == 1``):
            each starts from its own initial state and no chunk crosses a boundary.
        scale: multiplies the queries; ``E ** -0.5`` if None.

    Returns:
        ``(out, final_state)``: ``out`` ``(B, L, Hv, Ev)`` in ``v``'s dtype, the state
        in at least float32 or None.

    Raises:
        TypeError: as in `gated_delta_rule`.
        ValueError: as in `gated_delta_rule`; ``g`` must be ``(B, L, Hv)`` or ``(B, L, Hv, E)``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(1, 6, 1, 4), torch.randn(1, 6, 1, 4), torch.randn(1, 6, 1, 2)
        >>> g = -torch.rand(1, 6, 1)
        >>> loop, _ = gated_linear_attention(q, k, v, g)
        >>> matrix, _ = gated_linear_attention(q, k, v, g, mode="quadratic")
        >>> torch.allclose(loop, matrix, atol=1e-5)
        True
        >>> per_channel = -torch.rand(1, 6, 1, 4)       # one decay per key channel
        >>> loop, _ = gated_linear_attention(q, k, v, per_channel)
        >>> chunks, _ = gated_linear_attention(q, k, v, per_channel, mode="chunked", chunk_size=4)
        >>> torch.allclose(loop, chunks, atol=1e-5)
        True
    """
    B, L, _, Hv, E, Ev = _check_qkv(q, k, v)
    check_bool("output_final_state", output_final_state)
    g_tensor = require_tensor("g", g)
    if g_tensor.dim() == 4:  # one decay per key channel
        g = _check_like("g", g, (B, L, Hv, E), "(B, L, Hv, E) per key channel", q)
    else:
        g = _check_like("g", g, (B, L, Hv), "(B, L, Hv) per head (or (B, L, Hv, E) per key channel)", q)
    _check_log_gate("g", g)
    _check_mode(mode, _GLA_MODES)
    check_positive_int("chunk_size", chunk_size)
    check_scale(scale)
    bounds = _packed_bounds(cu_seqlens, B, L, q.device)
    N = B if bounds is None else len(bounds) - 1
    initial_state = _check_state(initial_state, N, Hv, E, Ev, q, bounds is not None)
    g = g if g.dim() == 4 else g[..., None]  # (B, L, Hv) -> (B, L, Hv, 1): one decay for all key channels
    if mode == "recurrent":
        return _run(_gated_linear_recurrent, q, k, v, g, None, initial_state, output_final_state, bounds, scale, False)
    if mode == "quadratic":
        return _run(_quadratic_form, q, k, v, g, None, initial_state, output_final_state, bounds, scale, False)
    return _run(_gated_linear_chunked, q, k, v, g, None, initial_state, output_final_state, bounds, scale, False,
                chunk_size=chunk_size)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalize: bool = False,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "recurrent",
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Plain causal linear attention ([Katharopoulos et al. 2020](https://arxiv.org/abs/2006.16236)).

    $$
    o_t = \sum_{j \le t} (q_t \cdot k_j)\, v_j
    \quad\text{or, normalised,}\quad
    o_t = \frac{\sum_{j \le t} (q_t \cdot k_j)\, v_j}{\sum_{j \le t} q_t \cdot k_j} .
    $$

    Softmax attention with ``exp(q . k)`` replaced by ``q . k``: `gated_linear_attention`
    with ``g = 0``. The normaliser is the same sum with a value of 1, so it runs as one
    more value column: the state is then ``(B, Hv, E, Ev + 1)``, its last column the
    running key sum ``z_t = k_1 + ... + k_t``. Normalised attention needs positive
    scores: apply a positive feature map to ``q`` and ``k`` first (the paper's
    ``elu(x) + 1``); a zero denominator gives ``inf`` or ``nan``, as the formula does.

    Args:
        q: ``(B, L, H, E)`` queries (after the feature map).
        k: ``(B, L, H, E)`` keys (after the feature map).
        v: ``(B, L, Hv, Ev)`` values, ``Hv`` a multiple of ``H``.
        normalize: divide by the running sum of the scores.
        initial_state: ``(B, Hv, E, Ev)``, or ``(B, Hv, E, Ev + 1)`` with ``normalize``.
        output_final_state: also return the state after the last token.
        mode: ``"recurrent"`` or ``"quadratic"``.
        scale: multiplies the queries (it cancels when normalised); ``E ** -0.5`` if None.

    Returns:
        ``(out, final_state)``: ``out`` ``(B, L, Hv, Ev)``; the state or None.

    Raises:
        TypeError: as in `gated_delta_rule`, or ``normalize`` not a bool.
        ValueError: as in `gated_delta_rule`.

    Example:
        >>> import torch
        >>> q = k = torch.ones(1, 3, 1, 2)
        >>> v = torch.tensor([1.0, 2.0, 6.0]).reshape(1, 3, 1, 1)
        >>> out, _ = linear_attention(q, k, v, normalize=True)
        >>> out.flatten().tolist()                  # the running mean of v
        [1.0, 1.5, 3.0]
    """
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    B, L, _, Hv, _, _ = _check_qkv(q, k, v)
    if normalize:
        v = torch.cat([v, v.new_ones(B, L, Hv, 1)], dim=-1)  # (B, L, Hv, Ev) -> (B, L, Hv, Ev + 1)
    g = v.new_zeros(B, L, Hv)  # no decay
    out, state = gated_linear_attention(q, k, v, g, initial_state=initial_state,
                                        output_final_state=output_final_state, mode=mode, scale=scale)
    if normalize:
        out = out[..., :-1] / out[..., -1:]  # (B, L, Hv, Ev) / (B, L, Hv, 1)
    return out, state


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "quadratic",
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Mamba-2's state space duality (SSD, [Dao & Gu 2024](https://arxiv.org/abs/2405.21060)).

    $$
    h_t = e^{\Delta_t A} h_{t-1} + B_t (\Delta_t x_t)^\top, \qquad y_t = h_t^\top C_t + D x_t ,
    $$

    in Mamba-2's names, which is `gated_linear_attention` with ``q = C``, ``k = B``,
    ``v = dt * x``, ``g = dt * A`` and ``scale = 1``: a scalar decay per head and no
    delta term. ``mode="quadratic"`` computes the "attention" form
    ``Y = (L * C B^T) (dt X)`` with the 1-semiseparable ``L_ij = exp(sum_{k=j+1..i} dt_k A)``
    (the segment sum of transformers' ``mamba2``); ``mode="recurrent"`` the scan;
    ``mode="chunked"`` the quadratic form inside chunks of ``chunk_size`` tokens and the
    state between them (Mamba-2's own chunked algorithm, its memory bounded by the chunk).
    The state is ``(batch, H, N, P)`` here (key channels first); Mamba-2's
    ``ssm_state`` is ``(batch, H, P, N)``: convert with `state_kv_to_vk`.

    Args:
        x: ``(batch, L, H, P)`` inputs, ``P`` the head size.
        dt: ``(batch, L, H)`` step sizes, ``>= 0`` (after Mamba-2's ``softplus(dt + dt_bias)``).
        A: ``(H,)`` decay rates, ``<= 0`` (Mamba-2 stores ``A_log``: ``A = -exp(A_log)``).
        B: ``(batch, L, G, N)`` input projections, ``G`` groups; head ``h`` reads group
            ``h // (H // G)``.
        C: ``(batch, L, G, N)`` output projections.
        D: ``(H,)`` skip connection, or None for none.
        initial_state: ``(batch, H, N, P)`` (``(n, H, N, P)`` with ``cu_seqlens``); zeros if None.
        output_final_state: also return the state after the last token.
        mode: ``"quadratic"``, ``"recurrent"`` or ``"chunked"``.
        chunk_size: tokens per chunk in chunked mode; the last chunk may be shorter.
        cu_seqlens: cumulative lengths of sequences packed along ``L`` (``batch == 1``).

    Returns:
        ``(y, final_state)``: ``y`` ``(batch, L, H, P)``; the state ``(batch, H, N, P)`` or None.

    Raises:
        TypeError: an argument is not a floating-point tensor, or their dtypes differ.
        ValueError: a shape does not match, ``H`` is not a multiple of ``G``, ``dt`` is
            negative or ``A`` positive, ``mode`` is unknown, or as
            in `gated_linear_attention`.

    Example:
        >>> import torch
        >>> x, dt = torch.randn(1, 6, 2, 3), torch.rand(1, 6, 2)
        >>> A, B, C = -torch.rand(2), torch.randn(1, 6, 1, 4), torch.randn(1, 6, 1, 4)
        >>> y, _ = ssd(x, dt, A, B, C)
        >>> y_scan, _ = ssd(x, dt, A, B, C, mode="recurrent")
        >>> torch.allclose(y, y_scan, atol=1e-5)
        True
    """
    x = require_float_tensor("x", x, 4, "(batch, L, H, P)")
    if x.dim() != 4:
        raise ValueError(f"x must have 4 dims (batch, L, H, P), got shape {fmt_shape(x.shape)}")
    batch, L, H, _ = x.shape
    dt = _check_like("dt", dt, (batch, L, H), "(batch, L, H)", x)
    A = _check_like("A", A, (H,), "(H,)", x)
    B = require_float_tensor("B", B, 4, "(batch, L, G, N)")
    if B.dim() != 4 or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"B must have shape (batch, L, G, N) with (batch, L)={fmt_shape(x.shape[:2])}, "
                         f"got {fmt_shape(B.shape)}")
    C = _check_like("C", C, tuple(B.shape), "(batch, L, G, N)", x)
    require_same_dtype_and_device(x=x, dt=dt, A=A, B=B, C=C)
    if H % B.shape[2] != 0:
        raise ValueError(f"x's heads H={H} must be a multiple of the groups G={B.shape[2]} of B and C")
    _check_mode(mode, ("quadratic", "recurrent", "chunked"))
    if D is not None:
        D = _check_like("D", D, (H,), "(H,)", x)
    if dt.numel() and not dt.is_meta and bool((dt < 0).any()):
        raise ValueError(f"dt must be >= 0, got a minimum of {dt.min().item():.4g}")
    if not A.is_meta and bool((A > 0).any()):
        raise ValueError(f"A must be <= 0 (A = -exp(A_log)), got a maximum of {A.max().item():.4g}")
    v = x * dt[..., None]  # (batch, L, H, P): the value written is dt * x
    g = dt * A  # (batch, L, H): log decay
    y, state = gated_linear_attention(C, B, v, g, initial_state=initial_state, output_final_state=output_final_state,
                                      mode=mode, chunk_size=chunk_size, cu_seqlens=cu_seqlens, scale=1.0)
    if D is not None:
        y = y + x * D[:, None]  # (batch, L, H, P) + (batch, L, H, P) * (H, 1)
    return y, state


# --- conventions at the boundary ----------------------------------------------------------------


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    r"""Divide each vector of the last dim by its length: ``x / sqrt(sum(x**2) + eps)``.

    The normalisation Gated DeltaNet and Kimi Delta Attention apply to queries and
    keys ("``use_qk_l2norm_in_kernel``"), with ``eps`` inside the square root as in
    fla and transformers. Unit keys keep the delta rule's step ``I - beta k k^T``
    a contraction for ``beta`` in ``[0, 2]``.

    Args:
        x: ``(..., E)`` floating-point tensor.
        eps: added to the squared length before the square root.

    Returns:
        ``(..., E)``, same dtype.

    Example:
        >>> import torch
        >>> l2_normalize(torch.tensor([3.0, 4.0]), eps=0.0).tolist() == [0.6000000238418579, 0.800000011920929]
        True
    """
    return _l2_normalize(x, False, eps)


def _l2_normalize(x: torch.Tensor, own: bool, eps: float = L2NORM_EPS, square: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """`l2_normalize`, dividing ``x`` in place when ``own`` (as in `_scaled`); ``square``:
    a `_Scratch` tensor like ``x`` for ``x * x``, or None for a new one."""
    length = torch.sqrt(torch.mul(x, x, out=square).sum(dim=-1, keepdim=True) + eps)  # (..., 1)
    return x.div_(length) if own else x / length


def state_kv_to_vk(state: torch.Tensor) -> torch.Tensor:
    """Convert a state from this module's ``(..., E, Ev)`` layout to ``(..., Ev, E)``.

    fla and transformers' Qwen3-Next store the state key channels first, ``(B, Hv,
    E, Ev)``, read as ``o = S^T q``; Mamba-2's ``ssm_state`` ``(B, H, headdim,
    d_state)`` and flashinfer's GDN state are value channels first ("k-last"),
    read as ``o = S q``.

    Args:
        state: ``(..., E, Ev)``.

    Returns:
        ``(..., Ev, E)``, a contiguous copy.

    Raises:
        TypeError: ``state`` is not a tensor.
        ValueError: ``state`` has fewer than 2 dims.

    Example:
        >>> import torch
        >>> state_kv_to_vk(torch.zeros(2, 4, 3)).shape
        torch.Size([2, 3, 4])
    """
    state = require_tensor("state", state)
    if state.dim() < 2:
        raise ValueError(f"state must have at least 2 dims (..., E, Ev), got shape {fmt_shape(state.shape)}")
    return state.transpose(-1, -2).contiguous()  # (..., E, Ev) -> (..., Ev, E)


def state_vk_to_kv(state: torch.Tensor) -> torch.Tensor:
    """Convert a state from the ``(..., Ev, E)`` layout (Mamba-2, flashinfer) to ``(..., E, Ev)``.

    The inverse of `state_kv_to_vk`.

    Args:
        state: ``(..., Ev, E)``.

    Returns:
        ``(..., E, Ev)``, a contiguous copy.

    Raises:
        TypeError: ``state`` is not a tensor.
        ValueError: ``state`` has fewer than 2 dims.

    Example:
        >>> import torch
        >>> s = torch.randn(2, 4, 3)
        >>> torch.equal(state_vk_to_kv(state_kv_to_vk(s)), s)
        True
    """
    state = require_tensor("state", state)
    if state.dim() < 2:
        raise ValueError(f"state must have at least 2 dims (..., Ev, E), got shape {fmt_shape(state.shape)}")
    return state.transpose(-1, -2).contiguous()  # (..., Ev, E) -> (..., E, Ev)
