"""One check per convention, so the same mistake gets the same message from every function.

`attention_ref._validation.check_cu_seqlens` checks cumulative sequence lengths for the packed
paths (`varlen`, `linear`'s ``cu_seqlens=``, `distributed`), and `require_int_tensor` every
integer tensor argument (lengths, document ids, block tables, indptr arrays), and
`require_module_input` a module's input (MultiHeadAttention, MLA, `assert_module_close`). Here the
same wrong argument goes to functions of different modules, and the messages must be equal.
"""

from __future__ import annotations

import pytest
import torch

from attention_ref import linear, masks, mods, varlen
from attention_ref._validation import check_cu_seqlens, require_int_tensor


def _message(call) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    return caught.type, str(caught.value)


def _packed(cu):
    """The same ``cu_seqlens`` to varlen_attention and to the gated delta rule, both over 6 packed tokens."""
    q = torch.randn(6, 2, 4, dtype=torch.float64)  # (total, H, E)
    x = torch.randn(1, 6, 2, 4, dtype=torch.float64)  # (1, L, H, E)
    g, beta = torch.zeros(1, 6, 2, dtype=torch.float64), torch.ones(1, 6, 2, dtype=torch.float64)
    return (lambda: varlen.varlen_attention(q, q, q, cu, torch.tensor([0, 6])),
            lambda: linear.gated_delta_rule(x, x, x, g, beta, cu_seqlens=cu))


@pytest.mark.parametrize("cu, message", [
    (torch.tensor([0.0, 6.0]), "cu_seqlens{} must be an integer tensor (n + 1,), got torch.float32"),
    (torch.tensor([[0, 6]]), "cu_seqlens{} must have shape (n + 1,), got shape (1, 2)"),
    (torch.tensor([1, 6]), "cu_seqlens{} must start at 0, got cu_seqlens{}[0] = 1 ([1, 6])"),
    (torch.tensor([0, 4, 3, 6]), "cu_seqlens{} must be non-decreasing (sequence lengths >= 0), got "
                                 "cu_seqlens{}[1] = 4 > cu_seqlens{}[2] = 3 ([0, 4, 3, 6])"),
])
def test_a_wrong_cu_seqlens_gets_one_message_from_every_packed_path(cu, message):
    packed_attention, delta_rule = _packed(cu)
    error, said = _message(packed_attention)  # varlen names it cu_seqlens_q
    assert said == message.format(*["_q"] * message.count("{}"))
    assert _message(delta_rule) == (error, message.format(*[""] * message.count("{}")))


def test_the_packed_length_is_named_by_each_caller():
    with pytest.raises(ValueError, match=r"^cu_seqlens must end at the packed length L = 6, got cu_seqlens\[-1\] = 5 "):
        check_cu_seqlens("cu_seqlens", torch.tensor([0, 5]), 6, "L")
    assert check_cu_seqlens("cu", [0, 2, 6]).dtype == torch.long  # a list of ints is taken


@pytest.mark.parametrize("call, name, layout", [
    (lambda bad: masks.padding_mask(bad, 4), "lengths", "(B,)"),
    (lambda bad: mods.padding(bad), "lengths", "(B,)"),
    (lambda bad: mods.prefix_lm(bad), "prefix_length", "(B,)"),
    (lambda bad: varlen.cu_seqlens_from_lengths(bad), "lengths", "(B,)"),
])
def test_a_float_or_2d_integer_argument_gets_one_message_everywhere(call, name, layout):
    assert _message(lambda: call(torch.tensor([1.0, 2.0]))) == (
        TypeError, f"{name} must be an integer tensor {layout}, got torch.float32")
    assert _message(lambda: call(torch.tensor([[1, 2]]))) == (
        ValueError, f"{name} must have shape {layout}, got shape (1, 2)")


def test_require_int_tensor_names_shape_device_and_list_mistakes():
    with pytest.raises(ValueError, match=r"^t must have shape \(B,\) = \(3,\), got shape \(2,\)$"):
        require_int_tensor("t", torch.tensor([1, 2]), "(B,)", shape=(3,))
    with pytest.raises(ValueError, match=r"^t must be on the same device as x \(meta\), got cpu$"):
        require_int_tensor("t", torch.tensor([1]), "(B,)", device=torch.device("meta"), device_of="x")
    with pytest.raises(TypeError, match=r"^t must be an integer tensor \(B,\) or a list of ints, got \[1, 2.5\]$"):
        require_int_tensor("t", [1, 2.5], "(B,)", lists=True)
    with pytest.raises(TypeError, match=r"^t must be a torch.Tensor, got list$"):
        require_int_tensor("t", [1, 2], "(B,)")  # a list only where the caller takes one
    assert require_int_tensor("t", torch.tensor([[1]]), "(B, S)", (2,)).shape == (1, 1)


def _modules_of_width_16():
    """Three modules that take (B, seq, 16) float64 inputs: MultiHeadAttention, MLA, and
    assert_module_close checking a MultiHeadAttention (the checker's own input check)."""
    from attention_ref import MultiHeadAttention
    from attention_ref.mla import MultiHeadLatentAttention
    from attention_ref.testing import assert_module_close

    mha = MultiHeadAttention(16, 2, dtype=torch.float64)
    mla = MultiHeadLatentAttention(16, 2, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
                                   v_head_dim=4, dtype=torch.float64)
    return {"MultiHeadAttention": lambda x: mha(x), "MultiHeadLatentAttention": lambda x: mla(x),
            "assert_module_close": lambda x: assert_module_close(mha, x)}


@pytest.mark.parametrize("x, message", [
    ([[0.0] * 16], (TypeError, "{} must be a torch.Tensor, got list")),
    (torch.zeros(2, 3, 15, dtype=torch.float64), (ValueError, "{} must have shape (B, seq, 16), batch first, "
                                                              "got (2, 3, 15)")),
    (torch.zeros(3, 16, dtype=torch.float64), (ValueError, "{} must have shape (B, seq, 16), batch first, got (3, 16)")),
    (torch.zeros(2, 3, 16), (TypeError, "{} must have the module's dtype (torch.float64), got torch.float32")),
], ids=["list", "width", "unbatched", "dtype"])
def test_a_wrong_module_input_gets_one_message_from_every_module(x, message):
    """`require_module_input`: the same wrong input, the same message (naming each module's argument)."""
    kind, text = message
    names = {"MultiHeadAttention": "query", "MultiHeadLatentAttention": "hidden_states", "assert_module_close": "query"}
    for module, call in _modules_of_width_16().items():
        assert _message(lambda: call(x)) == (kind, text.format(names[module])), module
