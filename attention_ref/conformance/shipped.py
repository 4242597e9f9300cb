"""The adapters the package ships and runs in its own tests.

Each is a function returning an `attention_ref.conformance.Adapter`, so that
``--attention-impl=attention_ref.conformance.shipped:torch_sdpa_math`` names it
and a library is imported only when its adapter is built. Every adapter passes
each feature to the library in that library's own convention (transformers'
masks with ``finfo(dtype).min``, ``torch.nn.MultiheadAttention``'s inverted
boolean masks, FlexAttention's mods and block masks), as a user of it would.

| name | what it runs | layout |
|---|---|---|
| `torch_sdpa_math` | ``F.scaled_dot_product_attention`` under ``sdpa_kernel(MATH)`` | bhld |
| `torch_sdpa_flash` | the same under ``sdpa_kernel(FLASH_ATTENTION)`` (a flash kernel on CPU too) | bhld |
| `torch_sdpa_efficient`, `torch_sdpa_cudnn` | the same under ``EFFICIENT_ATTENTION``, ``CUDNN_ATTENTION`` (CUDA only) | bhld |
| `torch_flex` | ``flex_attention``, eager (unfused: it materialises the scores) | bhld |
| `torch_flex_compiled` | ``torch.compile(flex_attention)`` (a minute to compile on CPU) | bhld |
| `torch_multihead` | ``nn.MultiheadAttention`` with identity projections | blhd |
| `hf_sdpa` | transformers' ``sdpa_attention_forward`` | bhld in, blhd out |
| `hf_eager` | Llama's ``eager_attention_forward`` (transformers) | bhld in, blhd out |
| `hf_flex` | transformers' ``flex_attention_forward``, ``flex_attention`` uncompiled | bhld in, blhd out |
| `hf_flex_compiled` | ``flex_attention_forward`` as shipped (it compiles ``flex_attention``) | bhld in, blhd out |
| `attention_ref_math`, `attention_ref_tiled`, `attention_ref_triton` | this package's backends | bhld |

The families beyond the attention matrix (`attention_ref.conformance.families`) have
adapters of their own, in `SHIPPED_FAMILIES`, apart from `SHIPPED` (whose adapters
the full run and the Conformance page run on the attention matrix):

| name | what it runs | layout |
|---|---|---|
| `attention_ref_nsa` | `attention_ref.nsa.nsa_attention` in float64 | bhld |
| `attention_ref_moba` | `attention_ref.moba.moba_attention` in float64 | bhld |
| `attention_ref_fp8` | `attention_ref.quant.fp8_attention` with ``p_format="e4m3fn"``: FlashAttention-3's FP8 path, emulated | bhld |

Known bugs are `KnownFailure` entries, each with a small repro run against the installed
library: expected to fail while it reproduces, judged plainly once it stops. Where torch's
SDPA refuses an input under the one kernel asked for ("No available kernel": the CUDA flash
kernel takes no mask and no float32, for one), the adapter raises `Unsupported` and the case
is skipped with torch's reasons.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attention_ref import mods
from attention_ref.conformance.adapter import Adapter, KnownFailure, Unsupported
from attention_ref.conformance.cases import Problem

__all__ = [
    "CUDA_ONLY",
    "SHIPPED",
    "SHIPPED_FAMILIES",
    "attention_ref_fp8",
    "attention_ref_math",
    "attention_ref_moba",
    "attention_ref_nsa",
    "attention_ref_tiled",
    "attention_ref_triton",
    "hf_eager",
    "hf_flex",
    "hf_flex_compiled",
    "hf_sdpa",
    "torch_flex",
    "torch_flex_compiled",
    "torch_multihead",
    "torch_sdpa_cudnn",
    "torch_sdpa_efficient",
    "torch_sdpa_flash",
    "torch_sdpa_math",
]

# The features every dense kernel here takes (torch's SDPA: masks, causal, heads, scale).
_SDPA_FEATURES = {"backward", "scale", "value_dim", "gqa", "mqa", "key_padding", "bool_mask", "float_mask",
                  "empty_rows", "causal", "causal_bottom_right"}
# The conditions FlexAttention-style mask functions express.
_MASK_MOD_FEATURES = {"causal", "causal_bottom_right", "sliding_window", "chunked", "document", "varlen"}
_FLEX_UNFUSED = "flex_attention called without torch.compile"


# --- torch's scaled_dot_product_attention ------------------------------------------------------------


def _torch_sdpa_call(kernel: str) -> Callable[[Problem], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backend = getattr(SDPBackend, kernel)

    def call(p: Problem) -> torch.Tensor:
        mask, is_causal = p.attn_mask, p.is_causal
        if p.causal == "bottom_right":  # torch's own form of FlashAttention's alignment
            if mask is not None:
                raise NotImplementedError("causal_lower_right does not combine with an attn_mask")
            with warnings.catch_warnings():  # "will produce NaNs when seq_len_q > seq_len_kv": the case judges it
                warnings.filterwarnings("ignore", "Lower right causal bias will produce NaNs", UserWarning)
                mask = causal_lower_right(p.query.shape[-2], p.key.shape[-2])
        elif is_causal and mask is not None:  # torch refuses both: fold the causal rule into the mask
            mask, is_causal = p.dense_mask(), False
        with warnings.catch_warnings(record=True) as why, sdpa_kernel(backend):
            warnings.simplefilter("always")  # torch says why a kernel cannot run as UserWarnings
            try:
                out = F.scaled_dot_product_attention(p.query, p.key, p.value, attn_mask=mask, is_causal=is_causal,
                                                     scale=p.scale, enable_gqa=p.enable_gqa)
            except RuntimeError as error:  # torch's own refusal: this kernel does not take this input
                if "No available kernel" not in str(error):
                    raise
                reasons = "; ".join(dict.fromkeys(str(w.message).strip() for w in why)) or str(error)
                raise Unsupported(f"torch {kernel}: {reasons}") from error
        for w in why:  # anything else torch warned about is not ours to hide
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out

    return call


def torch_sdpa_math() -> Adapter:
    """``torch.nn.functional.scaled_dot_product_attention``, math kernel."""
    return Adapter("torch-sdpa-math", _torch_sdpa_call("MATH"), supports=_SDPA_FEATURES,
                   description=f"F.scaled_dot_product_attention, sdpa_kernel(MATH), torch {torch.__version__}")


def torch_sdpa_flash() -> Adapter:
    """``torch.nn.functional.scaled_dot_product_attention``, flash kernel (CPU: torch's C++ flash kernel)."""
    return Adapter("torch-sdpa-flash", _torch_sdpa_call("FLASH_ATTENTION"), supports=_SDPA_FEATURES - {"value_dim"},
                   notes={"value_dim": "the flash kernel needs Ev == E ('No available kernel')"},
                   description="F.scaled_dot_product_attention, sdpa_kernel(FLASH_ATTENTION), "
                               f"torch {torch.__version__}")


def _cuda_only(name: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{name}: torch has this SDPA kernel on CUDA only (torch.cuda.is_available() is False)")


def torch_sdpa_efficient() -> Adapter:
    """``F.scaled_dot_product_attention`` under ``sdpa_kernel(EFFICIENT_ATTENTION)`` (memory-efficient; CUDA only)."""
    _cuda_only("torch-sdpa-efficient")
    return Adapter("torch-sdpa-efficient", _torch_sdpa_call("EFFICIENT_ATTENTION"), supports=_SDPA_FEATURES,
                   description="F.scaled_dot_product_attention, sdpa_kernel(EFFICIENT_ATTENTION), "
                               f"torch {torch.__version__}")


def torch_sdpa_cudnn() -> Adapter:
    """``F.scaled_dot_product_attention`` under ``sdpa_kernel(CUDNN_ATTENTION)`` (cuDNN's kernel; CUDA only)."""
    _cuda_only("torch-sdpa-cudnn")
    return Adapter("torch-sdpa-cudnn", _torch_sdpa_call("CUDNN_ATTENTION"), supports=_SDPA_FEATURES,
                   description="F.scaled_dot_product_attention, sdpa_kernel(CUDNN_ATTENTION), "
                               f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")


# --- FlexAttention -----------------------------------------------------------------------------------


def _with_mask_tensor(p: Problem, shape: tuple[int, int, int, int]):
    """``(score_mod, mask_mod)``: the Problem's mods with its ``attn_mask`` folded in (indexed per ``b, h, q, kv``)."""
    score_mod, mask_mod = p.score_mod, p.mask_mod
    if p.attn_mask is None:
        return score_mod, mask_mod
    full = p.attn_mask.expand(shape)  # (B, H, L, S), a view
    if full.dtype == torch.bool:
        inner = mask_mod

        def attn_mask_mod(b, h, q_idx, kv_idx):
            keep = full[b, h, q_idx, kv_idx]
            return keep if inner is None else keep & inner(b, h, q_idx, kv_idx)

        return score_mod, attn_mask_mod
    inner_score = score_mod

    def attn_mask_score_mod(score, b, h, q_idx, kv_idx):
        score = score if inner_score is None else inner_score(score, b, h, q_idx, kv_idx)
        return score + full[b, h, q_idx, kv_idx]

    return attn_mask_score_mod, mask_mod


def _flex_call(flex: Callable[..., torch.Tensor]) -> Callable[[Problem], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask

    def call(p: Problem) -> torch.Tensor:
        q, k, v = p.query, p.key, p.value
        packed = q.dim() == 3  # varlen: (H, T, E) -> a batch of one
        if packed:
            q, k, v = q[None], k[None], v[None]
        B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        score_mod, mask_mod = _with_mask_tensor(p, (B, H, L, S))
        block_mask = None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S, device=q.device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _FLEX_UNFUSED, UserWarning)  # eager is unfused, and says so
            out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=p.scale, enable_gqa=p.enable_gqa)
        return out[0] if packed else out

    return call


_FLEX_NOTES = {"backward": "FlexAttention has no backward on CPU (NotImplementedError)",
               "value_dim": "FlexAttention needs Ev == E"}
_FLEX_FEATURES = (_SDPA_FEATURES - {"backward", "value_dim"}) | _MASK_MOD_FEATURES | {"softcap", "alibi"}
if torch.cuda.is_available():  # FlexAttention's backward exists on CUDA
    _FLEX_NOTES.pop("backward")
    _FLEX_FEATURES |= {"backward"}


def _flex_loses_a_captured_float() -> bool:
    """The repro of eager flex_attention's bug with a float a score_mod captures (first seen in torch 2.15.0).

    flex_attention runs eagerly under dynamo (``backend="eager"``); once its wrapper has been traced
    twice, dynamo makes the floats it sees symbolic, and a float captured by a score_mod reaches
    FlexAttention's operator as a ``SymFloat`` among its extra buffers, which it refuses ("can only be
    of (Tensor, int, SymInt)"). Two soft-capping score_mods, each capturing its cap, called one after
    the other: True while the second raises that, False when both give the right output.
    """
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))  # (B, H, L, E)
    for cap in (2.0, 3.0):
        def softcap(score, b, h, q_idx, kv_idx, cap=cap):
            return cap * torch.tanh(score / cap)

        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, L, S)
        right = torch.softmax(cap * torch.tanh(scores / cap), dim=-1) @ v
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _FLEX_UNFUSED, UserWarning)
                out = flex_attention(q, k, v, score_mod=softcap)
        except Exception as error:  # dynamo's TorchRuntimeError: its message names the SymFloat
            if "SymFloat" in str(error):
                return True
            raise
        _shows(out, right, None, f"flex_attention with a soft cap of {cap}")
    return False


