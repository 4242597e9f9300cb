r"""Cost of one attention layer: parameters, FLOPs and memory, as closed formulas.

Shapes use the package legend: ``B`` batch, ``H`` heads, ``L`` query length,
``S`` key length, ``E`` query/key size per head, ``Ev`` value size per head.
A multi-head layer of width ``d = H * E`` (with ``Ev = E``) costs

$$
\underbrace{2 B L d^2 + 2 B S d\,(d_k + d_v) + 2 B L d^2}_{\text{projections}}
\;+\; \underbrace{2 B H L S (E + E_v)}_{QK^\top \text{ and } WV}
$$

multiply-add FLOPs (one multiply-add counts 2), i.e. ``O(n d^2 + n^2 d)`` for
``n = L = S``: the projections dominate for short sequences, the ``n x n``
score matrix for long ones. Softmax and masking (``O(B H L S)``) are not counted,
as ``torch.utils.flop_counter.FlopCounterMode`` does not count them either.

Generating text keeps a KV cache, and its size is the other cost that decides what a model
can serve. Per token, a layer of grouped-query attention stores a key and a value per
key/value head (`kv_bytes_per_token`), a layer of multi-head latent attention one
compressed latent and one shared RoPE key (`latent_kv_bytes_per_token`), a layer with a
sliding window or a chunk at most that many tokens (`cached_tokens`), and a linear-attention
layer a fixed state instead (`linear_state_bytes`); `kv_cache_bytes` adds the layers of a
model up for one sequence. An FP8 cache stores one byte per element
(``bytes_per_element=1``) and a few float32 scales per layer (`kv_scale_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable

from attention_ref._validation import check_positive_int

__all__ = [
    "attention_flops",
    "attention_memory_bytes",
    "cached_tokens",
    "causal_pairs",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_scale_bytes",
    "latent_kv_bytes_per_token",
    "layer_flops",
    "linear_state_bytes",
    "parameter_count",
    "projection_flops",
    "ring_attention_bytes",
    "sliding_window_pairs",
    "ulysses_attention_bytes",
    "usp_attention_bytes",
]


def _nonneg(**sizes: int) -> None:
    for name, value in sizes.items():
        check_positive_int(name, value, allow_zero=True)


def causal_pairs(L: int, S: int) -> int:
    r"""Number of (query, key) pairs kept by a top-left causal mask.

    Query ``i`` sees keys ``0..min(i, S-1)``: $\sum_{i<L} \min(i+1, S)$,
    which is ``L (L + 1) / 2`` when ``L = S``.

    Examples:
        >>> causal_pairs(4, 4)
        10
    """
    _nonneg(L=L, S=S)
    full = min(L, S)  # rows 0..full-1 see i + 1 keys, later rows see all S
    return full * (full + 1) // 2 + (L - full) * S


def sliding_window_pairs(L: int, window: int) -> int:
    r"""Number of (query, key) pairs kept by a causal sliding window over ``L`` tokens.

    Query ``i`` sees the ``w = window`` most recent keys, itself included:
    key ``j`` when $i - w < j \le i$, that is $\min(i + 1, w)$ keys. With
    $w' = \min(w, L)$ the total is $w'(w' + 1)/2 + (L - w')\,w'$: linear in ``L``
    for a fixed window, where the dense causal mask keeps ``L (L + 1) / 2``
    (`causal_pairs`, which a window of ``L`` or more gives back).

    Examples:
        >>> sliding_window_pairs(5, 2)  # rows keep 1, 2, 2, 2, 2 keys
        9
    """
    _nonneg(L=L)
    check_positive_int("window", window)
    w = min(window, L)
    return w * (w + 1) // 2 + (L - w) * w


def attention_flops(B: int, H: int, L: int, S: int, E: int, Ev: int, causal: bool = False) -> int:
    r"""FLOPs of the two matrix products of scaled dot-product attention.

    $$
    \underbrace{2 B H L S E}_{Q K^\top} + \underbrace{2 B H L S E_v}_{W V}
    $$

    With ``causal=True`` only the pairs a causal mask keeps are counted
    (`causal_pairs` instead of ``L * S``): the work a kernel that skips masked
    blocks must do. The reference path computes all ``L * S`` pairs either way.

    Examples:
        >>> attention_flops(B=1, H=1, L=2, S=3, E=4, Ev=5)
        108
    """
    _nonneg(B=B, H=H, L=L, S=S, E=E, Ev=Ev)
    pairs = causal_pairs(L, S) if causal else L * S
    return 2 * B * H * pairs * (E + Ev)


def projection_flops(
    B: int, L: int, S: int, embed_dim: int, kdim: int | None = None, vdim: int | None = None, num_kv_heads_width: int | None = None
) -> int:
    r"""FLOPs of the four linear projections of a multi-head layer (biases not counted).

    $$
    \underbrace{2 B L d^2}_{W^Q} + \underbrace{2 B S d_k d_{kv}}_{W^K}
    + \underbrace{2 B S d_v d_{kv}}_{W^V} + \underbrace{2 B L d^2}_{W^O}
    $$

    ``d = embed_dim``, ``d_k = kdim``, ``d_v = vdim`` (both default to ``d``), and
    ``d_kv = num_kv_heads_width`` the width of the key/value projections
    (``num_kv_heads * head_dim``, defaults to ``d``).
    """
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    kv = embed_dim if num_kv_heads_width is None else num_kv_heads_width
    _nonneg(B=B, L=L, S=S, embed_dim=embed_dim, kdim=kdim, vdim=vdim, num_kv_heads_width=kv)
    return 2 * B * L * embed_dim * embed_dim * 2 + 2 * B * S * kv * (kdim + vdim)


def layer_flops(B: int, H: int, L: int, S: int, embed_dim: int, *, kdim: int | None = None, vdim: int | None = None, causal: bool = False) -> int:
    """FLOPs of one `attention_ref.MultiHeadAttention` forward: projections + attention.

    Examples:
        >>> layer_flops(B=1, H=2, L=3, S=3, embed_dim=4)
        528
    """
    check_positive_int("H", H)
    if embed_dim % H:
        raise ValueError(f"embed_dim must be divisible by H, got embed_dim={embed_dim}, H={H}")
    D = embed_dim // H
    return projection_flops(B, L, S, embed_dim, kdim, vdim) + attention_flops(B, H, L, S, D, D, causal)


def parameter_count(embed_dim: int, *, kdim: int | None = None, vdim: int | None = None, num_heads: int = 1, num_kv_heads: int | None = None, bias: bool = True) -> int:
    r"""Parameters of one multi-head attention layer.

    $$
    \underbrace{d^2 + d}_{W^Q, b^Q} + \underbrace{d_k d_{kv} + d_{kv}}_{W^K, b^K}
    + \underbrace{d_v d_{kv} + d_{kv}}_{W^V, b^V} + \underbrace{d^2 + d}_{W^O, b^O}
    $$

    which is ``4 d^2 + 4 d`` for self-attention. The count does not depend on the
    number of heads (heads split ``d``), except through ``d_kv = num_kv_heads * d / H``.

    Examples:
        >>> parameter_count(512)
        1050624
    """
    check_positive_int("embed_dim", embed_dim)
    check_positive_int("num_heads", num_heads)
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_positive_int("kdim", kdim)
    check_positive_int("vdim", vdim)
    check_positive_int("num_kv_heads", num_kv_heads)
    if embed_dim % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"embed_dim must be divisible by num_heads and num_heads by num_kv_heads, got "
            f"embed_dim={embed_dim}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    kv = num_kv_heads * (embed_dim // num_heads)
    weights = embed_dim * embed_dim * 2 + kdim * kv + vdim * kv
    biases = (2 * embed_dim + 2 * kv) if bias else 0
    return weights + biases


def attention_memory_bytes(B: int, H: int, L: int, S: int, E: int, Ev: int, *, bytes_per_element: int = 4, materialize_weights: bool = True) -> dict[str, int]:
    """Bytes held by one attention call's tensors.

    Returns a dict with ``inputs`` (Q, K, V: ``B H (L E + S E + S Ev)``),
    ``output`` (``B H L Ev``) and ``weights`` (the ``B H L S`` score/weight matrix
    the reference path materialises, 0 when ``materialize_weights=False`` as in
    the tiled and fused kernels), each times ``bytes_per_element``.

    Examples:
        >>> attention_memory_bytes(1, 1, 32768, 32768, 64, 64)["weights"] // 2**30
        4
    """
    _nonneg(B=B, H=H, L=L, S=S, E=E, Ev=Ev, bytes_per_element=bytes_per_element)
    per = bytes_per_element
    return {
        "inputs": B * H * (L * E + S * E + S * Ev) * per,
        "output": B * H * L * Ev * per,
        "weights": B * H * L * S * per if materialize_weights else 0,
    }


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, v_head_dim: int | None = None, *, bytes_per_element: int = 2) -> int:
    r"""Bytes one attention layer adds to its KV cache per token.

    Each of the ``Hkv = num_kv_heads`` key/value heads stores one key of size
    ``E = head_dim`` and one value of size ``Ev = v_head_dim`` (defaults to ``E``):

    $$
    H_{kv}\,(E + E_v) \times \text{bytes per element}
    $$

    which is ``2 Hkv E`` elements when ``Ev = E``. Multi-head attention has ``Hkv = H``,
    grouped-query attention fewer, multi-query attention 1; the number of query heads does
    not enter. ``bytes_per_element`` is 2 for bfloat16 and float16 (the default), 4 for
    float32, 1 for an FP8 cache, whose scales, a fixed few per layer, `kv_scale_bytes` counts.

    Examples:
        >>> kv_bytes_per_token(8, 128)  # Llama-3-8B: 8 key/value heads of 128, bfloat16
        4096
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    check_positive_int("num_kv_heads", num_kv_heads)
    check_positive_int("head_dim", head_dim)
    check_positive_int("v_head_dim", v_head_dim)
    check_positive_int("bytes_per_element", bytes_per_element)
    return num_kv_heads * (head_dim + v_head_dim) * bytes_per_element


