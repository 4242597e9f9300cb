r"""Multi-head attention (self and cross), a thin module over the functional core.

$$
\mathrm{head}_h = \mathrm{Attention}(X_q W^Q_h,\; X_k W^K_h,\; X_v W^V_h), \qquad
\mathrm{MHA}(X_q, X_k, X_v) = [\mathrm{head}_1, \dots, \mathrm{head}_H]\, W^O
$$

Shapes: ``B`` batch, ``H`` heads, ``L`` query length, ``S`` key length;
``D = embed_dim / H`` is the per-head size (``E`` and ``Ev`` of the core).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from attention_ref._inputs import check_bool
from attention_ref._validation import (
    check_positive_int,
    check_probability,
    fmt_shape,
    require_module_input,
)
from attention_ref.backends import check_backend
from attention_ref.block_mask import BlockMask
from attention_ref.functional import scaled_dot_product_attention

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    r"""Batch-first multi-head attention, equal to ``torch.nn.MultiheadAttention``.

    Self-attention when ``key`` is ``None``; cross-attention when ``key`` and
    ``value`` come from another sequence (``S != L``, ``kdim``/``vdim`` may
    differ from ``embed_dim``). With ``num_kv_heads < num_heads`` it is
    grouped-query attention (``num_kv_heads=1``: multi-query attention).

    Args:
        embed_dim: model width; the query input size and the output size.
        num_heads: ``H``; must divide ``embed_dim``.
        kdim: key input size; defaults to ``embed_dim``.
        vdim: value input size; defaults to ``embed_dim``.
        num_kv_heads: key/value heads; must divide ``num_heads``. Defaults to ``num_heads``.
        bias: add biases to the four projections.
        dropout: dropout probability on the weights, in training mode only.
        device: where to create the parameters.
        dtype: dtype of the parameters.
        backend: the attention backend, passed to
            `attention_ref.scaled_dot_product_attention` (``"math"``,
            ``"tiled"``, ``"sdpa"``, ``"triton"`` or ``"auto"``; see
            `attention_ref.backends`). Only ``"math"`` (or ``"auto"``, which
            then picks it) can return weights.
        sinks: give each query head a learned sink logit (gpt-oss,
            Granite-SWA; `attention_ref.sinks`): the parameter ``sinks`` of
            shape ``(num_heads,)``, initialised to zeros as Granite-SWA does
            (a sink of 0 adds ``exp(0) = 1`` to every row's denominator, so it
            already takes mass at initialisation; ``-inf`` would be no sink).
            Needs ``backend`` ``"math"``, ``"tiled"`` or ``"auto"``.

    Attributes:
        q_proj, k_proj, v_proj, out_proj: the ``nn.Linear`` projections.
        sinks: the ``(num_heads,)`` ``nn.Parameter`` of sink logits, or
            ``None`` without ``sinks=True`` (then not in the ``state_dict``).

    Raises:
        ValueError: ``embed_dim`` not divisible by ``num_heads``, ``num_heads``
            not divisible by ``num_kv_heads``, dropout outside ``[0, 1)``, an
            unknown ``backend``, or ``sinks=True`` with a backend that takes no
            sinks (the message names it).
        TypeError: ``sinks`` not a bool.

    Examples:
        >>> import torch
        >>> from attention_ref import MultiHeadAttention
        >>> mha = MultiHeadAttention(16, 4)
        >>> x = torch.randn(2, 5, 16)
        >>> out, w = mha(x, return_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: str = "math",
        sinks: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim}, "
                f"num_heads={num_heads}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads, got num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}"
            )
        kdim = embed_dim if kdim is None else check_positive_int("kdim", kdim)
        vdim = embed_dim if vdim is None else check_positive_int("vdim", vdim)
        check_probability("dropout", dropout)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype (the parameters are trained), got {dtype}")
        self.backend = check_backend(backend)
        check_bool("sinks", sinks)
        if sinks and backend not in ("math", "tiled", "auto"):
            raise ValueError(
                f"sinks=True needs backend 'math', 'tiled' or 'auto', got backend={backend!r}, "
                "which takes no learned sinks"
            )
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.kdim, self.vdim, self.dropout = kdim, vdim, float(dropout)
        self.head_dim = embed_dim // num_heads
        kv_width = num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        # One logit per query head; None (and no state_dict entry) without sinks, as nn.Linear's bias.
        self.sinks: nn.Parameter | None
        self.register_parameter("sinks", nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"kdim={self.kdim}, vdim={self.vdim}, dropout={self.dropout}, backend={self.backend!r}, "
            f"sinks={self.sinks is not None}"
        )

    def _check_input(self, name: str, x: object, width: int) -> torch.Tensor:
        return require_module_input(name, x, width, self.q_proj.weight.dtype, self.q_proj.weight.device)

    def _split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads * D) -> (B, T, heads, D) -> (B, heads, T, D)
        return x.view(B, T, heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        is_causal: bool = False,
        return_weights: bool = False,
        average_weights: bool = True,
        score_mod: Callable[..., torch.Tensor] | None = None,
        mask_mod: Callable[..., torch.Tensor] | None = None,
        block_mask: BlockMask | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: ``(B, L, embed_dim)``.
            key: ``(B, S, kdim)``; ``None`` means ``query`` (self-attention).
            value: ``(B, S, vdim)``; ``None`` means ``key``.
            attn_mask: bool ``True`` = takes part (the opposite of
                ``torch.nn.MultiheadAttention``; see
                `attention_ref.masks.from_key_padding_mask`) or float,
                broadcastable to ``(B, H, L, S)``.
            is_causal: top-left aligned causal mask, combined with ``attn_mask``.
            return_weights: also return the attention weights.
            average_weights: average the weights over heads.
            score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, applied to the
                scaled scores of every head (`attention_ref.mods`; ``h`` is the
                query head).
            mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, ``True`` = takes
                part, combined with ``attn_mask`` and ``is_causal``; the module's
                backend must take it (``"sdpa"`` takes no ``score_mod``, see
                `attention_ref.backends`).
            block_mask: a `attention_ref.block_mask.BlockMask` made once for
                ``(B, H, L, S)`` (or ``None`` for ``B``/``H`` it does not depend
                on) by `attention_ref.block_mask.create_block_mask` and shared by
                every layer: its mod masks (``mask_mod`` may be left out, or must
                be that function); the tiled backend skips its empty blocks,
                the others materialise it (see
                `attention_ref.scaled_dot_product_attention`).

        Returns:
            ``(B, L, embed_dim)``, or ``(output, weights)`` with weights
            ``(B, L, S)`` (averaged) or ``(B, H, L, S)`` (per head). With
            ``sinks`` each head's rows of weights sum to less than 1.
        """
        if not isinstance(average_weights, bool):
            raise TypeError(f"average_weights must be a bool, got {type(average_weights).__name__}")
        key = query if key is None else key
        value = key if value is None else value
        query = self._check_input("query", query, self.embed_dim)
        key = self._check_input("key", key, self.kdim)
        value = self._check_input("value", value, self.vdim)
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(
                f"query (B, L, _), key and value (B, S, _) must share B, and key and value S: "
                f"got query {fmt_shape(query.shape)}, key {fmt_shape(key.shape)}, value {fmt_shape(value.shape)}"
            )
        B, L, _ = query.shape
        q = self._split_heads(self.q_proj(query), self.num_heads)  # (B, H, L, D)
        k = self._split_heads(self.k_proj(key), self.num_kv_heads)  # (B, Hkv, S, D)
        v = self._split_heads(self.v_proj(value), self.num_kv_heads)  # (B, Hkv, S, D)
        result = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_kv_heads != self.num_heads,
            return_weights=return_weights,
            backend=self.backend,
            score_mod=score_mod,
            mask_mod=mask_mod,
            sinks=self.sinks,
            block_mask=block_mask,
        )  # (B, H, L, D), with return_weights also (B, H, L, S)
        out, weights = result if return_weights else (result, None)
        out = out.transpose(1, 2).reshape(B, L, self.embed_dim)  # (B, H, L, D) -> (B, L, H * D)
        out = self.out_proj(out)  # (B, L, embed_dim)
        if not return_weights:
            return out
        return out, weights.mean(dim=1) if average_weights else weights  # (B, L, S) or (B, H, L, S)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy a ``torch.nn.MultiheadAttention`` into this class.

        Handles fused (``in_proj_weight``) and separate (``q/k/v_proj_weight``)
        in-projections, bias on or off, ``kdim``/``vdim``, and dropout. The copy is
        always batch first: for a source built with ``batch_first=False``, pass
        ``x.transpose(0, 1)``. Boolean masks must be converted, since PyTorch's are
        ``True`` = ignore: use `attention_ref.masks.from_key_padding_mask`
        and ``~attn_mask``.

        Raises:
            TypeError: ``module`` is not an ``nn.MultiheadAttention``.
            ValueError: ``add_bias_kv=True`` or ``add_zero_attn=True`` (not supported).
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("from_torch does not support add_bias_kv=True or add_zero_attn=True")
        E = module.embed_dim
        ref = module.out_proj.weight
        copy = cls(
            E,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=module.in_proj_bias is not None,
            dropout=module.dropout,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                w_q, w_k, w_v = module.in_proj_weight.chunk(3, dim=0)  # (3E, E) -> 3 x (E, E)
            else:
                w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
            for proj, w in ((copy.q_proj, w_q), (copy.k_proj, w_k), (copy.v_proj, w_v)):
                proj.weight.copy_(w)
            if module.in_proj_bias is not None:
                for proj, b in zip((copy.q_proj, copy.k_proj, copy.v_proj), module.in_proj_bias.chunk(3)):
                    proj.bias.copy_(b)
            copy.out_proj.weight.copy_(module.out_proj.weight)
            if module.out_proj.bias is not None:
                copy.out_proj.bias.copy_(module.out_proj.bias)
        copy.train(module.training)
        return copy
