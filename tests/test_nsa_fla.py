"""attention_ref.nsa against fla-core's naive NSA references (flash-linear-attention), in a subprocess.

fla-core 0.6.0's ``fla/ops/nsa/naive.py`` holds the plain PyTorch definitions every public NSA
kernel is tested against: ``naive_nsa_compression`` (the compressed branch, ``(o, lse)``),
``naive_nsa_topk`` (the block selection, ``[B, T, Hkv, S]`` padded with ``-1``),
``naive_nsa_selection`` (the selected branch) and ``naive_nsa`` (the gated sum). fla-core lives
in a folder of its own and runs in a subprocess (why: ``tests/fla_core.py``); slow, it runs only
with ``ATTENTION_REF_SLOW_TESTS=1``.

That ``naive.py`` imports two helpers from fla's package (whose ``__init__`` imports the Triton
kernels, and ``mean_pooling`` is one itself), so the subprocess registers plain-torch stand-ins
for them under their names before loading the file: ``prepare_chunk_offsets`` (where each
packed sequence's blocks start) and ``mean_pooling`` (the mean of each block of every
sequence, the last one over its own tokens), used only by ``naive_nsa``. The per-function
comparisons take their compressed keys and values from `attention_ref.nsa.compress_blocks`
instead. fla's window branch is ``flash_attn_func`` (a CUDA kernel): ``flash_attn`` is made
unimportable there, ``naive_nsa`` runs with ``window_size=0``, and the window branch is
attention_ref's `window_attention`, gated and added here.

Both sides read the same float32 numbers; attention_ref computes in float64, fla in float32
(its compression and selection cast to ``float()``; its top-k keeps the input dtype, so it also
runs once on float64 inputs). The outputs are averages of values of size about 1, so float32
rounding leaves about 1e-7 (at most 4e-7 seen): they must agree within ``atol = rtol = 1e-5``.
Selections are compared as sets of blocks; where a set differs, the scores of fla's blocks,
sorted, must equal those of attention_ref's within 1e-6 (a near tie decided the other way; the
scores are probabilities, rounded in float32 to about 1e-7).

What differs by convention (checked below): a query whose block list is empty gets 0 here and
NaN from ``naive_nsa_selection`` (a softmax over nothing); the native-sparse-attention README's
padding with ``T`` works in fla's reference and must be mapped to ``-1`` here. fla's
``naive_nsa`` asks ``HQ / H`` to be a power of 2 and at least 16, so it runs with 16 query heads
on one key head; its three functions take any grouping and run with 1, 2 and 4.
"""

from __future__ import annotations

import itertools
import textwrap

import pytest
import torch
from fla_core import install_fla, run_fla, slow  # tests/fla_core.py

from attention_ref.nsa import (
    compress_blocks,
    compressed_attention,
    nsa_attention,
    select_blocks,
    selected_attention,
    window_attention,
)
from attention_ref.sparse import assert_topk_close

pytestmark = slow

ATOL = RTOL = 1e-5  # float32 arithmetic on values of size about 1 (see the module docstring)
SCORE_ATOL = 1e-6  # a near tie between two probabilities, each rounded in float32

RUNNER = textwrap.dedent("""
    import importlib.util, sys, types
    from pathlib import Path
    import torch
    import torch.nn.functional as F

    target, inputs_path, outputs_path = map(Path, sys.argv[1:4])

    def prepare_chunk_offsets(cu_seqlens, chunk_size):  # the first block of each packed sequence
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return F.pad(-(-lengths // chunk_size), (1, 0)).cumsum(-1)

    def mean_pooling(x, chunk_size, cu_seqlens=None):  # [B, T, H, D] -> [B, blocks, H, D]
        bounds = [0, x.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        return torch.stack([x[:, a:min(a + chunk_size, end)].mean(1) for start, end in zip(bounds, bounds[1:])
                            for a in range(start, end, chunk_size)], dim=1)

    # naive.py's imports, answered without running fla/__init__.py (Triton kernels)
    for name, attrs in {"fla": {}, "fla.ops": {}, "fla.ops.utils": {"prepare_chunk_offsets": prepare_chunk_offsets},
                        "fla.ops.utils.pooling": {"mean_pooling": mean_pooling}}.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    sys.modules["flash_attn"] = None  # the window branch is attention_ref's
    spec = importlib.util.spec_from_file_location("fla_naive_nsa", target / "fla/ops/nsa/naive.py")
    nsa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nsa)
    assert "triton" not in sys.modules and nsa.flash_attn_func is None
    calls = torch.load(inputs_path)
    torch.save({name: getattr(nsa, fn)(*args, **kwargs) for name, (fn, args, kwargs) in calls.items()},
               outputs_path)
""")

