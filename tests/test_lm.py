"""The character-level language model of page 11 (attention_ref.lm).

The model is checked against an independent forward pass written here with PyTorch's own
functions (F.scaled_dot_product_attention, F.layer_norm) in float64; the KV-cache path against
the full pass; generation with and without the cache; the shipped weights against the record
of the run that made them (the first training steps rerun from the same seed give the
recorded losses).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from attention_ref import lm


@pytest.fixture(scope="module")
def shipped():
    return lm.load_char_lm()


@pytest.fixture(scope="module")
def corpus():
    text = lm.load_corpus()
    tok = lm.CharTokenizer.from_text(text)
    train_text, held_out = lm.split_corpus(text)
    return tok, tok.encode(train_text), tok.encode(held_out)


def small(**kw) -> lm.CharLM:
    torch.manual_seed(0)
    config = dict(vocab_size=7, context=13, layers=2, heads=2, width=12)
    config.update(kw)
    model = lm.CharLM(lm.LMConfig(**config)).double()
    with torch.no_grad():  # biases and norms away from their 0/1 start, so they count
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def independent_forward(model: lm.CharLM, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits, computed with torch's functions and a rotation written out here."""
    c = model.config
    B, L = ids.shape
    D = c.width // c.heads
    sd = model.state_dict()
    x = sd["embed.weight"][ids]
    if c.positions == "learned":
        x = x + sd["position.weight"][:L]
    pos = torch.arange(L, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    cos, sin = (pos[:, None] * theta).cos(), (pos[:, None] * theta).sin()  # (L, D/2)

    def rotate(t):  # (B, H, L, D): pairs (j, j + D/2)
        a, b = t[..., : D // 2], t[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    for i in range(c.layers):
        p = f"blocks.{i}."
        h = F.layer_norm(x, (c.width,), sd[p + "norm1.weight"], sd[p + "norm1.bias"])
        q, k, v = F.linear(h, sd[p + "qkv.weight"], sd[p + "qkv.bias"]).split(c.width, dim=-1)
        q, k, v = (t.view(B, L, c.heads, D).transpose(1, 2) for t in (q, k, v))
        if c.positions == "rope":
            q, k = rotate(q), rotate(k)
        if c.sinks:  # softmax over [sink | scores], the sink's weight dropped (gpt-oss)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            sink = sd[p + "sinks"].view(1, -1, 1, 1).expand(B, -1, L, 1)
            a = torch.softmax(torch.cat([sink, scores], dim=-1), dim=-1)[..., 1:] @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(B, L, c.width)
        x = x + F.linear(a, sd[p + "out.weight"], sd[p + "out.bias"])
        if c.mlp:
            h = F.layer_norm(x, (c.width,), sd[p + "norm2.weight"], sd[p + "norm2.bias"])
            h = F.gelu(F.linear(h, sd[p + "up.weight"], sd[p + "up.bias"]), approximate="tanh")
            x = x + F.linear(h, sd[p + "down.weight"], sd[p + "down.bias"])
    x = F.layer_norm(x, (c.width,), sd["norm.weight"], sd["norm.bias"])
    return x @ sd["embed.weight"].T


@pytest.mark.parametrize("kw", [{}, {"positions": "none"}, {"positions": "learned"}, {"mlp": False},
                                {"layers": 3, "heads": 3}, {"sinks": True}])
def test_forward_equals_torch_in_float64(kw):
    model = small(**kw)
    ids = torch.randint(0, 7, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    torch.testing.assert_close(ours, independent_forward(model, ids), rtol=1e-10, atol=1e-10)


def test_learned_positions_stop_at_the_context():
    model = small(positions="learned")
    caches = model.new_caches(max_length=20)
    model(torch.zeros(1, 13, dtype=torch.long), caches=caches)
    with pytest.raises(ValueError, match="ids: learned positions stop at context = 13, got positions up to 13"):
        model(torch.zeros(1, 1, dtype=torch.long), caches=caches)


def test_causal_no_leak_from_the_future():
    model = small()
    ids = torch.randint(0, 7, (1, 11), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 7
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_kv_cache_in_chunks_equals_the_full_pass():
    model = small()
    ids = torch.randint(0, 7, (2, 13), generator=torch.Generator().manual_seed(3))
    caches = model.new_caches(batch=2)
    with torch.no_grad():
        full, full_w = model(ids, return_weights=True)
        parts = [model(ids[:, a:b], caches=caches, return_weights=True) for a, b in ((0, 5), (5, 6), (6, 13))]
    torch.testing.assert_close(torch.cat([p[0] for p in parts], dim=1), full, rtol=1e-12, atol=1e-12)
    # the last chunk's weights are the last rows of the full maps
    torch.testing.assert_close(parts[2][1][1], full_w[1][:, :, 6:, :], rtol=1e-12, atol=1e-12)


def test_weights_are_causal_and_sum_to_one():
    model = small()
    ids = torch.randint(0, 7, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, weights = model(ids, return_weights=True)
    for w in weights:
        assert w.shape == (2, 2, 9, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 9, dtype=w.dtype))
        assert (w.triu(1) == 0).all()


def test_ablating_a_head_removes_its_output():
    model = small()
    ids = torch.randint(0, 7, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = model(ids)
        ablated = model(ids, ablate=[(1, 0)])
        # by hand: zero head 0's slice of the out projection's input in layer 1
        w = model.blocks[1].out.weight
        saved = w.clone()
        w[:, :6] = 0
        by_hand = model(ids)
        w.copy_(saved)
    assert not torch.allclose(base, ablated)
    torch.testing.assert_close(ablated, by_hand, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"ablate: no head \(2, 0\) in 2 layers x 2 heads"):
        model(ids, ablate=[(2, 0)])


def test_bad_inputs_are_named():
    model = small()
    with pytest.raises(ValueError, match="ids: at most context = 13 tokens, got L = 14"):
        model(torch.zeros(1, 14, dtype=torch.long))
    with pytest.raises(TypeError, match=r"ids must be an int64 tensor \(B, L\), got torch.float32"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 7\), got values 0..7"):
        model(torch.tensor([[0, 7]]))
    with pytest.raises(ValueError, match="width must be heads x an even head size"):
        lm.LMConfig(vocab_size=5, width=12, heads=4)
    with pytest.raises(ValueError, match="positions must be 'rope', 'learned' or 'none', got 'alibi'"):
        lm.LMConfig(vocab_size=5, positions="alibi")


def test_tokenizer_round_trip_and_errors():
    tok = lm.CharTokenizer.from_text("hello world")
    assert tok.chars == " dehlorw"
    assert tok.decode(tok.encode("world hello")) == "world hello"
    with pytest.raises(ValueError, match=r"text: 2 characters outside the vocabulary of 8: 'é' \(at index 1\), "
                                         r"'!' \(at index 5\)"):
        tok.encode("hé lo!")
    assert tok.unknown("hé lo!") == [(1, "é"), (5, "!")]
    with pytest.raises(ValueError, match=r"given more than once: \['a'\]"):
        lm.CharTokenizer("aba")
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 8\), got \[8\]"):
        tok.decode([8])


def test_generate_with_and_without_cache_agree():
    model = small()
    prompt = torch.tensor([1, 2, 3])
    for T, k in ((0.0, None), (1.0, None), (0.7, 3)):
        a = lm.generate(model, prompt, 9, temperature=T, top_k=k, generator=torch.Generator().manual_seed(0))
        b = lm.generate(model, prompt, 9, temperature=T, top_k=k, generator=torch.Generator().manual_seed(0),
                        use_cache=False)
        assert a.tolist() == b.tolist()
        assert a[:3].tolist() == [1, 2, 3] and len(a) == 12


def test_generate_greedy_is_argmax_and_top_k_1_is_greedy():
    model = small()
    prompt = torch.tensor([[4, 0]])
    greedy = lm.generate(model, prompt, 5, temperature=0.0)
    ids = prompt
    for _ in range(5):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert greedy.tolist() == ids.tolist()
    top1 = lm.generate(model, prompt, 5, temperature=1.7, top_k=1, generator=torch.Generator().manual_seed(3))
    assert top1.tolist() == greedy.tolist()


def test_sampling_follows_temperature_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([lm._sample(logits, 0.5, None, g) for _ in range(4000)]).flatten()
    expected = torch.softmax(logits[0].double() / 0.5, -1)
    observed = torch.bincount(draws, minlength=4).double() / 4000
    assert (observed - expected).abs().max() < 0.03
    draws = torch.stack([lm._sample(logits, 1.0, 2, g) for _ in range(500)]).flatten()
    assert set(draws.tolist()) == {0, 1}


def test_generate_refuses_bad_arguments():
    model = small()
    prompt = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"text must fit the context: prompt of 2 \+ steps 12 > context = 13"):
        lm.generate(model, prompt, 12)
    assert len(lm.generate(model, prompt, 12, use_cache=False)) == 14
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1"):
        lm.generate(model, prompt, 2, temperature=-1)
    with pytest.raises(ValueError, match="top_k must be None or an int >= 1, got 0"):
        lm.generate(model, prompt, 2, top_k=0)
    with pytest.raises(ValueError, match="steps must be an int >= 0, got -1"):
        lm.generate(model, prompt, -1)
    with pytest.raises(ValueError, match="prompt: at least one character"):
        lm.generate(model, torch.zeros(0, dtype=torch.long), 2)


def witten_bell_by_hand(train: list[int], held: list[int], V: int, n: int) -> list[float]:
    """Interpolated Witten-Bell, written from its definition with dictionaries and Python floats."""
    from collections import Counter

    def prob(w: int, context: tuple[int, ...]) -> float:
        if not context:
            counts = Counter(train)
            return (counts[w] + len(counts) / V) / (len(train) + len(counts))
        k = len(context)
        followers = Counter(tuple(train[i + 1 - k:i + 2]) for i in range(k - 1, len(train) - 1)
                            if tuple(train[i + 1 - k:i + 1]) == context)
        c = sum(followers.values())
        lower = prob(w, context[1:])
        if c == 0:
            return lower
        return (followers[context + (w,)] + len(followers) * lower) / (c + len(followers))

    return [-math.log(prob(held[i], tuple(held[max(0, i - n + 1):i]))) for i in range(1, len(held))]


def test_ngram_losses_by_hand():
    train = torch.tensor([0, 0, 1, 0])
    held = torch.tensor([0, 1, 1])
    # unigram: counts [3, 1] of 4, two distinct characters: P(1) = (1 + 2 / 2) / (4 + 2)
    assert lm.ngram_loss(train, held, 2, 1) == pytest.approx(-math.log(2 / 6))
    # bigram: after 0 came 0 and 1 (c = 2, t = 2): P(1 | 0) = (1 + 2 * 2 / 6) / 4; after 1 came 0
    # (c = 1, t = 1): P(1 | 1) = (0 + 1 * 2 / 6) / 2
    assert lm.ngram_losses(train, held, 2, 2).tolist() == pytest.approx(
        [-math.log((1 + 4 / 6) / 4), -math.log((2 / 6) / 2)])


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_ngram_losses_equal_the_definition_on_random_text(n):
    g = torch.Generator().manual_seed(n)
    V = 4
    train = torch.randint(0, V - 1, (300,), generator=g)  # id 3 never occurs in training
    held = torch.randint(0, V, (60,), generator=g)
    expected = witten_bell_by_hand(train.tolist(), held.tolist(), V, n)
    torch.testing.assert_close(lm.ngram_losses(train, held, V, n), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_an_ngram_distribution_sums_to_one(n):
    g = torch.Generator().manual_seed(0)
    V = 5
    train = torch.randint(0, V, (200,), generator=g)
    for context in ([1, 2, 3], [4, 4, 4], [0]):  # seen and perhaps unseen contexts
        total = sum(math.exp(-lm.ngram_losses(train, torch.tensor(context + [w]), V, n)[-1].item())
                    for w in range(V))
        assert total == pytest.approx(1.0, abs=1e-12)


def test_ngram_losses_refuse_what_they_cannot_count():
    ids = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"eval_ids: ids must lie in \[0, vocab_size = 2\), got \[0, 2\]"):
        lm.ngram_losses(ids[:2], ids, 2, 1)
    with pytest.raises(TypeError, match="train_ids must be a 1-d int64 tensor, got torch.float32"):
        lm.ngram_losses(ids.float(), ids, 3, 1)
    with pytest.raises(ValueError, match=r"vocab_size \*\* n must stay below 2 \*\* 62"):
        lm.ngram_losses(ids, ids, 73, 11)
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        lm.ngram_losses(ids, ids, 3, 0)
    with pytest.raises(ValueError, match="eval_ids: need at least 2 ids"):
        lm.ngram_losses(ids, ids[:1], 3, 1)


def test_evaluate_equals_cross_entropy_by_hand():
    model = small()
    ids = torch.randint(0, 7, (40,), generator=torch.Generator().manual_seed(6))
    windows = ids[:39].view(3, 13)
    with torch.no_grad():
        logits = model(windows)
    expected = F.cross_entropy(logits.reshape(-1, 7), ids[1:40].view(3, 13).reshape(-1)).item()
    assert lm.evaluate(model, ids) == pytest.approx(expected, rel=1e-12)
    per = lm.position_losses(model, ids)  # (windows, context): each character's own loss
    torch.testing.assert_close(per, F.cross_entropy(logits.transpose(1, 2), ids[1:40].view(3, 13), reduction="none"))
    torch.testing.assert_close(lm.position_losses(model, ids, max_windows=2), per[:2])
    with pytest.raises(TypeError, match=r"ids must be a 1-d int64 tensor, got torch.float32 of shape \(40,\)"):
        lm.position_losses(model, ids.float())
    with pytest.raises(ValueError, match=r"ids: ids must lie in \[0, vocab_size = 7\), got \[0, 9\]"):
        lm.position_losses(model, torch.cat([ids, torch.tensor([9])]))


def test_head_scores_on_perfect_patterns():
    L, P = 10, 4
    prev = torch.zeros(1, 1, L, L)
    prev[0, 0, 0, 0] = 1
    for i in range(1, L):
        prev[0, 0, i, i - 1] = 1
    assert lm.previous_token_score(prev).item() == 1.0
    ind = torch.zeros(1, 1, 2 * P, 2 * P)
    for i in range(P, 2 * P):
        ind[0, 0, i, i - P + 1] = 1
    assert lm.induction_score(ind, P).item() == 1.0
    assert lm.induction_score(prev, P).item() == 0.0
    with pytest.raises(ValueError, match=r"period must lie in \[1, L = 10\), got 10"):
        lm.induction_score(prev, 10)


def test_copy_task_copies_and_marks_what_is_predictable():
    g = torch.Generator().manual_seed(0)
    inputs, targets, copied, distance = lm.copy_task(g, 64, 64, 73, min_span=20, max_span=31)
    assert inputs.shape == targets.shape == copied.shape == (64, 64)
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    for b in range(64):
        seq = torch.cat([inputs[b], targets[b, -1:]])  # the context + 1 characters
        where = copied[b].nonzero().flatten()
        # targets t .. t + s - 2 are predictable: the copy starts at second = where[0], is s long
        second, s = int(where[0]), len(where) + 1
        assert 20 <= s <= 31 and where.tolist() == list(range(second, second + s - 1))
        span = seq[second:second + s]
        assert torch.equal(seq[second - distance[b]:second - distance[b] + s], span)
    # a perfect induction map scores 1 in copy_attention
    perfect = torch.zeros(64, 1, 64, 64)
    b, i = copied.nonzero(as_tuple=True)
    perfect[b, 0, i, i - distance[b] + 1] = 1
    assert lm.copy_attention(perfect, copied, distance).item() == 1.0
    with pytest.raises(ValueError, match="2 \\* max_span \\+ 1 <= context"):
        lm.copy_task(g, 1, 16, 5, max_span=8)


def test_shipped_weights_reproduce_the_recorded_first_steps(shipped, corpus):
    model, tok, record = shipped
    _, train_ids, _ = corpus
    config = lm.TrainConfig(**{**record["train_config"], "steps": 20})
    # with the worker's threads, not the record's two: the sums' order moves the losses by less than
    # 1e-6 here (4.8e-7 with one thread and with two), and two threads on a loaded machine ran this
    # test 2.4 times slower (one core's share each: their barriers wait on each other)
    fresh = lm.CharLM(model.config)
    log = lm.train(fresh, train_ids, config)
    recorded = record["log"]["train_loss"][:20]
    assert max(abs(a - b) for a, b in zip(log.train_loss, recorded)) < 1e-4
    assert recorded[0] > math.log(len(tok)) - 0.1 and recorded[-1] < recorded[0] - 0.5


def test_shipped_weights_give_the_recorded_held_out_loss(shipped, corpus):
    model, tok, record = shipped
    tok2, _, held_ids = corpus
    assert tok.chars == tok2.chars
    assert lm.evaluate(model, held_ids) == pytest.approx(record["held_out_loss_float16"], abs=1e-4)
    assert record["log"]["eval_loss"][-1] < 1.7


def test_shipped_sinks_model_gives_its_recorded_loss_and_uses_its_sinks(corpus):
    model, tok, record = lm.load_char_lm("sinks")
    _, _, held_ids = corpus
    assert model.config.sinks and all(b.sinks is not None for b in model.blocks)
    assert lm.evaluate(model, held_ids) == pytest.approx(record["held_out_loss_float16"], abs=1e-4)
    with torch.no_grad():
        _, weights = model(held_ids[:256].view(2, 128), return_weights=True)
    on_sink = torch.stack([1 - w.sum(-1).mean((0, 2)) for w in weights])
    assert on_sink.min() >= 0 and on_sink.max() > 0.3


def test_kv_cache_with_sinks_equals_the_full_pass():
    model = small(sinks=True)
    ids = torch.randint(0, 7, (1, 10), generator=torch.Generator().manual_seed(7))
    caches = model.new_caches()
    with torch.no_grad():
        full = model(ids)
        stepped = torch.cat([model(ids[:, i:i + 1], caches=caches) for i in range(10)], dim=1)
    torch.testing.assert_close(stepped, full, rtol=1e-12, atol=1e-12)


def test_mask_mod_replaces_the_causal_mask():
    from attention_ref import mods

    model = small()
    ids = torch.randint(0, 7, (1, 13), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        causal = model(ids)
        same = model(ids, mask_mod=mods.causal())
        window = model(ids, mask_mod=mods.sliding_window(2))
        longer = model(torch.cat([ids, ids], 1), mask_mod=mods.sliding_window(2), max_length=26)
    torch.testing.assert_close(same, causal, rtol=0, atol=0)
    torch.testing.assert_close(window[:, :3], causal[:, :3], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(window[:, 3:], causal[:, 3:])
    assert longer.shape == (1, 26, 7)
    with pytest.raises(ValueError, match="mask_mod: not with caches"):
        model(ids, caches=model.new_caches(), mask_mod=mods.causal())
    with pytest.raises(ValueError, match="ids: at most max_length = 20 tokens, got L = 26"):
        model(torch.cat([ids, ids], 1), max_length=20)


@pytest.mark.parametrize("kw", [{}, {"positions": "none"}, {"positions": "learned"}, {"mlp": False},
                                {"layers": 3, "heads": 3}])
def test_forward_trace_agrees_with_the_forward_pass(kw):
    model = small(**kw)
    c = model.config
    D = c.width // c.heads
    ids = torch.randint(0, 7, (11,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits, weights = model(ids[None], return_weights=True)  # the whole text: causal, so each prefix's
    for position, layer, head in ((10, c.layers - 1, c.heads - 1), (4, 0, 1), (0, 1, 0), (7, 1, 0)):
        t = lm.forward_trace(model, ids, position, layer, head)
        exact = {"rtol": 1e-12, "atol": 1e-12}
        # the two ends: the model's own probabilities and attention weights
        torch.testing.assert_close(t["probabilities"], torch.softmax(logits[0, position], dim=-1), **exact)
        torch.testing.assert_close(t["weights"], weights[layer][0, head, position, : position + 1], **exact)
        # and every stage follows from the one before
        block = model.blocks[layer]
        assert int(t["id"]) == int(ids[position])
        torch.testing.assert_close(t["embedding"], model.embed.weight[ids[position]], **exact)
        if layer == 0:
            extra = model.position.weight[position] if c.positions == "learned" else 0
            torch.testing.assert_close(t["block_input"], t["embedding"] + extra, **exact)
        with torch.no_grad():
            torch.testing.assert_close(t["norm1"], block.norm1(t["block_input"]), **exact)
            q, k, v = block.qkv(t["norm1"]).view(3, c.heads, D)[:, head]
            torch.testing.assert_close(torch.stack([t["q"], t["k"], t["v"]]), torch.stack([q, k, v]), **exact)
        for name in ("q", "k"):  # a rotation keeps the length; at position 0 (or without RoPE) it is none
            torch.testing.assert_close(t[name + "_rotated"].norm(), t[name].norm(), **exact)
            if position == 0 or c.positions != "rope":
                torch.testing.assert_close(t[name + "_rotated"], t[name], **exact)
        torch.testing.assert_close(t["scores"][-1], t["q_rotated"] @ t["k_rotated"], **exact)
        torch.testing.assert_close(t["scaled"], t["scores"] / math.sqrt(D), **exact)
        torch.testing.assert_close(t["weights"], torch.softmax(t["scaled"], dim=-1), **exact)
        torch.testing.assert_close(t["heads"][head * D:(head + 1) * D], t["head_output"], **exact)
        with torch.no_grad():
            torch.testing.assert_close(t["out"], block.out(t["heads"]), **exact)
        torch.testing.assert_close(t["residual"], t["block_input"] + t["out"], **exact)
        if c.mlp:
            torch.testing.assert_close(t["gelu"], F.gelu(t["up"], approximate="tanh"), **exact)
            torch.testing.assert_close(t["block_output"], t["residual"] + t["down"], **exact)
        else:
            assert not {"norm2", "up", "gelu", "down"} & set(t)
            torch.testing.assert_close(t["block_output"], t["residual"], **exact)
        torch.testing.assert_close(t["logits"], t["final_norm"] @ model.embed.weight.T, **exact)
        assert all(value.dtype == torch.float64 for name, value in t.items() if name != "id")


def test_forward_trace_of_the_shipped_model_leaves_it_as_it_was(shipped):
    model, tok, _ = shipped
    ids = tok.encode("To be, or not to b")
    t = lm.forward_trace(model, ids, position=17, layer=1, head=2)
    with torch.no_grad():
        logits, weights = model(ids[None], return_weights=True)  # float32
    assert model.embed.weight.dtype == torch.float32 and not any(m._forward_hooks for m in model.modules())
    assert not any(value.requires_grad for value in t.values())  # numbers to read, not a graph
    torch.testing.assert_close(t["probabilities"].float(), torch.softmax(logits[0, -1], -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(t["weights"].float(), weights[1][0, 2, -1], rtol=0, atol=1e-5)
    assert list(t) == ["id", "embedding", "block_input", "norm1", "q", "k", "v", "q_rotated", "k_rotated",
                       "scores", "scaled", "weights", "head_output", "heads", "out", "residual", "norm2", "up",
                       "gelu", "down", "block_output", "final_norm", "logits", "probabilities"]


def test_forward_trace_refuses_what_it_cannot_trace():
    model = small()
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"position must be an int in \[0, 3\), got 3"):
        lm.forward_trace(model, ids, 3, 0, 0)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\), got 2"):
        lm.forward_trace(model, ids, 0, 2, 0)
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 2\), got -1"):
        lm.forward_trace(model, ids, 0, 0, -1)
    with pytest.raises(ValueError, match=r"ids: 1 to context = 13 ids, got 14"):
        lm.forward_trace(model, torch.zeros(14, dtype=torch.long), 0, 0, 0)
    with pytest.raises(TypeError, match=r"ids must be a 1-d int64 tensor, got torch.int64 of shape \(1, 3\)"):
        lm.forward_trace(model, ids[None], 0, 0, 0)
    with pytest.raises(ValueError, match="models with sinks are not traced"):
        lm.forward_trace(small(sinks=True), ids, 0, 0, 0)


def test_browser_export_holds_every_weight(shipped):
    model, tok, _ = shipped
    manifest, raw = lm.browser_export(model, tok)
    halves = torch.frombuffer(bytearray(raw), dtype=torch.float16)
    assert manifest["numbers"] == halves.numel() == model.num_parameters()
    state = model.state_dict()
    assert [t["name"] for t in manifest["tensors"]] == list(state)
    for t in manifest["tensors"]:
        value = state[t["name"]]
        got = halves[t["offset"]:t["offset"] + value.numel()].view(t["shape"]).float()
        assert torch.equal(got, value)  # the shipped weights are float16 values already
    assert manifest["chars"] == tok.chars and manifest["config"]["context"] == model.config.context


def test_widget_html_escapes_and_checks():
    html = lm.widget_html("../x.json", prompt='a "b" <c>\n')
    assert 'data-prompt="a &quot;b&quot; &lt;c&gt;\n"' in html and 'data-src="../x.json"' in html
    with pytest.raises(ValueError, match="temperature must lie in \\[0, 2\\], got 3"):
        lm.widget_html("x", temperature=3)
    with pytest.raises(ValueError, match="top_k must be an int >= 1, got 0"):
        lm.widget_html("x", top_k=0)


def test_train_and_evaluate_name_bad_arguments():
    model = small().float()
    config = lm.TrainConfig(steps=1)
    with pytest.raises(TypeError, match=r"train_ids must be a 1-d int64 tensor \(or pass make_batch=\), got NoneType"):
        lm.train(model, None, config)
    with pytest.raises(ValueError, match=r"train_ids: need more than context \+ 1 = 14 ids, got 5"):
        lm.train(model, torch.zeros(5, dtype=torch.long), config)
    with pytest.raises(ValueError, match="max_windows"):
        lm.evaluate(model, torch.zeros(40, dtype=torch.long), max_windows=0)
    assert lm.warmup_cosine(0, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
    assert lm.warmup_cosine(100, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
    assert lm.warmup_cosine(55, 1.0, 0.1, 10, 100) == pytest.approx(0.55)


def test_the_widgets_window_jumps_and_always_reads_between_65_and_128_characters():
    for n in range(1000):
        start = lm.widget_window_start(n)
        assert start % 64 == 0 and (start == 0 if n <= 128 else 65 <= n - start <= 128), n
        assert start >= lm.widget_window_start(max(n - 1, 0))  # it never moves back
    assert lm.widget_window_start(300, context=100, hop=100) == 200
    assert [lm.widget_window_start(n, context=64) for n in (64, 65, 96, 97)] == [0, 32, 32, 64]  # hops of 32
    with pytest.raises(ValueError, match="hop must be at most context \\(128\\), got 129"):
        lm.widget_window_start(200, hop=129)
    with pytest.raises(ValueError, match="length must be an int >= 0, got -1"):
        lm.widget_window_start(-1)