#: eager flex_attention and the floats its score_mods capture: the soft cap's
_TORCH_FLEX_BUGS = (
    KnownFailure("eager flex_attention refuses a score_mod that captures a float once dynamo has traced it "
                 "before: the float reaches the operator as a SymFloat", "torch", frozenset({"softcap"}),
                 _flex_loses_a_captured_float, first_seen="2.15.0"),
)


def torch_flex() -> Adapter:
    """``torch.nn.attention.flex_attention.flex_attention``, eager."""
    from torch.nn.attention.flex_attention import flex_attention

    return Adapter("torch-flex", _flex_call(flex_attention), supports=_FLEX_FEATURES, notes=_FLEX_NOTES,
                   known_failures=_TORCH_FLEX_BUGS, description=f"flex_attention, eager, torch {torch.__version__}")


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def torch_flex_compiled() -> Adapter:
    """``torch.compile(flex_attention)``: slow to compile on CPU (about a minute per new shape)."""
    return Adapter("torch-flex-compiled", _flex_call(_compiled_flex()), supports=_FLEX_FEATURES, notes=_FLEX_NOTES,
                   description=f"torch.compile(flex_attention), torch {torch.__version__}")


# --- nn.MultiheadAttention ------------------------------------------------------------------------------


def _multihead_call(p: Problem) -> torch.Tensor:
    B, L, H, E = p.query.shape  # blhd: (B, L, H, E); the module splits d = H * E into heads
    S, d = p.key.shape[1], H * E
    module = torch.nn.MultiheadAttention(d, H, bias=False, batch_first=True, device=p.query.device,
                                         dtype=p.query.dtype)
    with torch.no_grad():  # identity projections: the module's heads see exactly q, k, v
        module.in_proj_weight.copy_(torch.eye(d).repeat(3, 1))
        module.out_proj.weight.copy_(torch.eye(d))
    attn_mask = key_padding_mask = None
    mask = p.dense_mask()
    if mask is not None and mask.dtype == torch.bool and mask.shape[1:3] == (1, 1) and mask.shape[0] == B:
        key_padding_mask = ~mask[:, 0, 0, :]  # (B, S), True = ignore: the module's polarity
    elif mask is not None:
        mask = mask.expand(B, H, L, S).reshape(B * H, L, S)  # the module's per-head layout
        attn_mask = ~mask if mask.dtype == torch.bool else mask  # True = may NOT attend
    out, _ = module(p.query.reshape(B, L, d), p.key.reshape(B, S, d), p.value.reshape(B, S, d),
                    attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)
    return out.reshape(B, L, H, E)


