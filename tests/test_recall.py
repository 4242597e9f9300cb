"""attention_ref.recall: the MQAR task, the four mixers against independent computations, the
shipped models against the record of the runs that made them.

- `mqar_batch`: every query's target is the value that followed its key among the pairs, each
  key is asked once, after the pairs, at a slot's first token; keys and values are distinct and
  in their halves of the vocabulary; pair counts mix within a batch; errors name the argument.
- Each mixer in float64 against a computation that does not go through it: the softmax mixer
  against `torch.nn.functional.scaled_dot_product_attention` (with and without a window), the
  linear mixer against its formula written as matrices, the delta mixers' chunked form against
  `gated_delta_rule(..., mode="recurrent")`, the convolution against a sum by hand.
- Causality: changing a token changes no logit before it (and does change later ones).
- ``sparse=``: every softmax layer computes `moba_attention`, or `nsa_attention` with only its
  selected branch gated on, on its rotated projections; a budget that covers every key gives
  full attention's logits and accuracy; a query reads at most blocks x block size keys; the
  specs' and the forward's errors name the argument.
- The shipped files: each reproduces its recorded accuracy per pair count, and the first
  training steps rerun from the record's seed give the recorded losses to 1e-4.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from attention_ref import recall
from attention_ref.linear import gated_delta_rule
from attention_ref.masks import causal_mask
from attention_ref.moba import moba_attention, moba_mask
from attention_ref.nsa import compress_blocks, nsa_attention, select_blocks
from attention_ref.positional import rope
from attention_ref.sparse import block_topk_indices, topk_mask

# --- the task ----------------------------------------------------------------------------------


def _check_batch(inputs, targets, mask, counts, length, vocab):
    """Every property `mqar_batch` promises, row by row."""
    half = vocab // 2
    assert inputs.shape == targets.shape == mask.shape == (len(counts), length)
    assert inputs.dtype == targets.dtype == torch.int64 and mask.dtype == torch.bool
    assert torch.equal(mask, targets != recall.IGNORE)
    for row, p in enumerate(counts):
        x, y, m = inputs[row].tolist(), targets[row].tolist(), mask[row]
        keys, values = x[0:2 * p:2], x[1:2 * p:2]
        assert all(1 <= k < half for k in keys) and len(set(keys)) == p
        assert all(half <= v < vocab for v in values) and len(set(values)) == p
        queries = m.nonzero().flatten().tolist()
        assert len(queries) == p
        # after the pairs, at the first token of a two-token slot
        assert all(i >= 2 * p and (i - 2 * p) % 2 == 0 for i in queries)
        # each key asked once, and the target is the value that followed it
        assert sorted(x[i] for i in queries) == sorted(keys)
        for i in queries:
            assert y[i] == values[keys.index(x[i])]
        rest = set(range(2 * p, length)) - set(queries)
        assert all(x[i] == recall.PAD for i in rest)


@pytest.mark.parametrize("length,pairs,vocab", [(64, 8, 256), (13, 3, 17), (29, 7, 31), (64, 16, 65)])
def test_every_query_asks_for_the_value_of_an_earlier_key(length, pairs, vocab):
    g = torch.Generator().manual_seed(length * 7 + pairs)
    batch = recall.mqar_batch(g, 11, length=length, pairs=pairs, vocab=vocab)
    _check_batch(*batch, [pairs] * 11, length, vocab)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_pair_counts_mix_within_a_batch(data):
    length = data.draw(st.integers(4, 70), label="length")
    vocab = data.draw(st.integers(length + 1, length + 40), label="vocab")
    counts = data.draw(st.lists(st.integers(1, length // 4), min_size=1, max_size=7), label="pairs")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    inputs, targets, mask = recall.mqar_batch(g, len(counts), length=length, pairs=torch.tensor(counts),
                                              vocab=vocab)
    _check_batch(inputs, targets, mask, counts, length, vocab)


def test_a_seed_gives_the_same_batch_and_queries_come_in_random_order():
    def draw():
        return recall.mqar_batch(torch.Generator().manual_seed(5), 64, length=64, pairs=8)

    first, second = draw(), draw()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    inputs, _, mask = first
    # the order of the queries is not the order of the keys in most rows
    same_order = sum(inputs[r, mask[r]].tolist() == inputs[r, 0:16:2].tolist() for r in range(64))
    assert same_order < 5
    # every slot is used somewhere: the last one too
    assert bool(mask[:, 62].any()) and bool(mask[:, 16].any())


@pytest.mark.parametrize("kwargs,error,message", [
    ({"pairs": 17}, ValueError, r"pairs must lie in \[1, length // 4 = 16\].*length=64.*got 17 to 17"),
    ({"pairs": 0}, ValueError, r"pairs must lie in \[1, length // 4 = 16\]"),
    ({"pairs": torch.tensor([2, 3])}, ValueError, r"pairs must have shape \(B,\)=\(3,\), got \(2,\)"),
    ({"pairs": torch.tensor([2.0, 3.0, 4.0])}, TypeError, r"pairs must be an int or an integer tensor"),
    ({"pairs": 2.0}, TypeError, r"pairs must be an int or an integer tensor \(B,\), got float"),
    ({"vocab": 64}, ValueError, r"vocab must be > length=64, got 64"),
    ({"length": 3, "pairs": 1}, ValueError, r"length must be >= 4.*got 3"),
    ({"length": 0}, ValueError, r"length must be a positive int, got 0"),
    ({"batch_size": -1}, ValueError, r"batch_size must be a positive int, got -1"),
])
def test_mqar_batch_errors_name_the_argument(kwargs, error, message):
    arguments = {"batch_size": 3, **kwargs}
    with pytest.raises(error, match=message):
        recall.mqar_batch(torch.Generator(), arguments.pop("batch_size"), **arguments)


def test_mqar_batch_wants_a_generator():
    with pytest.raises(TypeError, match="generator must be a torch.Generator, got int"):
        recall.mqar_batch(0, 3)


def test_training_batches_mix_the_configured_pair_counts():
    config = recall.RecallTraining(batch_size=500, min_pairs=3, max_pairs=11)
    _, _, mask = recall.training_batch(torch.Generator().manual_seed(0), config)
    assert set(mask.sum(dim=1).tolist()) == set(range(3, 12))


# --- the mixers against independent computations -------------------------------------------------


def _mixer(kind: str, d: int = 12, heads: int = 3) -> recall._Mixer:
    torch.manual_seed(11)
    mixer = recall._Mixer(kind, d, heads).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.5)
    return mixer


def _projections(mixer, x, heads):
    B, L, d = x.shape
    return [(x @ lin.weight.T + lin.bias).view(B, L, heads, d // heads) for lin in (mixer.q, mixer.k, mixer.v)]


def _read_out(mixer, out):
    B, L = out.shape[:2]
    return out.reshape(B, L, -1) @ mixer.out.weight.T + mixer.out.bias


@pytest.mark.parametrize("window", [None, 1, 4])
def test_softmax_mixer_is_torch_attention_with_rotary_positions(window):
    B, L, d, H = 2, 13, 12, 3
    mixer = _mixer("softmax", d, H)
    x = torch.randn(B, L, d, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in _projections(mixer, x, H))  # (B, H, L, E)
    q, k = rope(q), rope(k)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (j > i - window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    expected = _read_out(mixer, expected.transpose(1, 2))
    torch.testing.assert_close(mixer(x, window), expected, rtol=1e-12, atol=1e-12)


def test_linear_mixer_is_normalised_linear_attention_written_as_matrices():
    B, L, d, H = 2, 11, 12, 3
    mixer = _mixer("linear", d, H)
    x = torch.randn(B, L, d, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in _projections(mixer, x, H))  # (B, H, L, E)
    phi = lambda t: torch.where(t > 0, t + 1, t.exp())  # elu + 1, written out
    scores = (phi(q) @ phi(k).transpose(-1, -2)).tril()  # (B, H, L, L), causal
    expected = (scores / scores.sum(-1, keepdim=True)) @ v
    torch.testing.assert_close(mixer(x), _read_out(mixer, expected.transpose(1, 2)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["delta", "gated_delta"])
@pytest.mark.parametrize("L", [7, 64, 131])
def test_delta_mixers_chunked_equal_the_recurrence(kind, L):
    B, d, H = 2, 12, 3
    mixer = _mixer(kind, d, H)
    x = torch.randn(B, L, d, dtype=torch.float64)
    q, k, v = _projections(mixer, x, H)
    beta = torch.sigmoid(x @ mixer.beta.weight.T + mixer.beta.bias)  # (B, L, H)
    g = torch.zeros(B, L, H, dtype=torch.float64) if kind == "delta" else \
        F.logsigmoid(x @ mixer.gate.weight.T + mixer.gate.bias)
    if kind == "gated_delta":
        assert g.min() < -0.1  # a decay that matters
    out, _ = gated_delta_rule(q, k, v, g, beta, mode="recurrent")
    torch.testing.assert_close(mixer(x), _read_out(mixer, out), rtol=1e-10, atol=1e-10)


def test_short_convolution_is_a_causal_sum_by_hand():
    torch.manual_seed(0)
    conv = recall._ShortConv(5, 3).double()
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    w, b = conv.conv.weight[:, 0, :], conv.conv.bias  # (d, kernel), (d,)
    expected = torch.stack([b + sum(w[:, 2 - s] * x[:, t - s] for s in range(3) if t - s >= 0)
                            for t in range(7)], dim=1)
    torch.testing.assert_close(conv(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mixer", recall.MIXERS)
def test_a_later_token_changes_no_earlier_logit(mixer):
    torch.manual_seed(3)
    model = recall.RecallModel(mixer, vocab=40, d=16, heads=2).double()
    ids = torch.randint(0, 40, (2, 29))
    changed = ids.clone()
    t = 17
    changed[:, t] = (ids[:, t] + 1) % 40
    before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-12)
    assert (after[:, t:] - before[:, t:]).abs().amax() > 1e-3  # the change is seen from t on


def test_a_window_hides_keys_further_back():
    torch.manual_seed(3)
    model = recall.RecallModel("softmax", vocab=40, d=16, heads=2, layers=1, kernel=1).double()
    ids = torch.randint(0, 40, (1, 20))
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 40
    before, after = model(ids, window=4), model(changed, window=4)
    # with one layer and no convolution, token 5 reaches queries 5 .. 8 only
    assert (after[0, 5:9] - before[0, 5:9]).abs().amax() > 1e-3
    torch.testing.assert_close(after[0, 9:], before[0, 9:], rtol=0, atol=1e-12)


# --- sizes, accuracy, errors ---------------------------------------------------------------------


def test_state_size_counts_the_floats_kept():
    assert recall.state_size("softmax", 64, 1, 64) == 2 * 64 * 64
    assert recall.state_size("softmax", 64, 2, 100) == 2 * 64 * 100
    assert recall.state_size("delta", 64, 1, 64) == 64 * 64
    assert recall.state_size("gated_delta", 64, 2, 10**6) == 2 * 32 * 32
    assert recall.state_size("linear", 64, 2, 64) == 2 * 32 * 33  # and the key sum
    with pytest.raises(ValueError, match="heads must divide d=64, got heads=3"):
        recall.state_size("delta", 64, 3, 8)
    with pytest.raises(ValueError, match="mixer must be one of 'softmax', .*got 'mamba'"):
        recall.state_size("mamba", 64, 1, 8)


def test_state_size_is_what_the_linear_functions_keep():
    from attention_ref.linear import linear_attention
    d, H, L = 12, 3, 9
    q = k = torch.rand(1, L, H, d // H)
    _, state = gated_delta_rule(q, k, q, torch.zeros(1, L, H), torch.rand(1, L, H), output_final_state=True)
    assert state.numel() == recall.state_size("delta", d, H, L)
    _, state = linear_attention(q, k, q, normalize=True, output_final_state=True)
    assert state.numel() == recall.state_size("linear", d, H, L)


def test_accuracy_counts_query_positions_only():
    batch = recall.mqar_batch(torch.Generator().manual_seed(0), 4, length=16, pairs=torch.tensor([1, 2, 3, 4]),
                              vocab=32)
    _, targets, mask = batch
    right = F.one_hot(targets.clamp(min=0), 32).double()  # (B, L, V), right at the queries
    assert recall.accuracy(lambda ids: right, batch) == 1.0
    # wrong at the first query of the last row only: 9 of 10 right
    wrong = right.clone()
    first = mask[3].nonzero()[0, 0]
    wrong[3, first] = F.one_hot(torch.tensor(0), 32)
    assert recall.accuracy(lambda ids: wrong, batch) == pytest.approx(0.9)
    # what happens off the queries does not count
    noisy = right.clone()
    noisy[~mask] = torch.rand(int((~mask).sum()), 32, dtype=torch.float64)
    assert recall.accuracy(lambda ids: noisy, batch) == 1.0
    with pytest.raises(ValueError, match="batch must be \\(inputs, targets, mask\\)"):
        recall.accuracy(lambda ids: right, batch[:2])


@pytest.mark.parametrize("kwargs,error,message", [
    ({"mixer": "mamba"}, ValueError, "mixer must be one of 'softmax', 'linear', 'delta', 'gated_delta', got 'mamba'"),
    ({"d": 12, "heads": 5}, ValueError, "heads must divide d into even head sizes: got d=12, heads=5"),
    ({"d": 12, "heads": 4}, ValueError, "heads must divide d into even head sizes: got d=12, heads=4"),
    ({"layers": 0}, ValueError, "layers must be a positive int, got 0"),
    ({"mlp": 1}, TypeError, "mlp must be a bool, got int"),
])
def test_model_errors_name_the_argument(kwargs, error, message):
    arguments = {"mixer": "softmax", **kwargs}
    with pytest.raises(error, match=message):
        recall.RecallModel(arguments.pop("mixer"), **arguments)


def test_forward_errors_name_the_argument():
    model = recall.RecallModel("delta", vocab=16, d=8)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab=16\), got 0 to 16"):
        model(torch.tensor([[0, 16]]))
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="window applies to the softmax mixer only, got mixer='delta'"):
        model(torch.tensor([[0, 1]]), window=2)


def test_the_mixers_are_matched_in_size():
    sizes = {m: sum(p.numel() for p in recall.RecallModel(m).parameters()) for m in recall.MIXERS}
    # the same projections; the delta rules add a step (and a gate) of d + 1 weights per head
    # in each of the 2 layers
    assert sizes["linear"] == sizes["softmax"]
    assert sizes["delta"] - sizes["softmax"] == 2 * 65 and sizes["gated_delta"] - sizes["delta"] == 2 * 65


# --- the shipped models ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=recall.MIXERS)
def shipped(request):
    return request.param, *recall.load_recall(request.param)


@pytest.fixture
def recorded_threads(shipped):
    threads = torch.get_num_threads()
    torch.set_num_threads(shipped[2]["threads"])
    yield
    torch.set_num_threads(threads)


def test_shipped_models_reproduce_their_recorded_accuracy(shipped, recorded_threads):
    mixer, model, record = shipped
    assert model.config["mixer"] == mixer and not model.training
    training = record["training"]
    counts = [int(p) for p in record["accuracy"]]
    assert counts == list(range(training["min_pairs"], training["max_pairs"] + 1))
    measured = recall.accuracy_by_pairs(model, counts, length=training["length"], vocab=training["vocab"])
    for p in counts:
        # to one query of the 256 * p (the sums' rounding may tip a near tie)
        assert measured[p] == pytest.approx(record["accuracy"][str(p)], abs=1.01 / (256 * p)), p


def test_shipped_records_hold_the_runs(shipped):
    _, model, record = shipped
    assert record["model"] == model.config
    assert len(record["loss"]) == record["training"]["steps"]
    assert record["loss"][0] > math.log(record["training"]["vocab"]) - 0.2  # chance at the start
    assert record["seconds"] > 0 and record["torch"] and record["threads"] >= 1


def test_first_training_steps_rerun_from_the_seed_equal_the_record(shipped, recorded_threads):
    mixer, _, record = shipped
    steps = 20
    config = recall.RecallTraining(**record["training"])
    fresh = recall.RecallModel(**record["model"])
    log = recall.train(fresh, config, first=steps)
    gap = max(abs(a - b) for a, b in zip(log["loss"], record["loss"][:steps]))
    assert gap < 1e-4, f"{mixer}: largest difference {gap:.2e}"


def test_load_recall_refuses_another_mixers_file(tmp_path):
    model = recall.RecallModel("linear", vocab=16, d=8)
    path = tmp_path / "m.pt"
    recall.save_recall(str(path), model, {})
    with pytest.raises(ValueError, match="mixer must match the file's, 'linear', got 'delta'"):
        recall.load_recall("delta", str(path))
    loaded, record = recall.load_recall("linear", path.read_bytes())
    assert record == {} and loaded.config == model.config


# --- block-sparse attention in place of the trained full attention ---------------------------------

SPARSE = [recall.MoBA(chunk_size=3, topk=2), recall.NSASelected(block_size=3, block_counts=4)]


def _sparse_by_hand(spec, q, k, v):
    """``(B, H, L, E)`` each: `moba_attention`, or `nsa_attention` with only the selected branch gated on."""
    if isinstance(spec, recall.MoBA):
        return moba_attention(q, k, v, chunk_size=spec.chunk_size, topk=spec.topk, topk1=spec.topk1)
    on = q.new_ones(q.shape[:-1])  # (B, H, L): one gate per query head and token
    return nsa_attention(q, k, v, 0 * on, on, 0 * on, block_size=spec.block_size,
                         block_counts=spec.block_counts, window_size=1)


@pytest.mark.parametrize("spec", SPARSE, ids=lambda spec: type(spec).__name__)
def test_sparse_layers_are_moba_and_nsa_on_the_rotated_projections(spec):
    torch.manual_seed(5)
    B, L, d, H = 2, 13, 12, 3
    model = recall.RecallModel("softmax", vocab=40, d=d, heads=H, layers=2).double()
    seen = []

    def check(mixer, args, output):
        x = args[0]  # (B, L, d), the mixer's input
        q, k, v = (t.transpose(1, 2) for t in _projections(mixer, x, H))  # (B, H, L, E)
        q, k = rope(q), rope(k)
        expected = _sparse_by_hand(spec, q, k, v)
        torch.testing.assert_close(output, _read_out(mixer, expected.transpose(1, 2)), rtol=1e-12, atol=1e-12)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seen.append((expected - full).abs().amax().item())

    hooks = [block.mix.register_forward_hook(check) for block in model.blocks]
    try:
        model(torch.randint(0, 40, (B, L)), sparse=spec)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == 2 and min(seen) > 1e-3  # both layers, each other than full attention


@pytest.fixture(scope="module")
def softmax_model():
    return recall.load_recall("softmax")[0]


@pytest.mark.parametrize("spec", [
    recall.MoBA(chunk_size=8, topk=8),
    recall.MoBA(chunk_size=7, topk=10),  # 10 chunks, the last of 1 key
    recall.MoBA(chunk_size=5, topk=1, topk1="full"),
    recall.NSASelected(block_size=8, block_counts=8),
    recall.NSASelected(block_size=5, block_counts=13),  # 13 blocks, the last of 4 keys
], ids=repr)
def test_a_budget_covering_every_key_is_full_attention(softmax_model, spec):
    batch = recall.eval_batch(16, size=32)
    full = softmax_model(batch[0])
    torch.testing.assert_close(softmax_model(batch[0], sparse=spec), full, rtol=1e-5, atol=1e-5)
    assert recall.accuracy(softmax_model, batch, sparse=spec) == recall.accuracy(softmax_model, batch)


def test_a_smaller_budget_changes_the_answers(softmax_model):
    batch = recall.eval_batch(16, size=32)
    full = recall.accuracy(softmax_model, batch)
    for spec in (recall.MoBA(chunk_size=4, topk=2), recall.NSASelected(block_size=4, block_counts=3)):
        assert recall.accuracy(softmax_model, batch, sparse=spec) < full - 0.2, spec


def test_a_query_reads_at_most_blocks_times_block_size_keys():
    # the page's budget: a query reads its selected blocks, its own only up to itself
    gen = torch.Generator().manual_seed(0)
    L, size, blocks = 64, 4, 4
    q, k = (torch.randn(2, 1, L, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    causal = causal_mask(L, L)
    moba_keys = moba_mask(q, k, size, blocks).sum(-1)  # (2, 1, L)
    chosen = select_blocks(q, compress_blocks(k, size), block_size=size, block_counts=blocks)
    nsa_keys = (topk_mask(block_topk_indices(chosen, size, L), L) & causal).sum(-1)  # (2, 1, L)
    budget = size * blocks
    for keys in (moba_keys, nsa_keys):
        assert keys.max() == budget
        # once enough blocks lie behind it, a query at the end of its block reads all ...
        assert bool((keys[..., budget - 1::size] == budget).all())
        # ... and one at the start of its block reads one key of it
        assert bool((keys[..., budget::size] == budget - size + 1).all())


@pytest.mark.parametrize("make,error,message", [
    (lambda: recall.MoBA(chunk_size=0, topk=2), ValueError, "MoBA.chunk_size must be a positive int, got 0"),
    (lambda: recall.MoBA(chunk_size=8, topk=2.0), TypeError, "MoBA.topk must be an int, got float"),
    (lambda: recall.MoBA(chunk_size=8, topk=1), ValueError, "MoBA.topk1 must be given when topk = 1"),
    (lambda: recall.MoBA(chunk_size=8, topk=2, topk1="local"), ValueError,
     "MoBA.topk1 must be one of 'block_local', 'full' or None, got 'local'"),
    (lambda: recall.NSASelected(block_size=4, block_counts=0), ValueError,
     "NSASelected.block_counts must be a positive int, got 0"),
    (lambda: recall.NSASelected(block_size=True, block_counts=2), TypeError,
     "NSASelected.block_size must be an int, got bool"),
])
def test_sparse_spec_errors_name_the_field(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_forward_refuses_sparse_where_it_does_not_apply():
    ids = torch.tensor([[0, 1, 2]])
    spec = recall.MoBA(chunk_size=2, topk=2)
    with pytest.raises(ValueError, match=r"window and sparse must not be given together .*got window=2 and "
                                         r"sparse=MoBA\(chunk_size=2, topk=2, topk1=None\)"):
        recall.RecallModel("softmax", vocab=16, d=8)(ids, window=2, sparse=spec)
    with pytest.raises(ValueError, match="sparse applies to the softmax mixer only, got mixer='delta'"):
        recall.RecallModel("delta", vocab=16, d=8)(ids, sparse=spec)
    with pytest.raises(TypeError, match="sparse must be a MoBA, an NSASelected or None, got str"):
        recall.RecallModel("softmax", vocab=16, d=8)(ids, sparse="moba")
