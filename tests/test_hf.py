"""Real transformers architectures run through attention_ref (attention_ref.hf), offline.

Small Llama, Mistral (sliding window) and Gemma 2 (sliding window + soft-capping) models are
built from their configs with random weights (no download). With attention_ref registered,
their logits on real tokens equal transformers' own ``eager`` attention, the weights
recorded equal eager's ``output_attentions`` on real rows, and greedy generation with
transformers' KV cache gives identical tokens, on a left-padded batch and on an unpadded one
(where transformers passes no mask at all). The pretrained all-MiniLM-L6-v2 shipped for the
explorer (a BERT encoder, bidirectional) is reproduced layer by layer the same way.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention_ref import hf  # noqa: E402

NAME = hf.register()
PAD = 0


def _tiny(kind: str):
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=PAD, bos_token_id=1, eos_token_id=2, head_dim=16)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(sliding_window=4, **common)
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.Gemma2Config(sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                           query_pre_attn_scalar=16, **common)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # random weights larger than the init's, so the softcap and the window matter
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def _batch(padded: bool):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 101, (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :4] = PAD  # left padding, as for generation
        mask[1, :4] = 0
    return ids, mask


def _run(model, impl, ids, mask, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kw)


MODELS = ["llama", "mistral", "gemma2"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return _tiny(request.param)


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_logits_equal_eager_on_real_tokens(model, padded):
    ids, mask = _batch(padded)
    eager = _run(model, "eager", ids, mask).logits
    ours = _run(model, NAME, ids, mask if padded else None).logits
    real = mask.bool()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[real], eager[real], atol=1e-4, rtol=1e-4)


def test_the_window_and_the_softcap_matter(model):
    """The tiny models are in the regime where the sliding window and soft-capping change the logits."""
    config = model.config
    if getattr(config, "sliding_window", None) is None:
        pytest.skip("no sliding window in this architecture")
    ids, mask = _batch(False)
    base = _run(model, NAME, ids, None).logits
    window = config.sliding_window
    config.sliding_window = 64  # wider than the sequence: no window
    try:
        wide = _run(model, NAME, ids, None).logits
    finally:
        config.sliding_window = window
    assert (base - wide).abs().max() > 1e-3


def test_recorded_weights_equal_eagers_output_attentions(model):
    ids, mask = _batch(True)
    eager = _run(model, "eager", ids, mask, output_attentions=True).attentions
    model.set_attn_implementation(NAME)
    with hf.record_weights() as weights, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert len(weights) == len(eager) == model.config.num_hidden_layers
    real = mask.bool()
    for ours, theirs in zip(weights, eager):
        assert ours.shape == theirs.shape == (2, model.config.num_attention_heads, 11, 11)
        # Rows of real queries: (B, H, L, S) -> the real (b, i) rows, every head and key.
        torch.testing.assert_close(ours.permute(0, 2, 1, 3)[real], theirs.permute(0, 2, 1, 3)[real],
                                   atol=1e-5, rtol=1e-4)
    # Padded query rows attend to nothing: weights 0 (eager spreads them uniformly over masked keys).
    assert torch.equal(weights[0][1, :, :4], torch.zeros_like(weights[0][1, :, :4]))


def test_recording_stops_after_the_block(model):
    ids, mask = _batch(False)
    model.set_attn_implementation(NAME)
    with hf.record_weights() as weights, torch.no_grad():
        model(input_ids=ids)
    with torch.no_grad():
        model(input_ids=ids)
    assert len(weights) == model.config.num_hidden_layers


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_greedy_generation_gives_identical_tokens(model, padded):
    ids, mask = _batch(padded)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    model.set_attn_implementation("eager")
    eager = model.generate(input_ids=ids, attention_mask=mask, **kw)
    model.set_attn_implementation(NAME)
    with hf.record_weights() as weights:
        ours = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(ours, eager)
    layers = model.config.num_hidden_layers
    assert len(weights) == layers * 12  # one call per layer per step: prefill, then 11 steps with the cache
    assert weights[-1].shape[-2] == 1  # decoding: one query against the cache


def test_the_mask_trap():
    """An attention function registered without a mask function gets no mask: the causal rule is lost."""
    model = _tiny("llama")

    def trusting(module, query, key, value, attention_mask, scaling=None, **kwargs):
        from attention_ref import scaled_dot_product_attention

        out = scaled_dot_product_attention(query, key, value, attention_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None

    transformers.AttentionInterface.register("attention_ref_without_mask", trusting)
    ids, mask = _batch(True)
    eager = _run(model, "eager", ids, mask).logits
    trapped = _run(model, "attention_ref_without_mask", ids, mask).logits
    real = mask.bool()
    assert (trapped[real] - eager[real]).abs().max() > 1e-2  # the future leaked in
    assert transformers.AttentionMaskInterface()[NAME] is transformers.masking_utils.sdpa_mask
    torch.testing.assert_close(_run(model, NAME, ids, mask).logits[real], eager[real], atol=1e-4, rtol=1e-4)


def test_dropout_only_in_training():
    model = _tiny("llama")
    ids, _ = _batch(False)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    a = _run(model, NAME, ids, None).logits
    b = _run(model, NAME, ids, None).logits
    assert torch.equal(a, b)  # eval: no dropout
    model.train()
    torch.manual_seed(3)
    c = model(input_ids=ids).logits
    assert not torch.allclose(a, c)


def test_register_errors():
    with pytest.raises(TypeError, match=r"name must be a non-empty str, got ''"):
        hf.register("")
    assert hf.register("attention_ref_again") == "attention_ref_again"


def test_minilm_layers_equal_eager():
    pytest.importorskip("safetensors")
    from attention_ref.pretrained import model_dir

    directory = model_dir()
    model = transformers.BertModel.from_pretrained(str(directory), attn_implementation="eager").eval()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    batch = tokenizer(["The cat sat on the mat.", "Attention is all you need, they said."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        eager = model(**batch, output_attentions=True)
    model.set_attn_implementation(NAME)
    with hf.record_weights() as weights, torch.no_grad():
        ours = model(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours.last_hidden_state[real], eager.last_hidden_state[real], atol=1e-4, rtol=1e-4)
    assert len(weights) == len(eager.attentions) == 6
    for w, e in zip(weights, eager.attentions):
        torch.testing.assert_close(w.permute(0, 2, 1, 3)[real], e.permute(0, 2, 1, 3)[real], atol=1e-5, rtol=1e-4)