def torch_multihead() -> Adapter:
    """``torch.nn.MultiheadAttention`` (its slow path) with identity projections, batch first."""
    notes = {"scale": "the module's scale is 1/sqrt(E), fixed",
             "gqa": "one number of heads for queries, keys and values",
             "mqa": "one number of heads for queries, keys and values",
             "value_dim": "vdim is projected to the model width: the value size per head is E"}
    return Adapter("torch-multihead", _multihead_call, layout="blhd", notes=notes,
                   supports={"backward", "key_padding", "bool_mask", "float_mask", "empty_rows", "causal"},
                   description=f"nn.MultiheadAttention, identity projections, torch {torch.__version__}")


# --- transformers ----------------------------------------------------------------------------------------


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _hf_module(p: Problem) -> torch.nn.Module:
    """The ``module`` transformers' attention functions read: groups of kv heads, causality, eval mode."""
    module = torch.nn.Module()
    module.num_key_value_groups = p.query.shape[-3] // p.key.shape[-3]
    module.is_causal = p.causal is not None
    module.layer_idx = 0
    module.train(False)
    return module


def _alibi_bias(p: Problem, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi as transformers' ``position_bias``: ``(1, H, L, S)``, ``slope_h * (j - i)``."""
    L, S = p.query.shape[-2], p.key.shape[-2]
    distance = torch.arange(S, device=p.query.device)[None, :] - torch.arange(L, device=p.query.device)[:, None]
    return (p.alibi_slopes.to(p.query.device)[:, None, None] * distance).to(dtype)[None]  # (1, H, L, S)


def _hf_batched(p: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The inputs as ``(B, H, L, E)``: packed varlen tensors become a batch of one."""
    packed = p.query.dim() == 3
    q, k, v = (t[None] if packed else t for t in (p.query, p.key, p.value))
    return q, k, v, packed


def _hf_sdpa_call(p: Problem) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, packed = _hf_batched(p)
    mask = p.dense_mask() if p.needs_mask else None  # transformers' masks for sdpa: bool (B, 1|H, L, S)
    bias = _alibi_bias(p, q.dtype) if p.alibi_slopes is not None else None
    out, _ = sdpa_attention_forward(_hf_module(p), q, k, v, mask, dropout=0.0, scaling=p.scale,
                                    is_causal=p.is_causal and mask is None, position_bias=bias)
    return out[0] if packed else out  # (B, L, H, Ev)


def hf_sdpa() -> Adapter:
    """transformers' ``sdpa_attention_forward``: masks as transformers builds them (bool, materialised)."""
    version = _transformers_version()
    return Adapter("hf-sdpa", _hf_sdpa_call, output_layout="blhd",
                   supports=_SDPA_FEATURES | _MASK_MOD_FEATURES | {"alibi"},
                   notes={"softcap": "raises: 'sdpa attention does not support softcap'"},
                   description=f"transformers {version} sdpa_attention_forward")


@contextlib.contextmanager
def _transformers_flex_uncompiled(active: bool) -> Iterator[None]:
    """transformers wraps ``flex_attention`` in ``torch.compile`` (minutes on CPU); here it calls it eagerly.

    ``flex_attention_forward`` reaches the compiled function through the module global
    ``compile_friendly_flex_attention``, replaced for the duration of the call by one that
    calls ``flex_attention`` itself with the same arguments.
    """
    if not active:
        yield
        return
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex_module

    def eager(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    original = hf_flex_module.compile_friendly_flex_attention
    hf_flex_module.compile_friendly_flex_attention = eager
    try:
        yield
    finally:
        hf_flex_module.compile_friendly_flex_attention = original


def _hf_flex_call(compiled: bool) -> Callable[[Problem], torch.Tensor]:
    def call(p: Problem) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask
        from transformers.integrations.flex_attention import flex_attention_forward

        q, k, v, packed = _hf_batched(p)
        B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if p.attn_mask is not None and p.attn_mask.dtype != torch.bool:
            attention_mask = p.dense_mask()  # a float tensor: transformers' score_mod adds it
        else:  # a BlockMask, as transformers' masking utilities build it for flex
            _, mask_mod = _with_mask_tensor(p, (B, H, L, S))
            attention_mask = None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S, device=q.device)
        bias = _alibi_bias(p, q.dtype).expand(B, H, L, S) if p.alibi_slopes is not None else None
        with _transformers_flex_uncompiled(not compiled), warnings.catch_warnings():
            warnings.filterwarnings("ignore", _FLEX_UNFUSED, UserWarning)
            out, _ = flex_attention_forward(_hf_module(p), q, k, v, attention_mask, scaling=p.scale,
                                            softcap=p.softcap, s_aux=p.sinks, position_bias=bias)
        return out[0] if packed else out

    return call


def _hf_flex_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' ``flex_attention_forward`` on a float mask, ``flex_attention`` eager as in `hf_flex`:
    ``(B, H, L, E)`` in, ``(B, H, L, E)`` out (transformers returns ``(B, L, H, E)``)."""
    from transformers.integrations.flex_attention import flex_attention_forward

    module = torch.nn.Module()
    module.train(False)  # all flex_attention_forward reads of it is .training
    with _transformers_flex_uncompiled(True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", _FLEX_UNFUSED, UserWarning)
        out, _ = flex_attention_forward(module, q, k, v, mask)  # (B, L, H, E)
    return out.transpose(1, 2)


def _shows(out: torch.Tensor, right: torch.Tensor, buggy: torch.Tensor | None, what: str) -> bool:
    """True when ``out`` is the bug's answer ``buggy``, False when it is ``right``; neither: the repro cannot tell."""
    if buggy is not None and torch.allclose(out, buggy, atol=1e-6, rtol=1e-5):
        return True
    if torch.allclose(out, right, atol=1e-6, rtol=1e-5):
        return False
    raise AssertionError(f"{what}: the library gives neither the right output nor the bug's (max |difference| "
                         f"from the right one: {(out - right).abs().max().item():.3g})")


def _hf_flex_adds_head_0s_mask() -> bool:
    """The repro of the first flex bug: a float mask that hides key 0 from head 1 only.

    True while head 1 gets head 0's mask (nothing hidden), False when each head gets its own.
    """
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=g)  # (B, H, L, E)
    k, v = (torch.randn(1, 2, 5, 4, generator=g) for _ in range(2))  # (B, H, S, E)
    mask = torch.zeros(1, 2, 3, 5)  # (B, H, L, S)
    mask[0, 1, :, 0] = float("-inf")  # head 1 may not see key 0; head 0 sees every key
    right = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    buggy = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :1])  # head 0's mask on every head
    return _shows(_hf_flex_eager(q, k, v, mask), right, buggy, "a two-head float mask")


