"""The conformance suite's NSA and MoBA families: the cases, what each is judged as, and planted bugs caught.

An adapter claiming ``"nsa"`` or ``"moba"`` runs those cases instead of the attention matrix. The shipped
references (`attention_ref.nsa`, `attention_ref.moba` in float64) pass every case; so do the plain versions
written out below from torch alone, and each of them with one bug planted fails on exactly the cases that
exercise it, the report naming them: the causal mask inside a selected block dropped, the forced blocks left
out (NSA: first, own and previous; MoBA: the own chunk), the group's mean score replaced by its first head's,
a block or chunk selectable before it ends, ``repeat`` for ``repeat_interleave`` of the key/value heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_ref import conformance, moba, nsa, scaled_dot_product_attention
from attention_ref.conformance import Adapter, by_id, families, matrix, shipped


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the cases are tiny."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the cases -----------------------------------------------------------------------------------------------


def test_the_families_are_apart_from_the_attention_matrix():
    assert (len(matrix("quick")), len(matrix("full"))) == (90, 336)  # as before the families
    assert [len(matrix("quick", [f])) for f in ("nsa", "moba")] == [3, 12]  # NSA fwd; MoBA fwd and bwd, 2 scenarios
    assert [len(matrix("full", [f])) for f in ("nsa", "moba")] == [6, 24]
    assert by_id("moba_gqa-bfloat16-bwd-medium").scenario.family == "moba"
    reports = {name: conformance.run(make(), select=lambda c: c.dtype == torch.float32)
               for name, make in [("math", shipped.torch_sdpa_math), ("nsa", shipped.attention_ref_nsa)]}
    assert {r.scenario for r in reports["nsa"].results} == {"nsa"}  # no case of the attention matrix
    assert not {r.scenario for r in reports["math"].results} & {"nsa", "moba", "moba_gqa"}
    with pytest.raises(ValueError, match=r"families must be a collection of \['attention', 'nsa', 'moba', 'fp8'\], "
                                         r"got 'nsa'"):
        matrix("quick", "nsa")


def test_the_problem_gives_the_parameters_and_the_gates_in_the_adapters_layout():
    inputs = by_id("nsa-float16-fwd-small").build()
    p = inputs.problem("blhd", requires_grad=False)
    assert (p.block_size, p.block_counts, p.window_size, p.enable_gqa) == (3, 5, 5, True)
    assert p.query.shape == (2, 29, 32, 16) and p.key.shape == (2, 29, 2, 16)  # (B, L, H, E), (B, S, Hkv, E)
    gates = torch.stack([p.g_cmp, p.g_slc, p.g_swa])  # 3 x (B, L, H), fla's [B, T, H]
    assert gates.dtype == torch.float16 and torch.equal(gates.sum(0), torch.ones(2, 29, 32, dtype=torch.float16))
    assert torch.equal(p.g_slc, inputs.arguments["g_slc"].transpose(1, 2))
    q = by_id("moba_gqa-float32-fwd-small").build().problem("bhld", requires_grad=False)
    assert (q.moba_chunk_size, q.moba_topk, q.query.shape, q.key.shape) == (4, 3, (2, 6, 29, 16), (2, 2, 29, 16))


@pytest.mark.parametrize("case_id", ["nsa-float32-fwd-small", "nsa-bfloat16-fwd-medium", "moba_gqa-float16-fwd-small"])
def test_each_case_is_the_one_attention_it_is_judged_as(case_id):
    """In float64, NSA with one branch per row is attention over the keys and the compressed keys, each row masked
    to its branch's keys; MoBA is attention with its mask. The references agree to rounding."""
    inputs = by_id(case_id).build()
    a = {name: t.double() if name in families.GATES else t for name, t in inputs.arguments.items()}
    q, k, v = (t.double() for t in (inputs.query, inputs.key, inputs.value))
    if case_id.startswith("nsa"):
        key, value, judged = families.nsa_as_attention(q, k, v, a)
        reference = nsa.nsa_attention(q, k, v, a["g_cmp"], a["g_slc"], a["g_swa"], block_size=a["block_size"],
                                      block_counts=a["block_counts"], window_size=a["window_size"])
        assert key.shape[-2] == q.shape[-2] + q.shape[-2] // a["block_size"]  # S keys, then n compressed ones
        assert torch.equal(judged["attn_mask"], inputs.reference_kwargs["attn_mask"])  # as the case is judged
    else:
        key, value, judged = families.moba_as_attention(q, k, v, a)
        reference = moba.moba_attention(q, k, v, chunk_size=a["moba_chunk_size"], topk=a["moba_topk"],
                                        enable_gqa=True)
    one = scaled_dot_product_attention(q, key, value, judged["attn_mask"], enable_gqa=True)
    torch.testing.assert_close(one, reference, rtol=1e-12, atol=1e-12)


def _gap(scores, count):
    """``count``-th best minus the next best of each row of ``scores`` ``(..., n)`` (``inf``: ranked first,
    ``-inf``: not selectable), on the rows where both are finite: where the top-``count`` is contested."""
    ranked = scores.sort(dim=-1, descending=True).values
    last, next_ = ranked[..., count - 1], ranked[..., count]
    contested = last.isfinite() & next_.isfinite()
    return (last - next_)[contested], last[contested]