def kv_scale_bytes(num_kv_heads: int, granularity: str = "tensor", *, bytes_per_scale: int = 4) -> int:
    r"""Bytes of the scales of one layer's FP8 KV cache: a fixed cost, whatever the number of tokens.

    vLLM's FP8 cache (``kv_cache_dtype="fp8"``) keeps one ``k_scale`` and one ``v_scale``
    per layer, per tensor (``granularity="tensor"``) or per key/value head (``"head"``),
    in float32:

    $$
    2 \times n \times \text{bytes per scale}, \qquad n = 1 \text{ or } H_{kv} .
    $$

    A layer's FP8 cache of ``T`` tokens then takes
    ``T * kv_bytes_per_token(Hkv, E, Ev, bytes_per_element=1) + kv_scale_bytes(Hkv, granularity)``
    (`attention_ref.kv_cache.KVCache.memory_bytes`, with ``T = B * S_max``).

    Examples:
        >>> kv_scale_bytes(8), kv_scale_bytes(8, "head")  # Llama-3-8B's 8 key/value heads, one layer
        (8, 64)
    """
    check_positive_int("num_kv_heads", num_kv_heads)
    check_positive_int("bytes_per_scale", bytes_per_scale)
    if granularity not in ("tensor", "head"):
        raise ValueError(f"granularity must be 'tensor' or 'head' (per key/value head), got {granularity!r}")
    return 2 * (1 if granularity == "tensor" else num_kv_heads) * bytes_per_scale