def _hf_flex_indexes_the_mask_by_batch() -> bool:
    """The repro of the second flex bug: a float mask of batch 1, ``(1, 1, L, S)``, given with a batch of 2.

    True while transformers raises IndexError (its score_mod reads ``score_mask[batch_idx]``, and the
    mask has no entry 1), False when every batch entry gets the broadcast mask.
    """
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 3, 4, generator=g)  # (B, H, L, E): B = 2
    k, v = (torch.randn(2, 1, 5, 4, generator=g) for _ in range(2))  # (B, H, S, E)
    mask = torch.zeros(1, 1, 3, 5)  # (1, 1, L, S): the same for every batch entry
    mask[..., 0] = float("-inf")
    try:
        out = _hf_flex_eager(q, k, v, mask)
    except IndexError:
        return True
    right = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _shows(out, right, None, "a float mask of batch 1 at batch 2")


#: transformers' flex_attention_forward adds a float mask in a score_mod that reads
#: ``score_mask[batch_idx][0][q_idx][kv_idx]``: both bugs come from it (first seen in 5.23.0).
_HF_FLEX_BUGS = (
    KnownFailure("flex_attention_forward adds head 0's float mask to every head: its score_mod reads "
                 "score_mask[batch_idx][0][q_idx][kv_idx]", "transformers", frozenset({"float_mask_per_head"}),
                 _hf_flex_adds_head_0s_mask, first_seen="5.23.0"),
    KnownFailure("flex_attention_forward raises IndexError on a float mask of batch 1 (broadcast over the "
                 "batch): its score_mod indexes score_mask[batch_idx]", "transformers",
                 frozenset({"float_mask_batch1"}), _hf_flex_indexes_the_mask_by_batch, first_seen="5.23.0"),
)


