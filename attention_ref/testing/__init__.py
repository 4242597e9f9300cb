"""Judge anyone's attention kernel by FlashAttention's rule, one query row at a time.

A kernel in float16 cannot match a float64 reference to ``1e-6``, and a fixed
tolerance per dtype is either too loose for small inputs or too tight for long
sequences. FlashAttention's test suite (Dao-AILab/flash-attention, ``tests/test_flash_attn.py``;
the algorithm: Dao et al. 2022, https://arxiv.org/abs/2205.14135) judges a kernel against
what plain PyTorch achieves in the same precision:

1. ``reference``: attention in float64 (this package's
   `attention_ref.functional.scaled_dot_product_attention`, ``backend="math"``);
2. ``low_precision``: plain PyTorch attention in the inputs' own dtype, with no
   upcasting anywhere (FlashAttention's ``upcast=False``): ``query * scale``
   first, then the product with ``key``, a ``score_mod``, softmax and the product
   with ``value``, all in that dtype. (FlashAttention's suite scales the keys
   instead, ``reorder_ops=True``: ``q @ (k / sqrt(d))``; either way one operand
   is rounded once more before the product);
3. the kernel passes when each error is at most ``factor`` times the baseline's,
   plus ``atol``.

FlashAttention takes one maximum over the whole tensor (``bound="global"`` here).
That single bound lets one bad row speak for all of them: a row the baseline
cannot compute (float16 rounding ``s - 65504`` to a constant, an overflowing
score) gives every position an allowance of its own size, and a kernel off by
0.4 everywhere passes. So the default, ``bound="row"``, gives each row ``r`` (a
query position for the output, ``dq`` and ``lse``; a key position for ``dk`` and
``dv``) its own allowance, from its own baseline error ``e_r = max_r|low - ref|``:

``max_r|actual - ref| <= factor * max(e_r, F_r) + atol``,
``F_r = max(min(max(T, R * m_r), max_healthy e), U_r)``

where ``m_r = max_r|ref|`` is the row's magnitude and ``T`` and ``R`` are the
90th percentiles of the healthy rows' ``e_r`` and ``e_r / m_r``. A row's ``e_r``
is the largest of a few rounding errors, a noisy estimate (a baseline that rounds
luckily on one row would demand the impossible there); the floor ``F_r`` is the
typical error in absolute terms and at the row's scale, which a minority of bad
rows cannot move, capped at the largest healthy ``e_r``. ``U_r`` is the rounding
any right kernel may make on the row: its sums in any order,
``sqrt(n) * u * sum|terms|`` with the terms' sizes from the exact weights (``u``
float32's unit roundoff, where kernels accumulate), plus its result and the
factors it stores before a product (``P``, ``dS``) rounded to the inputs' dtype.
A row whose exact value cancels to near 0, such as ``dq`` of a query that sees
one key, or whose baseline rounded luckily, can be off by that much in a right
kernel however the baseline's own order rounded it. ``U_r`` is an a priori bound, so the cap does not
apply to it: a float32 baseline whose order happens to be more exact than a tiled
kernel's on every row would otherwise fail the kernel (it did, on two machines).
A row whose baseline is
*degenerate* (not finite, its scores overflowed, or off by a quarter of its own
magnitude and by more than the typical row) has no estimate of its own: it is
held to ``factor * F_r + atol`` alone, and the message says so. So no row is
allowed more than the larger of FlashAttention's global rule and its own rounding term
``factor * U_r + atol``, and most far less.

Float-mask values at or below ``finfo(dtype).min`` count as masked (``-inf``) in
the reference and the baseline alike: that is what transformers' masks mean by
them. A query row that such values alone empty (every key masked, at least one
only by such a finite value) has no agreed output: libraries give 0, the mean of
the values, or the softmax of the masked scores. Its output is not judged beyond
being finite; it is listed in the returned `CheckReport`, and gradients are
checked only with ``grad_output`` zero on it (see `assert_attention_close`).

On a failure, cheap probes (float64 forwards with one planted bug each) name the
likely cause: an inverted boolean mask, the other causal alignment, a
transposed layout, ``scale = 1`` or ``1/E``, GQA heads grouped with ``repeat``
instead of ``repeat_interleave``. `assert_module_close` applies the same rule to
a whole multi-head module against ``torch.nn.MultiheadAttention``.

Where each part lives, one file per idea: ``attention.py`` (`assert_attention_close` and its
argument checks), ``linear.py`` (`assert_linear_attention_close` and its probes), ``low_precision.py``
(`assert_fp8_attention_close`: an FP8 or INT8 kernel against float64 on the dequantized inputs, each
element held to an allowance set in advance from named rounding terms), ``modules.py``
(`assert_module_close`: the module's weights in a float64 ``torch.nn.MultiheadAttention``),
``probes.py`` (the planted bugs that name a likely cause), ``verdict.py`` (the rule applied to each
quantity, the numbers of a failure's message, `CheckReport`), ``rounding.py`` (``U_r``: what any
right kernel may round away on a row), ``baseline.py`` (the low-precision baseline, the float64
reference's arguments, the float-mask convention), ``messages.py`` (positions, rows and dtypes as
the messages write them) and ``arguments.py`` (the options the checkers share). Imports flow down
that list; this file only gathers the public names. `assert_topk_close`, which judges a top-k
selection by its scores, lives beside the indexer it checks (`attention_ref.sparse`) and is gathered
here too, beside the other checkers.

Shapes use the package legend: ``B`` batch, ``H`` query heads, ``Hkv``
key/value heads, ``L`` query length, ``S`` key length, ``E`` query/key size,
``Ev`` value size, ``d`` model width.
"""

from __future__ import annotations

from attention_ref.sparse import assert_topk_close
from attention_ref.testing.attention import assert_attention_close
from attention_ref.testing.linear import assert_linear_attention_close
from attention_ref.testing.low_precision import (
    FP8CheckReport,
    assert_fp8_attention_close,
)
from attention_ref.testing.modules import assert_module_close
from attention_ref.testing.verdict import CheckReport

__all__ = [
    "CheckReport",
    "FP8CheckReport",
    "assert_attention_close",
    "assert_fp8_attention_close",
    "assert_linear_attention_close",
    "assert_module_close",
    "assert_topk_close",
]
