r"""Run Hugging Face transformers models through attention_ref.

transformers lets a model's attention layers call any function registered under
a name (``AttentionInterface``), chosen with ``attn_implementation=name`` or
``model.set_attn_implementation(name)``. `register` registers one that computes
every layer with `attention_ref.scaled_dot_product_attention`, the package's
reference (the ``"math"`` backend), so a model's logits, its attention weights
(`record_weights`) and its generated tokens can be checked against the
reference.

The mask trap. transformers builds each layer's mask with a *mask function*
looked up under the same name (``AttentionMaskInterface``). An attention
function registered without one receives ``attention_mask=None``, and a causal
model that trusts the mask silently attends to the future. `register` also
registers ``eager_mask``, the mask function of transformers' own eager
attention, so every model hands attention_ref exactly the mask tensor its eager
path gets: float ``(B, 1, L, S)``, 0 where a pair takes part and the dtype's
most negative number where not, added to the scores. A comparison with eager
then isolates the attention function. transformers' ``sdpa_mask`` would give a
boolean mask (this package's convention, ``True`` = takes part), but a model
written only for eager's float mask misreads it: DeepSeek V4 appends its
compressed keys' bias with ``.to(attention_mask.dtype)``, which turns a bool
mask's ``-inf`` into ``True``: its logits leave eager's, silently.
So a query row with no key (a padding token's) is spread evenly over the keys, as
in eager, where a boolean mask would give it weights 0. A layer that gets no
mask at all (a model's own choice, or a layer called on its own) gets the
causal rule, as transformers' SDPA path applies it: ``is_causal = L > 1 and
module.is_causal``, top-left aligned.

No keyword is dropped. Every keyword a model passes either changes the result
and is implemented, is on `HARMLESS_KEYWORDS` (it cannot change the result, for
the reason given there), or raises `NotImplementedError` naming the keyword, the
layer's class and its index. A reference that is silently wrong is worse than
none: a model that passed ``s_aux`` (gpt-oss's sinks) or ``position_bias`` (T5)
to a function that ignored them would give plausible logits, far from eager's.

| transformers passes | attention_ref does |
| --- | --- |
| ``query (B, H, L, E)``, ``key``/``value (B, Hkv, S, E or Ev)`` | the same; ``enable_gqa`` when ``Hkv < H`` |
| ``attention_mask``, float (added) or bool (``True`` = takes part) | ``attn_mask`` |
| ``attention_mask=None`` | ``is_causal = L > 1 and module.is_causal`` |
| ``scaling`` (``None``: ``1 / sqrt(E)``) | ``scale`` |
| ``is_causal`` | overrides ``module.is_causal`` |
| ``dropout`` | ``dropout_p``, only while ``module.training`` |
| ``softcap`` (Gemma 2) | ``score_mod=mods.softcap(softcap)``, before the mask |
| ``s_aux`` ``(H,)`` (gpt-oss, MiMo-V2, Granite-SWA, DeepSeek V4) | ``sinks=s_aux``; ``None``: no sink |
| ``position_bias`` (T5's family) | added to the scores, with the mask |
| ``sliding_window=W`` and a mask | nothing more: the mask holds the window |
| ``sliding_window=W``, no mask, ``S > W`` | ``from_hf_sliding_window(W)``; raises if bidirectional |
| ``output_attentions`` | the weights are returned |
| ``indices`` ``(B, L, k)`` int (DeepSeek V3.2 and its family) | `attention_ref.sparse.topk_attention`, the mask kept |
| ``sinks`` ``(B, H, L, 1)``, one per query (Inkling 2) | ``sinks=sinks[..., 0]``; raises beside ``s_aux`` |
| ``block_indices`` ``(B, Hkv, L, k)`` int (MiniMax-M3) | `attention_ref.sparse.block_topk_attention`, blocks of ``module.indexer.block_size`` |
| packed-varlen keywords, ``cache`` | raise unless ``None`` |
| any other keyword | raises, unless in `HARMLESS_KEYWORDS` |

``indices`` is DeepSeek V3.2's top-k selection (also GLM-5's, Mistral Large 4's
and the other DSA models'): transformers folds it into the mask for eager and
SDPA only, and hands every other attention function the plain causal mask plus
``indices``, the ``int32`` ``(B, L, k)`` keys each query keeps, one selection
for all heads. Ignoring it computes dense attention, silently. Here each query
attends to the keys listed *and* allowed by the mask: where fewer than ``k``
keys are valid, transformers' ``topk`` lists masked (future or padding)
positions too, and the mask keeps them out, as in eager. The one difference
from eager: a query row that the mask empties completely (a padding token's)
is spread over its ``k`` listed keys here and over all ``S`` keys in eager
(its float mask holds the same most-negative number everywhere); such a row is
a padding token's, which no real token reads.

``block_indices`` is MiniMax-M3's block selection: per query and key/value
head, the key blocks (of ``module.indexer.block_size`` keys) its indexer kept,
``-1`` padded. transformers folds it into the mask for eager and SDPA only;
here each query head reads its key/value head's blocks (as that mask does),
and attends to their keys the mask keeps.

Of the refused: ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx`` describe
packed sequences, which this adapter reads from the mask only; ``cache`` is a
paged cache the attention function would have to update. A sliding window on a
bidirectional layer without a mask is refused because transformers' own paths
count it differently there (``|i - j| <= W`` in its masks, ``< W`` in
FlashAttention's). Where a mask is given, transformers' mask functions put the
window in it whenever it removes a key, and eager reads only the mask.

The output is returned as transformers expects, ``(B, L, H, Ev)``, with the
weights ``(B, H, L, S)`` when ``output_attentions`` is requested or
`record_weights` is active.

``transformers`` is an optional dependency (the ``hf`` extra); importing
``attention_ref`` never needs it, this module imports it on first use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from attention_ref import mods
from attention_ref.conventions import from_hf_sliding_window
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.masks import combine_masks
from attention_ref.sparse import block_topk_indices, topk_attention

__all__ = ["DEFAULT_NAME", "HARMLESS_KEYWORDS", "attention_forward", "record_weights", "register"]

#: The name `register` uses unless told otherwise.
DEFAULT_NAME = "attention_ref"

#: Keywords transformers passes to attention functions that cannot change the result: accepted
#: and not used, each with the reason. Anything neither implemented nor listed here raises.
HARMLESS_KEYWORDS: dict[str, str] = {
    "position_ids": "already rotated into query and key; packing comes in the mask",
    "position_embeddings": "the (cos, sin) pair, already applied to query and key",
    "cache_position": "the layer updated the cache already: key and value hold it",
    "past_key_values": "the layer updated the cache already: key and value hold it",
    "past_key_value": "the layer updated the cache already: key and value hold it",
    "use_cache": "whether the layer keeps a cache: decided already",
    "encoder_hidden_states": "what key and value were computed from (BERT's family)",
    "layer_idx": "the layer's index, for caches and messages",
    "output_hidden_states": "what the model returns, not what attention computes",
    "output_router_logits": "what the model returns, not what attention computes",
    "return_dict": "what the model returns, not what attention computes",
    "num_items_in_batch": "the loss's normaliser, not used by attention",
    "deterministic": "FlashAttention's choice of a backward without atomic adds (ModernBERT passes it): the "
    "same numbers up to the order of a sum; attention_ref's backward is deterministic anyway",
    "labels": "the loss's targets, threaded through **kwargs by Gemma 4's forward: not read by attention",
    "logits_to_keep": "which positions' logits the model returns (GOT-OCR2 threads it through): not attention's",
    "second_per_grid_ts": "seconds per temporal patch of each video: Qwen2.5-VL turns it into rotary positions, "
    "already applied to query and key; no attention function of transformers reads it (LLaVA-OneVision-1.5 "
    "threads it through **kwargs and reads it nowhere)",
    "mm_token_type_ids": "which tokens are text, image or video: a model that attends differently within an image "
    "puts that in the mask first (Gemma 4, Molmo 2), Qwen2.5-VL turns it into rotary positions; no attention "
    "function of transformers reads it (LLaVA-OneVision-1.5 threads it through **kwargs and reads it nowhere)",
}

# Keywords that change attention and that this module does not implement: accepted only as None.
_REFUSED = {
    "cu_seq_lens_q": "packed variable-length sequences: attention_ref.hf reads packing only from the mask",
    "cu_seq_lens_k": "packed variable-length sequences: attention_ref.hf reads packing only from the mask",
    "max_length_q": "packed variable-length sequences: attention_ref.hf reads packing only from the mask",
    "max_length_k": "packed variable-length sequences: attention_ref.hf reads packing only from the mask",
    "seq_idx": "packed variable-length sequences: attention_ref.hf reads packing only from the mask",
    "cache": "a paged cache (continuous batching), which the attention function must update itself",
    "cross_attention_mask": "a mask for cross-attention (BLT, Mllama thread it through **kwargs): attention_ref.hf "
    "reads masks only from attention_mask",
    "full_text_row_masked_out_mask": "rows of a cross-attention masked out (BLT, Mllama): attention_ref.hf reads "
    "masks only from attention_mask",
}

_recording = threading.local()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - the hf extra is installed in the tests
        raise ImportError(
            "attention_ref.hf needs transformers: pip install 'attention_ref[hf]' (transformers >= 5, Python >= 3.11)"
        ) from error
    return transformers


def _where(module: torch.nn.Module) -> str:
    return f"{type(module).__name__} (layer_idx={getattr(module, 'layer_idx', None)})"


def _check_keywords(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise for a keyword that would change the result and is not implemented."""
    for name, value in kwargs.items():
        if name in HARMLESS_KEYWORDS or name == "output_attentions":
            continue
        if name in _REFUSED:
            if value is None:
                continue
            raise NotImplementedError(
                f"attention_ref.hf: {_where(module)} passed {name}=..., which changes attention: "
                f"{_REFUSED[name]}. Refusing rather than computing without it."
            )
        raise NotImplementedError(
            f"attention_ref.hf: {_where(module)} passed the keyword {name!r} ({type(value).__name__}), which "
            "attention_ref.hf does not know. It may change attention, so it is refused rather than ignored "
            "(the keywords known to change nothing: attention_ref.hf.HARMLESS_KEYWORDS)."
        )


