r"""Attention over a key/value cache: generating text one token at a time.

A decoder generates a sequence token by token. The keys and values of the tokens
already seen do not change, so they are kept in a *cache* and each step computes
only the new tokens' query, key and value: one new row of the causal weight
matrix instead of the whole matrix again.

- `attention_with_kv_cache` is the attention of ``Lq`` new queries against a
  cache, contiguous or paged; it gathers the valid keys and values and calls the
  functional core (`attention_ref.functional.scaled_dot_product_attention`)
  with a mask mod, so it computes the same numbers as every other path.
- `KVCache` holds ``B`` sequences that advance together, in one contiguous
  ``(B, Hkv, S_max, E)`` tensor for the keys and one for the values.
- `PagedKVCache` holds any number of sequences in a pool of fixed-size blocks
  that each sequence takes as it grows (the paged attention of vLLM,
  [Kwon et al. 2023](https://arxiv.org/abs/2309.06180)).

Positions are aligned bottom-right, as in FlashAttention's
``flash_attn_with_kvcache``: ``cache_seqlens[b]`` counts the valid keys of
sequence ``b``, the new tokens included, and query ``i`` of ``Lq`` sits at
position ``cache_seqlens[b] - Lq + i``, the last query at the last key.

Shapes use the package legend: ``B`` batch, ``H`` query heads, ``Hkv``
key/value heads (``H`` a multiple of ``Hkv``: query head ``h`` reads kv head
``h // (H // Hkv)``), ``Lq`` new queries, ``S`` keys, ``E`` query/key size,
``Ev`` value size. The caches put heads before positions, ``(..., Hkv, S, E)``,
like the rest of this package; FlashAttention and vLLM store a paged pool as
``(num_blocks, block_size, Hkv, E)``, which is ``key_blocks.transpose(1, 2)``.

**FP8 caches** (vLLM's ``kv_cache_dtype="fp8"``): both caches take an FP8 ``dtype``
(``torch.float8_e4m3fn``, ``float8_e5m2``, or the ``fnuz`` formats of
`attention_ref.quant`) with a ``k_scale`` and a ``v_scale``, one per tensor or one per
key/value head. `KVCache.append` and `PagedKVCache.append` take float keys and values and
store ``x8 = satfinite_RNE(x / scale)``, the package's quantizer
(`attention_ref.quant.quantize_fp8`, clamp then round to nearest even; never a bare cast),
as vLLM's ``reshape_and_cache_flash`` does (it divides in float32: see `KVCache`).
`attention_with_kv_cache` takes the scales as ``k_descale``/``v_descale`` and attends to
the dequantized ``x8 * scale`` (`attention_ref.quant.dequantize_fp8`):
`attention_ref.quant.fp8_attention` without P emulation. ``memory_bytes`` counts one byte per element plus the float32 scales
(`attention_ref.complexity.kv_scale_bytes`).

Examples:
    >>> import torch
    >>> from attention_ref.kv_cache import KVCache, attention_with_kv_cache
    >>> cache = KVCache(batch=1, num_kv_heads=2, max_length=8, head_dim=4)
    >>> k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)  # 3 tokens, Hkv = 2
    >>> keys, values = cache.append(k, v)
    >>> q = torch.randn(1, 6, 3, 4)  # their queries, H = 6
    >>> out = attention_with_kv_cache(q, cache.key_cache, cache.value_cache,
    ...                               cache.lengths, is_causal=True)
    >>> out.shape
    torch.Size([1, 6, 3, 4])

    The same in FP8, one scale per tensor for the keys and one per key/value head for the values:

    >>> fp8 = KVCache(batch=1, num_kv_heads=2, max_length=8, head_dim=4, dtype=torch.float8_e4m3fn,
    ...               k_scale=0.01, v_scale=torch.tensor([0.01, 0.02]))
    >>> _ = fp8.append(k, v)
    >>> out8 = attention_with_kv_cache(q, fp8.key_cache, fp8.value_cache, fp8.lengths, is_causal=True,
    ...                                k_descale=fp8.k_scale, v_descale=fp8.v_scale)
    >>> fp8.key_cache.dtype, fp8.memory_bytes  # 2 x 1 x 2 x 8 x 4 bytes, and 3 float32 scales
    (torch.float8_e4m3fn, 140)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

from attention_ref import mods
from attention_ref._validation import check_dense, check_positive_int, fmt_shape, require_int_tensor, require_tensor
from attention_ref.block_mask import BlockMask, recorded_on
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.quant import FORMATS, dequantize_fp8, quantize_fp8, to_torch_float8
from attention_ref.sinks import check_sinks

__all__ = ["KVCache", "PagedKVCache", "attention_with_kv_cache", "kv_cache_mask_mod"]


# --- argument checks -----------------------------------------------------------------------------


def _float_4d(name: str, value: object, layout: str) -> torch.Tensor:
    tensor = require_tensor(name, value)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")
    if tensor.dim() != 4:
        raise ValueError(f"{name} must have 4 dims {layout}, got shape {fmt_shape(tensor.shape)}")
    return tensor


def _same_dtype_and_device(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if tensor.dtype != ref.dtype:
        raise TypeError(f"{name} must have the same dtype as {ref_name} ({ref.dtype}), got {tensor.dtype}")
    if tensor.device != ref.device:
        raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {tensor.device}")


#: torch's FP8 dtypes a cache may hold, by `attention_ref.quant.FORMATS` name
_FP8_DTYPES = {getattr(torch, f.torch_dtype): f.name for f in FORMATS.values() if hasattr(torch, f.torch_dtype)}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_dtype(dtype: object) -> torch.dtype:
    resolved = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(resolved, torch.dtype) or not (resolved in _FLOAT_DTYPES or resolved in _FP8_DTYPES):
        raise TypeError(
            f"dtype must be a floating-point torch.dtype (float16, bfloat16, float32, float64), an FP8 one "
            f"({', '.join(str(d) for d in _FP8_DTYPES)}) or None, got {dtype!r}"
        )
    return resolved


def _scale(name: str, value: object, num_kv_heads: int, device: torch.device | str | None) -> torch.Tensor:
    """A k/v scale (or descale) as float32 ``()`` or ``(Hkv,)``: per tensor or per key/value head (vLLM's)."""
    expected = f"a number, a 0-dim tensor or a tensor (Hkv,) = ({num_kv_heads},)"
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.dtype in _FP8_DTYPES:
            raise TypeError(f"{name} must be {expected} of a floating-point dtype, got {value.dtype}")
        if value.shape not in ((), (num_kv_heads,)):
            raise ValueError(f"{name} must be {expected}, got shape {fmt_shape(value.shape)}")
    elif not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    scale = torch.as_tensor(value, dtype=torch.float32).to(device)  # float32, as vLLM keeps it
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bad.any():
        raise ValueError(f"{name} must be finite and > 0 everywhere, got {scale.tolist()}")
    return scale


def _cache_scales(fmt: str | None, dtype: torch.dtype, k_scale: object, v_scale: object, num_kv_heads: int,
                  device: torch.device | str | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The cache's ``(k_scale, v_scale)``: both required with an FP8 ``dtype``, refused with another."""
    if fmt is None:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise ValueError(
                    f"{name} is for an FP8 cache (dtype {' or '.join(str(d) for d in _FP8_DTYPES)}), got "
                    f"{name}={value!r} with dtype={dtype}: leave it None, or pass an FP8 dtype"
                )
        return None, None
    scales = []
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is None:
            raise ValueError(
                f"{name} is required with dtype={dtype}: a number, a 0-dim tensor or a tensor (Hkv,) = "
                f"({num_kv_heads},), the descale x ≈ x8 * {name} per tensor or per key/value head (vLLM's "
                f"{name}), got None"
            )
        scales.append(_scale(name, value, num_kv_heads, device))
    return scales[0], scales[1]


def _granularity(scale: torch.Tensor) -> str:
    """`attention_ref.quant`'s name of a scale's layout: ``"tensor"`` for ``()``, ``"head"`` for ``(Hkv,)``."""
    return "tensor" if scale.dim() == 0 else "head"


def _quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x8 = satfinite_RNE(x / scale)`` as torch's FP8 dtype: `attention_ref.quant.quantize_fp8`'s rule."""
    q, _ = quantize_fp8(x, fmt, scale, granularity=_granularity(scale))  # float64 values on the grid
    return to_torch_float8(q, fmt)  # exact: they are representable


def _scale_bytes(*scales: torch.Tensor | None) -> int:
    return sum(s.numel() * s.element_size() for s in scales if s is not None)


# --- the mask --------------------------------------------------------------------------------------


def _causal_from_seqlens(cache_seqlens: torch.Tensor, num_queries: int) -> mods.MaskMod:
    """Bottom-right causal rule per sequence: key ``j`` takes part for query ``i`` of sequence
    ``b`` when ``j <= i + cache_seqlens[b] - num_queries`` (`attention_ref.mods.causal` with a
    per-sequence offset: the last query sits at the last valid key)."""
    offsets = cache_seqlens - num_queries  # (B,): the position of query 0 of each sequence

    def causal_from_seqlens_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return kv_idx <= q_idx + offsets[b]

    return causal_from_seqlens_mask_mod


def _cache_mask(cache_seqlens: torch.Tensor, num_queries: int, is_causal: bool) -> mods.MaskMod:
    """The keys a query may see: the valid ones (``j < cache_seqlens[b]``), and with
    ``is_causal`` only those up to its own position."""
    valid = mods.padding(cache_seqlens)
    mask_mod = valid if not is_causal else mods.and_masks(valid, _causal_from_seqlens(cache_seqlens, num_queries))
    # what it was made from, for attention_with_kv_cache's block_mask= check
    mask_mod._attention_ref_kv_cache = (cache_seqlens, num_queries, is_causal)  # type: ignore[attr-defined]
    return mask_mod


def kv_cache_mask_mod(cache_seqlens: torch.Tensor, num_queries: int, *, is_causal: bool = False) -> mods.MaskMod:
    """The mask of `attention_with_kv_cache` as a mask mod, for its ``block_mask=``.

    Key ``j`` takes part for query ``i`` of sequence ``b`` when ``j < cache_seqlens[b]``
    and, with ``is_causal``, ``j <= i + cache_seqlens[b] - num_queries`` (bottom-right).
    It depends on ``b``: make its block mask with the batch size, e.g.
    ``create_block_mask(mod, B, None, num_queries, int(cache_seqlens.max()))``.

    Args:
        cache_seqlens: ``(B,)`` integers, the valid keys of each sequence.
        num_queries: ``Lq``, the new queries of each sequence.
        is_causal: add the bottom-right causal rule.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``, ``True`` = takes part.

    Raises:
        TypeError: ``cache_seqlens`` not an integer tensor, ``num_queries`` not an int,
            ``is_causal`` not a bool.
        ValueError: ``cache_seqlens`` not 1-D, ``num_queries`` negative.

    Examples:
        >>> mod = kv_cache_mask_mod(torch.tensor([2, 3]), 1, is_causal=True)
        >>> mods.create_mask(mod, 2, None, 1, 3)[:, 0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 1]]
    """
    tensor = require_tensor("cache_seqlens", cache_seqlens)
    require_int_tensor("cache_seqlens", tensor, "(B,)")
    check_positive_int("num_queries", num_queries, allow_zero=True)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    return _cache_mask(tensor, num_queries, is_causal)


def _block_mask_for(
    block_mask: object, cache_seqlens: torch.Tensor, num_queries: int, is_causal: bool, B: int
) -> mods.MaskMod:
    """The mod of a ``block_mask`` made from `kv_cache_mask_mod` with this call's arguments."""
    mask_mod, (seqlens, lq, causal) = recorded_on(block_mask, "_attention_ref_kv_cache",
                                                   "kv_cache_mask_mod(cache_seqlens, Lq, is_causal=...)")
    if not torch.equal(seqlens.to(device=cache_seqlens.device, dtype=cache_seqlens.dtype), cache_seqlens):
        raise ValueError(
            f"block_mask was made for cache_seqlens={seqlens.tolist()}, this call has "
            f"cache_seqlens={cache_seqlens.tolist()}"
        )
    if (lq, causal) != (num_queries, is_causal):
        raise ValueError(
            f"block_mask was made for Lq={lq}, is_causal={causal}; this call has Lq={num_queries}, "
            f"is_causal={is_causal}"
        )
    if block_mask.B != B:  # type: ignore[union-attr]
        raise ValueError(
            f"block_mask was made for B={block_mask.B}, this call has B={B} (the mask depends on the "  # type: ignore[union-attr]
            "sequence: make it with the batch size)"
        )
    return mask_mod


# --- attention over a cache ------------------------------------------------------------------------


def _gather_rows(pool: torch.Tensor, rows: torch.Tensor, B: int, Hkv: int, length: int) -> torch.Tensor:
    """The listed ``(block, head)`` rows of a paged pool, side by side: ``(B, Hkv, length, E)``.

    One copy of whole ``(block_size, E)`` rows (``index_select``), already in the
    order of the result, so the last reshape is a view.
    """
    # (num_blocks, Hkv, block_size, E) -> (num_blocks * Hkv, block_size, E): a view of a contiguous pool
    flat = pool.reshape(-1, *pool.shape[2:])
    # (B * Hkv * n, block_size, E) -> (B, Hkv, n * block_size, E): each head's n blocks end to end
    return flat.index_select(0, rows).view(B, Hkv, length, pool.shape[3])


def _check_cache_dtypes(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_descale: object, v_descale: object
) -> tuple[str | None, torch.Tensor | None, torch.Tensor | None]:
    """``(fmt, k_descale, v_descale)``: the caches' FP8 format (``None`` for a float cache) and their descales.

    A float cache has the query's dtype and device and takes no descales. An FP8 cache takes a
    float query, both caches in one FP8 dtype on the query's device, and both descales, each
    checked by `_scale` and returned as float32 ``()`` or ``(Hkv,)``.
    """
    fmt = _FP8_DTYPES.get(key_cache.dtype)
    if fmt is None:  # a float cache: the query's dtype, no descales
        _same_dtype_and_device("key_cache", key_cache, "query", query)
        _same_dtype_and_device("value_cache", value_cache, "query", query)
        for name, value in (("k_descale", k_descale), ("v_descale", v_descale)):
            if value is not None:
                raise ValueError(f"{name} is for an FP8 cache, got {name}={value!r} with a key_cache of "
                                 f"{key_cache.dtype}: leave it None")
        return None, None, None
    # an FP8 cache: a float query, both caches in one format, both descales
    if query.dtype in _FP8_DTYPES:
        raise TypeError(
            f"query must have a float dtype (float16, bfloat16, float32, float64) with an FP8 cache, got "
            f"{query.dtype}: pass the query (or its dequantized values), not FP8 bytes"
        )
    _same_dtype_and_device("value_cache", value_cache, "key_cache", key_cache)
    if key_cache.device != query.device:
        raise ValueError(f"key_cache must be on the same device as query ({query.device}), got {key_cache.device}")
    missing = [name for name, value in (("k_descale", k_descale), ("v_descale", v_descale)) if value is None]
    if missing:
        raise ValueError(
            f"{' and '.join(missing)} {'are' if len(missing) > 1 else 'is'} required with an FP8 cache "
            f"(key_cache is {key_cache.dtype}): pass the cache's k_scale and v_scale, a number or (Hkv,) = "
            f"({key_cache.shape[1]},) each"
        )
    return (fmt, _scale("k_descale", k_descale, key_cache.shape[1], query.device),
            _scale("v_descale", v_descale, key_cache.shape[1], query.device))


def _check_cache_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The sizes the caches share with the query and each other, in either layout.

    ``key_cache`` ends in the query's ``E``, ``value_cache`` matches ``key_cache`` in every dim but
    the last, and the query's ``H`` is a multiple of ``Hkv`` (dim 1 of the caches). The batch is
    checked by the caller: a paged pool's dim 0 is its blocks.
    """
    H, E = query.shape[1], query.shape[3]
    Hkv = key_cache.shape[1]
    if key_cache.shape[-1] != E:
        raise ValueError(
            f"key_cache must have the query's size E = {E} (dim -1), got shape {fmt_shape(key_cache.shape)}"
        )
    if value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(
            f"value_cache must match key_cache in every dim but the last: key_cache has shape "
            f"{fmt_shape(key_cache.shape)}, value_cache has shape {fmt_shape(value_cache.shape)}"
        )
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"the query heads H = {H} must be a multiple of the key/value heads Hkv (key_cache dim 1), "
            f"got Hkv = {Hkv}"
        )


def _check_block_table(block_table: object, B: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    """``block_table`` checked: an integer tensor ``(B, max_blocks)`` on ``device``, indices in ``[0, num_blocks)``."""
    block_table = require_int_tensor("block_table", block_table, "(B, max_blocks)", (2,), device=device)
    if block_table.shape[0] != B:
        raise ValueError(
            f"block_table must have one row per sequence, (B, max_blocks) with B = {B}, "
            f"got shape {fmt_shape(block_table.shape)}"
        )
    if block_table.numel():
        low, high = int(block_table.min()), int(block_table.max())
        if low < 0 or high >= num_blocks:
            bad = low if low < 0 else high
            where = (block_table == bad).nonzero()[0].tolist()
            raise ValueError(
                f"block_table must hold block indices in [0, num_blocks) = [0, {num_blocks}), "
                f"got {bad} at block_table[{where[0]}, {where[1]}]"
            )
    return block_table


def _check_cache_seqlens(cache_seqlens: object, B: int, Lq: int, capacity: int, device: torch.device,
                         blocks: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
    """``(cache_seqlens, S)``: the lengths checked, and the longest, ``S = max(cache_seqlens)`` (0 when ``B = 0``).

    Each length lies in ``[Lq, capacity]``: it counts the ``Lq`` new tokens, and the cache (or,
    paged, the ``blocks = (max_blocks, block_size)`` of the block table) holds ``capacity`` positions.
    """
    cache_seqlens = require_int_tensor("cache_seqlens", cache_seqlens, "(B,)", shape=(B,), device=device)
    if not B:
        return cache_seqlens, 0
    low, S = int(cache_seqlens.min()), int(cache_seqlens.max())
    if low < 0:
        raise ValueError(f"cache_seqlens must be non-negative, got a minimum of {low}")
    if S > capacity:
        b = int(cache_seqlens.argmax())
        if blocks is not None:
            raise ValueError(
                f"block_table is too short for cache_seqlens: its {blocks[0]} blocks of "
                f"{blocks[1]} hold {capacity} positions, cache_seqlens[{b}] = {S}"
            )
        raise ValueError(
            f"cache_seqlens must be at most the cache's length S_max = {capacity} (key_cache dim 2), "
            f"got cache_seqlens[{b}] = {S}"
        )
    if low < Lq:
        raise ValueError(
            f"cache_seqlens must be at least the number of new queries Lq = {Lq} (they are "
            f"counted in it), got a minimum of {low}"
        )
    return cache_seqlens, S


def _gather_paged(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                  S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``S`` positions of each sequence of a paged pool: ``(B, Hkv, S, E)`` and ``(B, Hkv, S, Ev)``, copies."""
    B, Hkv, block_size = block_table.shape[0], key_cache.shape[1], key_cache.shape[2]
    n = -(-S // block_size)  # blocks that hold the first S positions
    blocks = block_table[:, :n]  # (B, n)
    heads = torch.arange(Hkv, device=block_table.device)
    # Row (block, g) of the pool seen as (num_blocks * Hkv, block_size, E) is block * Hkv + g:
    # the rows of head g of each sequence's blocks, in order, (B, 1, n) and (1, Hkv, 1) -> (B, Hkv, n)
    rows = (blocks[:, None, :] * Hkv + heads[None, :, None]).flatten()  # (B * Hkv * n,)
    keys = _gather_rows(key_cache, rows, B, Hkv, n * block_size)[:, :, :S]  # (B, Hkv, S, E)
    values = _gather_rows(value_cache, rows, B, Hkv, n * block_size)[:, :, :S]  # (B, Hkv, S, Ev)
    return keys, values


def _zero_past_lengths(keys: torch.Tensor, values: torch.Tensor,
                       cache_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` and ``values`` ``(B, Hkv, S, E|Ev)`` with 0 in the slots ``>= cache_seqlens[b]`` (even over NaN).

    ``torch.where``, not a product: ``0 * NaN`` is NaN, and a stale or uninitialised slot may hold one.
    """
    S = keys.shape[2]
    valid = torch.arange(S, device=keys.device) < cache_seqlens[:, None]  # (B, S)
    keep = valid[:, None, :, None]  # (B, 1, S, 1): broadcasts over heads and E
    keys = torch.where(keep, keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    values = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return keys, values


def attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
    backend: str = "math",
    sinks: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    k_descale: torch.Tensor | float | None = None,
    v_descale: torch.Tensor | float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Attention of ``Lq`` new queries per sequence against a key/value cache.

    Equal to ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...,
    block_table=..., causal=is_causal)`` of FlashAttention (called without new
    ``k``/``v``), up to the layout of the tensors, and to a full attention pass
    over each sequence's valid keys: for sequence ``b``, with
    ``n = cache_seqlens[b]`` and ``K``, ``V`` its first ``n`` keys and values,

    ```python
    causal = mods.causal(offset=n - Lq) if is_causal else None
    scaled_dot_product_attention(query[b], K, V, enable_gqa=True, mask_mod=causal, sinks=sinks)
    ```

    How it runs: the valid keys and values are gathered into ``(B, Hkv, S, E)``
    (a view of a contiguous cache; a copy of the blocks of a paged one), with
    ``S = max(cache_seqlens)``, and the functional core is called once, with the
    mask mod ``padding(cache_seqlens)`` and, if causal, the bottom-right causal
    rule of each sequence. Slots past a sequence's length are zeroed in the
    gathered copy, so stale or uninitialised cache entries (even NaN) cannot
    reach the output or the gradients.

    Every sequence must hold at least its ``Lq`` new tokens
    (``cache_seqlens >= Lq``): a shorter one would put queries before the
    sequence's start, and is refused rather than silently given zeros. A
    left-padded batch of prompts is prefilled with the core and a padding
    mask instead (the "KV cache" page shows how).

    An FP8 cache (torch's FP8 dtypes, `KVCache`'s ``dtype=torch.float8_e4m3fn``)
    comes with its descales, ``k_descale=cache.k_scale, v_descale=cache.v_scale``:
    the keys and values attended to are ``dequantize_fp8(x8, descale)`` in the
    query's dtype (`attention_ref.quant.dequantize_fp8`, ``x8 * descale``), so the
    result equals `attention_ref.quant.fp8_attention` without P emulation
    (attention of the dequantized inputs) on the query quantized the same way.
    The query stays in its float dtype, as in vLLM's and FlashInfer's FP8
    KV-cache paths that leave Q unquantized.

    Args:
        query: ``(B, H, Lq, E)``, the new tokens' queries.
        key_cache: contiguous ``(B, Hkv, S_max, E)``, or with ``block_table``
            a paged pool ``(num_blocks, Hkv, block_size, E)``.
        value_cache: ``(B, Hkv, S_max, Ev)``, or ``(num_blocks, Hkv, block_size, Ev)``.
        cache_seqlens: ``(B,)`` integers, the number of valid keys of each
            sequence, the new tokens' included.
        block_table: ``(B, max_blocks)`` integer block indices into the pool:
            position ``p`` of sequence ``b`` is slot ``p % block_size`` of block
            ``block_table[b, p // block_size]``. Entries past a sequence's length
            are not read but must still be valid indices (pad with 0).
        is_causal: each query sees the keys up to its own position (bottom-right
            aligned); otherwise every valid key.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        return_weights: also return the attention weights ``(B, H, Lq, S)``
            over the first ``S = max(cache_seqlens)`` positions, from the same
            call as the output (``backend="math"`` or ``"auto"`` only).
        backend: the core's backend. The default ``"math"`` forms the
            ``(B, H, Lq, S)`` scores, which is all a decoding step (``Lq = 1``)
            needs; for a long prefill ``"tiled"`` skips the key blocks past each
            sequence's length and above its causal diagonal and never holds more
            than a block of scores (see
            `attention_ref.functional.scaled_dot_product_attention`).
        sinks: ``(H,)``, one learned logit per *query* head (not per key/value
            head), added as ``exp(sinks[h])`` to every query's softmax
            denominator, never scaled (`attention_ref.sinks`); or one per new
            query, broadcastable to ``(B, H, Lq)``. The whole
            row is one call of the core, so the sink enters each row once,
            whatever the cache's length or layout. ``"math"``, ``"tiled"``
            and ``"auto"`` take it; ``"sdpa"`` and ``"triton"`` raise.

        block_mask: the cache mask's `attention_ref.block_mask.BlockMask`, made once
            with ``create_block_mask(kv_cache_mask_mod(cache_seqlens, Lq,
            is_causal=is_causal), B, None, Lq, max(cache_seqlens))`` and reused
            by every layer of the step: ``"tiled"`` uses its blocks as they are;
            the other backends materialise its mod. It must come from
            `kv_cache_mask_mod` with equal ``cache_seqlens``, the same ``Lq``
            and ``is_causal``, and be made for this ``B`` (checked:
            ``ValueError`` otherwise).
        k_descale: for an FP8 ``key_cache`` (required then, refused otherwise):
            the number each stored key is multiplied by, a number or 0-dim tensor
            (per tensor) or ``(Hkv,)`` (per key/value head), vLLM's ``k_scale``.
        v_descale: the same for ``value_cache``.

    Returns:
        ``(B, H, Lq, Ev)`` in ``query``'s dtype, or ``(output, weights)``
        (with ``sinks``, each row of weights sums to less than 1).

    Raises:
        TypeError: non-tensor or non-float ``query``/caches, caches of another
            dtype than ``query`` (or, FP8, than each other), an FP8 ``query``;
            ``cache_seqlens`` or ``block_table`` not an integer tensor; ``sinks``
            not a float tensor; a descale not a number or float tensor.
        ValueError: a wrong number of dims or mismatching sizes (batch, heads,
            ``E``, key and value caches), ``H`` not a multiple of ``Hkv``, a
            tensor on another device than ``query``; ``cache_seqlens`` negative,
            longer than the cache (or than ``block_table`` can hold), or shorter
            than ``Lq`` without ``is_causal``; a ``block_table`` index outside
            ``[0, num_blocks)``; ``sinks`` not of shape ``(H,)``, on another
            device, NaN or ``+inf``; an unknown ``backend``, or one that cannot
            run the call (the message names it); a ``block_mask`` made from
            another mod or for other lengths (``TypeError`` if it is not a
            `attention_ref.block_mask.BlockMask`); an FP8 cache without its
            descales, descales for a float cache, descales of a wrong shape,
            not finite or not > 0.

    Examples:
        >>> import torch
        >>> q = torch.randn(2, 4, 1, 8)  # one new token, H = 4
        >>> k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)  # Hkv = 2
        >>> lengths = torch.tensor([5, 9])  # valid keys of each sequence
        >>> out = attention_with_kv_cache(q, k, v, lengths, is_causal=True)
        >>> out.shape
        torch.Size([2, 4, 1, 8])
        >>> alone = attention_with_kv_cache(q[:1], k[:1, :, :5], v[:1, :, :5],
        ...                                 torch.tensor([5]))
        >>> torch.allclose(out[:1], alone)  # the keys past 5 play no part
        True
    """
    query = _float_4d("query", query, "(B, H, Lq, E)")
    paged = block_table is not None
    k_layout = "(num_blocks, Hkv, block_size, E)" if paged else "(B, Hkv, S_max, E)"
    v_layout = "(num_blocks, Hkv, block_size, Ev)" if paged else "(B, Hkv, S_max, Ev)"
    key_cache = _float_4d("key_cache", key_cache, k_layout)
    value_cache = _float_4d("value_cache", value_cache, v_layout)
    fmt, k_descale, v_descale = _check_cache_dtypes(query, key_cache, value_cache, k_descale, v_descale)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    B, H, Lq, _ = query.shape
    _check_cache_shapes(query, key_cache, value_cache)
    if sinks is not None:
        check_sinks(sinks, H, query, rows=(B, H, Lq))  # per query head (dim 1), not per key/value head, or per query
    if paged:
        num_blocks, _, block_size, _ = key_cache.shape
        block_table = _check_block_table(block_table, B, num_blocks, query.device)
        blocks = (block_table.shape[1], block_size)
        capacity = block_table.shape[1] * block_size
    else:
        if key_cache.shape[0] != B:
            raise ValueError(
                f"key_cache must have the query's batch B = {B} (dim 0), got shape {fmt_shape(key_cache.shape)}"
                " (for a paged pool, pass block_table)"
            )
        blocks, capacity = None, key_cache.shape[2]
    cache_seqlens, S = _check_cache_seqlens(cache_seqlens, B, Lq, capacity, query.device, blocks)

    if paged:
        keys, values = _gather_paged(key_cache, value_cache, block_table, S)  # (B, Hkv, S, E|Ev), copies
    else:
        keys, values = key_cache[:, :, :S], value_cache[:, :, :S]  # views (B, Hkv, S, E|Ev)
    if fmt is not None:
        # x8 * descale, exact in float64, then the query's dtype: (B, Hkv, S, E|Ev) each
        keys = dequantize_fp8(keys, k_descale, _granularity(k_descale)).to(query.dtype)
        values = dequantize_fp8(values, v_descale, _granularity(v_descale)).to(query.dtype)
    if B and int(cache_seqlens.min()) < S:  # zero the slots past a sequence's length
        keys, values = _zero_past_lengths(keys, values, cache_seqlens)
    if block_mask is None:
        mask_mod = _cache_mask(cache_seqlens, Lq, is_causal)
    else:
        mask_mod = _block_mask_for(block_mask, cache_seqlens, Lq, is_causal, B)
    return scaled_dot_product_attention(query, keys, values, enable_gqa=True, scale=scale, mask_mod=mask_mod,
                                        return_weights=return_weights, backend=backend, sinks=sinks,
                                        block_mask=block_mask)


# --- a contiguous cache ---------------------------------------------------------------------------


def _check_new(name: str, value: object, batch: int, heads: int, size: int, layout: str,
               cache: torch.Tensor) -> torch.Tensor:
    tensor = _float_4d(name, value, layout)
    if (tensor.shape[0], tensor.shape[1], tensor.shape[3]) != (batch, heads, size):
        raise ValueError(
            f"{name} must have shape {layout} = ({batch}, {heads}, Lnew, {size}), got shape "
            f"{fmt_shape(tensor.shape)}"
        )
    if cache.dtype not in _FP8_DTYPES:
        _same_dtype_and_device(name, tensor, "the cache", cache)
        return tensor
    # an FP8 cache quantizes float tokens on the way in
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a float dtype (float16, bfloat16, float32, float64) for a cache of "
            f"{cache.dtype}, which quantizes on append, got {tensor.dtype}"
        )
    if tensor.device != cache.device:
        raise ValueError(f"{name} must be on the same device as the cache ({cache.device}), got {tensor.device}")
    return tensor


def _check_new_pair(key: torch.Tensor, value: torch.Tensor) -> int:
    """``Lnew``, after checking that ``key`` and ``value`` hold as many tokens (and, FP8, one dtype)."""
    if value.shape[2] != key.shape[2]:
        raise ValueError(
            f"key and value must hold the same number of new tokens Lnew (dim 2): key has shape "
            f"{fmt_shape(key.shape)}, value has shape {fmt_shape(value.shape)}"
        )
    if value.dtype != key.dtype:  # only an FP8 cache lets them differ from its dtype
        raise TypeError(f"value must have the same dtype as key ({key.dtype}), got {value.dtype}")
    return key.shape[2]


class KVCache:
    """A contiguous key/value cache for ``B`` sequences that advance together.

    ``key_cache`` ``(B, Hkv, S_max, E)`` and ``value_cache`` ``(B, Hkv, S_max, Ev)``
    are allocated once, zero-filled; `append` writes the new tokens' keys and
    values after the ones already held. Every sequence of the batch holds the
    same number of tokens (``lengths`` is constant): for sequences of different
    lengths, write a contiguous cache yourself and pass its ``cache_seqlens``, or
    use `PagedKVCache`. One cache serves one attention layer; a model keeps one
    per layer.

    A cache is meant for inference (``torch.no_grad()``): `append` writes in
    place, which autograd cannot differentiate through across steps.

    With an FP8 ``dtype`` the cache stores one byte per element:
    `append` quantizes the float keys and values it is given,
    ``x8 = satfinite_RNE(x / k_scale)`` (`attention_ref.quant.quantize_fp8`: the
    quotient in float64, clamped to the format's largest value, then rounded to
    nearest even), as vLLM's ``reshape_and_cache_flash`` does (which divides in
    float32, and so can land one step away at an exact midpoint), and
    `attention_with_kv_cache` reads ``x8 * k_scale`` back when given
    ``k_descale=cache.k_scale, v_descale=cache.v_scale``.

    Args:
        batch: ``B``.
        num_kv_heads: ``Hkv``.
        max_length: ``S_max``, the most tokens a sequence may hold.
        head_dim: ``E``.
        value_dim: ``Ev``; defaults to ``head_dim``.
        dtype: ``torch.float16``, ``bfloat16``, ``float32`` or ``float64`` (default
            torch's default dtype), or an FP8 dtype: ``torch.float8_e4m3fn``,
            ``float8_e5m2``, ``float8_e4m3fnuz``, ``float8_e5m2fnuz``.
        device: where the tensors live.
        k_scale: with an FP8 ``dtype`` (required then, refused otherwise): the
            descale of the keys, ``key ≈ key8 * k_scale``; a number or 0-dim tensor
            (per tensor) or a tensor ``(Hkv,)`` (per key/value head), vLLM's
            ``k_scale``. Kept as float32 ``()`` or ``(Hkv,)``, as vLLM keeps it;
            a common choice is ``amax(|key|) / 448`` for e4m3fn (the scale
            `attention_ref.quant.quantize_fp8` computes).
        v_scale: the same for the values.

    Attributes:
        key_cache: ``(B, Hkv, S_max, E)`` in ``dtype``.
        value_cache: ``(B, Hkv, S_max, Ev)`` in ``dtype``.
        k_scale: float32 ``()`` or ``(Hkv,)`` for an FP8 cache, else ``None``.
        v_scale: the same for the values.

    Raises:
        TypeError: a size that is not an int, a dtype not listed above, a scale
            that is not a number or a float tensor.
        ValueError: a size that is not positive; with an FP8 dtype a missing
            scale, a scale of another shape than ``()`` or ``(Hkv,)``, not finite
            or not > 0; with a float dtype, a scale at all.

    Examples:
        >>> cache = KVCache(batch=2, num_kv_heads=1, max_length=4, head_dim=3)
        >>> keys, values = cache.append(torch.ones(2, 1, 3, 3), torch.ones(2, 1, 3, 3))
        >>> keys.shape, cache.lengths.tolist()
        (torch.Size([2, 1, 3, 3]), [3, 3])
        >>> cache.memory_bytes  # 2 tensors of 2 x 1 x 4 x 3 float32 numbers
        192
        >>> more = torch.ones(2, 1, 2, 3)  # 2 more tokens: one too many
        >>> cache.append(more, more)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: key: appending 2 tokens to a cache holding 3 of max_length = 4 needs 5; ...

        An FP8 cache saturates: a key above ``448 * k_scale`` is stored as 448.

        >>> fp8 = KVCache(1, 1, 4, 2, dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=1.0)
        >>> keys, _ = fp8.append(torch.tensor([[[[1.3, 1000.0]]]]), torch.ones(1, 1, 1, 2))
        >>> fp8.key_cache[0, 0, 0].tolist(), keys[0, 0, 0].tolist()  # 2.6 rounds to 2.5
        ([2.5, 448.0], [1.25, 224.0])
    """

    def __init__(self, batch: int, num_kv_heads: int, max_length: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, k_scale: torch.Tensor | float | None = None,
                 v_scale: torch.Tensor | float | None = None) -> None:
        check_positive_int("batch", batch)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("max_length", max_length)
        check_positive_int("head_dim", head_dim)
        value_dim = head_dim if value_dim is None else check_positive_int("value_dim", value_dim)
        dtype = _check_dtype(dtype)
        self._fmt = _FP8_DTYPES.get(dtype)
        self.k_scale, self.v_scale = _cache_scales(self._fmt, dtype, k_scale, v_scale, num_kv_heads, device)
        check_dense("KVCache", (batch, num_kv_heads, max_length, head_dim + value_dim), dtype,
                    torch.device(device or "cpu"), copies=1, noun="the keys and values (B, Hkv, S_max, E + Ev)",
                    instead="a smaller max_length, or PagedKVCache, which takes blocks as sequences grow")
        self.key_cache = torch.zeros(batch, num_kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.value_cache = torch.zeros(batch, num_kv_heads, max_length, value_dim, dtype=dtype, device=device)
        self._length = 0

    @property
    def length(self) -> int:
        """The number of tokens each sequence holds."""
        return self._length

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` int64: the tokens each sequence holds, the ``cache_seqlens`` of `attention_with_kv_cache`."""
        return torch.full((self.key_cache.shape[0],), self._length, dtype=torch.long, device=self.key_cache.device)

    @property
    def max_length(self) -> int:
        """``S_max``: the most tokens a sequence may hold."""
        return self.key_cache.shape[2]

    @property
    def fp8_format(self) -> str | None:
        """The `attention_ref.quant.FORMATS` name of an FP8 cache (``"e4m3fn"``, ...), ``None`` for a float one."""
        return self._fmt

    @property
    def memory_bytes(self) -> int:
        """Bytes of the two tensors, allocated up front for ``max_length`` tokens, and of the FP8 scales.

        ``B · S_max · Hkv · (E + Ev)`` elements times their size (one byte in FP8), plus
        4 bytes per float32 scale (`attention_ref.complexity.kv_scale_bytes`).
        """
        return (sum(t.numel() * t.element_size() for t in (self.key_cache, self.value_cache))
                + _scale_bytes(self.k_scale, self.v_scale))

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``Lnew`` new tokens of every sequence after the ones held.

        Args:
            key: ``(B, Hkv, Lnew, E)``, in the cache's dtype, on its device; for an
                FP8 cache float16, bfloat16, float32 or float64, quantized here.
            value: ``(B, Hkv, Lnew, Ev)``, the same (for an FP8 cache, ``key``'s dtype).

        Returns:
            ``(keys, values)``: views ``(B, Hkv, length, E)`` and
            ``(B, Hkv, length, Ev)`` of every token held, the new ones included.
            For an FP8 cache, their dequantized values instead (copies,
            ``x8 * scale`` in ``key``'s dtype, what `attention_with_kv_cache` attends to).

        Raises:
            TypeError: a non-float tensor or another dtype than the cache's (FP8
                cache: an FP8 tensor, or ``key`` and ``value`` of different dtypes).
            ValueError: wrong shapes, ``key`` and ``value`` of different
                ``Lnew``, another device, or more tokens than ``max_length``
                leaves room for (nothing is written then).
        """
        B, Hkv, _, E = self.key_cache.shape
        key = _check_new("key", key, B, Hkv, E, "(B, Hkv, Lnew, E)", self.key_cache)
        value = _check_new("value", value, B, Hkv, self.value_cache.shape[3], "(B, Hkv, Lnew, Ev)",
                           self.value_cache)
        new = _check_new_pair(key, value)
        start, end = self._length, self._length + new
        if end > self.max_length:
            raise ValueError(
                f"key: appending {new} tokens to a cache holding {start} of max_length = {self.max_length} "
                f"needs {end}; nothing was written"
            )
        dtype = key.dtype
        if self._fmt is not None:  # x8 = satfinite_RNE(x / scale), torch's FP8 dtype
            key, value = _quantize(key, self.k_scale, self._fmt), _quantize(value, self.v_scale, self._fmt)
        self.key_cache[:, :, start:end] = key  # positions start .. end - 1 of every sequence
        self.value_cache[:, :, start:end] = value
        self._length = end
        keys, values = self.key_cache[:, :, :end], self.value_cache[:, :, :end]
        if self._fmt is None:
            return keys, values
        # x8 * scale, exact in float64, then the dtype given: (B, Hkv, length, E|Ev)
        return (dequantize_fp8(keys, self.k_scale, _granularity(self.k_scale)).to(dtype),
                dequantize_fp8(values, self.v_scale, _granularity(self.v_scale)).to(dtype))

    def reset(self) -> None:
        """Forget every token (the tensors are kept and overwritten by the next `append`)."""
        self._length = 0

    def __repr__(self) -> str:
        B, Hkv, S_max, E = self.key_cache.shape
        return (f"KVCache(batch={B}, num_kv_heads={Hkv}, length={self._length}/{S_max}, head_dim={E}, "
                f"value_dim={self.value_cache.shape[3]}, dtype={self.key_cache.dtype}, "
                f"memory_bytes={self.memory_bytes})")


# --- a paged cache --------------------------------------------------------------------------------


class PagedKVCache:
    """A key/value cache in fixed-size blocks: sequences take blocks from a shared pool as they grow.

    The pool is ``key_blocks`` ``(num_blocks, Hkv, block_size, E)`` and
    ``value_blocks`` ``(num_blocks, Hkv, block_size, Ev)``, allocated once. A
    sequence holds a list of block indices, its row of the block table:
    position ``p`` is slot ``p % block_size`` of its block number
    ``p // block_size``. A sequence takes a block from the free list only when
    its last block is full, so it wastes at most ``block_size - 1`` slots, and
    `free` gives its blocks back for the next sequence (vLLM's paged attention).
    The pool and `block_table` go to `attention_with_kv_cache` unchanged.

    FlashAttention and vLLM store the pool as ``(num_blocks, block_size, Hkv, E)``:
    that is ``key_blocks.transpose(1, 2)``.

    With an FP8 ``dtype`` the pool holds one byte per element, quantized on
    `append` with ``k_scale``/``v_scale`` exactly as `KVCache` does (vLLM's
    ``kv_cache_dtype="fp8"``: one scale per tensor or per key/value head for the
    whole pool); pass ``k_descale=cache.k_scale, v_descale=cache.v_scale`` to
    `attention_with_kv_cache`.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        num_kv_heads: ``Hkv``.
        head_dim: ``E``.
        value_dim: ``Ev``; defaults to ``head_dim``.
        dtype: ``torch.float16``, ``bfloat16``, ``float32`` or ``float64`` (default
            torch's default dtype), or an FP8 dtype (as `KVCache`).
        device: where the pool lives.
        k_scale: with an FP8 ``dtype`` (required then, refused otherwise): the
            keys' descale, a number or 0-dim tensor or ``(Hkv,)``, as `KVCache`'s.
        v_scale: the same for the values.

    Raises:
        TypeError: a size that is not an int, a dtype not listed above, a scale
            that is not a number or a float tensor.
        ValueError: a size that is not positive; a missing, misshapen,
            non-finite or non-positive scale with an FP8 dtype, or one at all
            with a float dtype.

    Examples:
        >>> cache = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2)
        >>> cache.allocate("a"); cache.allocate("b")
        >>> cache.append(["a", "b"], torch.ones(2, 1, 5, 2), torch.ones(2, 1, 5, 2))
        >>> cache.block_table(["a", "b"]).tolist(), cache.seqlens(["a", "b"]).tolist()
        ([[0, 1], [2, 3]], [5, 5])
        >>> cache.blocks_in_use, cache.num_free_blocks
        (4, 4)
        >>> cache.free("a"); cache.num_free_blocks
        6
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, k_scale: torch.Tensor | float | None = None,
                 v_scale: torch.Tensor | float | None = None) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("head_dim", head_dim)
        value_dim = head_dim if value_dim is None else check_positive_int("value_dim", value_dim)
        dtype = _check_dtype(dtype)
        self._fmt = _FP8_DTYPES.get(dtype)
        self.k_scale, self.v_scale = _cache_scales(self._fmt, dtype, k_scale, v_scale, num_kv_heads, device)
        self.key_blocks = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        self.value_blocks = torch.zeros(num_blocks, num_kv_heads, block_size, value_dim, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes block 0 first
        self._blocks: dict[Hashable, list[int]] = {}  # sequence id -> its block indices, in order
        self._lengths: dict[Hashable, int] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.key_blocks.shape[0]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.key_blocks.shape[2]

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - len(self._free)

    @property
    def fp8_format(self) -> str | None:
        """The `attention_ref.quant.FORMATS` name of an FP8 pool (``"e4m3fn"``, ...), ``None`` for a float one."""
        return self._fmt

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of keys and its block of values (one byte per element in FP8)."""
        return sum(t[0].numel() * t.element_size() for t in (self.key_blocks, self.value_blocks))

    @property
    def memory_bytes(self) -> int:
        """Bytes of the whole pool, allocated up front, and of its float32 FP8 scales (4 bytes each)."""
        return self.num_blocks * self.bytes_per_block + _scale_bytes(self.k_scale, self.v_scale)

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the blocks held by sequences (the pool's scales, shared, are counted in `memory_bytes`)."""
        return self.blocks_in_use * self.bytes_per_block

    def _known(self, sequence_id: Hashable) -> None:
        if sequence_id not in self._blocks:
            raise ValueError(f"sequence_id {sequence_id!r} is not allocated (call allocate({sequence_id!r}) first)")

    def _ids(self, sequence_ids: Iterable[Hashable]) -> list[Hashable]:
        if isinstance(sequence_ids, (str, bytes, torch.Tensor)) or not isinstance(sequence_ids, Iterable):
            raise TypeError(f"sequence_ids must be a list of sequence ids, got {type(sequence_ids).__name__}")
        ids = list(sequence_ids)
        for sid in ids:
            self._known(sid)
        if len(set(ids)) != len(ids):
            raise ValueError(f"sequence_ids must not repeat an id, got {ids}")
        return ids

    def allocate(self, sequence_id: Hashable) -> None:
        """Start an empty sequence; it takes blocks as `append` writes to it.

        Raises:
            ValueError: the id is already in use.
        """
        try:
            hash(sequence_id)
        except TypeError:
            raise TypeError(f"sequence_id must be hashable (an int, a str, a tuple), got "
                            f"{type(sequence_id).__name__} {sequence_id!r}") from None
        if sequence_id in self._blocks:
            raise ValueError(f"sequence_id {sequence_id!r} is already allocated (free it first)")
        self._blocks[sequence_id] = []
        self._lengths[sequence_id] = 0

    def append(self, sequence_ids: Iterable[Hashable], key: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``Lnew`` new tokens of each listed sequence, taking free blocks as needed.

        Args:
            sequence_ids: ``n`` allocated ids, no repeats.
            key: ``(n, Hkv, Lnew, E)``, row ``i`` for ``sequence_ids[i]``, in the
                pool's dtype; for an FP8 pool float16, bfloat16, float32 or
                float64, quantized here (``satfinite_RNE(key / k_scale)``, as `KVCache`).
            value: ``(n, Hkv, Lnew, Ev)``, the same (for an FP8 pool, ``key``'s dtype).

        Raises:
            TypeError: ``sequence_ids`` not a list; a non-float tensor or another
                dtype than the pool's (FP8 pool: an FP8 tensor, or ``key`` and
                ``value`` of different dtypes).
            ValueError: an id not allocated or repeated, wrong shapes, another device.
            RuntimeError: the pool has too few free blocks (nothing is written then).
        """
        ids = self._ids(sequence_ids)
        _, Hkv, bs, E = self.key_blocks.shape
        n = len(ids)
        key = _check_new("key", key, n, Hkv, E, "(n, Hkv, Lnew, E)", self.key_blocks)
        value = _check_new("value", value, n, Hkv, self.value_blocks.shape[3], "(n, Hkv, Lnew, Ev)",
                           self.value_blocks)
        new = _check_new_pair(key, value)
        needed = [-(-(self._lengths[sid] + new) // bs) - len(self._blocks[sid]) for sid in ids]
        if sum(needed) > len(self._free):
            raise RuntimeError(
                f"the block pool is full: appending {new} tokens to {n} sequences needs {sum(needed)} more "
                f"blocks of {bs} tokens, {len(self._free)} of {self.num_blocks} are free; nothing was written "
                "(free finished sequences, or make a larger pool)"
            )
        if self._fmt is not None:  # x8 = satfinite_RNE(x / scale), torch's FP8 dtype
            key, value = _quantize(key, self.k_scale, self._fmt), _quantize(value, self.v_scale, self._fmt)
        device = self.key_blocks.device
        for i, (sid, more) in enumerate(zip(ids, needed)):
            self._blocks[sid].extend(self._free.pop() for _ in range(more))
            start = self._lengths[sid]
            positions = torch.arange(start, start + new, device=device)  # (Lnew,)
            table = torch.tensor(self._blocks[sid], dtype=torch.long, device=device)
            block, slot = table[positions // bs], positions % bs  # (Lnew,) each
            # pool[block[t], :, slot[t]] is token t's (Hkv, E): the indexed dims come first, so the
            # target is (Lnew, Hkv, E); key[i] is (Hkv, Lnew, E) -> transpose -> (Lnew, Hkv, E)
            self.key_blocks[block, :, slot] = key[i].transpose(0, 1)
            self.value_blocks[block, :, slot] = value[i].transpose(0, 1)
            self._lengths[sid] = start + new

    def block_table(self, sequence_ids: Iterable[Hashable]) -> torch.Tensor:
        """``(n, max_blocks)`` int64 block indices of the listed sequences, padded with 0.

        ``max_blocks`` is the most blocks any of them holds; the padding is never
        read (it lies past the sequence's length) but is a valid index.
        """
        ids = self._ids(sequence_ids)
        width = max((len(self._blocks[sid]) for sid in ids), default=0)
        rows = [self._blocks[sid] + [0] * (width - len(self._blocks[sid])) for sid in ids]
        return torch.tensor(rows, dtype=torch.long, device=self.key_blocks.device).reshape(len(ids), width)

    def seqlens(self, sequence_ids: Iterable[Hashable]) -> torch.Tensor:
        """``(n,)`` int64: the tokens each listed sequence holds (``cache_seqlens``)."""
        ids = self._ids(sequence_ids)
        return torch.tensor([self._lengths[sid] for sid in ids], dtype=torch.long, device=self.key_blocks.device)

    def free(self, sequence_id: Hashable) -> None:
        """End a sequence: its blocks go back to the free list (their contents are left as they are).

        Raises:
            ValueError: the id is not allocated.
        """
        self._known(sequence_id)
        self._free.extend(reversed(self._blocks.pop(sequence_id)))
        del self._lengths[sequence_id]

    def __repr__(self) -> str:
        _, Hkv, bs, E = self.key_blocks.shape
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={bs}, num_kv_heads={Hkv}, head_dim={E}, "
                f"value_dim={self.value_blocks.shape[3]}, dtype={self.key_blocks.dtype}, sequences="
                f"{len(self._blocks)}, blocks_in_use={self.blocks_in_use})")