def hf_flex() -> Adapter:
    """transformers' ``flex_attention_forward`` with ``flex_attention`` eager: BlockMasks, or a float mask tensor.

    transformers compiles ``flex_attention`` on first use (minutes on CPU); this
    adapter calls the uncompiled ``flex_attention`` in its place, the rest of
    ``flex_attention_forward`` unchanged. `hf_flex_compiled` runs it as shipped.
    """
    return _hf_flex(compiled=False)


def hf_flex_compiled() -> Adapter:
    """transformers' ``flex_attention_forward`` as shipped: ``flex_attention`` under ``torch.compile``."""
    return _hf_flex(compiled=True)


def _hf_flex(compiled: bool) -> Adapter:
    version = _transformers_version()
    notes = dict(_FLEX_NOTES, sinks="s_aux raises on CPU ('Attention sinks cannot be run on CPU with flex attention')")
    supports = set(_FLEX_FEATURES)
    if torch.cuda.is_available():  # the CPU's refusal of s_aux does not apply
        supports.add("sinks")
        notes.pop("sinks")
    if compiled and not torch.cuda.is_available():
        # Not a failure the suite can record: the process dies. Seen with torch 2.13, transformers 5.23.
        supports.discard("float_mask")
        notes["float_mask"] = ("its score_mod indexes score_mask[batch_idx][0][q_idx][kv_idx]; compiled on a CPU "
                               "that chained indexing corrupts memory and the process dies (segfault or malloc abort)")
    return Adapter("hf-flex-compiled" if compiled else "hf-flex", _hf_flex_call(compiled), output_layout="blhd",
                   notes=notes, supports=supports, known_failures=_HF_FLEX_BUGS,
                   description=f"transformers {version} flex_attention_forward"
                               + ("" if compiled else " (flex_attention uncompiled)"))