# the three functions, one case a grouping; sizes prime where fla allows
CASES = {
    # 2 query heads per key head; 37 tokens in blocks of 4: 10 blocks, the last of 1 token
    "gqa2": {"seed": 0, "B": 2, "T": 37, "HQ": 6, "H": 3, "K": 5, "V": 7, "bs": 4, "counts": 5, "scale": None},
    # 4 per key head, a quota per query and group (0 to 7), another scale
    "gqa4_quota": {"seed": 1, "B": 1, "T": 53, "HQ": 4, "H": 1, "K": 5, "V": 3, "bs": 4, "counts": "per query",
                   "scale": 0.3},
    # one query head per key head
    "mha": {"seed": 2, "B": 2, "T": 29, "HQ": 3, "H": 3, "K": 7, "V": 5, "bs": 3, "counts": 5, "scale": None},
    # blocks 1 and 2 equal, block 4 one float32 step (2^-20) away from them: exact and near ties
    "ties": {"seed": 3, "B": 1, "T": 43, "HQ": 2, "H": 1, "K": 3, "V": 5, "bs": 4, "counts": 4, "scale": None},
}
# naive_nsa itself: 16 query heads per key head (fla's constraint), in a batch and packed
WHOLE = {
    "g16": {"seed": 4, "B": 2, "T": 41, "HQ": 16, "H": 1, "K": 5, "V": 3, "bs": 4, "counts": 5, "window": 5,
            "cu_seqlens": None},
    # a first sequence shorter than a block: no compressed block, its own block only
    "g16_packed": {"seed": 5, "B": 1, "T": 41, "HQ": 16, "H": 1, "K": 5, "V": 3, "bs": 4, "counts": 5, "window": 5,
                   "cu_seqlens": [0, 3, 16, 41]},
}


def _ours(x: torch.Tensor) -> torch.Tensor:
    """fla's ``[B, T, H, D]`` (or ``[B, T, H]``) to attention_ref's ``(B, H, T, ...)``, in float64."""
    return x.transpose(1, 2).double() if x.is_floating_point() else x.transpose(1, 2)


def _draw(c: dict) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    B, T = c["B"], c["T"]
    x = {"q": torch.randn(B, T, c["HQ"], c["K"], generator=gen), "k": torch.randn(B, T, c["H"], c["K"], generator=gen),
         "v": torch.randn(B, T, c["H"], c["V"], generator=gen)}
    x["gates"] = [torch.rand(B, T, c["HQ"], generator=gen) for _ in range(3)]
    x["counts"] = torch.randint(0, 8, (B, T, c["H"]), generator=gen) if c["counts"] == "per query" else c["counts"]
    return x