def _per_query_sinks(module: torch.nn.Module, sinks: Any, s_aux: Any, query: torch.Tensor) -> torch.Tensor:
    """Inkling 2's ``sinks`` ``(B, H, L, 1)`` as attention_ref's one sink per query ``(B, H, L)``."""
    if s_aux is not None:
        raise NotImplementedError(
            f"attention_ref.hf: {_where(module)} passed both s_aux (one sink per head) and sinks (one per query): "
            "two sinks in one row is no convention this adapter knows. Refusing rather than guessing."
        )
    if not isinstance(sinks, torch.Tensor) or sinks.dim() < 2 or sinks.shape[-1] != 1:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"attention_ref.hf: {_where(module)} passed sinks of shape {shape}; expected a column beside the "
            f"scores, (B, H, L, 1) = (.., {query.shape[-3]}, {query.shape[-2]}, 1), one logit per query"
        )
    return sinks[..., 0]  # (B, H, L, 1) -> (B, H, L)


def _check_not_packed(module: torch.nn.Module, position_ids: Any, L: int) -> None:
    """A batch whose positions restart within a row is packed; without a mask nothing separates its sequences."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != L or L < 2:
        return
    if bool((position_ids.diff(dim=-1) != 1).any()):
        raise NotImplementedError(
            f"attention_ref.hf: {_where(module)} got position_ids that restart within a row (packed sequences) "
            "and no attention_mask: nothing tells which keys belong to which sequence. Pass a mask that "
            "separates them (transformers builds one from position_ids when no cache is used)."
        )


def _selected(module: torch.nn.Module, indices: object, query: torch.Tensor) -> torch.Tensor:
    """transformers' ``indices`` ``(B, L, k)``, one selection for all heads, as ``(B, 1, L, k)``."""
    B, L = query.shape[0], query.shape[-2]
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or tuple(indices.shape[:2]) != (B, L):
        got = f"shape {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(
            f"attention_ref.hf: {_where(module)} passed indices of {got}; expected the top-k keys of each "
            f"query, (B, L, k) with (B, L) = ({B}, {L}), as DeepSeek V3.2 passes them"
        )
    return indices.unsqueeze(1)  # (B, L, k) -> (B, 1, L, k): shared by the H heads