def _hf_eager_call(p: Problem) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import eager_attention_forward

    q, k, v, packed = _hf_batched(p)
    # transformers' eager masks: float, finfo(dtype).min where masked (so a row with no key averages every value)
    mask = p.dense_mask(fill=torch.finfo(q.dtype).min)
    mask = None if mask is None else mask.to(q.dtype)
    out, _ = eager_attention_forward(_hf_module(p), q, k, v, mask, scaling=p.resolved_scale, dropout=0.0)
    return out[0] if packed else out


def hf_eager() -> Adapter:
    """Llama's ``eager_attention_forward``: masks as transformers builds them for eager (float, ``finfo.min``)."""
    version = _transformers_version()
    notes = {"empty_rows": "transformers masks with finfo(dtype).min, so a row with no key gets the mean of "
                           "the values, not 0: a convention, not a bug"}
    return Adapter("hf-eager", _hf_eager_call, output_layout="blhd", notes=notes,
                   supports=(_SDPA_FEATURES - {"empty_rows"}) | _MASK_MOD_FEATURES,
                   description=f"transformers {version} modeling_llama.eager_attention_forward")


# --- this package's backends -----------------------------------------------------------------------------


def _package_call(backend: str) -> Callable[[Problem], torch.Tensor]:
    from attention_ref.functional import scaled_dot_product_attention
    from attention_ref.kv_cache import attention_with_kv_cache
    from attention_ref.varlen import varlen_attention

    def call(p: Problem) -> torch.Tensor:
        if p.block_table is not None:
            return attention_with_kv_cache(p.query, p.key, p.value, p.cache_seqlens, block_table=p.block_table,
                                           is_causal=p.causal is not None, scale=p.scale, backend=backend,
                                           sinks=p.sinks)
        if p.cu_seqlens_q is not None:
            return varlen_attention(p.query, p.key, p.value, p.cu_seqlens_q, p.cu_seqlens_k,
                                    is_causal=p.causal is not None, scale=p.scale, backend=backend, sinks=p.sinks)
        return scaled_dot_product_attention(p.query, p.key, p.value, p.attn_mask, scale=p.scale,
                                            enable_gqa=p.enable_gqa, backend=backend, score_mod=p.score_mod,
                                            mask_mod=p.mask_mod, sinks=p.sinks)

    return call


