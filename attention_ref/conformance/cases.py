"""The case matrix: what the suite asks a kernel, each case seeded and named.

A *scenario* is one attention feature or combination (a causal mask aligned
bottom-right, a sliding window, packed sequences, ...) on fixed sizes. A *case*
is a scenario in one dtype, one direction (``fwd``: the output; ``bwd``: the
output and the gradients of ``query``, ``key`` and ``value``) and one shape set
(``small`` or ``medium``). Its id, ``"<scenario>-<dtype>-<direction>-<shape>"``,
is stable across releases and machines, and so are its numbers: the inputs are
drawn from a generator seeded with the id's CRC-32, on the CPU, in float32, then
rounded to the case's dtype. A failing case reruns alone by its id.

The sizes are distinct primes wherever the feature allows (``B=2, H=3, L=5,
S=7``; ``L != S`` unless the feature is about self-attention), so a swapped axis
fails instead of passing. ``E = Ev = 16`` on the small shapes (the smallest head
size the Triton kernel takes) and 64 on the medium ones; ``value_dim`` uses
``Ev = E / 2``. Dropout is off in every case.

Beside the attention matrix stand the *families* NSA, MoBA and FP8: kernels
with calls of their own, whose cases an adapter runs by claiming the family's
feature (``"nsa"``, ``"moba"``, ``"fp8"``), and then instead of the attention
matrix (`attention_ref.conformance.families` says what each case is judged
as). ``matrix(size)`` is the attention matrix alone, as it always was;
``matrix(size, families)`` adds or picks families.

Shapes use the package legend: ``B`` batch, ``H`` query heads, ``Hkv`` key/value
heads, ``L`` queries, ``S`` keys, ``E`` query/key size, ``Ev`` value size; packed
(varlen) tensors are ``(H, T, E)`` with ``T`` the total length.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from attention_ref import mods, quant
from attention_ref.conformance.families import (
    FAMILIES,
    GATES,
    moba_as_attention,
    nsa_as_attention,
    ranked_query_key,
)
from attention_ref.varlen import cu_seqlens_from_lengths, varlen_mask_mod

__all__ = [
    "DTYPES", "FAMILIES", "FEATURES", "LAYOUTS", "SCENARIOS", "SHAPES", "SIZES", "Case", "Inputs", "Problem",
    "Scenario", "by_id", "matrix", "to_layout",
]

#: Every feature a case can need, and what it means. An adapter lists those its
#: kernel supports; a case runs when the adapter supports all of the case's features.
FEATURES: dict[str, str] = {
    "backward": "gradients of query, key and value (the 'bwd' cases)",
    "scale": "a scale other than 1/sqrt(E)",
    "value_dim": "a value size Ev different from the query/key size E",
    "gqa": "grouped-query attention, 1 < Hkv < H key/value heads (query head h reads kv head h // (H // Hkv))",
    "mqa": "multi-query attention, one key/value head",
    "key_padding": "a boolean key-padding attn_mask of shape (B, 1, 1, S), True = the key takes part",
    "bool_mask": "a boolean attn_mask broadcastable to (B, H, L, S), True = takes part "
                 "(the opposite of torch.nn.MultiheadAttention)",
    "float_mask": "a float attn_mask added to the scores, with -inf entries, broadcastable to (B, H, L, S)",
    "empty_rows": "query rows where no key takes part: output 0 (and gradients 0), as PyTorch >= 2.5 gives",
    "causal": "causal, aligned top-left: key j for query i when j <= i (torch's is_causal)",
    "causal_bottom_right": "causal, aligned bottom-right: j <= i + S - L (FlashAttention's causal=True)",
    "sliding_window": "a sliding window (left, right): i - left <= j <= i + right (here L == S)",
    "chunked": "chunked attention (Llama 4): i // size == j // size, with causal",
    "document": "packed documents (B, L) ids: a query sees the keys of its own document",
    "softcap": "logit soft-capping cap * tanh(score / cap), before any mask (Gemma 2)",
    "alibi": "ALiBi: score + slope_h * (j - i), with causal",
    "sinks": "learned sinks: exp(sinks[h]) in every row's softmax denominator (gpt-oss)",
    "varlen": "packed variable-length sequences with cu_seqlens (FlashAttention's varlen functions)",
    "paged": "a paged key/value cache with a block table and cache_seqlens (vLLM, flash_attn_with_kvcache)",
    # the families: an adapter claiming one runs its cases instead of the attention matrix
    "nsa": "the NSA family: Native Sparse Attention (attention_ref.nsa), compressed, selected and sliding-window "
           "branches gated per query head and token; problem.block_size, block_counts, window_size, g_cmp, "
           "g_slc, g_swa",
    "moba": "the MoBA family: Mixture of Block Attention (attention_ref.moba), the own chunk and the top-k past "
            "chunks, causal; problem.moba_chunk_size, moba_topk",
    "fp8": "the FP8 family: e4m3fn query, key and value with FlashAttention-3's descales (B, Hkv); "
           "problem.q_descale, k_descale, v_descale, output_dtype",
}

#: The layouts of query/key/value/output an adapter can ask for: heads before positions
#: (``(B, H, L, E)``, torch's) or after them (``(B, L, H, E)``, FlashAttention's and transformers' outputs).
LAYOUTS = ("bhld", "blhd")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIZES = ("quick", "full")


@dataclass(frozen=True)
class _Sizes:
    """The sizes of one shape set."""

    B: int
    H: int
    L: int
    S: int
    E: int
    self_length: int  # L == S for the features about self-attention
    gqa: tuple[int, int]  # (H, Hkv)
    mqa: int  # H with Hkv = 1
    varlen_q: tuple[int, ...]
    varlen_k: tuple[int, ...]
    paged_lengths: tuple[int, int]
    block_size: int
    prefill: int  # new queries of a paged prefill step
    sparse_length: int  # L == S of the NSA and MoBA cases
    nsa_heads: tuple[int, int]  # (H, Hkv) of the NSA cases: H // Hkv = 16, as fla's NSA kernels need
    nsa: tuple[int, int, int]  # (block_size, block_counts, window_size)
    moba: tuple[int, int]  # (chunk_size, topk)
    fp8_keys: int  # S of the FP8 cases: one past a tile of 128 keys (two tiles on the medium shapes)


SHAPES: dict[str, _Sizes] = {
    "small": _Sizes(B=2, H=3, L=5, S=7, E=16, self_length=11, gqa=(6, 2), mqa=3, varlen_q=(3, 5, 2),
                    varlen_k=(4, 6, 3), paged_lengths=(9, 5), block_size=4, prefill=3, sparse_length=29,
                    nsa_heads=(32, 2), nsa=(3, 5, 5), moba=(4, 3), fp8_keys=129),
    "medium": _Sizes(B=2, H=5, L=61, S=97, E=64, self_length=127, gqa=(8, 2), mqa=5, varlen_q=(37, 61, 13),
                     varlen_k=(41, 67, 29), paged_lengths=(211, 67), block_size=16, prefill=17, sparse_length=127,
                     nsa_heads=(32, 2), nsa=(8, 6, 16), moba=(16, 3), fp8_keys=257),
}


@dataclass
class Problem:
    """What an adapter's call gets: one case's inputs, in the adapter's layout, and its arguments.

    The tensors are in the layout the adapter asked for (``"bhld"``: ``(B, H, L, E)``;
    ``"blhd"``: ``(B, L, H, E)``), contiguous, and require gradients in the
    ``bwd`` cases. Every feature of the case is given in two forms: plain fields
    (``causal``, ``window``, ``softcap``, ...) for a kernel with arguments of its
    own, and FlexAttention-style functions (``score_mod``, ``mask_mod``) that hold
    all of them but ``attn_mask`` and ``sinks``; `dense_mask` materialises every
    boolean condition for a kernel that takes only a mask. A field the case does
    not use is ``None``.

    Attributes:
        layout: ``"bhld"`` or ``"blhd"``.
        query: ``(B, H, L, E)`` / ``(B, L, H, E)``; packed ``(H, T, E)`` / ``(T, H, E)``
            in the varlen cases; ``(B, H, Lq, E)`` / ``(B, Lq, H, E)`` new queries in
            the paged cases.
        key: ``(B, Hkv, S, E)`` / ``(B, S, Hkv, E)``; packed in the varlen cases; in
            the paged cases the pool ``(num_blocks, Hkv, block_size, E)`` /
            ``(num_blocks, block_size, Hkv, E)`` (vLLM's and FlashAttention's).
        value: like ``key``, with ``Ev``.
        attn_mask: bool (``True`` = takes part, the opposite of
            ``torch.nn.MultiheadAttention``) or float (added), broadcastable to
            ``(B, H, L, S)``, always with heads before positions.
        causal: ``None``, ``"top_left"`` (torch) or ``"bottom_right"`` (FlashAttention).
        scale: ``None`` (meaning ``1 / sqrt(E)``) or the scale to use.
        enable_gqa: ``Hkv < H``.
        window: ``(left, right)`` keys before and after the query's own position.
        chunk_size: the chunk length of chunked attention.
        document_ids: ``(B, L)`` int64, the document of each position (keys too).
        softcap: the cap of ``cap * tanh(score / cap)``.
        alibi_slopes: ``(H,)`` float32, ALiBi's slopes (`attention_ref.mods.alibi_slopes`).
        sinks: ``(H,)`` float32 learned sink logits.
        cu_seqlens_q: ``(n + 1,)`` int32 cumulative query lengths (varlen).
        cu_seqlens_k: ``(n + 1,)`` int32 cumulative key lengths (varlen).
        max_seqlen_q: the longest query sequence (varlen).
        max_seqlen_k: the longest key sequence (varlen).
        block_table: ``(B, max_blocks)`` int32 (paged).
        cache_seqlens: ``(B,)`` int32 valid keys per sequence, new ones included (paged).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``: softcap, then ALiBi.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)``, ``True`` = takes part: causal,
            window, chunks, documents, varlen's block diagonal, the paged cache's lengths.
        dropout_p: always 0.0.
        block_size: NSA: tokens per block, for compression and selection (fla's ``block_size``).
        block_counts: NSA: blocks selected per query and key/value group, the
            forced ones (first, own, previous) counted.
        window_size: NSA: the sliding window, keys ``t - window_size + 1 .. t``.
        g_cmp: NSA: ``(B, H, L)`` / ``(B, L, H)`` (fla's ``[B, T, H]``) in the case's
            dtype, the compressed branch's gate after the sigmoid; here 0 or 1.
        g_slc: NSA: the selected branch's gate, the same.
        g_swa: NSA: the sliding-window branch's gate, the same. One of the three is 1
            per query head and token.
        moba_chunk_size: MoBA: keys per chunk (MoonshotAI's ``moba_chunk_size``).
        moba_topk: MoBA: chunks per query, the own chunk counted (``moba_topk``, at least 2).
        q_descale: FP8: float32 ``(B, Hkv)``, one per (batch, KV group of query
            heads): FlashAttention-3's layout. ``query``, ``key`` and ``value`` are
            then ``torch.float8_e4m3fn``, the quantized values.
        k_descale: FP8: float32 ``(B, Hkv)``.
        v_descale: FP8: float32 ``(B, Hkv)``.
        output_dtype: FP8: the dtype the output is expected in (the case's dtype).
    """

    layout: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    causal: str | None = None
    scale: float | None = None
    enable_gqa: bool = False
    window: tuple[int, int] | None = None
    chunk_size: int | None = None
    document_ids: torch.Tensor | None = None
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    block_table: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
    score_mod: mods.ScoreMod | None = None
    mask_mod: mods.MaskMod | None = None
    dropout_p: float = 0.0
    block_size: int | None = None
    block_counts: int | None = None
    window_size: int | None = None
    g_cmp: torch.Tensor | None = None
    g_slc: torch.Tensor | None = None
    g_swa: torch.Tensor | None = None
    moba_chunk_size: int | None = None
    moba_topk: int | None = None
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    output_dtype: torch.dtype | None = None
    _mask_shape: tuple[int, int, int, int] = field(default=(1, 1, 1, 1), repr=False)
    _mask_beyond_causal: bool = field(default=False, repr=False)

    @property
    def is_causal(self) -> bool:
        """torch's ``is_causal``: causal and aligned top-left."""
        return self.causal == "top_left"

    @property
    def needs_mask(self) -> bool:
        """Whether anything but top-left causal restricts the keys: an ``attn_mask``, or a
        condition of ``mask_mod`` other than ``is_causal`` (a window, bottom-right causal, ...)."""
        return self.attn_mask is not None or self._mask_beyond_causal

    @property
    def resolved_scale(self) -> float:
        """``scale``, or ``1 / sqrt(E)`` when it is ``None``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.query.shape[-1])

    def dense_mask(self, fill: float | None = None) -> torch.Tensor | None:
        """Every boolean condition of the case in one tensor, ``(B|1, H|1, L, S)``; ``None`` if there is none.

        The conditions are ``attn_mask`` and ``mask_mod`` (causal, window, chunks,
        documents; not the score mods, not the sinks). With ``fill=None`` and a
        boolean or absent ``attn_mask`` the result is boolean (``True`` = takes
        part); otherwise it is float in the query's dtype: ``attn_mask``'s values
        (0 without one) where the pair takes part and ``fill`` (``-inf`` when
        ``None``) where it does not. Transformers' eager convention is
        ``fill=torch.finfo(dtype).min``, which gives a row with no key uniform
        weights instead of 0.
        """
        B, H, L, S = self._mask_shape
        keep = None  # bool, broadcastable to (B, H, L, S)
        if self.mask_mod is not None:
            keep = mods.create_mask(self.mask_mod, B, H, L, S, device=self.query.device)  # (B, H, L, S)
        bias = None
        if self.attn_mask is not None and self.attn_mask.dtype == torch.bool:
            keep = self.attn_mask if keep is None else keep & self.attn_mask  # broadcasts
        elif self.attn_mask is not None:
            bias = self.attn_mask.to(self.query.dtype)
        if keep is None and bias is None:
            return None
        if bias is None and fill is None:
            return keep
        minus_inf = float("-inf")
        if bias is None:
            bias = torch.zeros((), dtype=self.query.dtype, device=self.query.device)
        if keep is not None:
            bias = torch.where(keep, bias, minus_inf)  # broadcasts to both shapes
        if fill is not None:
            bias = bias.masked_fill(bias == minus_inf, fill)
        return bias


@dataclass(frozen=True)
class Scenario:
    """One feature (or combination) on fixed sizes: a name, what it needs, how to build it."""

    name: str
    features: frozenset[str]
    build: Callable[[_Sizes, torch.Generator], dict] = field(repr=False, compare=False)
    low_precision_in_quick: bool = False  # also run in float16 and bfloat16 in the quick matrix
    backward: bool = True  # has a bwd direction (not the paged cache: decoding has no backward)
    description: str = ""
    family: str = "attention"  # or one of FAMILIES, whose cases only the adapters claiming it run


@dataclass(frozen=True)
class Case:
    """One scenario in one dtype, direction and shape set; ``id`` names it for good."""

    scenario: Scenario
    dtype: torch.dtype
    backward: bool
    shape: str

    @property
    def id(self) -> str:
        """``"<scenario>-<dtype>-<fwd|bwd>-<shape>"``, e.g. ``"causal_bottom_right-float16-bwd-small"``."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.scenario.name}-{dtype}-{'bwd' if self.backward else 'fwd'}-{self.shape}"

    @property
    def features(self) -> frozenset[str]:
        """The features an adapter needs for this case (``"backward"`` in the bwd cases)."""
        return self.scenario.features | ({"backward"} if self.backward else frozenset())

    @property
    def seed(self) -> int:
        """The inputs' seed: the CRC-32 of the id, the same on every machine."""
        return zlib.crc32(self.id.encode())

    def build(self, device: torch.device | str = "cpu") -> Inputs:
        """The case's inputs and arguments in the canonical layout (heads before positions)."""
        generator = torch.Generator().manual_seed(self.seed)
        spec = self.scenario.build(SHAPES[self.shape], generator)
        return Inputs.from_spec(spec, self.dtype, torch.device(device))


@dataclass
class Inputs:
    """A case made concrete, heads before positions: what the reference and the adapter see."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    arguments: dict  # the Problem's fields other than the tensors and the layout
    reference_kwargs: dict  # the checker's attention arguments
    mask_shape: tuple[int, int, int, int]
    paged: dict | None = None  # the paged cases' key/value pools (key and value are the dense copies)
    # NSA: the key and value the checker's one attention reads (the keys, then the compressed keys)
    judged_key_value: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_spec(cls, spec: dict, dtype: torch.dtype, device: torch.device) -> Inputs:
        """The tensors of a scenario's spec in ``dtype`` on ``device``, its features as mods and arguments."""
        spec = dict(spec)
        to = {"dtype": dtype, "device": device}
        fp8 = spec.get("q_descale") is not None  # FP8 inputs stay as quantized; the dtype is the output's
        query, key, value = (spec.pop(name).to(device) if fp8 else spec.pop(name).to(**to)
                             for name in ("query", "key", "value"))
        mask = spec.pop("attn_mask", None)
        if mask is not None:
            mask = mask.to(device=device, dtype=mask.dtype if mask.dtype == torch.bool else dtype)
        judged_as = spec.pop("judged_as", None)  # a family's form as one attention the checker judges
        args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in spec.items()}
        for name in GATES:  # NSA's gates in the inputs' dtype, as its kernels take them
            if args.get(name) is not None:
                args[name] = args[name].to(dtype)
        if fp8:
            args["output_dtype"] = dtype
        paged = args.pop("paged", None)
        mask_shape = args.pop("mask_shape")
        causal = args.get("causal")
        H = query.shape[-3]

        score_mods = []
        if args.get("softcap") is not None:
            score_mods.append(mods.softcap(args["softcap"]))
        if args.get("alibi_slopes") is not None:
            score_mods.append(mods.alibi(H))
        # a mod that reads the case's index tensors is made from them on ``device``: one made
        # on the CPU would index CPU tensors with the kernel's device indices
        mask_mods = [args.pop("mask_mod_from")(args)] if "mask_mod_from" in args else []
        L, S = mask_shape[-2:]
        if causal == "bottom_right" and args.get("cu_seqlens_q") is None and paged is None:
            mask_mods.append(mods.causal(offset=S - L))
        if args.get("window") is not None:
            mask_mods.append(mods.sliding_window(*args["window"]))
        if args.get("chunk_size") is not None:
            mask_mods.append(mods.chunked(args["chunk_size"]))
        if args.get("document_ids") is not None:
            mask_mods.append(mods.document(args["document_ids"]))
        score_mod = score_mods[0] if len(score_mods) == 1 else (mods.compose(*score_mods) if score_mods else None)
        mask_mod = mask_mods[0] if len(mask_mods) == 1 else (mods.and_masks(*mask_mods) if mask_mods else None)
        # The Problem's mask_mod holds causal whatever its alignment; the reference takes top-left as is_causal.
        problem_mask_mod = mask_mod
        if causal == "top_left" and args.get("cu_seqlens_q") is None:
            top_left = mods.causal()
            problem_mask_mod = top_left if mask_mod is None else mods.and_masks(top_left, mask_mod)
        args.update(attn_mask=mask, score_mod=score_mod, mask_mod=problem_mask_mod)

        reference = {
            "attn_mask": mask,
            "is_causal": causal == "top_left" and args.get("cu_seqlens_q") is None,
            "scale": args.get("scale"),
            "enable_gqa": bool(args.get("enable_gqa")),
            "score_mod": score_mod,
            "mask_mod": mask_mod,
            "sinks": args.get("sinks"),
        }
        judged_key_value = None
        if judged_as is not None:
            judged_key, judged_value, more = judged_as(query, key, value, args)
            reference.update(more)
            if judged_key is not key or judged_value is not value:
                judged_key_value = (judged_key, judged_value)
        if paged is not None:
            paged = {k: (v.to(**to) if v.is_floating_point() else v.to(device)) for k, v in paged.items()}
        return cls(query, key, value, args, {k: v for k, v in reference.items() if v is not None and v is not False},
                   mask_shape, paged, judged_key_value)

    def problem(self, layout: str, requires_grad: bool) -> Problem:
        """The adapter's view: tensors in ``layout``, fresh leaves (with gradients when asked)."""
        def leaf(t: torch.Tensor) -> torch.Tensor:
            return to_layout(t, layout).detach().clone().requires_grad_(requires_grad)

        arguments = dict(self.arguments)
        for name in GATES:  # (B, H, L) -> (B, L, H) in "blhd": heads after positions, as in the tensors
            if arguments.get(name) is not None and layout == "blhd":
                arguments[name] = arguments[name].transpose(-2, -1).contiguous()
        if arguments.get("sinks") is not None:  # a leaf too: its gradient is judged in the bwd cases
            arguments["sinks"] = arguments["sinks"].detach().clone().requires_grad_(requires_grad)

        key, value = self.key, self.value
        if self.paged is not None:  # the pools, not the dense copies
            key, value = self.paged["key_pool"], self.paged["value_pool"]
        beyond = self.reference_kwargs.get("mask_mod") is not None
        return Problem(layout, leaf(self.query), leaf(key), leaf(value), _mask_shape=self.mask_shape,
                       _mask_beyond_causal=beyond, **arguments)


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``(..., H, L, E)`` <-> ``(..., L, H, E)``: swap dims -3 and -2 for ``"blhd"``; contiguous."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return t if layout == "bhld" else t.transpose(-3, -2).contiguous()


# --- the scenarios ------------------------------------------------------------------------------------
# Each builder ``_<scenario>(z, g)`` makes the tensors and keywords of the scenario of that name (the table
# `SCENARIOS` below pairs them) from the case's sizes ``z`` (a `_Sizes`) and a seeded generator ``g``.


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _qkv(z: _Sizes, g: torch.Generator, *, H: int | None = None, Hkv: int | None = None, L: int | None = None,
         S: int | None = None, Ev: int | None = None) -> dict:
    H = z.H if H is None else H
    Hkv = H if Hkv is None else Hkv
    L = z.L if L is None else L
    S = z.S if S is None else S
    Ev = z.E if Ev is None else Ev
    return {
        "query": _randn(g, z.B, H, L, z.E),
        "key": _randn(g, z.B, Hkv, S, z.E),
        "value": _randn(g, z.B, Hkv, S, Ev),
        "enable_gqa": Hkv != H,
        "mask_shape": (z.B, H, L, S),
    }


def _random_keep(g: torch.Generator, shape: tuple[int, ...], p: float = 0.6) -> torch.Tensor:
    """A random boolean mask where every row keeps at least one key (key ``i % S`` of row ``i``)."""
    keep = torch.rand(*shape, generator=g) < p
    L, S = shape[-2:]
    keep[..., torch.arange(L), torch.arange(L) % S] = True
    return keep


def _float_mask(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A float mask: an N(0, 1) bias, and ``-inf`` on about a fifth of the pairs (never a whole row)."""
    bias = _randn(g, *shape)
    return bias.masked_fill(~_random_keep(g, shape, p=0.8), float("-inf"))


def _qkv_square(z: _Sizes, g: torch.Generator, **kw) -> dict:
    """`_qkv` with as many queries as keys (``L == S``, the sizes' self-attention length)."""
    return _qkv(z, g, L=z.self_length, S=z.self_length, **kw)


def _plain(z, g):
    return _qkv(z, g)


def _self_attention(z, g):
    return _qkv_square(z, g)


def _scale(z, g):
    return {**_qkv(z, g), "scale": 0.3}


def _value_dim(z, g):
    return _qkv(z, g, Ev=z.E // 2)


def _gqa(z, g):
    H, Hkv = z.gqa
    return {**_qkv(z, g, H=H, Hkv=Hkv), "causal": "top_left"}


def _gqa_bottom_right(z, g):
    H, Hkv = z.gqa
    return {**_qkv(z, g, H=H, Hkv=Hkv), "causal": "bottom_right"}  # L < S: FlashAttention's causal=True


def _mqa(z, g):
    return _qkv(z, g, H=z.mqa, Hkv=1)


def _key_padding(z, g):
    lengths = torch.tensor([z.S, z.S // 2 + 1])
    keep = torch.arange(z.S) < lengths[:, None]  # (B, S)
    return {**_qkv(z, g), "attn_mask": keep[:, None, None, :]}  # (B, 1, 1, S)


def _bool_mask(z, g):
    return {**_qkv(z, g), "attn_mask": _random_keep(g, (z.B, z.H, z.L, z.S))}


def _bool_mask_batch1(z, g):
    return {**_qkv(z, g), "attn_mask": _random_keep(g, (1, 1, z.L, z.S))}


def _float_mask_per_head(z, g):
    return {**_qkv(z, g), "attn_mask": _float_mask(g, (z.B, z.H, z.L, z.S))}


def _float_mask_shared_heads(z, g):
    return {**_qkv(z, g), "attn_mask": _float_mask(g, (z.B, 1, z.L, z.S))}


def _float_mask_batch1(z, g):
    return {**_qkv(z, g), "attn_mask": _float_mask(g, (1, 1, z.L, z.S))}


def _empty_rows(z, g):
    keep = _random_keep(g, (z.B, z.H, z.L, z.S))
    keep[0, 0, 1] = False  # one query of one head
    keep[1, :, -1] = False  # the last query of batch entry 1, every head
    return {**_qkv(z, g), "attn_mask": keep}


def _causal(z, g):
    return {**_qkv(z, g), "causal": "top_left"}  # L < S: alignment matters


def _causal_bool_mask(z, g):
    return {**_qkv(z, g), "causal": "top_left", "attn_mask": _random_keep(g, (z.B, z.H, z.L, z.S), p=0.8)}


def _causal_bottom_right(z, g):
    return {**_qkv(z, g), "causal": "bottom_right"}  # L < S


def _causal_bottom_right_tall(z, g):
    return {**_qkv(z, g, L=z.S, S=z.L), "causal": "bottom_right"}  # L > S: the first L - S rows see no key


def _sliding_window(z, g):
    return {**_qkv_square(z, g), "window": (3, 0)}


def _sliding_window_both_sides(z, g):
    return {**_qkv_square(z, g), "window": (2, 3)}


def _chunked(z, g):
    return {**_qkv_square(z, g), "chunk_size": 4, "causal": "top_left"}


def _document(z, g):
    n = z.self_length
    starts = torch.stack([torch.randperm(n - 1, generator=g)[:2].sort().values + 1 for _ in range(z.B)])  # (B, 2)
    ids = (torch.arange(n)[None, :, None] >= starts[:, None, :]).sum(-1)  # (B, L): 3 documents per row
    return {**_qkv_square(z, g), "document_ids": ids}


def _softcap(z, g):
    spec = _qkv(z, g)
    spec["query"] = spec["query"] * 3.0  # scores of size ~3, so that a cap of 1.5 bends them
    return {**spec, "softcap": 1.5}


def _alibi(z, g):
    return {**_qkv_square(z, g), "alibi_slopes": mods.alibi_slopes(z.H), "causal": "top_left"}


def _sinks(z, g):
    spec = _qkv(z, g)
    return {**spec, "sinks": _randn(g, z.H) + 1.0}


def _varlen(lengths_q: tuple[int, ...], lengths_k: tuple[int, ...], causal: bool, z: _Sizes,
            g: torch.Generator) -> dict:
    H, Hkv = z.gqa
    Tq, Tk = sum(lengths_q), sum(lengths_k)
    cu_q, cu_k = cu_seqlens_from_lengths(list(lengths_q)), cu_seqlens_from_lengths(list(lengths_k))
    return {
        "query": _randn(g, H, Tq, z.E),  # (H, T, E), packed
        "key": _randn(g, Hkv, Tk, z.E),
        "value": _randn(g, Hkv, Tk, z.E),
        "enable_gqa": True,
        "mask_shape": (1, H, Tq, Tk),
        "causal": "top_left" if causal else None,  # each sequence is square when causal
        "cu_seqlens_q": cu_q.to(torch.int32),
        "cu_seqlens_k": cu_k.to(torch.int32),
        "max_seqlen_q": max(lengths_q),
        "max_seqlen_k": max(lengths_k),
        "mask_mod_from": lambda a: varlen_mask_mod(a["cu_seqlens_q"], a["cu_seqlens_k"], is_causal=causal),
    }


def _varlen_cross(z, g):
    return _varlen(z.varlen_q, z.varlen_k, False, z, g)


def _varlen_causal(z, g):
    return _varlen(z.varlen_q, z.varlen_q, True, z, g)


def _paged(Lq: int, causal: bool, z: _Sizes, g: torch.Generator) -> dict:
    """A paged cache: the sequences' blocks scattered over a larger pool in a random order."""
    lengths = torch.tensor(z.paged_lengths)
    B, H, bs, S = len(z.paged_lengths), z.H, z.block_size, max(z.paged_lengths)
    query = _randn(g, B, H, Lq, z.E)
    dense_k, dense_v = _randn(g, B, H, S, z.E), _randn(g, B, H, S, z.E)
    blocks = [math.ceil(n / bs) for n in z.paged_lengths]
    num_blocks = sum(blocks) + 3  # a few blocks nobody uses
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(B, max(blocks), dtype=torch.int32)
    key_pool = _randn(g, num_blocks, H, bs, z.E) * 100  # stale data where no sequence writes
    value_pool = _randn(g, num_blocks, H, bs, z.E) * 100
    used = 0
    for b, n in enumerate(z.paged_lengths):
        for i in range(blocks[b]):
            block = int(order[used])
            used += 1
            table[b, i] = block
            rows = slice(i * bs, min((i + 1) * bs, n))
            width = rows.stop - rows.start
            key_pool[block, :, :width] = dense_k[b, :, rows]
            value_pool[block, :, :width] = dense_v[b, :, rows]
    valid = torch.arange(S) < lengths[:, None]  # (B, S)
    dense_k = dense_k * valid[:, None, :, None]  # zeros past each length, so nothing stale is judged
    dense_v = dense_v * valid[:, None, :, None]

    def paged_cache_mask_mod_from(args: dict):
        cache_seqlens = args["cache_seqlens"]  # (B,) on the case's device

        def paged_cache_mask_mod(b, h, q_idx, kv_idx):
            n = cache_seqlens[b]
            keep = kv_idx < n
            return keep & (kv_idx <= q_idx + n - Lq) if causal else keep

        return paged_cache_mask_mod

    return {
        "query": query,
        "key": dense_k,
        "value": dense_v,
        "mask_shape": (B, H, Lq, S),
        "causal": "bottom_right" if causal else None,
        "block_table": table,
        "cache_seqlens": lengths.to(torch.int32),
        "mask_mod_from": paged_cache_mask_mod_from,
        "paged": {"key_pool": key_pool, "value_pool": value_pool},
    }


def _paged_decode(z, g):
    return _paged(1, False, z, g)


def _paged_prefill(z, g):
    return _paged(z.prefill, True, z, g)


# --- the families' scenarios (attention_ref.conformance.families: the ranks, what each is judged as) ----


def _nsa(z, g):
    """NSA on ``H // Hkv = 16`` heads per group (fla's kernels need a power of 2, at least 16), one branch per row."""
    H, Hkv = z.nsa_heads
    block_size, block_counts, window_size = z.nsa
    L = z.sparse_length
    signs = torch.ones(H)
    signs[:: H // Hkv] = -0.25  # the first query head of each group ranks the blocks the other way, faintly
    step = 3 * math.sqrt(z.E) / (-(-L // block_size) - 1)  # the scaled scores of the levels span 3
    query, key = ranked_query_key(g, z.B, H, Hkv, L, z.E, block_size, signs, step)
    branch = torch.randint(3, (z.B, H, L), generator=g)  # 0: compressed, 1: selected, 2: sliding window
    gates = {name: (branch == i).float() for i, name in enumerate(GATES)}  # (B, H, L) each, 0 or 1
    return {"query": query, "key": key, "value": _randn(g, z.B, Hkv, L, z.E), "enable_gqa": True,
            "mask_shape": (z.B, H, L, L), "block_size": block_size, "block_counts": block_counts,
            "window_size": window_size, **gates, "judged_as": nsa_as_attention}


def _moba(H: int, Hkv: int, z: _Sizes, g: torch.Generator) -> dict:
    chunk_size, topk = z.moba
    L = z.sparse_length
    signs = torch.randint(2, (z.B, H), generator=g) * 2.0 - 1.0  # each query head prefers high or low levels
    query, key = ranked_query_key(g, z.B, H, Hkv, L, z.E, chunk_size, signs, math.sqrt(z.E) / 2)
    return {"query": query, "key": key, "value": _randn(g, z.B, Hkv, L, z.E), "enable_gqa": Hkv != H,
            "mask_shape": (z.B, H, L, L), "moba_chunk_size": chunk_size, "moba_topk": topk,
            "judged_as": moba_as_attention}


def _moba_heads(z, g):
    return _moba(z.H, z.H, z, g)


def _moba_gqa(z, g):
    return _moba(*z.gqa, z, g)  # each query head gates with its key head's chunk means


def _fp8(causal: bool, z: _Sizes, g: torch.Generator) -> dict:
    """e4m3fn inputs with FlashAttention-3's descales: ``(B, Hkv)`` for Q (one per KV group), K and V.

    KV head ``h``'s queries and values are ``10^(1.5 h)`` times larger and its
    keys as much smaller (the scores unchanged), so the descales differ between
    KV heads; keys are 3 times larger than values, so K's and V's descales differ.
    """
    H, Hkv = z.gqa
    S = z.fp8_keys
    L = S if causal else z.L
    magnitude = 10.0 ** (1.5 * torch.arange(Hkv, dtype=torch.float64)).reshape(Hkv, 1, 1)  # (Hkv, 1, 1)
    query = _randn(g, z.B, H, L, z.E).double() * magnitude.repeat_interleave(H // Hkv, dim=0)
    key = 1.5 * _randn(g, z.B, Hkv, S, z.E).double() / magnitude
    value = (0.5 * _randn(g, z.B, Hkv, S, z.E).double() + 0.25) * magnitude
    q8, q_descale = quant.quantize_fp8(query, "e4m3fn", granularity="batch_kvhead", kv_heads=Hkv)
    k8, k_descale = quant.quantize_fp8(key, "e4m3fn", granularity="batch_head")
    v8, v_descale = quant.quantize_fp8(value, "e4m3fn", granularity="batch_head")
    return {"query": quant.to_torch_float8(q8), "key": quant.to_torch_float8(k8), "value": quant.to_torch_float8(v8),
            "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale, "enable_gqa": True,
            "mask_shape": (z.B, H, L, S), "causal": "top_left" if causal else None}


def _fp8_decode(z, g):
    return _fp8(False, z, g)  # a few queries, S one past a tile of 128 keys


def _fp8_prefill(z, g):
    return _fp8(True, z, g)  # L = S one past a tile, causal


def _scenario(name: str, build: Callable, features: set[str], description: str, **kw) -> Scenario:
    return Scenario(name, frozenset(features), build, description=description, **kw)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    _scenario("plain", _plain, set(), "no mask, L != S", low_precision_in_quick=True),
    _scenario("self_attention", _self_attention, set(), "no mask, L == S"),
    _scenario("scale", _scale, {"scale"}, "scale=0.3"),
    _scenario("value_dim", _value_dim, {"value_dim"}, "Ev = E / 2"),
    _scenario("gqa", _gqa, {"gqa", "causal"}, "grouped-query heads, causal", low_precision_in_quick=True),
    _scenario("gqa_bottom_right", _gqa_bottom_right, {"gqa", "causal_bottom_right"},
              "grouped-query heads, causal bottom-right (a FlashAttention-style kernel's GQA case)"),
    _scenario("mqa", _mqa, {"mqa"}, "one key/value head"),
    _scenario("key_padding", _key_padding, {"key_padding"}, "bool (B, 1, 1, S) key padding"),
    _scenario("bool_mask", _bool_mask, {"bool_mask"}, "bool (B, H, L, S), per head",
              low_precision_in_quick=True),
    _scenario("bool_mask_batch1", _bool_mask_batch1, {"bool_mask"}, "bool (1, 1, L, S), broadcast"),
    _scenario("float_mask", _float_mask_shared_heads, {"float_mask"}, "float (B, 1, L, S) with -inf",
              low_precision_in_quick=True),
    _scenario("float_mask_per_head", _float_mask_per_head, {"float_mask"}, "float (B, H, L, S), per head"),
    _scenario("float_mask_batch1", _float_mask_batch1, {"float_mask"}, "float (1, 1, L, S), broadcast"),
    _scenario("empty_rows", _empty_rows, {"bool_mask", "empty_rows"}, "bool mask with rows of no key"),
    _scenario("causal", _causal, {"causal"}, "top-left, L < S", low_precision_in_quick=True),
    _scenario("causal_bool_mask", _causal_bool_mask, {"causal", "bool_mask"}, "top-left and a bool mask"),
    _scenario("causal_bottom_right", _causal_bottom_right, {"causal_bottom_right"}, "bottom-right, L < S"),
    _scenario("causal_bottom_right_tall", _causal_bottom_right_tall, {"causal_bottom_right", "empty_rows"},
              "bottom-right, L > S: the first L - S rows see no key"),
    _scenario("sliding_window", _sliding_window, {"sliding_window"}, "window (3, 0): causal, 4 keys",
              low_precision_in_quick=True),
    _scenario("sliding_window_both_sides", _sliding_window_both_sides, {"sliding_window"}, "window (2, 3)"),
    _scenario("chunked", _chunked, {"chunked", "causal"}, "chunks of 4, causal"),
    _scenario("document", _document, {"document"}, "3 documents per batch entry"),
    _scenario("softcap", _softcap, {"softcap"}, "cap 1.5 on scores of size ~3", low_precision_in_quick=True),
    _scenario("alibi", _alibi, {"alibi", "causal"}, "ALiBi slopes, causal"),
    _scenario("sinks", _sinks, {"sinks"}, "one learned sink per head"),
    _scenario("varlen", _varlen_cross, {"varlen", "gqa"}, "3 packed sequences, Lq_s != Lk_s, GQA"),
    _scenario("varlen_causal", _varlen_causal, {"varlen", "gqa", "causal"}, "3 packed sequences, causal, GQA",
              low_precision_in_quick=True),
    _scenario("paged_decode", _paged_decode, {"paged"}, "one new token per sequence, shuffled blocks",
              backward=False, low_precision_in_quick=True),
    _scenario("paged_prefill", _paged_prefill, {"paged", "causal_bottom_right"},
              "a few new tokens per sequence, causal bottom-right", backward=False),
    # the families (attention_ref.conformance.families): run by the adapters that claim them, and only by them
    _scenario("nsa", _nsa, {"nsa", "gqa"}, "NSA, 16 query heads per key/value head, one branch on per "
              "query head and token", family="nsa", backward=False, low_precision_in_quick=True),
    _scenario("moba", _moba_heads, {"moba"}, "MoBA, top 3 chunks, the last chunk short", family="moba",
              low_precision_in_quick=True),
    _scenario("moba_gqa", _moba_gqa, {"moba", "gqa"}, "MoBA on grouped key/value heads", family="moba",
              low_precision_in_quick=True),
    _scenario("fp8", _fp8_decode, {"fp8", "gqa"}, "e4m3fn inputs, FlashAttention-3's descales, S one past a tile",
              family="fp8", backward=False, low_precision_in_quick=True),
    _scenario("fp8_causal", _fp8_prefill, {"fp8", "gqa", "causal"}, "e4m3fn inputs, causal, L = S one "
              "past a tile", family="fp8", backward=False, low_precision_in_quick=True),
)}


def matrix(size: str = "quick", families: Collection[str] = ("attention",)) -> list[Case]:
    """The cases of a size, in a fixed order.

    ``"full"``: every scenario in float32, float16 and bfloat16, fwd and bwd, on
    the ``small`` and ``medium`` shapes. ``"quick"``: the ``small`` shapes, every
    scenario in float32 and the core ones also in float16 and bfloat16, fwd and bwd.
    Every quick case is a full case with the same id.

    Args:
        size: ``"quick"`` or ``"full"``.
        families: ``"attention"`` (the attention matrix) and any of `FAMILIES`
            (``"nsa"``, ``"moba"``, ``"fp8"``): the scenarios of these families,
            in `SCENARIOS`' order. An adapter runs ``adapter.families``.

    Raises:
        ValueError: an unknown size or family.

    Examples:
        >>> len(matrix("quick")), len(matrix("quick", ["moba"])), matrix("quick", ["fp8"])[0].id
        (90, 12, 'fp8-float32-fwd-small')
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if isinstance(families, str) or set(families) - {"attention", *FAMILIES}:
        raise ValueError(f"families must be a collection of {['attention', *FAMILIES]}, got {families!r}")
    cases = []
    shapes = ("small",) if size == "quick" else ("small", "medium")
    chosen = [scenario for scenario in SCENARIOS.values() if scenario.family in families]
    for shape in shapes:
        for scenario in chosen:
            quick_low = size == "full" or scenario.low_precision_in_quick
            dtypes = DTYPES.values() if quick_low else (torch.float32,)
            for dtype in dtypes:
                for backward in (False, True) if scenario.backward else (False,):
                    cases.append(Case(scenario, dtype, backward, shape))
    return cases


def by_id(case_id: str) -> Case:
    """The case of an id (any size).

    Raises:
        KeyError: no case has that id.
    """
    for case in matrix("full", ("attention", *FAMILIES)):
        if case.id == case_id:
            return case
    raise KeyError(f"no conformance case has the id {case_id!r}")