def latent_kv_bytes_per_token(kv_lora_rank: int, rope_head_dim: int, *, bytes_per_element: int = 2) -> int:
    r"""Bytes one multi-head latent attention (MLA) layer adds to its cache per token.

    MLA (DeepSeek-V2/V3) caches, per token, one compressed latent ``c_KV`` of size
    ``kv_lora_rank`` and one RoPE key of size ``rope_head_dim`` shared by all heads; the
    per-head keys and values are re-expanded from the latent (or the expansion is absorbed
    into the query and output projections):

    $$
    (d_c + d_R) \times \text{bytes per element}
    $$

    whatever the number of heads. Transformers caches these two tensors
    (``DeepseekV3Attention``), as do the absorbed decode kernels (FlashMLA's 576 = 512 + 64).

    Examples:
        >>> latent_kv_bytes_per_token(512, 64)  # DeepSeek-V3, bfloat16
        1152
    """
    check_positive_int("kv_lora_rank", kv_lora_rank)
    check_positive_int("rope_head_dim", rope_head_dim, allow_zero=True)
    check_positive_int("bytes_per_element", bytes_per_element)
    return (kv_lora_rank + rope_head_dim) * bytes_per_element


def cached_tokens(context: int, window: int | None = None) -> int:
    """Tokens a layer must hold to attend from the next position of a ``context``-token sequence.

    A layer of full (causal) attention holds all ``context`` tokens. A layer with a sliding
    window of ``w`` holds the ``w`` most recent, the keys its newest query sees (itself
    included, as `sliding_window_pairs` counts them): ``min(context, w)``. A chunked layer
    (Llama 4's ``attention_chunk_size``) holds at most its chunk, so passing the chunk size as
    ``window`` gives the most it holds. Transformers' sliding cache stores ``w - 1`` tokens
    between steps and appends the new one before attending.

    Examples:
        >>> cached_tokens(32768), cached_tokens(32768, window=4096), cached_tokens(100, window=4096)
        (32768, 4096, 100)
    """
    check_positive_int("context", context, allow_zero=True)
    if window is None:
        return context
    check_positive_int("window", window)
    return min(context, window)