_EVERYTHING = _SDPA_FEATURES | _MASK_MOD_FEATURES | {"softcap", "alibi", "sinks", "paged"}


def attention_ref_math() -> Adapter:
    """This package's reference, ``backend="math"``, in the inputs' dtype (softmax in float32)."""
    return Adapter("attention_ref-math", _package_call("math"), supports=_EVERYTHING,
                   description="attention_ref backend='math' (the reference's own code, in the inputs' dtype)")


def attention_ref_tiled() -> Adapter:
    """This package's tiled path (online softmax), ``backend="tiled"``."""
    return Adapter("attention_ref-tiled", _package_call("tiled"), supports=_EVERYTHING,
                   description="attention_ref backend='tiled' (online softmax in PyTorch)")


def _triton_call(p: Problem) -> torch.Tensor:
    from attention_ref.functional import scaled_dot_product_attention

    mask_mod = score_mod = None
    L, S = p.query.shape[-2], p.key.shape[-2]
    if p.window is not None:
        mask_mod = mods.sliding_window(*p.window, offset=S - L if p.causal == "bottom_right" else 0)
    elif p.causal == "bottom_right":
        mask_mod = mods.causal(offset=S - L)
    if p.softcap is not None:
        score_mod = mods.softcap(p.softcap)
    return scaled_dot_product_attention(p.query, p.key, p.value, p.attn_mask, is_causal=p.is_causal, scale=p.scale,
                                        enable_gqa=p.enable_gqa, backend="triton", mask_mod=mask_mod,
                                        score_mod=score_mod)


def attention_ref_triton() -> Adapter:
    """This package's Triton kernel, ``backend="triton"`` (Triton's interpreter without CUDA).

    Without CUDA it sets ``TRITON_INTERPRET=1`` if triton has not been imported yet
    (the variable is read at triton's first import).

    Raises:
        ImportError: triton is not installed.
        RuntimeError: no CUDA, and triton was imported in compiled mode before
            (transformers imports it, for one).
    """
    if importlib.util.find_spec("triton") is None:
        raise ImportError("the attention_ref-triton adapter needs triton (pip install triton)")
    cuda = torch.cuda.is_available()
    if not cuda:
        if "triton" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from attention_ref import triton_flash

        if not triton_flash.is_available("cpu"):
            raise RuntimeError(
                "the attention_ref-triton adapter needs CUDA or Triton's interpreter, and triton was "
                "imported without TRITON_INTERPRET=1 (transformers imports it, for one): set "
                "TRITON_INTERPRET=1 before anything imports triton"
            )
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if cuda else (torch.float32, torch.float16)
    notes = {"bfloat16": "Triton's interpreter computes in numpy, which has no bfloat16: CUDA only",
             "bool_mask": "the kernel takes key-padding masks only", "float_mask": "the kernel takes no float mask",
             "value_dim": "the kernel needs Ev == E"}
    return Adapter("attention_ref-triton", _triton_call, dtypes=dtypes, notes=notes,
                   supports={"backward", "scale", "gqa", "mqa", "key_padding", "empty_rows", "causal",
                             "causal_bottom_right", "sliding_window", "softcap"},
                   description="attention_ref backend='triton'" + ("" if cuda else " (Triton's interpreter)"))


