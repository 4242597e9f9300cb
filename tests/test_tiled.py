"""Tests of attention_ref.tiled: the online-softmax path against the float64 reference.

The reference is ``scaled_dot_product_attention(..., backend="math")`` evaluated in
float64 on the same (rounded) inputs. Block sizes are chosen so they do not divide
``L`` or ``S`` (partial last blocks), and sizes are distinct odd numbers so a swapped
axis changes a shape. The memory bound is checked structurally: every tensor an
aten op produces during forward and backward is recorded, and none may be as large
as one ``(L, S)`` score matrix per head (the same recorder does see one on the math
path, so the check can fail).

Tests that take the ``device`` fixture run on ``--device cuda`` too (tests/conftest.py).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from attention_ref import scaled_dot_product_attention
from attention_ref.tiled import tiled_attention

# (atol, rtol) per dtype for outputs and gradients against the float64 reference.
TOL = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (2e-6, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def _reference(q, k, v, mask, **kw):
    """float64 reference output and gradients for the upstream gradient ``g``."""
    return scaled_dot_product_attention(q, k, v, mask, backend="math", **kw)


def _inputs(shape_q, shape_k, shape_v, dtype, seed, device):
    """q, k, v drawn in float64 on the CPU (the same numbers on every device), then moved and cast."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
        for s in (shape_q, shape_k, shape_v)
    ]


def _check(shape_q, shape_k, shape_v, *, device, mask=None, dtype=torch.float32, block_q=3, block_k=5, seed=0, **kw):
    """Tiled output and gradients (q, k, v and a float mask) equal the float64 reference."""
    q, k, v = _inputs(shape_q, shape_k, shape_v, dtype, seed, device)
    mask = None if mask is None else mask.to(device)
    mask_grad = mask is not None and mask.is_floating_point()
    if mask_grad:
        mask = mask.to(dtype).requires_grad_()
    out = tiled_attention(q, k, v, mask, block_q=block_q, block_k=block_k, **kw)
    assert out.dtype == dtype and out.device == device
    leaves = [q, k, v] + ([mask] if mask_grad else [])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, leaves, g.to(dtype))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_mask = ref_leaves[3] if mask_grad else mask
    ref = _reference(*ref_leaves[:3], ref_mask, **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    for name, got, want in zip("qkvm", grads, ref_grads):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.double(), want, atol=atol * 4, rtol=rtol * 4, msg=lambda m, n=name: f"d{n}: {m}")
    return out


