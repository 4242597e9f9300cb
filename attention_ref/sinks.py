r"""Learned attention sinks: one extra logit per query head (or per query) in the softmax's denominator.

gpt-oss, DeepSeek V4, MiMo-V2-Flash and Granite-SWA give each query head ``h`` one
learned number ``s_h``, the *sink*. It is a logit with no value vector: it takes
part in the softmax and then vanishes, so the weights of the real keys sum to less
than 1 and a head can attend to "nothing":

$$
P_{ij} = \frac{e^{S_{ij}}}{\sum_k e^{S_{ik}} + e^{s_h}}, \qquad
O_i = \sum_j P_{ij} V_j, \qquad
\mathrm{lse}_i = \log\Big(\sum_k e^{S_{ik}} + e^{s_h}\Big),
$$

where ``S`` are the scores after ``scale``, the mods and the masks: the sink lives
in that space and is never multiplied by ``scale``. A row with no key gives output
0, weights 0 and ``lse = s_h``. Under grouped-query attention the sink belongs to
the query head.

Inkling 2 goes one step further: its sink is computed from each token's hidden
state, one logit ``s_{h,i}`` per head and query. Every function here takes that
too, as a tensor of two or more dims broadcastable to the rows ``(..., H, L)``
(``(B, H, L)`` for a batch); a one-dimensional ``sinks`` is always ``(H,)``.

Because the sink has no value, it can be added after the attention over the keys
is done: with the sink-free result ``(out, lse)``,

$$
\mathrm{lse}' = \log(e^{\mathrm{lse}} + e^{s_h}), \qquad
\mathrm{out}' = e^{\mathrm{lse} - \mathrm{lse}'}\,\mathrm{out}.
$$

`add_sinks` does exactly this step, once. Whoever merges partial results (split-KV
decoding, ring attention, the tiled path's blocks) merges sink-free parts with
`attention_ref.merge_attention` and adds the sink to the merged result: adding it
to every part counts it once per part.

Its backward is written out, not left to autograd, because it is the formula
kernels implement (FlashAttention 4's ``dsink``): with ``p_i = e^{s_h - lse'_i}``
(the sink's own weight) and ``Δ_i = Σ_d out'_id · dout'_id``,

$$
\frac{\partial\,\mathrm{loss}}{\partial s_h} = \sum_i p_i\,(d\mathrm{lse}'_i - Δ_i),
\qquad
d\mathrm{out} = e^{\mathrm{lse}-\mathrm{lse}'}\, d\mathrm{out}', \qquad
d\mathrm{lse} = p\,Δ + e^{\mathrm{lse}-\mathrm{lse}'}\, d\mathrm{lse}' .
$$

Shapes use the package legend: ``H`` query heads, ``L`` queries, ``Ev`` value size.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from attention_ref._validation import fmt_shape

__all__ = ["add_sinks", "check_sinks", "sink_column"]


def check_sinks(
    sinks: object, heads: int, like: torch.Tensor, name: str = "sinks", rows: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Check sinks against ``heads`` query heads (and the rows they join); returns them.

    Args:
        sinks: the tensor to check: ``(H,)``, one logit per query head, or, where
            ``rows`` is given, any tensor of two or more dims that broadcasts to
            ``rows`` ``(..., H, L)`` without enlarging it: one logit per query
            (Inkling 2 computes ``(B, H, L)`` from the hidden states). Floating
            point, on ``like``'s device, no NaN and no ``+inf`` (``-inf`` is
            allowed: no sink for that head or query).
        heads: ``H``, the size of the query's head dim (dim -3; 1 when the
            query has no leading dims).
        like: a tensor of the call (device).
        name: the argument's name in messages.
        rows: ``(..., H, L)``, the shape of the rows the sinks join; ``None``
            where only one sink per head is taken.

    Raises:
        TypeError: not a tensor, or not floating point.
        ValueError: the wrong shape, another device, NaN or ``+inf``.
    """
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (H,) = ({heads},), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{name} must be floating point (one logit per query head), got {sinks.dtype}")
    if sinks.device != like.device:
        raise ValueError(f"{name} must be on the query's device {like.device}, got {sinks.device}")
    if sinks.dim() >= 2 and rows is not None:
        if _broadcasts_to(sinks.shape, rows):
            return _finite_or_minus_inf(sinks, name, "query")
        raise ValueError(
            f"{name} must have shape (H,) = ({heads},), one logit per query head, or broadcast to the rows "
            f"(..., H, L) = {fmt_shape(rows)}, one per query; got {fmt_shape(sinks.shape)}"
        )
    if tuple(sinks.shape) != (heads,):
        per_query = (f", or broadcast to the rows (..., H, L) = {fmt_shape(rows)}, one per query" if rows is not None
                     else "; this function takes no sink per query")
        raise ValueError(
            f"{name} must have shape (H,) = ({heads},), one logit per query head (dim -3 of the query)"
            f"{per_query}, got {fmt_shape(sinks.shape)}"
        )
    return _finite_or_minus_inf(sinks, name, "head")