@pytest.mark.parametrize("scenario", ["nsa", "moba", "moba_gqa"])
def test_every_selection_of_the_full_matrix_is_far_from_a_tie(scenario):
    """A right kernel rounds its block scores and must still pick the reference's blocks. At each contested place
    the last block chosen and the first left out differ by a twentieth of the score or more for NSA (the group's
    mean compressed probability; bfloat16 moves a score by about 2^-8 of itself), by half a level step,
    sqrt(E) / 4, for MoBA (the gate). And the selection is contested on many rows: the top-k is no formality."""
    contested = 0
    for case in matrix("full", ["nsa", "moba"]):
        if case.scenario.name != scenario:
            continue
        inputs = case.build()
        q, k = inputs.query.double(), inputs.key.double()
        a = inputs.arguments
        if scenario == "nsa":
            k_cmp = nsa.compress_blocks(k, a["block_size"])
            _, scores = nsa.select_blocks(q, k_cmp, block_size=a["block_size"], block_counts=a["block_counts"],
                                          return_scores=True)
            gap, last = _gap(scores.masked_fill(scores == 1.0, float("inf")), a["block_counts"])  # forced: first
            assert (gap / last).min() > 0.05, case.id
        else:
            _, gate = moba.moba_select(q, k, a["moba_chunk_size"], a["moba_topk"], enable_gqa=a["enable_gqa"],
                                       gate_dtype=torch.float64, return_gate=True)
            gap, _ = _gap(gate, a["moba_topk"])
            assert gap.min() > q.shape[-1] ** 0.5 / 4, case.id
        contested += gap.numel()
    assert contested > 200


# ---- the shipped references pass -----------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [shipped.attention_ref_nsa, shipped.attention_ref_moba])
def test_the_shipped_reference_passes_every_quick_case(factory):
    adapter = factory()
    report = conformance.run(adapter)
    assert report.ok and report.counts()["passed"] == len(matrix("quick", adapter.families)), report.table()
    assert adapter.name in shipped.SHIPPED_FAMILIES and adapter.name not in shipped.SHIPPED


# ---- plain NSA and MoBA, with planted bugs ---------------------------------------------------------------------


def _heads(t, groups, interleave):
    """``(B, Hkv, ...) -> (B, H, ...)``: query head h reads key head h // groups (``repeat`` instead: h % Hkv)."""
    return t.repeat_interleave(groups, dim=1) if interleave else t.repeat(1, groups, *[1] * (t.dim() - 2))