CASES = {
    "plain L<S": dict(shape_q=(2, 3, 7, 5), shape_k=(2, 3, 13, 5), shape_v=(2, 3, 13, 11)),
    "plain L>S": dict(shape_q=(2, 3, 13, 5), shape_k=(2, 3, 7, 5), shape_v=(2, 3, 7, 11)),
    "causal L<S": dict(shape_q=(2, 3, 7, 5), shape_k=(2, 3, 13, 5), shape_v=(2, 3, 13, 11), is_causal=True),
    "causal L>S": dict(shape_q=(3, 13, 5), shape_k=(3, 7, 5), shape_v=(3, 7, 11), is_causal=True),
    "2-D inputs": dict(shape_q=(7, 5), shape_k=(13, 5), shape_v=(13, 3)),
    "broadcast batch": dict(shape_q=(2, 3, 7, 5), shape_k=(3, 13, 5), shape_v=(1, 1, 13, 3), is_causal=True),
    "scale": dict(shape_q=(2, 7, 5), shape_k=(2, 13, 5), shape_v=(2, 13, 3), scale=0.7),
    "gqa": dict(shape_q=(2, 6, 7, 5), shape_k=(2, 2, 13, 5), shape_v=(2, 2, 13, 3), enable_gqa=True),
    "gqa causal": dict(shape_q=(1, 6, 13, 5), shape_k=(1, 3, 11, 5), shape_v=(1, 3, 11, 3), enable_gqa=True, is_causal=True),
    "mqa": dict(shape_q=(2, 5, 7, 3), shape_k=(2, 1, 13, 3), shape_v=(2, 1, 13, 3), enable_gqa=True),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference_without_mask(case, dtype, device):
    _check(**CASES[case], dtype=dtype, device=device)


def _bool_mask(shape, seed, empty_rows=()):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(*shape, generator=gen) > 0.4
    for row in empty_rows:
        mask[..., row, :] = False  # a query row no key may attend to
    return mask


MASKS = {
    "bool (L, S)": lambda: _bool_mask((7, 13), 1),
    "bool (B, 1, L, S) with empty rows": lambda: _bool_mask((2, 1, 7, 13), 2, empty_rows=(0, 4)),
    "key padding (B, 1, 1, S)": lambda: _bool_mask((2, 1, 1, 13), 3),
    "key padding (S,)": lambda: _bool_mask((13,), 4),
    "all keys padded (B, 1, 1, S)": lambda: torch.tensor([True] * 13 + [False] * 13).view(2, 1, 1, 13),
    "float (B, H, L, S)": lambda: torch.randn(2, 3, 7, 13, generator=torch.Generator().manual_seed(5)),
    "float (L, 1)": lambda: torch.randn(7, 1, generator=torch.Generator().manual_seed(6)),
    "float with -inf rows": lambda: torch.randn(3, 7, 13, generator=torch.Generator().manual_seed(7)).index_fill(1, torch.tensor([2, 6]), float("-inf")),
}


@pytest.mark.parametrize("is_causal", [False, True], ids=["mask", "causal+mask"])
@pytest.mark.parametrize("name", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_matches_reference_with_masks(name, is_causal, dtype, device):
    mask = MASKS[name]()
    _check((2, 3, 7, 5), (2, 3, 13, 5), (2, 3, 13, 11), mask=mask, dtype=dtype, is_causal=is_causal, block_q=4,
           block_k=6, device=device)


def test_gqa_with_head_dependent_mask(device):
    # A mask that differs per query head must reach the right head of each group.
    mask = _bool_mask((1, 6, 7, 13), 8, empty_rows=(3,))
    _check((1, 6, 7, 5), (1, 2, 13, 5), (1, 2, 13, 3), mask=mask, enable_gqa=True, dtype=torch.float64, device=device)


def test_fully_masked_rows_are_zero_with_zero_grad(device):
    q, k, v = _inputs((2, 7, 5), (2, 13, 5), (2, 13, 3), torch.float32, 9, device)
    mask = _bool_mask((2, 7, 13), 9, empty_rows=(1, 5)).to(device)
    out = tiled_attention(q, k, v, mask, block_q=2, block_k=4)
    assert torch.equal(out[:, [1, 5]], torch.zeros(2, 2, 3, device=device))
    out.sum().backward()
    assert torch.equal(q.grad[:, [1, 5]], torch.zeros(2, 2, 5, device=device))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_empty_sequences(device):
    q, k, v = (torch.randn(2, n, e, device=device) for n, e in ((7, 5), (0, 5), (0, 3)))
    assert torch.equal(tiled_attention(q, k, v), torch.zeros(2, 7, 3, device=device))  # S = 0: every row empty
    q, k, v = (torch.randn(2, n, e, device=device) for n, e in ((0, 5), (13, 5), (13, 3)))
    assert tiled_attention(q, k, v).shape == (2, 0, 3)


def test_hand_computable_case_one_key_per_block(device):
    # q = [0, sqrt 2], k = I: scores [0, 1] -> weights [1, e] / (1 + e), one key per block.
    q = torch.tensor([[0.0, 2.0**0.5]], dtype=torch.float64, device=device)
    eye = torch.eye(2, dtype=torch.float64, device=device)
    out = tiled_attention(q, eye, eye, block_q=1, block_k=1)
    expected = torch.tensor([[1.0, math.e]], dtype=torch.float64, device=device) / (1 + math.e)
    torch.testing.assert_close(out, expected, atol=1e-15, rtol=0)


def test_rescaling_when_the_running_max_jumps(device):
    # Scores grow by ~1000 from one key block to the next: without the running-max
    # rescaling exp() overflows, and with a stale max the early blocks would dominate.
    q = torch.tensor([[1.0]], dtype=torch.float64, device=device)
    k = torch.tensor([[0.0], [1.0], [500.0], [1000.0], [999.0]], dtype=torch.float64, device=device)
    v = torch.arange(5, dtype=torch.float64, device=device).unsqueeze(-1)
    out = tiled_attention(q, k, v, scale=1.0, block_k=2)
    ref = scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert torch.isfinite(out).all()


class _StepCounter(TorchFunctionMode):
    """Counts the steps of the forward loop: each key block ends in one ``exp2_`` (a lazy attempt
    or an exact step), and only the exact step takes a block's max (``amax``)."""

    def __init__(self) -> None:
        super().__init__()
        self.exp2 = self.amax = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.exp2 += func is torch.Tensor.exp2_
        self.amax += func is torch.Tensor.amax
        return func(*args, **(kwargs or {}))


def _exact_steps(fn) -> int:
    """How many key blocks took the exact step."""
    with _StepCounter() as counter:
        fn()
    return counter.amax


@pytest.mark.parametrize(("jump", "exact_steps"), [(0.0, 1), (20.0, 1), (28.0, 1), (33.0, 2), (200.0, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_lazy_step_keeps_the_old_max_up_to_its_bound(jump, exact_steps, dtype, device):
    # Keys 0-3 score about 0, keys 4-7 about `jump` (in powers of 2, i.e. log2 units after the
    # package's log2(e) factor). While the block's weights against the old max sum to at most
    # 2**_LAZY_GROWTH = 2**32 (4 keys of 2**28 do), they are summed as they are, no second max
    # taken; a larger sum sends the block through the exact step. Both equal the reference.
    gen = torch.Generator().manual_seed(3)
    q = torch.ones(1, 2, dtype=dtype)
    k = torch.randn(8, 2, generator=gen, dtype=torch.float64).to(dtype) * 0.1
    k[4:] += jump * math.log(2.0) / 2  # q . k grows by jump * ln 2 nats = jump powers of 2
    v = torch.randn(8, 3, generator=gen, dtype=dtype)
    q, k, v = q.to(device), k.to(device), v.to(device)
    out = tiled_attention(q, k, v, scale=1.0, block_k=4)
    ref = scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=1.0)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    assert _exact_steps(lambda: tiled_attention(q, k, v, scale=1.0, block_k=4)) == exact_steps


def test_lazy_step_runs_on_every_block_after_the_first(device):
    # Random scores never jump by 2**32: one exact step per query block, every other block lazy.
    q, k, v = (torch.randn(2, n, 8, device=device) for n in (12, 40, 40))
    assert _exact_steps(lambda: tiled_attention(q, k, v, block_q=6, block_k=8)) == 2  # 2 query blocks x 5 key blocks
    assert _exact_steps(lambda: tiled_attention(q, k, v, is_causal=True, block_q=6, block_k=4)) == 2


def test_rows_without_a_key_in_the_first_block_take_exact_steps(device):
    # Left padding: the first key block is masked for query 0, and its remaining scores are about
    # -300 nats: a shift of 0 (the lazy step's value for a row with no max yet) would underflow
    # every weight to 0. Such rows keep the exact step until they have seen a key.
    q = torch.full((2, 1), -1.0, dtype=torch.float64)
    k = torch.linspace(290, 310, 9, dtype=torch.float64).unsqueeze(-1)
    v = torch.randn(9, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    q, k, v, mask = q.to(device), k.to(device), v.to(device), mask.to(device)
    out = tiled_attention(q, k, v, mask, scale=1.0, block_k=3)
    ref = scaled_dot_product_attention(q, k, v, mask, scale=1.0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert _exact_steps(lambda: tiled_attention(q, k, v, mask, scale=1.0, block_k=3)) == 2


def test_no_lazy_attempt_while_a_row_has_seen_no_key(device):
    # Row 1 may attend to no key at all (a padded query). A lazy attempt against its max of -inf
    # could only fail (its shift is +inf) and cost a block's matmul and exp for nothing: every
    # block takes the exact step at once, one exp2 per key block.
    q, k, v = torch.randn(2, 4, device=device), torch.randn(9, 4, device=device), torch.randn(9, 2, device=device)
    mask = torch.ones(2, 9, dtype=torch.bool, device=device)
    mask[1] = False
    with _StepCounter() as counter:
        out = tiled_attention(q, k, v, mask, block_k=3)
    assert (counter.amax, counter.exp2) == (3, 3)
    assert torch.equal(out[1], torch.zeros(2, device=device))
    with _StepCounter() as counter:  # without the padded row: one exact step, then lazy ones
        tiled_attention(q[:1], k, v, mask[:1], block_k=3)
    assert (counter.amax, counter.exp2) == (1, 3)


def test_gradcheck_float64(device):
    gen = torch.Generator().manual_seed(11)
    q, k, v, bias = (
        torch.randn(*shape, dtype=torch.float64, generator=gen).to(device).requires_grad_()
        for shape in ((1, 2, 5, 3), (1, 1, 7, 3), (1, 1, 7, 2), (5, 7))
    )

    def fn(q, k, v, bias):
        return tiled_attention(q, k, v, bias, is_causal=True, enable_gqa=True, block_q=2, block_k=3)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_non_contiguous_inputs(device):
    x = torch.randn(2, 13, 3, 5, device=device)  # (B, S, H, E): heads split like multi-head attention does
    q, k, v = x[:, :7].transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2)
    ref = scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(tiled_attention(q, k, v, is_causal=True, block_q=4, block_k=4), ref, atol=2e-6, rtol=1e-5)


def test_double_backward_is_refused(device):
    # The blockwise backward is not differentiable: a second derivative raises, never silently 0.
    q = torch.randn(1, 7, 5, dtype=torch.float64, device=device, requires_grad=True)
    out = tiled_attention(q, q, q, block_q=3, block_k=3)
    w = torch.randn(out.shape, dtype=torch.float64, device=device, requires_grad=True)
    (g,) = torch.autograd.grad(out, q, w, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(block_q=0), ValueError, r"block_q must be a positive int, got 0"),
        (dict(block_k=-3), ValueError, r"block_k must be a positive int, got -3"),
        (dict(block_k=2.5), TypeError, r"block_k must be an int, got float"),
        (dict(block_q=True), TypeError, r"block_q must be an int, got bool"),
    ],
)
def test_block_size_errors(kwargs, error, match):
    q = torch.randn(7, 5)
    with pytest.raises(error, match=match):
        tiled_attention(q, q, q, **kwargs)


def test_validation_is_the_core_one():
    with pytest.raises(TypeError, match=r"value must be a torch.Tensor, got NoneType"):
        tiled_attention(torch.randn(7, 5), torch.randn(13, 5), None)
    with pytest.raises(ValueError, match=r"query and key must have the same last dim E"):
        tiled_attention(torch.randn(7, 5), torch.randn(13, 3), torch.randn(13, 3))
    with pytest.raises(ValueError, match=r"attn_mask must be broadcastable to \(\.\.\., L, S\) = \(7, 13\)"):
        tiled_attention(torch.randn(7, 5), torch.randn(13, 5), torch.randn(13, 3), torch.ones(7, 12, dtype=torch.bool))


# --- the memory bound, checked structurally -------------------------------------------------


class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor an aten op allocates.

    Views and in-place results share an input's storage and are skipped: they cost
    no memory (slicing the user's ``(L, S)`` mask is free; copying it would not be).
    """

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        shared = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _record(fn, device) -> list[tuple[str, tuple[int, ...]]]:
    B, H, L, S, E = 1, 2, 96, 80, 4
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, H, n, E, generator=gen).to(device).requires_grad_() for n in (L, S, S))
    mask = (torch.rand(L, S, generator=gen) > 0.3).to(device)  # the user's own (L, S) mask: an input, not recorded
    with _ShapeRecorder() as rec:
        out = fn(q, k, v, mask)
        out.backward(torch.ones_like(out))
    return rec.shapes


def test_tiled_never_allocates_a_score_matrix(device):
    block_q, block_k = 16, 32
    shapes = _record(lambda q, k, v, m: tiled_attention(q, k, v, m, is_causal=True, block_q=block_q, block_k=block_k),
                     device)
    H, L, S, E = 2, 96, 80, 4
    largest = max(math.prod(s) for _, s in shapes)
    # Nothing bigger than one block of scores per head or one input: no (L, S) matrix.
    assert largest <= max(H * block_q * block_k, H * L * E), largest
    assert not [s for _, s in shapes if len(s) >= 2 and s[-2] == L and s[-1] == S]
    # The score blocks (the buffers they are written into) respect the block sizes, and there are
    # blocks of exactly that size.
    score_blocks = [s for _, s in shapes if len(s) == 3 and s[-1] not in (1, E)]
    assert score_blocks and all(s[-2] <= block_q and s[-1] <= block_k for s in score_blocks)
    assert (H, block_q, block_k) in score_blocks


def test_the_recorder_sees_the_math_paths_score_matrix(device):
    # The same check fails on the reference path: it is not vacuous.
    shapes = _record(lambda q, k, v, m: scaled_dot_product_attention(q, k, v, m, is_causal=True), device)
    assert [s for _, s in shapes if s[-2:] == (96, 80) and math.prod(s) >= 2 * 96 * 80]


# --- threads chosen per call -------------------------------------------------------------------


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_fitting_threads_leaves_the_cores_other_processes_keep_busy(monkeypatch, two_threads):
    from attention_ref import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_others_running", lambda: 1)
    assert threads.fitting_threads() == 1
    monkeypatch.setattr(threads, "_others_running", lambda: 5)
    assert threads.fitting_threads() == 1  # never fewer than one
    monkeypatch.setattr(threads, "_others_running", lambda: 0)
    assert threads.fitting_threads() is None  # nothing busy: threads as they are
    monkeypatch.undo()
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    readings = iter([3, 2, 3])  # the machine's runnable tasks; this process runs 2 of them
    monkeypatch.setattr(threads, "_runnable", lambda: next(readings))
    monkeypatch.setattr(threads, "_own_running", lambda: 2)
    assert threads.fitting_threads() is None  # a task that passed by in one reading of three does not count
    readings = iter([3, 3, 3])
    assert threads.fitting_threads() == 1
    monkeypatch.setattr(threads, "_others_running", lambda: 1)
    monkeypatch.setattr(threads, "ADAPT_THREADS", False)
    assert threads.fitting_threads() is None

    def unreadable():
        raise OSError("no /proc here")

    monkeypatch.setattr(threads, "ADAPT_THREADS", True)
    monkeypatch.setattr(threads, "_others_running", unreadable)
    assert threads.fitting_threads() is None


def test_a_large_call_runs_forward_and_backward_on_the_fitting_threads(monkeypatch, two_threads):
    from attention_ref import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_others_running", lambda: 1)
    seen = []

    def spy(score, b, h, q_idx, kv_idx):  # runs inside the forward and the backward passes
        seen.append(torch.get_num_threads())
        return score

    n = 2048  # 2048 x 2048 pairs = threads.ADAPT_MIN_PAIRS
    q, k, v = (torch.randn(1, 1, n, 8).requires_grad_() for _ in range(3))
    out = tiled_attention(q, k, v, score_mod=spy, block_q=1024, block_k=1024)
    forward = len(seen)
    out.sum().backward()
    assert seen[0] == 2  # the check of the mod's output, before the pass
    assert forward > 1 and len(seen) > forward and set(seen[1:]) == {1}
    assert torch.get_num_threads() == 2  # restored after each pass
    seen.clear()
    small = [t[..., : n // 2, :] for t in (q, k, v)]
    tiled_attention(*small, score_mod=spy, block_q=1024, block_k=1024)
    assert set(seen) == {2}  # a small call keeps its threads: the check would cost more than it saves
    monkeypatch.setattr(threads, "_others_running", lambda: 0)
    seen.clear()
    tiled_attention(q, k, v, score_mod=spy, block_q=1024, block_k=1024)
    assert set(seen) == {2}


def test_threads_for_names_an_argument_it_cannot_read():
    from attention_ref import threads

    for pairs, device, error, message in [
            ("many", "cpu", TypeError, "pairs must be an int, got str"),
            (-1, "cpu", ValueError, "pairs must be a non-negative int, got -1"),
            (10, "cpux", ValueError, "device must be a device such as 'cpu', 'cuda' or 'cuda:0', got 'cpux'"),
            (10, 1.5, TypeError, "device must be a torch.device or a device string")]:
        with pytest.raises(error, match=re.escape(message)):
            with threads.threads_for(pairs, device):
                pass
    with threads.threads_for(10, "cpu"):  # a name works as the device it names
        pass


def test_the_flag_set_where_it_lived_before_still_turns_the_choice_off(monkeypatch, two_threads):
    """`tiled.ADAPT_THREADS` (its home before attention_ref.threads) reads and sets the one flag: a copy
    would let `tiled.ADAPT_THREADS = False` change nothing, without a word."""
    from attention_ref import threads, tiled

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_others_running", lambda: 1)
    assert tiled.fitting_threads is threads.fitting_threads and tiled.fitting_threads() == 1
    monkeypatch.setattr(tiled, "ADAPT_THREADS", False)
    assert threads.ADAPT_THREADS is False and tiled.fitting_threads() is None
    monkeypatch.undo()
    assert tiled.ADAPT_THREADS is True and threads.ADAPT_THREADS is True


@pytest.mark.skipif(not __import__("os").path.exists("/proc/loadavg"), reason="reads Linux's /proc")
def test_others_running_counts_a_busy_process():
    import subprocess
    import sys
    import time

    from attention_ref import threads

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert max(threads._others_running() for _ in range(5)) >= 1
    finally:
        busy.kill()
        busy.wait()


def test_other_processes_load_is_read_in_pairs_a_few_milliseconds_apart(monkeypatch):
    """Each reading of the machine's runnable tasks is paired with one of this process's own (its OpenMP
    workers may be spinning down meanwhile), and a core counts as busy only if every reading, taken
    `_READING_GAP_S` apart, says so (issue 30: a quiet call ran at 0.47x)."""
    from attention_ref import threads

    slept = []
    monkeypatch.setattr(threads.time, "sleep", slept.append)
    machine, own = iter([3, 3, 3]), iter([3, 3, 1])  # our 3 threads runnable, then 2 of them stop
    monkeypatch.setattr(threads, "_runnable", lambda: next(machine))
    monkeypatch.setattr(threads, "_own_running", lambda: next(own))
    assert threads._others_running() == 0 and slept == []  # nothing else runs: one reading, no wait
    machine, own = iter([4, 4, 2]), iter([1, 1, 1])  # another process, then it ends
    assert threads._others_running() == 1 and slept == [threads._READING_GAP_S] * 2
    machine, own = iter([3, 3, 3]), iter([1, 1, 1])
    assert threads._others_running() == 2  # busy in every reading: it counts


# transformers pads with finfo(dtype).min, not -inf: a row masked with it everywhere is the mean of
# the values on torch and the math path (scores + finfo.min round to finfo.min). Issue 39, S1: the
# tiled path multiplied the mask by log2(e), overflowed to -inf and gave 0.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(6))
def test_finfo_min_rows_agree_across_backends(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    L, S = int(torch.randint(2, 40, (1,), generator=g)), int(torch.randint(2, 40, (1,), generator=g))
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=dtype) for n in (L, S, S))
    low = torch.finfo(dtype).min
    mask = torch.zeros(2, 3, L, S, dtype=dtype)
    mask[torch.rand(2, 3, L, S, generator=g) < 0.3] = low  # some keys padded
    mask[:, :, int(torch.randint(0, L, (1,), generator=g))] = low  # one row padded everywhere
    expected = F.scaled_dot_product_attention(q, k, v, mask)
    for backend in ("math", "tiled", "sdpa"):
        got = scaled_dot_product_attention(q, k, v, mask, backend=backend)
        torch.testing.assert_close(got, expected, msg=backend)
    got = tiled_attention(q, k, v, mask, block_q=7, block_k=5)
    torch.testing.assert_close(got, expected)


def test_auto_agrees_across_its_switch_over_on_finfo_min_rows(monkeypatch):
    from attention_ref import backends

    q, k, v = torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)
    mask = torch.zeros(24, 24)
    mask[5] = torch.finfo(torch.float32).min
    short = scaled_dot_product_attention(q, k, v, mask, backend="auto")  # the math path
    monkeypatch.setattr(backends, "CPU_TILED_MIN_LENGTH", 16)  # now 24 tokens switch to tiled
    assert backends.select_backend(q, k, v, mask) == "tiled"
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask, backend="auto"), short)


def test_tiled_refuses_mask_values_it_cannot_represent():
    q = torch.randn(1, 4, 8)
    mask = torch.zeros(4, 4)
    mask[1, 2] = -3e38  # below finfo.min / log2(e), above finfo.min
    with pytest.raises(ValueError, match=r"attn_mask: the tiled backend computes in log2 units .* got -3e\+38"):
        tiled_attention(q, q, q, mask)
    mask[1, 2] = float("-inf")
    tiled_attention(q, q, q, mask)  # -inf and finfo.min are fine


def test_finfo_min_rows_have_the_math_paths_gradients():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (9, 11, 11))
    mask = torch.zeros(9, 11, dtype=torch.float64)
    mask[2] = torch.finfo(torch.float64).min
    mask[5, :4] = torch.finfo(torch.float64).min
    grads = []
    for backend in ("math", "tiled"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = scaled_dot_product_attention(*leaves, mask, backend=backend) if backend == "math" else \
            tiled_attention(*leaves, mask, block_q=4, block_k=3)
        (out * torch.linspace(-1, 1, 8, dtype=torch.float64)).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a)
