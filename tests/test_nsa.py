"""attention_ref.nsa: Native Sparse Attention against its definition, written here as loops over queries.

The plain formula (`_plain_nsa`) follows fla's ``naive_nsa`` in words: mean-pooled complete
blocks, visible to query ``t`` iff ``(c + 1) * bs - 1 <= t``; selection scores the compressed
softmax averaged over each key/value group's query heads, blocks 0, ``t // bs`` and
``t // bs - 1`` forced first, then the best by score (equal scores: the lower block), up to the
quota; one causal softmax over the selected blocks; a window of ``w`` keys; the gated sum.
Properties: one branch gated on is that branch; a query with no visible block gets 0 and
``lse = -inf``; forced blocks are always selected; the selection passes ``assert_topk_close``
on its scores; gradients (gates included) pass ``gradcheck``. Planted bugs, each a piece of
``attention_ref.nsa`` swapped for a broken one while the test runs, must make the plain formula
fail, and the untouched code must pass the same check. Sizes: B=2, H=6 query heads in Hkv=3
groups of 2, L=13 (blocks of 2: 7 blocks, the last of 1 token), E=5, Ev=7, 4 blocks per query,
a window of 3. (Proof against fla's own references: ``tests/test_nsa_fla.py``, slow.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

import attention_ref._inputs
import attention_ref.nsa
from attention_ref.functional import attention_weights
from attention_ref.nsa import (
    compress_blocks,
    compressed_attention,
    nsa_attention,
    select_blocks,
    selected_attention,
    window_attention,
)
from attention_ref.sparse import assert_topk_close, block_topk_attention

B, H, Hkv, L, E, Ev = 2, 6, 3, 13, 5, 7
BS, COUNT, W = 2, 4, 3
G = H // Hkv
NB = -(-L // BS)  # 7 blocks


def _inputs(seed=0, grad=False, length=L):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, length, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, length, Ev, generator=gen, dtype=torch.float64)
    gates = [torch.rand(B, H, length, generator=gen, dtype=torch.float64) for _ in range(3)]
    return [t.requires_grad_(grad) for t in (q, k, v, *gates)]


def _softmax_out(scores, values):
    """Softmax over a list of scores and the weighted values; (0, -inf) for an empty list."""
    if not scores:
        return torch.zeros(values.shape[-1], dtype=torch.float64), float("-inf"), []
    s = torch.stack(scores)
    w = torch.softmax(s, 0)
    return (w[:, None] * values).sum(0), float(torch.logsumexp(s, 0)), w.tolist()


def _plain_compressed(q, k, v, t, scale):
    """One head, one query: (output, lse, probs per complete block)."""
    n = k.shape[0] // BS
    k_cmp = [k[c * BS:(c + 1) * BS].mean(0) for c in range(n)]
    v_cmp = [v[c * BS:(c + 1) * BS].mean(0) for c in range(n)]
    seen = [c for c in range(n) if (c + 1) * BS - 1 <= t]
    values = torch.stack([v_cmp[c] for c in seen]) if seen else torch.zeros(0, v.shape[-1], dtype=torch.float64)
    out, lse, w = _softmax_out([scale * (q[t] @ k_cmp[c]) for c in seen], values)
    probs = [0.0] * n
    for c, p in zip(seen, w):
        probs[c] = p
    return out, lse, probs


def _plain_selection(q, k, t, g, count, scale):
    """The blocks of group ``g`` for query ``t`` (one batch entry: ``q`` ``(H, L, E)``, ``k`` ``(Hkv, L, E)``)."""
    n_blocks = -(-k.shape[1] // BS)
    probs = [0.0] * n_blocks
    for h in range(g * G, (g + 1) * G):  # the group's query heads
        for c, p in enumerate(_plain_compressed(q[h], k[g], k[g], t, scale)[2]):
            probs[c] += p / G
    forced = {c for c in (0, t // BS, t // BS - 1) if 0 <= c < n_blocks}
    visible = {c for c in range(n_blocks) if (c + 1) * BS - 1 <= t}
    score = {c: 1.0 if c in forced else probs[c] for c in forced | visible}  # forced: 1.0, ties by index
    order = sorted(score, key=lambda c: (c not in forced, -score[c], c))
    return order[:count]


def _plain_nsa(q, k, v, g_cmp, g_slc, g_swa, count=COUNT, window=W, block_indices=None):
    """Output ``(B, H, L, Ev)``, the three branches and the selection ``{(b, g, t): blocks}``."""
    scale = q.shape[-1] ** -0.5
    branches = {name: torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64) for name in ("cmp", "slc", "swa")}
    chosen = {}
    for b in range(q.shape[0]):
        for t in range(q.shape[2]):
            for g in range(k.shape[1]):
                if block_indices is None:
                    chosen[b, g, t] = _plain_selection(q[b], k[b], t, g, count, scale)
                else:
                    chosen[b, g, t] = [int(c) for c in block_indices[b, g, t] if c >= 0]
            for h in range(q.shape[1]):
                qh, kh, vh = q[b, h], k[b, h // G], v[b, h // G]
                branches["cmp"][b, h, t] = _plain_compressed(qh, kh, vh, t, scale)[0]
                keys = [j for j in range(t + 1) if j // BS in chosen[b, h // G, t]]
                branches["slc"][b, h, t] = _softmax_out([scale * (qh[t] @ kh[j]) for j in keys], vh[keys])[0]
                keys = list(range(max(0, t - window + 1), t + 1))
                branches["swa"][b, h, t] = _softmax_out([scale * (qh[t] @ kh[j]) for j in keys], vh[keys])[0]
    out = sum(gate[..., None] * branches[name] for gate, name in ((g_cmp, "cmp"), (g_slc, "slc"), (g_swa, "swa")))
    return out, branches, chosen


@pytest.fixture(scope="module")
def plain():
    """`_plain_nsa` of the default inputs: ``(output, branches, selection)``."""
    return _plain_nsa(*_inputs())


def _assert_equals_plain(plain) -> None:
    """``nsa_attention`` of the default inputs, its output and its selection, against the plain formula."""
    q, k, v, *gates = _inputs()
    out, indices = nsa_attention(q, k, v, *gates, block_size=BS, block_counts=COUNT, window_size=W,
                                 return_block_indices=True)
    ref, _, chosen = plain
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert indices.shape == (B, Hkv, L, COUNT)
    for (b, g, t), blocks in chosen.items():
        assert indices[b, g, t].tolist() == blocks + [-1] * (COUNT - len(blocks)), (b, g, t)


def test_equals_the_plain_formula(plain):
    _assert_equals_plain(plain)
    free = [key for key, blocks in plain[2].items() if len(blocks) == COUNT and set(blocks) - {0, key[2] // BS,
                                                                                               key[2] // BS - 1}]
    assert len(free) > 10  # the quota leaves room to choose: the test exercises the ranking


# Planted bugs: (module, name, replacement), swapped in while `nsa_attention` runs.


def _expand_with_repeat(query, kv, name):
    """Grouped heads expanded with ``repeat``: query head ``h`` reads key head ``h % Hkv``, not ``h // G``."""
    return kv.repeat(*[1] * (kv.dim() - 3), query.shape[-3] // kv.shape[-3], 1, 1)  # (..., Hkv, S, E) -> (..., H, S, E)


def _selected_with_repeated_lists(query, key, value, block_indices, *, block_size, scale=None):
    """The selected branch with the group's block lists handed to query heads by ``repeat``."""
    per_head = block_indices.repeat(1, query.shape[-3] // key.shape[-3], 1, 1)  # (B, Hkv, L, k) -> (B, H, L, k)
    return block_topk_attention(query, key, value, per_head, block_size, is_causal=True, scale=scale,
                                enable_gqa=True)


def _select_without_forced_blocks(query, key_cmp, *, block_size, block_counts, scale=None):
    """The best ``block_counts`` visible blocks by the group mean, blocks 0, own and previous not forced."""

    def visible(b, h, q_idx, kv_idx):
        return (kv_idx + 1) * block_size - 1 <= q_idx

    probs = attention_weights(query, key_cmp, mask_mod=visible, scale=scale, enable_gqa=True)  # (B, H, L, n)
    scores = probs.unflatten(-3, (key_cmp.shape[-3], -1)).mean(-3)  # (B, Hkv, G, L, n) -> (B, Hkv, L, n)
    t, c = torch.arange(query.shape[-2]).unsqueeze(-1), torch.arange(scores.shape[-1])
    ranked = scores.masked_fill(~visible(None, None, t, c), float("-inf")).sort(dim=-1, descending=True, stable=True)
    chosen = ranked.indices[..., :block_counts]
    return chosen.masked_fill(ranked.values[..., :block_counts] == float("-inf"), -1)


def _select_by_first_head(query, key_cmp, **kwargs):
    """The selection scored by each group's first query head alone, not the group's mean."""
    return select_blocks(query[..., ::G, :, :], key_cmp, **kwargs)  # (B, H, L, E) -> (B, Hkv, L, E)


PLANTED = {
    "causal mask inside a selected block dropped": (
        attention_ref.nsa, "block_topk_attention",
        lambda *args, **kwargs: block_topk_attention(*args, **{**kwargs, "is_causal": False})),
    "forced blocks (first, own, previous) missing": (
        attention_ref.nsa, "select_blocks", _select_without_forced_blocks),
    "group mean replaced by the first head's scores": (attention_ref.nsa, "select_blocks", _select_by_first_head),
    "a compressed block visible before it ends": (  # from its first token on: the own block leaks the future
        attention_ref.nsa, "_visible", lambda block_size: lambda b, h, q_idx, kv_idx: kv_idx * block_size <= q_idx),
    "repeat for repeat_interleave on grouped keys and values": (attention_ref._inputs, "expand_kv_heads",
                                                                 _expand_with_repeat),
    "repeat for repeat_interleave on the block lists": (
        attention_ref.nsa, "selected_attention", _selected_with_repeated_lists),
}


@pytest.mark.parametrize("bug", [pytest.param(None, id="the code as it is"), *PLANTED])
def test_planted_bugs_fail_the_plain_formula_and_the_code_passes(plain, monkeypatch, bug):
    if bug is None:
        _assert_equals_plain(plain)
        return
    monkeypatch.setattr(*PLANTED[bug])
    with pytest.raises(AssertionError):
        _assert_equals_plain(plain)


@pytest.mark.parametrize("branch", ["cmp", "slc", "swa"])
def test_one_branch_gated_on_is_that_branch(branch):
    q, k, v, *_ = _inputs()
    on, off = torch.ones(B, H, L, dtype=torch.float64), torch.zeros(B, H, L, dtype=torch.float64)
    gates = [on if name == branch else off for name in ("cmp", "slc", "swa")]
    out = nsa_attention(q, k, v, *gates, block_size=BS, block_counts=COUNT, window_size=W)
    k_cmp, v_cmp = compress_blocks(k, BS), compress_blocks(v, BS)
    alone = {
        "cmp": lambda: compressed_attention(q, k_cmp, v_cmp, block_size=BS)[0],
        "slc": lambda: selected_attention(q, k, v, select_blocks(q, k_cmp, block_size=BS, block_counts=COUNT),
                                          block_size=BS),
        "swa": lambda: window_attention(q, k, v, window_size=W),
    }[branch]()
    torch.testing.assert_close(out, alone, rtol=0, atol=0)
    torch.testing.assert_close(alone, _plain_nsa(q, k, v, *gates)[1][branch], rtol=1e-12, atol=1e-12)


def test_a_compressed_block_is_visible_once_it_ends_and_empty_rows_give_zero():
    q, k, v, *_ = _inputs()
    out, lse = compressed_attention(q, compress_blocks(k, BS), compress_blocks(v, BS), block_size=BS)
    assert (out[..., : BS - 1, :] == 0).all() and (lse[..., : BS - 1] == float("-inf")).all()
    assert torch.isfinite(lse[..., BS - 1:]).all()
    # query BS - 1 sees block 0 alone: the block's mean value, lse its one score
    v_mean = v[:, :, :BS].mean(-2).repeat_interleave(G, dim=1)  # (B, H, Ev)
    torch.testing.assert_close(out[..., BS - 1, :], v_mean, rtol=1e-12, atol=1e-12)


def test_forced_blocks_are_always_selected():
    q, k, *_ = _inputs(seed=4)
    for count in (3, 5):
        indices = select_blocks(q, compress_blocks(k, BS), block_size=BS, block_counts=count)
        for t in range(L):
            forced = {c for c in (0, t // BS, t // BS - 1) if c >= 0}
            for row in indices[..., t, :].reshape(-1, count).tolist():
                assert forced <= set(row), (count, t, row)


def test_the_selection_is_judged_by_scores_the_group_mean_of_the_compressed_softmax():
    q, k, *_ = _inputs()
    k_cmp = compress_blocks(k, BS)
    indices, scores = select_blocks(q, k_cmp, block_size=BS, block_counts=COUNT, return_scores=True)
    assert_topk_close(indices, scores, COUNT)
    for b, g, t in [(0, 0, 9), (1, 2, 12), (0, 1, 4)]:
        probs = [sum(_plain_compressed(q[b, h], k[b, g], k[b, g], t, E ** -0.5)[2][c] for h in range(g * G, g * G + G))
                 / G for c in range(L // BS)]
        for c, p in enumerate(probs + [0.0]):
            forced = c in (0, t // BS, t // BS - 1)
            visible = (c + 1) * BS - 1 <= t
            want = 1.0 if forced else p if visible else float("-inf")
            assert scores[b, g, t, c].item() == pytest.approx(want, rel=1e-12, abs=1e-15), (b, g, t, c)


def test_a_quota_per_query_and_group_pads_with_minus_one():
    q, k, *_ = _inputs()
    gen = torch.Generator().manual_seed(2)
    counts = torch.randint(0, 6, (B, Hkv, L), generator=gen)
    indices = select_blocks(q, compress_blocks(k, BS), block_size=BS, block_counts=counts)
    assert indices.shape[-1] == int(counts.max())
    for b in range(B):
        for g in range(Hkv):
            for t in range(L):
                row = indices[b, g, t].tolist()
                blocks = _plain_selection(q[b], k[b], t, g, int(counts[b, g, t]), E ** -0.5)
                assert row == blocks + [-1] * (len(row) - len(blocks)), (b, g, t)


def test_given_block_indices_with_minus_one_padding_override_the_selection():
    q, k, v, *gates = _inputs()
    gen = torch.Generator().manual_seed(5)
    given = torch.stack([torch.randperm(NB, generator=gen)[:3] for _ in range(B * Hkv * L)]).reshape(B, Hkv, L, 3)
    given[..., 0, :] = -1  # query 0: no block at all (output 0 in the selected branch)
    given[..., 5, 1:] = -1
    out = nsa_attention(q, k, v, *gates, block_size=BS, block_counts=COUNT, window_size=W, block_indices=given)
    torch.testing.assert_close(out, _plain_nsa(q, k, v, *gates, block_indices=given)[0], rtol=1e-12, atol=1e-12)


def test_gradients_through_the_gates_and_the_inputs():
    gen = torch.Generator().manual_seed(1)

    def tensor(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = tensor(1, 2, 7, 3), tensor(1, 1, 7, 3), tensor(1, 1, 7, 2)
    gates = [torch.rand(1, 2, 7, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)]

    def f(q, k, v, g_cmp, g_slc, g_swa):
        return nsa_attention(q, k, v, g_cmp, g_slc, g_swa, block_size=2, block_counts=3, window_size=2)

    assert torch.autograd.gradcheck(f, (q, k, v, *gates))


def test_packed_sequences_are_split_into_blocks_each_from_its_start():
    q, k, v, *gates = _inputs()
    cu = [0, 5, 13]
    counts = torch.full((B, Hkv, L), 3)
    counts[..., 7] = 4
    out, indices = nsa_attention(q, k, v, *gates, block_size=BS, block_counts=counts, window_size=W, cu_seqlens=cu,
                                 return_block_indices=True)
    assert indices.shape == (B, Hkv, L, 4)
    for a, b in itertools.pairwise(cu):
        part, part_indices = nsa_attention(
            q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], *[g[..., a:b] for g in gates], block_size=BS,
            block_counts=counts[..., a:b], window_size=W, return_block_indices=True)
        torch.testing.assert_close(out[..., a:b, :], part, rtol=0, atol=0)
        assert (indices[..., a:b, : part_indices.shape[-1]] == part_indices).all()
        assert (indices[..., a:b, part_indices.shape[-1]:] == -1).all()


def test_a_learned_compression_takes_the_blocks():
    q, k, v, *gates = _inputs()
    weights = torch.linspace(0.0, 1.0, BS, dtype=torch.float64)  # a position-weighted pooling

    def pooled(blocks):
        return (blocks * weights[:, None]).sum(-2)  # (..., n, BS, D) -> (..., n, D)

    mean = nsa_attention(q, k, v, *gates, block_size=BS, block_counts=COUNT, window_size=W)
    same = nsa_attention(q, k, v, *gates, block_size=BS, block_counts=COUNT, window_size=W,
                         compress=lambda blocks: blocks.mean(-2))
    torch.testing.assert_close(same, mean, rtol=0, atol=0)
    other = nsa_attention(q, k, v, *gates, block_size=BS, block_counts=COUNT, window_size=W, compress=(pooled, pooled))
    assert not torch.allclose(other, mean)
    with pytest.raises(ValueError, match=r"compress must return \(\.\.\., n, D'\) = \(2, 3, 6, D'\)"):
        nsa_attention(q, k, v, *gates, block_size=BS, block_counts=COUNT, window_size=W, compress=lambda b: b)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"block_size": 0}, ValueError, "block_size must be a positive int, got 0"),
        ({"window_size": 0}, ValueError, "window_size must be a positive int, got 0"),
        ({"block_counts": -1}, ValueError, "block_counts must be a non-negative int, got -1"),
        ({"block_counts": 2.5}, TypeError, "block_counts must be an int or an integer tensor"),
        ({"block_counts": torch.ones(B, H, L, dtype=torch.long)}, ValueError,
         r"block_counts must have shape \(\.\.\., Hkv, L\) = \(2, 3, 13\), got shape \(2, 6, 13\)"),
        ({"g_slc": torch.ones(B, H, L - 1, dtype=torch.float64)}, ValueError,
         r"g_slc must have shape \(\.\.\., H, L\) = \(2, 6, 13\), one gate per query head and token, got \(2, 6, 12\)"),
        ({"g_cmp": torch.ones(B, H, L, dtype=torch.float32)}, TypeError,
         r"g_cmp must have the same dtype as query \(torch.float64\), got torch.float32"),
        ({"block_indices": torch.zeros(B, H, L, 2, dtype=torch.long)}, ValueError,
         r"block_indices must have shape \(\.\.\., Hkv, L, k\) = \(2, 3, 13, k\)"),
        ({"block_indices": torch.full((B, Hkv, L, 2), NB, dtype=torch.long)}, ValueError,
         r"block_indices must hold block positions in \[0, n\) = \[0, 7\), or -1 for no block; got 7"),
        ({"key": torch.ones(B, 4, L, E, dtype=torch.float64)}, ValueError,
         r"key must have Hkv heads \(dim -3\) dividing the query's H = 6, got key \(2, 4, 13, 5\) with Hkv = 4"),
        ({"key": torch.ones(B, Hkv, L - 1, E, dtype=torch.float64)}, ValueError, "key must have S = L = 13 keys"),
        ({"cu_seqlens": [0, 5, 12]}, ValueError, r"cu_seqlens must end at .* = 13, got cu_seqlens\[-1\] = 12"),
        ({"compress": "mean"}, TypeError, "compress must be a callable"),
    ],
)
def test_bad_arguments_name_themselves(change, error, match):
    q, k, v, g_cmp, g_slc, g_swa = _inputs()
    call = {"query": q, "key": k, "value": v, "g_cmp": g_cmp, "g_slc": g_slc, "g_swa": g_swa, "block_size": BS,
            "block_counts": COUNT, "window_size": W, **change}
    if change.get("key") is not None and change["key"].shape[-2] != L:
        call["value"] = v[..., : L - 1, :]
    with pytest.raises(error, match=match):
        nsa_attention(**call)