def _broadcasts_to(shape: torch.Size, rows: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``rows`` without enlarging it (and has no more dims)."""
    if len(shape) > len(rows):
        return False
    return all(n in (1, m) for n, m in zip(reversed(shape), reversed(rows)))


def _finite_or_minus_inf(sinks: torch.Tensor, name: str, per: str) -> torch.Tensor:
    if sinks.is_meta:  # no values to check (shapes only)
        return sinks
    bad = torch.isnan(sinks) | (sinks == float("inf"))
    if bool(bad.any()):
        shown = sinks.tolist() if sinks.numel() <= 16 else f"{int(bad.sum())} NaN or +inf entries"
        raise ValueError(f"{name} must hold finite logits or -inf (no sink for that {per}), got {shown}")
    return sinks


def heads_of(shape: tuple[int, ...] | torch.Size) -> int:
    """``H``, the head dim of leading dims ``(..., H)``: their last, or 1 when there are none."""
    return shape[-1] if len(shape) else 1


def sink_column(sinks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The sinks laid out along ``rows``' ``(..., H, L)`` dims, in ``rows``' dtype: ``(H, 1)`` for one per head,
    as given (broadcastable to ``(..., H, L)``) for one per query."""
    if sinks.dim() >= 2:
        return sinks.to(rows.dtype)
    return sinks.to(rows.dtype).reshape(-1, 1)  # (H,) -> (H, 1): broadcasts over (..., H, L)


class _AddSinks(torch.autograd.Function):
    """``(out, lse, s) -> (out', lse')`` with the closed-form backward of the module docstring.

    ``out`` ``(..., L, Ev)``, ``lse`` and ``s`` ``(..., L)`` in the compute dtype.
    """

    @staticmethod
    def forward(ctx, out, lse, s):  # type: ignore[override]
        shift = torch.maximum(lse, s)  # (..., L); -inf only where both are -inf
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        total = torch.exp(lse - shift) + torch.exp(s - shift)
        empty = total == 0  # no key and no sink: lse' = -inf, both shares 0
        safe = torch.where(empty, torch.ones_like(total), total)
        new_lse = torch.where(empty, torch.full_like(total, float("-inf")), shift + torch.log(safe))
        # The shares e^{lse - lse'} and e^{s - lse'}, from the differences to the shift and the sum,
        # not from the rounded lse' (float32 rounds an lse of 1e7 by 0.5); 0 on an empty row.
        keys_share = torch.exp(lse - shift) / safe  # the keys' share of the mass
        sink_share = torch.exp(s - shift) / safe  # p: the sink's weight
        new_out = out.to(keys_share.dtype) * keys_share.unsqueeze(-1)  # (..., L, Ev) * (..., L, 1)
        new_out = new_out.to(out.dtype)
        ctx.save_for_backward(new_out, keys_share, sink_share)
        return new_out, new_lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        new_out, keys_share, sink_share = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(new_out)
        if d_lse is None:
            d_lse = torch.zeros_like(keys_share)
        compute = keys_share.dtype
        delta = (new_out.to(compute) * d_out.to(compute)).sum(dim=-1)  # Δ_i = rowsum(O' * dO'), (..., L)
        grad_out = (d_out.to(compute) * keys_share.unsqueeze(-1)).to(new_out.dtype)
        grad_lse = sink_share * delta + keys_share * d_lse
        grad_sink = sink_share * (d_lse - delta)
        return grad_out, grad_lse, grad_sink


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Add one sink per query head to a finished, sink-free attention result.

    ``out, lse`` is attention over some keys without a sink, as
    ``scaled_dot_product_attention(..., return_lse=True)`` or
    `attention_ref.merge_attention` return it; the result is attention over the
    same keys plus the sink ``exp(sinks[h])`` in every row's denominator (see this
    module's docstring). Apply it once, to the result over all keys: a sink added
    to each part before a merge is counted once per part.

    Args:
        out: ``(..., H, L, Ev)``, sink-free.
        lse: ``(..., H, L)``, its natural-log log-sum-exp (``-inf`` on a row with no key).
        sinks: ``(H,)``, one logit per query head, or broadcastable to ``lse``
            ``(..., H, L)`` with two or more dims, one per query; in the space of
            the scaled scores; ``-inf`` for no sink.

    Returns:
        ``(out', lse')``: ``out'`` in ``out``'s dtype, ``lse'`` (sink-inclusive)
        in ``lse``'s. A row with no key gets ``out' = 0``, ``lse' = sinks[h]``.
        Gradients flow to all three, by the closed form of the module docstring.

    Raises:
        TypeError: non-tensors, or non-float tensors.
        ValueError: shapes that do not fit, tensors on different devices, NaN
            or ``+inf`` in ``sinks``.

    Examples:
        >>> import torch
        >>> from attention_ref import add_sinks, scaled_dot_product_attention as sdpa
        >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
        >>> sinks = torch.tensor([0.5, -1.0])  # H = 2
        >>> out, lse = add_sinks(*sdpa(q, k, v, return_lse=True), sinks)
        >>> ref, ref_lse = sdpa(q, k, v, sinks=sinks, return_lse=True)
        >>> torch.allclose(out, ref, atol=1e-6), torch.allclose(lse, ref_lse, atol=1e-6)
        (True, True)
    """
    for name, value in (("out", out), ("lse", lse)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {value.dtype}")
    if out.dim() < 1 or tuple(out.shape[:-1]) != tuple(lse.shape):
        raise ValueError(
            f"lse must have out's shape without its last dim: out (..., H, L, Ev) = {fmt_shape(out.shape)} "
            f"needs lse {fmt_shape(out.shape[:-1])}, got {fmt_shape(lse.shape)}"
        )
    if out.device != lse.device:
        raise ValueError(f"out and lse must be on one device, got {out.device} and {lse.device}")
    check_sinks(sinks, heads_of(lse.shape[:-1]), lse, rows=tuple(lse.shape))
    # (H,) -> (H, 1), or one per query as given -> (..., H, L); an lse of one dim (L,) has H = 1
    s = sink_column(sinks, lse).expand(lse.shape) if lse.dim() >= 2 else sinks.to(lse.dtype).expand(lse.shape)
    return _AddSinks.apply(out, lse, s)