def _case(name: str) -> dict:
    """One case's float32 inputs in fla's layout and what attention_ref makes of them."""
    c = CASES[name]
    x = _draw(c)
    if name == "ties":
        bs = c["bs"]
        x["k"][:, 2 * bs:3 * bs] = x["k"][:, bs:2 * bs]
        x["k"][:, 4 * bs:5 * bs] = x["k"][:, bs:2 * bs]
        x["k"][:, 4 * bs, :, 0] += 2.0 ** -20
    scale = c["scale"] if c["scale"] is not None else c["K"] ** -0.5
    q, k, v = (_ours(x[n]) for n in ("q", "k", "v"))
    k_cmp, v_cmp = compress_blocks(k, c["bs"]), compress_blocks(v, c["bs"])
    full = c["T"] // c["bs"] * c["bs"]

    def pooled(cmp, whole):  # fla's mean_pooling keeps the partial last block (never visible): its mean
        return torch.cat([cmp, whole[..., full:, :].mean(-2, keepdim=True)], dim=-2).transpose(1, 2).float()

    counts = x["counts"] if isinstance(x["counts"], int) else _ours(x["counts"])
    chosen, scores = select_blocks(q, k_cmp, block_size=c["bs"], block_counts=counts, scale=c["scale"],
                                   return_scores=True)
    return {**c, **x, "scale_value": scale, "ours": (q, k, v), "k_cmp": k_cmp, "v_cmp": v_cmp,
            "fla_cmp": (pooled(k_cmp, k), pooled(v_cmp, v)), "chosen": chosen, "scores": scores,
            "ours_counts": counts, "random_blocks": _random_blocks(c)}


