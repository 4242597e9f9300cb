"""A conformance suite any attention kernel can run: who agrees with the reference?

Describe a kernel with a small `Adapter` (its call, its layout, the features it
supports) and the suite runs every case of its matrix that the kernel supports,
each judged by `attention_ref.testing.assert_attention_close` against the
float64 reference, and skips the others with the reason::

    from attention_ref import conformance

    def call(p):  # p: conformance.Problem, the case's tensors in your layout
        return my_attention(p.query, p.key, p.value, causal=p.is_causal, softmax_scale=p.scale)

    adapter = conformance.Adapter("mine", call, layout="blhd", supports={"causal", "scale", "backward"})
    report = conformance.run(adapter, size="quick", progress=True)
    print(report.summary())   # one line; report.table() and report.to_json() for the rest

Or under pytest, one test per case (``-k`` reruns one by its id)::

    pytest --pyargs attention_ref.conformance --attention-impl=package.module:adapter [--full]

The matrix (`attention_ref.conformance.cases`): prime sizes with ``L != S``,
grouped- and multi-query heads, boolean, float and no masks, fully masked rows,
causal aligned top-left (torch) and bottom-right (FlashAttention), sliding
windows, chunked attention, documents, softcap, ALiBi, learned sinks, packed
variable-length sequences, a paged KV cache; float32, float16 and bfloat16;
forward and backward; dropout off. `FEATURES` lists the features by name.

Beside it, three families of kernels with calls of their own
(`attention_ref.conformance.families`): NSA (gates, block counts, a window),
MoBA (chunks and their top-k) and FP8 (e4m3fn inputs with FlashAttention-3's
descales, judged by `attention_ref.testing.assert_fp8_attention_close` with the
adapter's `FP8Path`). An adapter claiming ``"nsa"``, ``"moba"`` or ``"fp8"`` in
its ``supports`` runs those cases instead of the attention matrix::

    adapter = conformance.Adapter("my-fp8", call, supports={"fp8", "gqa", "causal"})

The adapters shipped with the package are in `attention_ref.conformance.shipped`.
"""

from __future__ import annotations

from attention_ref.conformance.adapter import (
    Adapter,
    FP8Path,
    KnownFailure,
    ReproError,
    Unsupported,
    load_adapter,
)
from attention_ref.conformance.cases import (
    FAMILIES,
    FEATURES,
    SCENARIOS,
    Case,
    Problem,
    by_id,
    matrix,
)
from attention_ref.conformance.report import CaseResult, Report, agreement_matrix
from attention_ref.conformance.runner import check, run

__all__ = [
    "FAMILIES",
    "FEATURES",
    "SCENARIOS",
    "Adapter",
    "Case",
    "CaseResult",
    "FP8Path",
    "KnownFailure",
    "Problem",
    "Report",
    "ReproError",
    "Unsupported",
    "agreement_matrix",
    "by_id",
    "check",
    "load_adapter",
    "matrix",
    "run",
]
