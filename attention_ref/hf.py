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
registers transformers' own ``sdpa_mask``: a boolean ``(B, 1, L, S)`` mask,
``True`` = takes part, the convention of this package. That mask is ``None``
when there is no padding and the causal rule alone suffices; the attention
function then applies it itself, exactly as transformers' SDPA path does:
``is_causal = L > 1 and module.is_causal`` (top-left aligned, which equals
bottom-right there, since transformers only skips the mask when ``L == S`` or
``L == 1``).

What transformers passes and what becomes of it:

| transformers passes | attention_ref receives |
| --- | --- |
| ``query (B, H, L, E)``, ``key``/``value (B, Hkv, S, E)`` | the same; ``enable_gqa=True`` when ``Hkv < H`` |
| ``scaling`` | ``scale`` |
| ``attention_mask`` (bool, ``True`` = takes part), or ``None`` | ``attn_mask``, or ``is_causal`` as above |
| ``softcap`` (Gemma 2) | ``score_mod=mods.softcap(softcap)`` |
| ``sliding_window`` | already in the mask whenever it removes a key (transformers always materialises the mask then); nothing more to do |
| ``dropout`` | ``dropout_p``, only while ``module.training`` |

The output is returned as transformers expects, ``(B, L, H, Ev)``, with the
weights ``(B, H, L, S)`` when ``output_attentions`` is requested.

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
from attention_ref.functional import scaled_dot_product_attention

__all__ = ["DEFAULT_NAME", "attention_forward", "record_weights", "register"]

#: The name `register` uses unless told otherwise.
DEFAULT_NAME = "attention_ref"

_recording = threading.local()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - the hf extra is installed in the tests
        raise ImportError(
            "attention_ref.hf needs transformers: pip install 'attention_ref[hf]' (transformers >= 5, Python >= 3.11)"
        ) from error
    return transformers


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function `register` gives transformers: one layer through the reference.

    Args:
        module: the transformers attention layer (read: ``is_causal``, ``training``).
        query: ``(B, H, L, E)``.
        key: ``(B, Hkv, S, E)``, ``H`` a multiple of ``Hkv``.
        value: ``(B, Hkv, S, Ev)``.
        attention_mask: bool ``(B, 1, L, S)`` (``True`` = takes part) or float
            (added), or ``None``: then the causal rule applies when ``L > 1``
            and the layer is causal, as in transformers' SDPA path.
        dropout: dropout probability, applied only while ``module.training``.
        scaling: the score scale (``None``: ``1 / sqrt(E)``).
        is_causal: overrides ``module.is_causal`` when given.
        softcap: logit soft-capping (Gemma 2), as ``mods.softcap``.
        **kwargs: the rest of what transformers passes (``sliding_window``,
            ``position_ids``, ...): encoded in ``attention_mask`` already.

    Returns:
        ``(output (B, L, H, Ev), weights (B, H, L, S) or None)``; the weights
        when `record_weights` is active or ``output_attentions`` is requested.
    """
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    causal = query.shape[-2] > 1 and attention_mask is None and causal
    want_weights = bool(getattr(_recording, "sinks", None)) or bool(kwargs.get("output_attentions", False))
    result = scaled_dot_product_attention(
        query, key, value, attention_mask,
        is_causal=causal,
        scale=scaling,
        dropout_p=float(dropout) if module.training else 0.0,
        enable_gqa=key.shape[-3] != query.shape[-3],
        score_mod=mods.softcap(float(softcap)) if softcap is not None else None,
        return_weights=want_weights,
    )
    output, weights = result if want_weights else (result, None)
    if weights is not None:
        for sink in getattr(_recording, "sinks", []):
            sink.append(weights.detach())
    return output.transpose(1, 2).contiguous(), weights  # (B, H, L, Ev) -> (B, L, H, Ev)


def register(name: str = DEFAULT_NAME) -> str:
    """Register `attention_forward` and transformers' ``sdpa_mask`` under ``name``.

    Afterwards ``model.set_attn_implementation(name)`` (or
    ``from_pretrained(..., attn_implementation=name)``) runs every attention
    layer of a transformers model through `attention_ref.scaled_dot_product_attention`.
    Registering twice is harmless.

    Args:
        name: the implementation's name.

    Returns:
        ``name``.

    Raises:
        TypeError: ``name`` not a non-empty string.
        ImportError: transformers is not installed.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    transformers = _transformers()
    from transformers.masking_utils import sdpa_mask

    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, sdpa_mask)
    return name


@contextlib.contextmanager
def record_weights() -> Iterator[list[torch.Tensor]]:
    """Collect the attention weights of every call of `attention_forward`, in call order.

    Yields:
        A list that receives, per attention call, the ``(B, H, L, S)``
        weights the output was computed from (detached). A forward pass of an
        ``n``-layer model appends ``n`` tensors; ``generate`` appends ``n`` per step.

    Example:
        ``with record_weights() as weights: model(input_ids)`` then
        ``weights[layer]`` is that layer's ``(B, H, L, L)``.
    """
    sinks = getattr(_recording, "sinks", None)
    if sinks is None:
        sinks = _recording.sinks = []
    captured: list[torch.Tensor] = []
    sinks.append(captured)
    try:
        yield captured
    finally:
        sinks.remove(captured)