# --- the families beyond the attention matrix ------------------------------------------------------------


def _float64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(torch.float64) for t in tensors]


def _nsa_call(p: Problem) -> torch.Tensor:
    from attention_ref.nsa import nsa_attention

    out = nsa_attention(*_float64(p.query, p.key, p.value, p.g_cmp, p.g_slc, p.g_swa), block_size=p.block_size,
                        block_counts=p.block_counts, window_size=p.window_size, scale=p.scale)
    return out.to(p.query.dtype)


def attention_ref_nsa() -> Adapter:
    """This package's NSA reference, `attention_ref.nsa.nsa_attention`, in float64 (the NSA family)."""
    return Adapter("attention_ref-nsa", _nsa_call, supports={"nsa", "gqa"},
                   description="attention_ref.nsa.nsa_attention in float64")


def _moba_call(p: Problem) -> torch.Tensor:
    from attention_ref.moba import moba_attention

    out = moba_attention(*_float64(p.query, p.key, p.value), chunk_size=p.moba_chunk_size, topk=p.moba_topk,
                         scale=p.scale, enable_gqa=p.enable_gqa)
    return out.to(p.query.dtype)


def attention_ref_moba() -> Adapter:
    """This package's MoBA reference, `attention_ref.moba.moba_attention`, in float64 (the MoBA family)."""
    return Adapter("attention_ref-moba", _moba_call, supports={"moba", "gqa", "backward"},
                   description="attention_ref.moba.moba_attention in float64")


def _fp8_call(p: Problem) -> torch.Tensor:
    from attention_ref.conformance.families import fp8_format
    from attention_ref.quant import fp8_attention

    out = fp8_attention(p.query, p.key, p.value, p.q_descale, p.k_descale, p.v_descale,
                        fmt=fp8_format(p.query.dtype), p_format="e4m3fn", is_causal=p.causal is not None,
                        scale=p.scale, enable_gqa=p.enable_gqa)  # (B, H, L, Ev) float64
    return out.to(p.output_dtype)


def attention_ref_fp8() -> Adapter:
    """FlashAttention-3's FP8 path emulated: `attention_ref.quant.fp8_attention` with P rounded to e4m3fn at 2^8."""
    return Adapter("attention_ref-fp8", _fp8_call, supports={"fp8", "gqa", "causal"},
                   description="attention_ref.quant.fp8_attention, p_format='e4m3fn': FlashAttention-3's FP8 path, "
                               "emulated in float64")


#: The adapters whose kernel torch has on CUDA only (building one without CUDA raises RuntimeError).
CUDA_ONLY = frozenset({"torch-sdpa-efficient", "torch-sdpa-cudnn"})

#: Every shipped adapter by name, as a function that builds it.
SHIPPED: dict[str, Callable[[], Adapter]] = {
    "torch-sdpa-math": torch_sdpa_math,
    "torch-sdpa-flash": torch_sdpa_flash,
    "torch-sdpa-efficient": torch_sdpa_efficient,
    "torch-sdpa-cudnn": torch_sdpa_cudnn,
    "torch-flex": torch_flex,
    "torch-flex-compiled": torch_flex_compiled,
    "torch-multihead": torch_multihead,
    "hf-sdpa": hf_sdpa,
    "hf-flex": hf_flex,
    "hf-flex-compiled": hf_flex_compiled,
    "hf-eager": hf_eager,
    "attention_ref-math": attention_ref_math,
    "attention_ref-tiled": attention_ref_tiled,
    "attention_ref-triton": attention_ref_triton,
}

#: The shipped adapters of the families beyond the attention matrix, by name (`attention_ref.conformance.families`).
SHIPPED_FAMILIES: dict[str, Callable[[], Adapter]] = {
    "attention_ref-nsa": attention_ref_nsa,
    "attention_ref-moba": attention_ref_moba,
    "attention_ref-fp8": attention_ref_fp8,
}
