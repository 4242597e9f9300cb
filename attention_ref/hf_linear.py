r"""Run the linear-attention and state-space layers of transformers' hybrid models through attention_ref.

`attention_ref.hf` sends a model's *softmax* attention layers to this package. The hybrids
of 2025-26 (Qwen3-Next, Kimi Linear, Bamba, Granite 4.0-H, Falcon-H1) also have layers
that keep a fixed-size state instead of a KV cache, and transformers computes their
recurrence in module-level torch functions of the model's ``modeling_<type>.py``, looked
up by name on every call. `use_attention_ref_linear` replaces those functions, for the
duration of a ``with`` block, by adapters that call `attention_ref.linear`, and puts
transformers' own back afterwards:

| model types | transformers' function | attention_ref computes |
| --- | --- | --- |
| ``qwen3_next`` | ``torch_chunk_gated_delta_rule`` | `attention_ref.linear.gated_delta_rule`, ``mode="chunked"`` |
| | ``torch_recurrent_gated_delta_rule`` | `attention_ref.linear.gated_delta_rule`, ``mode="recurrent"`` |
| ``kimi_linear`` | ``chunk_kimi_delta_attention`` | `attention_ref.linear.kimi_delta_attention`, ``mode="chunked"`` |
| | ``recurrent_kimi_delta_attention`` | `attention_ref.linear.kimi_delta_attention`, ``mode="recurrent"`` |
| ``bamba``, ``granitemoehybrid``, ``falcon_h1`` | ``mamba2_chunk_scan`` | `attention_ref.linear.ssd`, ``mode="chunked"`` |
| | ``mamba2_selective_state_update`` | `attention_ref.linear.ssd`, ``mode="recurrent"``, one token |

What stays transformers': the projections, the short causal convolution and its cache,
the gates (``g``, ``beta``, ``dt``), the output norm and gate, and every cache. The
adapters only translate conventions at the boundary:

- Gated DeltaNet and KDA: the same layout ``(B, L, H, E)``, log-decay gate, ``beta``, state
  ``(B, Hv, E, Ev)`` key channels first; ``use_qk_l2norm_in_kernel`` is ``use_qk_l2norm``
  and the scale is the default ``E ** -0.5`` in both.
- Mamba-2: transformers hands over the raw ``dt``; the model's own discretisation,
  ``softplus(dt + dt_bias)`` clamped to ``dt_limit``, happens in the adapter, as in
  transformers' fallback, and `attention_ref.linear.ssd` computes the recurrence with the
  ``D`` skip. The single-token update receives ``dt``, ``A``, ``D`` and ``dt_bias``
  expanded over the head size (and ``A`` over the state size); the adapter takes one value
  per head and raises if they differ along the expanded axes. Mamba-2's ``ssm_state`` is
  ``(B, H, P, N)``, value channels first: `attention_ref.linear.state_vk_to_kv` and
  `attention_ref.linear.state_kv_to_vk` convert it at the boundary, and the cache's
  tensor is updated in place as transformers' update does. Falcon-H1's ``z`` gate
  (``out * silu(z)``) is applied after the recurrence, as in transformers. The scan runs
  in chunks of the model's own ``chunk_size``.

The computation precision follows transformers' fallbacks: Mamba-2's inputs are brought to
at least float32 (transformers calls ``.float()``), and the output is returned in the
dtype transformers' function returns.

The swap is process-wide: it replaces attributes of the ``transformers.models.<type>``
module, so every model of that type in the process runs through attention_ref inside the
block, and the functions are restored on exit even after an exception. Other model types
are refused by name. MiniMax is refused too: its lightning attention is written inline in
``MiniMaxLightningAttention.forward`` (transformers 5.23), with no function to replace;
`attention_ref.linear.gated_linear_attention` with ``g = -slope_rate`` per head and
``scale=1`` computes it (the tests show how, by replacing that forward).

Keywords. An adapter accepts only the keywords transformers passes that cannot change its
result (`HARMLESS_KEYWORDS`) and raises `NotImplementedError` naming any other, so a
model that starts passing, say, ``seq_idx`` for packed sequences is refused rather than
silently computed as one sequence.

``transformers`` is an optional dependency; this module imports it on first use.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from attention_ref import linear

__all__ = ["HARMLESS_KEYWORDS", "SUPPORTED", "use_attention_ref_linear"]

#: Keywords the layers of the supported models pass on to their linear-attention functions (seen with
#: transformers 5.23) that cannot change the result, each with the reason. Any other keyword that is not
#: None raises `NotImplementedError`: ``position_ids`` or ``seq_idx``, say, would describe packed sequences.
HARMLESS_KEYWORDS: dict[str, str] = {
    "use_cache": "whether the model keeps a cache: the layer decided output_final_state already",
    "output_router_logits": "what a mixture-of-experts model returns, not what the recurrence computes",
}

#: The model types `use_attention_ref_linear` knows, each with its family.
SUPPORTED: dict[str, str] = {
    "qwen3_next": "gated_delta_rule",
    "kimi_linear": "kimi_delta_attention",
    "bamba": "mamba2",
    "granitemoehybrid": "mamba2",
    "falcon_h1": "mamba2",
}

_REFUSED: dict[str, str] = {
    "minimax": "MiniMax's lightning attention is written inline in MiniMaxLightningAttention.forward (transformers "
    "5.23): there is no function to replace. It is attention_ref.linear.gated_linear_attention with "
    "g = -slope_rate per head and scale=1",
}


def _check_keywords(where: str, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if name not in HARMLESS_KEYWORDS and value is not None:
            raise NotImplementedError(
                f"{where} was passed {name}={type(value).__name__}, which attention_ref.hf_linear does not "
                f"implement (accepted and unused: {sorted(HARMLESS_KEYWORDS)})"
            )


# --- the delta-rule family: the same conventions on both sides -----------------------------------


def _delta_rule(name: str, fn_name: str, mode: str, calls: Counter) -> Callable[..., Any]:
    def adapter(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        _check_keywords(name, kwargs)
        calls[name] += 1
        fn = getattr(linear, fn_name)  # looked up per call: a test can replace it
        return fn(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                  mode=mode, chunk_size=chunk_size, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm_in_kernel)

    adapter.__name__ = name
    adapter.__doc__ = f"transformers' ``{name}``, computed by `attention_ref.linear.{fn_name}` (mode={mode!r})."
    return adapter


# --- Mamba-2's SSD: the model's discretisation here, the recurrence in attention_ref -------------


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _one_per_head(name: str, x: torch.Tensor, dims: int) -> torch.Tensor:
    """``x`` of shape ``(..., H, *expanded)`` with its last ``dims`` axes constant -> ``(..., H)``."""
    first = x[(...,) + (0,) * dims]
    if not torch.equal(first[(...,) + (None,) * dims].expand_as(x), x):
        raise ValueError(f"{name} must hold one value per head (expanded over its last {dims} dims of shape "
                         f"{tuple(x.shape)}); attention_ref.linear.ssd has one step size and decay per head")
    return first


def _mamba2_chunk_scan(calls: Counter) -> Callable[..., Any]:
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False, z=None, **kwargs):
        """transformers' ``mamba2_chunk_scan``: ``hidden_states`` ``(B, L, H, P)``, raw ``dt`` ``(B, L, H)``,
        ``A`` ``(H,)``, ``B``/``C`` ``(B, L, G, N)``, ``initial_states`` ``(B, H, P, N)``."""
        _check_keywords("mamba2_chunk_scan", kwargs)
        if z is not None:
            raise NotImplementedError("mamba2_chunk_scan was passed a z gate, which transformers' own fallback ignores")
        calls["mamba2_chunk_scan"] += 1
        dtype = _compute_dtype(hidden_states, B, C)
        # the model's own discretisation, as transformers' fallback does it
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        state = None if initial_states is None else linear.state_vk_to_kv(initial_states.to(dtype))  # (B, H, N, P)
        y, final = linear.ssd(hidden_states.to(dtype), dt.to(dtype), A.to(dtype), B.to(dtype), C.to(dtype),
                              D=None if D is None else D.to(dtype), initial_state=state,
                              output_final_state=return_final_states, mode="chunked",
                              chunk_size=chunk_size)  # y: (B, L, H, P)
        if return_final_states:
            return y, linear.state_kv_to_vk(final)  # (B, H, N, P) -> (B, H, P, N)
        return y

    return mamba2_chunk_scan


def _mamba2_selective_state_update(calls: Counter) -> Callable[..., Any]:
    def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                                      z=None, **kwargs):
        """transformers' ``mamba2_selective_state_update``: one token, ``state`` ``(B, H, P, N)`` updated in place,
        ``hidden_states`` ``(B, H, P)``, ``dt`` ``(B, H, P)``, ``A`` ``(H, P, N)``, ``B``/``C`` ``(B, G, N)``,
        ``D``/``dt_bias`` ``(H, P)``."""
        _check_keywords("mamba2_selective_state_update", kwargs)
        calls["mamba2_selective_state_update"] += 1
        dtype = _compute_dtype(hidden_states, B, C, state)
        dt = _one_per_head("dt", dt, 1)  # (B, H, P) -> (B, H)
        if dt_bias is not None:
            dt = dt + _one_per_head("dt_bias", dt_bias, 1).to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)  # transformers' single-token update applies no dt_limit
        A = _one_per_head("A", A, 2)  # (H, P, N) -> (H,)
        D = None if D is None else _one_per_head("D", D, 1)  # (H, P) -> (H,)
        y, final = linear.ssd(hidden_states[:, None].to(dtype), dt[:, None].to(dtype), A.to(dtype),
                              B[:, None].to(dtype), C[:, None].to(dtype), D=None if D is None else D.to(dtype),
                              initial_state=linear.state_vk_to_kv(state.to(dtype)), output_final_state=True,
                              mode="recurrent")  # (B, 1, H, P); final (B, H, N, P)
        state.copy_(linear.state_kv_to_vk(final).to(state.dtype))  # the cache's tensor, in place
        y = y[:, 0]  # (B, H, P)
        if z is not None:
            y = y * F.silu(z)
        return y.to(hidden_states.dtype)

    return mamba2_selective_state_update


def _replacements(family: str, calls: Counter) -> dict[str, Callable[..., Any]]:
    if family == "gated_delta_rule":
        return {"torch_chunk_gated_delta_rule": _delta_rule("torch_chunk_gated_delta_rule", "gated_delta_rule",
                                                            "chunked", calls),
                "torch_recurrent_gated_delta_rule": _delta_rule("torch_recurrent_gated_delta_rule",
                                                                "gated_delta_rule", "recurrent", calls)}
    if family == "kimi_delta_attention":
        return {"chunk_kimi_delta_attention": _delta_rule("chunk_kimi_delta_attention", "kimi_delta_attention",
                                                          "chunked", calls),
                "recurrent_kimi_delta_attention": _delta_rule("recurrent_kimi_delta_attention",
                                                              "kimi_delta_attention", "recurrent", calls)}
    return {"mamba2_chunk_scan": _mamba2_chunk_scan(calls),
            "mamba2_selective_state_update": _mamba2_selective_state_update(calls)}


def _model_type(model: Any) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise TypeError(f"model must be a transformers model with a config.model_type, got {type(model).__name__}")
    return model_type


@contextlib.contextmanager
def use_attention_ref_linear(model: Any) -> Iterator[Counter]:
    """Compute the linear-attention / state-space layers of ``model`` with `attention_ref.linear`.

    Inside the block, the module-level functions of ``transformers.models.<type>`` that
    ``model``'s linear layers call (see the table in the module docstring) are replaced by
    adapters into `attention_ref.linear`; on exit transformers' own are restored. Softmax
    attention layers are untouched: send them to attention_ref with `attention_ref.hf.register`
    and ``model.set_attn_implementation(name)``.

    Args:
        model: a transformers model whose ``config.model_type`` is in `SUPPORTED`.

    Yields:
        A `collections.Counter` of the calls, keyed by the name of the transformers
        function each replaced: proof that attention_ref ran, and how often.

    Raises:
        TypeError: ``model`` has no ``config.model_type``.
        ValueError: the model type is not in `SUPPORTED` (MiniMax with the reason).
        ImportError: transformers is not installed.
        NotImplementedError: (inside the block) a layer passes a keyword the adapters
            do not implement.

    Example:
        ``with use_attention_ref_linear(model) as calls: logits = model(ids).logits`` then
        ``calls["torch_chunk_gated_delta_rule"]`` is the number of Gated DeltaNet layers
        of a Qwen3-Next prefill.
    """
    model_type = _model_type(model)
    if model_type in _REFUSED:
        raise ValueError(f"model type {model_type!r} is not supported: {_REFUSED[model_type]}")
    if model_type not in SUPPORTED:
        raise ValueError(f"model type {model_type!r} is not supported; attention_ref.hf_linear knows "
                         f"{sorted(SUPPORTED)}")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    calls: Counter = Counter()
    replacements = _replacements(SUPPORTED[model_type], calls)
    originals = {name: getattr(module, name) for name in replacements}  # AttributeError: a renamed function
    try:
        for name, fn in replacements.items():
            setattr(module, name, fn)
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