def _attend(q, k, v, keep, scale):
    """Attention of ``q`` over ``k``, ``v`` where ``keep`` ``(..., L, S)`` is True; a row with no key gives 0."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights @ v, weights  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)


def _chosen_keys(scores, count, block, L):
    """``(..., L, L)``: the keys of the ``count`` best blocks by ``scores`` ``(..., L, N)``, a ``-inf`` one never."""
    best = scores.topk(min(count, scores.shape[-1]), dim=-1)
    blocks = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, best.indices, best.values > float("-inf"))
    return blocks.repeat_interleave(block, dim=-1)[..., :L]  # (..., L, N) -> (..., L, N * block) -> (..., L, L)


def plain_nsa(p, *, causal_in_blocks=True, forced=True, group_mean=True, visible_once_ended=True, interleave=True):
    """NSA written out in float64 (heads first), each keyword one place a kernel can go wrong."""
    q, k, v = (t.double() for t in (p.query, p.key, p.value))  # (B, H, L, E), (B, Hkv, L, E), (B, Hkv, L, Ev)
    H, L = q.shape[1], q.shape[2]
    groups, bs, scale = H // k.shape[1], p.block_size, p.resolved_scale
    n, N = L // bs, -(-L // bs)  # complete blocks, all blocks
    t, c, j = torch.arange(L)[:, None], torch.arange(N), torch.arange(L)  # queries (L, 1), blocks, keys

    pooled = [x[:, :, :n * bs].unflatten(2, (n, bs)).mean(3) for x in (k, v)]  # (B, Hkv, n, bs, E) -> (B, Hkv, n, E)
    k_cmp, v_cmp = (_heads(x, groups, interleave) for x in pooled)
    ends = (c[:n] + 1) * bs - 1 if visible_once_ended else c[:n] * bs  # the bug: visible once it starts
    o_cmp, w_cmp = _attend(q, k_cmp, v_cmp, ends <= t, scale)  # (B, H, L, Ev), (B, H, L, n)

    # (B, H, L, n) -> (B, Hkv, G, L, n) -> (B, Hkv, L, n): the group's mean, or its first head's
    scores = w_cmp.unflatten(1, (-1, groups)).mean(2) if group_mean else w_cmp[:, ::groups]
    scores = F.pad(scores, (0, N - n)).masked_fill((c + 1) * bs - 1 > t, float("-inf"))  # (B, Hkv, L, N)
    if forced:
        scores = scores.masked_fill((c == 0) | (c == t // bs) | (c == t // bs - 1), float("inf"))
    keys = _heads(_chosen_keys(scores, p.block_counts, bs, L), groups, interleave)  # (B, H, L, L)
    k_all, v_all = _heads(k, groups, interleave), _heads(v, groups, interleave)
    o_slc, _ = _attend(q, k_all, v_all, keys & (j <= t) if causal_in_blocks else keys, scale)
    o_swa, _ = _attend(q, k_all, v_all, (j <= t) & (j > t - p.window_size), scale)
    g_cmp, g_slc, g_swa = (g.double().unsqueeze(-1) for g in (p.g_cmp, p.g_slc, p.g_swa))  # (B, H, L, 1)
    return (g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa).to(p.query.dtype)


def plain_moba(p, *, causal_in_chunks=True, own_forced=True, future_excluded=True, interleave=True):
    """MoBA written out in float64 (heads first), each keyword one place a kernel can go wrong."""
    q = p.query.double()  # (B, H, L, E)
    groups = q.shape[1] // p.key.shape[1]
    k, v = (_heads(x.double(), groups, interleave) for x in (p.key, p.value))  # (B, H, L, E)
    L, cs = q.shape[2], p.moba_chunk_size
    t, c, j = torch.arange(L)[:, None], torch.arange(-(-L // cs)), torch.arange(L)
    means = torch.stack([k[:, :, a:a + cs].mean(2) for a in range(0, L, cs)], dim=2)  # (B, H, N, E)
    gate = q @ means.transpose(-2, -1)  # (B, H, L, E) x (B, H, E, N) -> (B, H, L, N), no scale
    if future_excluded:  # selectable once the chunk's last key is before the query
        gate = gate.masked_fill((c + 1) * cs > t, float("-inf"))
    if own_forced:
        gate = gate.masked_fill(c == t // cs, float("inf"))
    keys = _chosen_keys(gate, p.moba_topk, cs, L)  # (B, H, L, L)
    out, _ = _attend(q, k, v, keys & (j <= t) if causal_in_chunks else keys, p.resolved_scale)
    return out.to(p.query.dtype)


# name: (the plain form, its bug, the scenarios that must fail)
PLANTED = {
    "NSA: causal mask inside a selected block dropped": (plain_nsa, {"causal_in_blocks": False}, {"nsa"}),
    "NSA: first, own and previous blocks not forced": (plain_nsa, {"forced": False}, {"nsa"}),
    "NSA: the group's mean score replaced by its first head's": (plain_nsa, {"group_mean": False}, {"nsa"}),
    "NSA: a block visible once it starts, not once it ends": (plain_nsa, {"visible_once_ended": False}, {"nsa"}),
    "NSA: key/value heads by repeat, not repeat_interleave": (plain_nsa, {"interleave": False}, {"nsa"}),
    "MoBA: causal mask inside the own chunk dropped": (plain_moba, {"causal_in_chunks": False}, {"moba", "moba_gqa"}),
    "MoBA: the own chunk not forced": (plain_moba, {"own_forced": False}, {"moba", "moba_gqa"}),
    "MoBA: a chunk selectable before it ends": (plain_moba, {"future_excluded": False}, {"moba", "moba_gqa"}),
    "MoBA: key/value heads by repeat, not repeat_interleave": (plain_moba, {"interleave": False}, {"moba_gqa"}),
}
_SUPPORTS = {plain_nsa: {"nsa", "gqa"}, plain_moba: {"moba", "gqa", "backward"}}


@pytest.mark.parametrize("plain", [plain_nsa, plain_moba])
def test_the_plain_forms_pass_every_quick_case(plain):
    report = conformance.run(Adapter(plain.__name__, plain, supports=_SUPPORTS[plain]))
    assert report.ok and report.counts()["passed"] == len(report.results), report.table()


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_bug_is_reported_on_the_cases_that_exercise_it(name):
    plain, bug, failing = PLANTED[name]
    adapter = Adapter(f"planted: {name}", lambda p: plain(p, **bug), supports=_SUPPORTS[plain])
    report = conformance.run(adapter)  # the quick cases: every dtype, fwd (and bwd for MoBA)
    bad = {r.scenario for r in report.problems()}
    assert bad == failing, report.table()
    assert all(r.status == "failed" and r.detail.startswith("assert_attention_close: ") for r in report.problems())
    assert all(r.status == "passed" for r in report.results if r.scenario not in failing), report.table()
    assert not report.ok and f"{len(report.problems())} failed" in report.summary()
    float32 = {r.id for r in report.problems() if "-float32-" in r.id}
    assert float32 == {c.id for c in matrix("quick", adapter.families)
                       if c.scenario.name in failing and c.dtype == torch.float32}, report.table()


def test_the_gates_of_a_judged_nsa_case_must_be_one_branch_per_row():
    inputs = by_id("nsa-float32-fwd-small").build()
    args = dict(inputs.arguments, g_cmp=torch.full_like(inputs.arguments["g_cmp"], 0.5))
    with pytest.raises(ValueError, match="needs gates of 0 or 1, one branch on per query head and token"):
        families.nsa_as_attention(inputs.query, inputs.key, inputs.value, args)