def _random_blocks(c: dict) -> torch.Tensor:
    """``[B, T, H, S]`` lists of blocks up to the query's own, unused slots padded with ``-1`` or ``T``.

    Query 5 of head 0 lists no block at all.
    """
    gen = torch.Generator().manual_seed(c["seed"] + 100)
    B, T, H, bs, S = c["B"], c["T"], c["H"], c["bs"], 3
    lists = torch.full((B, T, H, S), -1, dtype=torch.long)
    for b, t, h in torch.cartesian_prod(torch.arange(B), torch.arange(T), torch.arange(H)).tolist():
        blocks = torch.randperm(t // bs + 1, generator=gen)[:S]
        lists[b, t, h, : len(blocks)] = blocks
        lists[b, t, h] = lists[b, t, h, torch.randperm(S, generator=gen)]  # padding anywhere in the list
    lists[:, 5, 0] = -1
    pad_with_T = torch.rand(lists.shape, generator=gen) < 0.5
    return torch.where((lists < 0) & pad_with_T, T, lists)


def _whole(name: str) -> dict:
    c = WHOLE[name]
    return {**c, **_draw(c)}


def _calls() -> tuple[dict, dict]:
    cases = {name: _case(name) for name in CASES}
    calls = {}
    for name, x in cases.items():
        k_cmp, v_cmp = x["fla_cmp"]
        calls[f"{name}/compression"] = ("naive_nsa_compression", (x["q"], k_cmp, v_cmp, x["bs"], x["scale_value"]), {})
        calls[f"{name}/topk"] = ("naive_nsa_topk", (x["q"], k_cmp, x["counts"], x["bs"], x["scale_value"]), {})
        calls[f"{name}/topk_float64"] = ("naive_nsa_topk", (x["q"].double(), k_cmp.double(), x["counts"], x["bs"],
                                                            x["scale_value"]), {})
        ours_chosen = x["chosen"].transpose(1, 2)  # (B, H, T, S) -> fla's [B, T, H, S]
        calls[f"{name}/selection"] = ("naive_nsa_selection", (x["q"], x["k"], x["v"], ours_chosen, x["bs"],
                                                              x["scale"]), {})
        calls[f"{name}/selection_random"] = ("naive_nsa_selection", (x["q"], x["k"], x["v"], x["random_blocks"],
                                                                     x["bs"], x["scale"]), {})
    wholes = {name: _whole(name) for name in WHOLE}
    for name, x in wholes.items():
        g_cmp, g_slc, _ = x["gates"]  # g_swa: attention_ref's window branch, added here
        cu = None if x["cu_seqlens"] is None else torch.tensor(x["cu_seqlens"])
        calls[name] = ("naive_nsa", (x["q"], x["k"], x["v"], g_cmp, g_slc, None),
                       {"block_counts": x["counts"], "block_size": x["bs"], "window_size": 0, "cu_seqlens": cu,
                        "return_block_indices": True})
    return cases, {"wholes": wholes, "calls": calls}


@pytest.fixture(scope="module")
def fla(tmp_path_factory) -> tuple[dict, dict, dict]:
    """(the cases, naive_nsa's cases, fla's answers by call name), one subprocess for all."""
    cases, rest = _calls()
    target = install_fla(tmp_path_factory)
    answers = run_fla(target, RUNNER, rest["calls"], tmp_path_factory.mktemp("nsa-fla"))
    return cases, rest["wholes"], answers


def _compare_selections(theirs: torch.Tensor, ours: torch.Tensor, scores: torch.Tensor, quota, bs: int) -> int:
    """Sets of blocks per (b, h, t); differing sets by their sorted scores. Returns how many differ with room.

    ``theirs`` and ``ours`` ``(B, H, T, S)``, ``scores`` ``(B, H, T, n)`` attention_ref's,
    ``quota`` an int or ``(B, H, T)``. Where the quota leaves room for every forced block, both
    must take them all, and the rows whose sets differ are counted; where it does not, the
    forced blocks tie at score 1.0 and either side may take any of them.
    """
    differ = 0
    B, H, T, _ = ours.shape
    n = scores.shape[-1]
    for b, h, t in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(T)).tolist():
        a, c = ({int(i) for i in row if i >= 0} for row in (ours[b, h, t], theirs[b, h, t]))
        forced = {i for i in (0, t // bs, t // bs - 1) if 0 <= i < n}
        room = (quota if isinstance(quota, int) else int(quota[b, h, t])) >= len(forced)
        if room:
            assert forced <= a and forced <= c, (b, h, t, forced, a, c)
        if a == c:
            continue
        differ += room
        row = scores[b, h, t]
        torch.testing.assert_close(row[sorted(c)].sort().values, row[sorted(a)].sort().values, atol=SCORE_ATOL,
                                   rtol=0, msg=lambda m, key=(b, h, t, a, c): f"{key}: {m}")
    return differ


def _assert_close_but_empty_lists(theirs: torch.Tensor, ours: torch.Tensor, lists: torch.Tensor) -> None:
    """``naive_nsa_selection``'s output against ours, ``(B, HQ, T, V)``; ``lists`` ``(B, H, T, S)``, ``-1`` padded.

    A query whose list is empty gets 0 here and NaN (a softmax over nothing) in fla's reference.
    """
    empty = (lists < 0).all(-1).repeat_interleave(ours.shape[1] // lists.shape[1], dim=1)  # (B, HQ, T)
    assert theirs[empty].isnan().all() and (ours[empty] == 0).all()
    torch.testing.assert_close(theirs[~empty], ours[~empty], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(CASES))
def test_the_compressed_branch_equals_naive_nsa_compression(fla, name):
    cases, _, answers = fla
    x = cases[name]
    their_out, their_lse = answers[f"{name}/compression"]
    assert their_out.dtype == torch.float32  # fla's arithmetic
    out, lse = compressed_attention(x["ours"][0], x["k_cmp"], x["v_cmp"], block_size=x["bs"], scale=x["scale"])
    torch.testing.assert_close(_ours(their_out), out, atol=ATOL, rtol=RTOL)
    # a query before the first block ends: lse -inf on both sides (and output 0); finite and close elsewhere
    early = slice(0, x["bs"] - 1)
    assert (_ours(their_lse)[..., early] == float("-inf")).all() and (lse[..., early] == float("-inf")).all()
    torch.testing.assert_close(_ours(their_lse), lse, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(CASES))
def test_the_selection_equals_naive_nsa_topk_by_sets_or_sorted_scores(fla, name):
    cases, _, answers = fla
    x = cases[name]
    ours, scores, quota = x["chosen"], x["scores"], x["ours_counts"]
    for call in ("topk", "topk_float64"):
        theirs = _ours(answers[f"{name}/{call}"])  # [B, T, H, S] -> (B, H, T, S)
        assert theirs.shape == ours.shape, call
        differ = _compare_selections(theirs, ours, scores, quota, x["bs"])
        if name != "ties" and call == "topk_float64":
            assert differ == 0  # fla's arithmetic in float64: the same sets, but for ties among forced blocks
        if isinstance(quota, int):  # the package's judge of a kernel's selection agrees
            assert_topk_close(theirs, scores, quota)
    bs, T = x["bs"], x["T"]
    forced = [{0, t // bs, t // bs - 1} for t in range(T)]
    free = [row for i, row in enumerate(ours.flatten(0, 2).tolist()) if set(row) - {-1} - forced[i % T]]
    assert len(free) > ours.flatten(0, 2).shape[0] // 3  # rows that chose beyond the forced blocks


def test_the_tie_case_has_ties_to_break(fla):
    cases, _, _ = fla
    x = cases["ties"]
    k_cmp = x["k_cmp"][0, 0]
    assert torch.equal(k_cmp[1], k_cmp[2]) and 0 < (k_cmp[4] - k_cmp[1]).abs().max() < 1e-6
    s = x["scores"][0, 0]  # (T, n): late queries see blocks 1, 2 and 4 with equal or near-equal scores
    assert (s[-1, 1] == s[-1, 2]) and 0 < abs(s[-1, 4] - s[-1, 1]) < SCORE_ATOL


@pytest.mark.parametrize("name", list(CASES))
def test_the_selected_branch_equals_naive_nsa_selection(fla, name):
    cases, _, answers = fla
    x = cases[name]
    q, k, v = x["ours"]
    theirs = answers[f"{name}/selection"]
    assert theirs.dtype == torch.float32
    ours = selected_attention(q, k, v, x["chosen"], block_size=x["bs"], scale=x["scale"])
    _assert_close_but_empty_lists(_ours(theirs), ours, x["chosen"])  # a quota of 0: an empty list


@pytest.mark.parametrize("name", list(CASES))
def test_random_block_lists_padded_with_minus_one_or_T(fla, name):
    cases, _, answers = fla
    x = cases[name]
    q, k, v = x["ours"]
    lists = x["random_blocks"]  # [B, T, H, S], -1 or T in the unused slots
    theirs = _ours(answers[f"{name}/selection_random"])
    with pytest.raises(ValueError, match="block positions in"):  # T is not a block here
        selected_attention(q, k, v, _ours(lists), block_size=x["bs"], scale=x["scale"])
    mapped = _ours(lists.masked_fill(lists == x["T"], -1))  # (B, H, T, S), -1 padded
    empty = (mapped < 0).all(-1)
    assert empty[:, 0, 5].all() and int(empty.sum()) == x["B"]  # the one empty list
    ours = selected_attention(q, k, v, mapped, block_size=x["bs"], scale=x["scale"])
    _assert_close_but_empty_lists(theirs, ours, mapped)


@pytest.mark.parametrize("name", list(WHOLE))
def test_naive_nsa_with_the_window_from_here_equals_nsa_attention(fla, name):
    _, wholes, answers = fla
    x = wholes[name]
    their_out, their_chosen = answers[name]
    q, k, v = (_ours(x[n]) for n in ("q", "k", "v"))
    g_cmp, g_slc, g_swa = (_ours(g) for g in x["gates"])
    out, chosen = nsa_attention(q, k, v, g_cmp, g_slc, g_swa, block_size=x["bs"], block_counts=x["counts"],
                                window_size=x["window"], cu_seqlens=x["cu_seqlens"], return_block_indices=True)
    bounds = [0, x["T"]] if x["cu_seqlens"] is None else x["cu_seqlens"]
    window = torch.cat([window_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], window_size=x["window"])
                        for a, b in itertools.pairwise(bounds)], dim=-2)
    torch.testing.assert_close(_ours(their_out) + g_swa.unsqueeze(-1) * window, out, atol=ATOL, rtol=RTOL)
    assert _ours(their_chosen).shape == chosen.shape
    for a, b in itertools.pairwise(bounds):  # block numbers count from each sequence's start on both sides
        part = slice(a, b)
        _, scores = select_blocks(q[..., part, :], compress_blocks(k[..., part, :], x["bs"]), block_size=x["bs"],
                                  block_counts=x["counts"], return_scores=True)
        _compare_selections(_ours(their_chosen)[..., part, :], chosen[..., part, :], scores, x["counts"], x["bs"])