def kv_cache_bytes(layers: Iterable[tuple[int, int | None]], context: int) -> int:
    r"""Bytes of a model's KV cache for one sequence of ``context`` tokens.

    ``layers`` holds one ``(bytes_per_token, window)`` pair per layer: what the layer stores
    per token (`kv_bytes_per_token`, `latent_kv_bytes_per_token`) and its window (``None``
    for full attention). The total is

    $$
    \sum_{\text{layers}} \text{bytes per token} \times \min(\text{context}, w)
    $$

    (`cached_tokens`). Multiply by the batch size for several sequences. A linear-attention
    layer stores no tokens: leave it out, and add its fixed `linear_state_bytes`; an FP8
    layer adds its fixed `kv_scale_bytes`.

    Examples:
        >>> kv_cache_bytes([(4096, None)] * 32, 8192) // 2**30  # Llama-3-8B, 8k tokens: 1 GiB
        1
        >>> kv_cache_bytes([(4096, None), (4096, 1024)], 8192) // 4096  # a full and a local layer
        9216
    """
    check_positive_int("context", context, allow_zero=True)
    if isinstance(layers, (int, float, str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be an iterable of (bytes_per_token, window) pairs, one per layer, "
                        f"got {type(layers).__name__} {layers!r}")
    total = 0
    for index, layer in enumerate(layers):
        if not (isinstance(layer, tuple) and len(layer) == 2):
            raise TypeError(f"layers[{index}] must be a (bytes_per_token, window) pair, got {layer!r}")
        per_token, window = layer
        check_positive_int(f"layers[{index}] bytes_per_token", per_token, allow_zero=True)
        total += per_token * cached_tokens(context, window)
    return total


def linear_state_bytes(num_heads: int, key_dim: int, value_dim: int, *, bytes_per_element: int = 2) -> int:
    r"""Bytes of the recurrent state of one linear-attention layer, for one sequence.

    Linear attention (and the gated delta rule of Qwen3-Next, Kimi Linear) replaces the KV
    cache by one ``key_dim x value_dim`` matrix per head, updated at every token: a fixed
    size, whatever the length of the sequence,

    $$
    H \, d_k \, d_v \times \text{bytes per element}.
    $$

    ``num_heads`` counts the heads that own a state (the value heads of Qwen3-Next's gated
    delta rule). The short convolution some layers keep before it is not counted. Many
    implementations keep this state in float32 (``bytes_per_element=4``).

    Examples:
        >>> linear_state_bytes(32, 128, 128) // 2**20  # Qwen3-Next: 32 heads of 128 x 128, MiB
        1
    """
    check_positive_int("num_heads", num_heads)
    check_positive_int("key_dim", key_dim)
    check_positive_int("value_dim", value_dim)
    check_positive_int("bytes_per_element", bytes_per_element)
    return num_heads * key_dim * value_dim * bytes_per_element


def _context_parallel_sizes(B: int, H: int, Hkv: int, L: int, E: int, Ev: int, world: int,
                            bytes_per_element: int) -> int:
    """Checks the sizes of the context-parallel formulas; returns ``n = L / world``."""
    for name, value in (("B", B), ("H", H), ("Hkv", Hkv), ("L", L), ("E", E), ("Ev", Ev), ("world", world),
                        ("bytes_per_element", bytes_per_element)):
        check_positive_int(name, value)
    if L % world:
        raise ValueError(f"L={L} must be a multiple of world={world}: each rank holds L / world positions")
    return L // world


def ring_attention_bytes(B: int, H: int, Hkv: int, L: int, E: int, Ev: int, world: int, *,
                         bytes_per_element: int = 2, window: int | None = None) -> int:
    r"""Bytes one rank sends in the forward pass of `attention_ref.distributed.ring_attention`.

    The key and value slices travel the ring: ``W - 1`` steps of this rank's share,

    $$
    (W - 1)\, B\, H_{kv}\, \frac{L}{W}\, (E + E_v) \times \text{bytes per element},
    $$

    which grows with ``W`` toward ``B H_kv L (E + E_v)``: every rank sees every key. ``H``
    is not used (the queries stay); it is an argument so that the formulas take the
    same ones. The backward pass sends the same again, plus the dK/dV accumulators.

    That is the whole ring, what every rank sends when every rank needs every slice (no
    mask, or the zigzag layout under a causal mask), and the most any rank sends otherwise:
    a slice stops where no rank further along needs it (`attention_ref.distributed.ring_hops`;
    a causal contiguous ring, a sliding window), and the busiest rank sends this much under
    a causal mask on the contiguous layout.

    With ``window``, a causal sliding window of that many earlier keys
    (`attention_ref.mods.sliding_window`) on the *contiguous* layout: a query reaches
    ``k = ceil(window / n)`` slices back, so a slice travels ``k`` hops and the busiest
    rank sends ``min(k, W - 1)`` slices,

    $$
    \min\!\Big(\Big\lceil \frac{w}{L / W} \Big\rceil,\ W - 1\Big)\, B\, H_{kv}\, \frac{L}{W}\, (E + E_v)
    \times \text{bytes per element},
    $$

    which *falls* with ``W`` while a slice is at least as long as the window (one slice per
    rank). On the zigzag layout a window saves almost nothing (a rank's late chunk needs a
    chunk of the next rank, whose slice arrives after ``W - 1`` hops): use the formula
    without ``window``.

    Raises:
        ValueError: ``L`` not a multiple of ``world``, a size not positive, ``window`` negative.

    Examples:
        >>> ring_attention_bytes(1, 32, 8, 131072, 128, 128, 8) // 2**20   # Llama 3 8B, 128k, 8 ranks, MiB
        448
        >>> ring_attention_bytes(1, 32, 8, 131072, 128, 128, 8, window=4096) // 2**20   # a 4k window
        64
    """
    n = _context_parallel_sizes(B, H, Hkv, L, E, Ev, world, bytes_per_element)
    steps = world - 1
    if window is not None:
        window = check_positive_int("window", window, allow_zero=True)
        steps = min(steps, -(-window // n))  # ceil(window / n) slices back
    return steps * B * Hkv * n * (E + Ev) * bytes_per_element


def ulysses_attention_bytes(B: int, H: int, Hkv: int, L: int, E: int, Ev: int, world: int, *,
                            bytes_per_element: int = 2) -> int:
    r"""Bytes one rank sends in the forward pass of `attention_ref.distributed.ulysses_attention`.

    Four all-to-alls: the query, key and value slices to head slices, the output back.
    Each sends the share ``(W - 1) / W`` of a local tensor of ``n = L / W`` positions,

    $$
    \frac{W - 1}{W}\, B\, \frac{L}{W}\, \big(H E + H'_{kv} (E + E_v) + H E_v\big)
    \times \text{bytes per element},
    $$

    with ``H'_kv = H_kv`` when ``H_kv`` is a multiple of ``W``, else ``W`` (each key/value
    head repeated so that every rank receives one). It *falls* as ``W`` grows (as ``1/W``),
    where the ring's rises; the price is that ``W`` cannot exceed ``H``. The backward pass
    sends the same again (``dO`` out, ``dQ``, ``dK``, ``dV`` back).

    Raises:
        ValueError: ``H`` not a multiple of ``world``, or ``Hkv`` neither a multiple nor a
            divisor of it (`ulysses_attention` refuses those too).

    Examples:
        >>> ulysses_attention_bytes(1, 32, 8, 131072, 128, 128, 8) // 2**20
        280
    """
    n = _context_parallel_sizes(B, H, Hkv, L, E, Ev, world, bytes_per_element)
    if H % world:
        raise ValueError(f"H={H} query heads must be a multiple of world={world} for Ulysses")
    if Hkv % world and world % Hkv:
        raise ValueError(f"Hkv={Hkv} key/value heads must be a multiple or a divisor of world={world} for Ulysses")
    kv_heads = Hkv if Hkv % world == 0 else world
    return (world - 1) * B * n * (H * E + kv_heads * (E + Ev) + H * Ev) * bytes_per_element // world


def usp_attention_bytes(B: int, H: int, Hkv: int, L: int, E: int, Ev: int, ulysses: int, ring: int, *,
                        bytes_per_element: int = 2) -> int:
    r"""Bytes one rank sends in the forward pass of `attention_ref.distributed.usp_attention`.

    ``W = U R`` ranks (``U = ulysses`` in a row, ``R = ring`` in a column), each holding
    ``n = L / (U R)`` positions. The four all-to-alls inside the row are Ulysses' on ``U``
    ranks; between them, the ring across the column passes the key/value block this rank
    holds after the first all-to-all, ``H'_kv / U`` heads over the row's ``U n`` positions,
    ``R - 1`` times:

    $$
    \Big[\underbrace{\frac{U - 1}{U}\, B\, n\, \big(H E + H'_{kv} (E + E_v) + H E_v\big)}_{\text{all-to-alls in the row}}
    + \underbrace{(R - 1)\, B\, H'_{kv}\, n\, (E + E_v)}_{\text{ring across the column}}\Big]
    \times \text{bytes per element},
    $$

    with ``H'_kv = H_kv`` when ``H_kv`` is a multiple of ``U``, else ``U`` (each key/value
    head repeated so that every rank of the row receives one; the copies travel the ring
    too). ``ring=1`` gives `ulysses_attention_bytes` on ``U`` ranks, ``ulysses=1``
    `ring_attention_bytes` on ``R``. The ring term counts the whole ring, what every rank
    sends when every rank needs every block (no mask, or the zigzag layout under a causal
    mask); for the same ``L`` it is ``1 / U`` of `ring_attention_bytes` on ``R`` ranks
    (``H_kv`` a multiple of ``U``): a rank passes on ``1 / U`` of the heads of its row's
    block. The backward pass sends the same again, plus the ring's dK/dV accumulators.

    Raises:
        ValueError: ``L`` not a multiple of ``ulysses * ring`` (the world size); ``H`` not a
            multiple of ``ulysses``, or ``Hkv`` neither a multiple nor a divisor of it
            (`attention_ref.distributed.usp_attention` refuses those too).

    Examples:
        >>> llama = dict(B=1, H=32, Hkv=8, L=131072, E=128, Ev=128)   # Llama 3 8B, 128k tokens
        >>> usp_attention_bytes(**llama, ulysses=8, ring=2) // 2**20    # 16 ranks: 8 x 2, MiB
        172
        >>> usp_attention_bytes(**llama, ulysses=8, ring=1) == ulysses_attention_bytes(**llama, world=8)
        True
        >>> usp_attention_bytes(**llama, ulysses=1, ring=8) == ring_attention_bytes(**llama, world=8)
        True
    """
    check_positive_int("ulysses", ulysses)
    check_positive_int("ring", ring)
    n = _context_parallel_sizes(B, H, Hkv, L, E, Ev, ulysses * ring, bytes_per_element)
    if H % ulysses:
        raise ValueError(f"H={H} query heads must be a multiple of ulysses={ulysses} for USP's all-to-all")
    if Hkv % ulysses and ulysses % Hkv:
        raise ValueError(f"Hkv={Hkv} key/value heads must be a multiple or a divisor of ulysses={ulysses} "
                         "for USP's all-to-all")
    kv_heads = Hkv if Hkv % ulysses == 0 else ulysses
    row = (ulysses - 1) * B * n * (H * E + kv_heads * (E + Ev) + H * Ev) // ulysses  # exact: U divides both
    column = (ring - 1) * B * kv_heads * n * (E + Ev)
    return (row + column) * bytes_per_element