def _block_keys(module: torch.nn.Module, block_indices: Any, indices: Any, query: torch.Tensor, S: int) -> torch.Tensor:
    """MiniMax-M3's ``block_indices`` ``(B, Hkv, L, k)`` as the keys of each query head, ``(B, H, L, k * block)``."""
    if indices is not None:
        raise NotImplementedError(
            f"attention_ref.hf: {_where(module)} passed both indices (top-k keys) and block_indices (top-k key "
            "blocks); no model combines them. Refusing rather than guessing."
        )
    block_size = getattr(getattr(module, "indexer", None), "block_size", None)
    if not isinstance(block_size, int):
        raise NotImplementedError(
            f"attention_ref.hf: {_where(module)} passed block_indices but has no indexer.block_size (MiniMax-M3's "
            "layout): the size of a key block is unknown. Refusing rather than guessing."
        )
    B, H, L = query.shape[0], query.shape[-3], query.shape[-2]
    if (not isinstance(block_indices, torch.Tensor) or block_indices.dim() != 4
            or (block_indices.shape[0], block_indices.shape[2]) != (B, L) or H % max(block_indices.shape[1], 1)):
        got = f"shape {tuple(block_indices.shape)}" if isinstance(block_indices, torch.Tensor) else type(
            block_indices).__name__
        raise ValueError(
            f"attention_ref.hf: {_where(module)} passed block_indices of {got}; expected (B, H_index, L, k) with "
            f"(B, L) = ({B}, {L}) and H_index dividing H = {H}, as MiniMax-M3 passes them"
        )
    per_head = block_indices.repeat_interleave(H // block_indices.shape[1], dim=1)  # (B, Hkv, L, k) -> (B, H, L, k)
    return block_topk_indices(per_head, block_size, S)  # (B, H, L, k * block_size)


def _window(module: torch.nn.Module, sliding_window: int, causal: bool, L: int, S: int) -> mods.MaskMod:
    """The window transformers would have put in the mask, for a call that came without one."""
    if not causal:
        raise NotImplementedError(
            f"attention_ref.hf: {_where(module)} passed sliding_window={sliding_window} on a bidirectional layer "
            f"with no attention_mask and {S} keys: transformers' mask functions keep |i - j| <= W there and "
            "its FlashAttention path |i - j| < W; pass a mask that holds the window."
        )
    # Without a mask the causal rule is top-left when L > 1 (query i at position i); a single query
    # is the newest token, at position S - 1.
    return from_hf_sliding_window(int(sliding_window), offset=S - 1 if L == 1 else 0)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    block_indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function `register` gives transformers: one layer through the reference.

    Args:
        module: the transformers attention layer (read: ``is_causal``,
            ``training``; its class and ``layer_idx`` name it in errors).
        query: ``(B, H, L, E)``.
        key: ``(B, Hkv, S, E)``, ``H`` a multiple of ``Hkv``.
        value: ``(B, Hkv, S, Ev)``.
        attention_mask: float ``(B, 1, L, S)``, added to the scores (what
            ``eager_mask`` builds), or bool (``True`` = takes part), or ``None``:
            then the causal rule applies when ``L > 1`` and the layer is causal,
            as in transformers' SDPA path.
        dropout: dropout probability, applied only while ``module.training``.
        scaling: the score scale (``None``: ``1 / sqrt(E)``).
        is_causal: overrides ``module.is_causal`` when given.
        softcap: logit soft-capping (Gemma 2), as ``mods.softcap``, applied to
            the scaled scores before the mask.
        sliding_window: ``W`` keys, the current one included (transformers'
            convention). With a mask, the mask already holds it; without one
            and more than ``W`` keys, it is applied (causal layers) or refused.
        s_aux: learned attention sinks ``(H,)``, one logit per query head
            (gpt-oss): ``sinks=`` of `attention_ref.scaled_dot_product_attention`;
            ``None``: no sink.
        position_bias: a float bias broadcastable to ``(B, H, L, S)`` added to
            the scaled scores (T5's relative positions), combined with the mask.
        indices: DeepSeek V3.2's top-k keys, ``(B, L, k)`` integer, one selection
            for all heads: each query attends only to the keys listed, through
            `attention_ref.sparse.topk_attention` (``-1`` = no key; a key out of
            range or listed twice raises); ``None``: dense attention.
        sinks: one sink logit per query, ``(B, H, L, 1)``, a column beside the
            scores (Inkling 2 computes it from each token's hidden state):
            ``sinks=sinks[..., 0]`` of `attention_ref.scaled_dot_product_attention`.
            Given together with ``s_aux`` it raises (two sinks per row).
        block_indices: MiniMax-M3's key blocks per query, ``(B, Hkv, L, k)``
            integer (``-1`` = none), blocks of ``module.indexer.block_size`` keys:
            `attention_ref.sparse.block_topk_attention`, query head ``h`` reading
            index head ``h // (H // Hkv)``. Given with ``indices`` it raises.
        **kwargs: ``output_attentions`` (return the weights), the keywords of
            `HARMLESS_KEYWORDS`, and keywords refused unless ``None``.

    Returns:
        ``(output (B, L, H, Ev), weights (B, H, L, S) or None)``; the weights
        when `record_weights` is active or ``output_attentions`` is requested
        (with sinks, rows sum to less than 1).

    Raises:
        NotImplementedError: a keyword that would change the result and is not
            implemented (``block_indices``, packed-varlen keywords, a paged
            ``cache``, any unknown keyword), or a sliding window this function
            cannot place; the message names the keyword, the layer's class and
            its ``layer_idx``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"module must be the transformers attention layer (a torch.nn.Module: its is_causal, training and "
            f"layer_idx are read), got {type(module).__name__}"
        )
    _check_keywords(module, kwargs)
    L, S = query.shape[-2], key.shape[-2]
    layer_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    window = None
    if attention_mask is None:
        _check_not_packed(module, kwargs.get("position_ids"), L)
        if sliding_window is not None and S > sliding_window:
            window = _window(module, sliding_window, layer_causal, L, S)
    causal = L > 1 and attention_mask is None and layer_causal
    if sinks is not None:
        s_aux = _per_query_sinks(module, sinks, s_aux, query)
    if position_bias is not None:  # one float mask: the bias, plus 0 / -inf (bool) or the float mask
        attention_mask = combine_masks(position_bias, attention_mask)
    want_weights = bool(getattr(_recording, "lists", None)) or bool(kwargs.get("output_attentions", False))
    options: dict[str, Any] = {
        "is_causal": causal,
        "scale": scaling,
        "dropout_p": float(dropout) if module.training else 0.0,
        "enable_gqa": key.shape[-3] != query.shape[-3],
        "score_mod": mods.softcap(float(softcap)) if softcap is not None else None,
        "mask_mod": window,
        "sinks": s_aux,
        "return_weights": want_weights,
    }
    if block_indices is not None:  # MiniMax-M3's key blocks, as the keys they hold
        indices = _block_keys(module, block_indices, indices, query, S)
    if indices is None:
        result = scaled_dot_product_attention(query, key, value, attention_mask, **options)
    else:  # top-k sparse attention: the same call, the selection as one more mask
        selected = indices if block_indices is not None else _selected(module, indices, query)
        result = topk_attention(query, key, value, selected, attention_mask, **options)
    output, weights = result if want_weights else (result, None)
    if weights is not None:
        for captured in getattr(_recording, "lists", []):
            captured.append(weights.detach())
    return output.transpose(1, 2).contiguous(), weights  # (B, H, L, Ev) -> (B, L, H, Ev)


def _builtin_names(transformers: Any) -> set[str]:
    """transformers' own implementations: ``"eager"`` (each model's default, in no registry) and
    every name its ``AttentionInterface`` maps to one of transformers' own functions."""
    mapping = transformers.AttentionInterface._global_mapping  # the registry register() writes to
    ours = {name for name, fn in mapping.items() if getattr(fn, "__module__", "").startswith("transformers.")}
    return {"eager"} | ours


def register(name: str = DEFAULT_NAME) -> str:
    """Register `attention_forward` and transformers' ``eager_mask`` under ``name``.

    Afterwards ``model.set_attn_implementation(name)`` (or
    ``from_pretrained(..., attn_implementation=name)``) runs every attention
    layer of a transformers model through `attention_ref.scaled_dot_product_attention`.
    Registering twice is harmless. transformers' registry is global: registering
    under ``"sdpa"`` would replace transformers' SDPA for every model of the
    process, so the names of its own implementations are refused.

    Args:
        name: the implementation's name.

    Returns:
        ``name``.

    Raises:
        TypeError: ``name`` not a non-empty string.
        ValueError: ``name`` is one of transformers' implementations (``"eager"``,
            ``"sdpa"``, ``"flash_attention_2"``, ``"flex_attention"``, ...), contains
            ``"flash"``, ``"sdpa"`` or ``"flex_attention"`` (transformers then applies
            that implementation's checks and code paths), starts with ``"paged|"``, or
            reads as a kernel on the Hub (``"org/repo"``).
        ImportError: transformers is not installed.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    transformers = _transformers()
    builtin = _builtin_names(transformers)
    if name in builtin:
        raise ValueError(
            f"name {name!r} is transformers' own attention implementation; registering it would replace it "
            f"for every model of the process. Pick another name (transformers' own: {sorted(builtin)})"
        )
    # transformers reads these in a name: "flash", "sdpa" and "flex_attention" anywhere switch a model
    # to that implementation's checks and code paths, "paged|" is a prefix it strips, "org/repo" a Hub kernel.
    if any(part in name for part in ("flash", "sdpa", "flex_attention", "/")) or name.startswith("paged|"):
        raise ValueError(
            f"name {name!r} means something to transformers: a name containing 'flash', 'sdpa' or "
            "'flex_attention' switches models to that implementation's checks and code paths, 'paged|' is a "
            "prefix it strips, 'org/repo' a kernel on the Hub. Pick another name"
        )
    from transformers.masking_utils import eager_mask

    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, eager_mask)  # the mask eager gets: see the module docstring
    return name


@contextlib.contextmanager
def record_weights() -> Iterator[list[torch.Tensor]]:
    """Collect the attention weights of every call of `attention_forward`, in call order.

    Yields:
        A list that receives, per attention call, the ``(B, H, L, S)``
        weights the output was computed from (detached; with sinks, as
        gpt-oss's, each row sums to less than 1). A forward pass of an
        ``n``-layer model appends ``n`` tensors; ``generate`` appends ``n`` per step.

    Example:
        ``with record_weights() as weights: model(input_ids)`` then
        ``weights[layer]`` is that layer's ``(B, H, L, L)``.
    """
    lists = getattr(_recording, "lists", None)
    if lists is None:
        lists = _recording.lists = []
    captured: list[torch.Tensor] = []
    lists.append(captured)
    try:
        yield captured
    finally:
        lists.remove(captured)
