"""attention_ref.hf: the adapter's keywords, its refusals, register, and three small models, offline.

Small Llama, Mistral (sliding window) and Gemma 2 (sliding window + soft-capping) models are
built from their configs with random weights (no download). With attention_ref registered,
their logits on real tokens equal transformers' own ``eager`` attention, the weights
recorded equal eager's ``output_attentions``, and greedy generation with transformers' KV
cache gives identical tokens, on a left-padded batch and on an unpadded one. The pretrained
all-MiniLM-L6-v2 shipped for the explorer (a BERT encoder, bidirectional) is reproduced layer
by layer the same way.

The adapter itself is checked on hand-made tensors: each keyword that changes attention
(``s_aux``, ``position_bias``, ``sliding_window`` without a mask) against the formula eager
uses, and each keyword it does not implement against its error message. The models of
2025-26 (gpt-oss, Llama 4, Gemma 3, DeepSeek V3, T5, ...) are in ``test_hf_models.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention_ref import hf  # noqa: E402

NAME = hf.register()
PAD = 0


def _tiny(kind: str, **over):
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=PAD, bos_token_id=1, eos_token_id=2, head_dim=16)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**{**common, "sliding_window": 4, **over})
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.Gemma2Config(**{**common, "sliding_window": 4, "attn_logit_softcapping": 5.0,
                                              "final_logit_softcapping": None, "query_pre_attn_scalar": 16, **over})
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


def test_the_window_matters(model):
    """The tiny models are in the regime where the sliding window changes the logits."""
    if getattr(model.config, "sliding_window", None) is None:
        pytest.skip("no sliding window in this architecture")
    ids, _ = _batch(False)
    wide = _tiny(model.config.model_type, sliding_window=64)  # wider than the prompt: no window
    assert (_run(model, NAME, ids, None).logits - _run(wide, NAME, ids, None).logits).abs().max() > 1e-3


def test_recorded_weights_equal_eagers_output_attentions(model):
    """Every row, padded queries included: both get the same float mask from eager_mask."""
    ids, mask = _batch(True)
    eager = _run(model, "eager", ids, mask, output_attentions=True).attentions
    model.set_attn_implementation(NAME)
    with hf.record_weights() as weights, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert len(weights) == len(eager) == model.config.num_hidden_layers
    for ours, theirs in zip(weights, eager):
        assert ours.shape == theirs.shape == (2, model.config.num_attention_heads, 11, 11)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


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
    assert transformers.AttentionMaskInterface()[NAME] is transformers.masking_utils.eager_mask
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


@pytest.mark.parametrize("name", ["sdpa", "eager", "flash_attention_2", "flex_attention", "paged|eager"])
def test_register_refuses_transformers_own_names(name):
    """Registering "sdpa" would replace transformers' SDPA for every model of the process."""
    sdpa = transformers.AttentionInterface._global_mapping["sdpa"]
    with pytest.raises(ValueError, match=rf"name '{re.escape(name)}' is transformers' own attention implementation"):
        hf.register(name)
    assert transformers.AttentionInterface._global_mapping["sdpa"] is sdpa


@pytest.mark.parametrize("name", ["my_flash", "ref_sdpa", "my_flex_attention", "paged|mine", "org/repo"])
def test_register_refuses_names_transformers_reads(name):
    with pytest.raises(ValueError, match=rf"name '{re.escape(name)}' means something to transformers"):
        hf.register(name)


# --- the adapter on hand-made tensors ---------------------------------------------------------


class Layer(torch.nn.Module):
    """What attention_forward reads of a transformers attention layer."""

    def __init__(self, is_causal: bool = True, layer_idx: int = 3):
        super().__init__()
        self.is_causal, self.layer_idx = is_causal, layer_idx


def _qkv(B=2, H=4, Hkv=2, L=7, S=7, E=5, Ev=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, E, generator=gen), torch.randn(B, Hkv, S, E, generator=gen),
            torch.randn(B, Hkv, S, Ev, generator=gen))


def _eager(q, k, v, bias=None, sinks=None):
    """Eager's formula (gpt-oss, T5): scores + bias, a sink column concatenated, softmax, the sink dropped."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    if bias is not None:
        scores = scores + bias
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    weights = scores.softmax(dim=-1)[..., : k.shape[-2]]
    return (weights @ v).transpose(1, 2), weights  # (B, H, L, S) x (B, H, S, Ev) -> (B, L, H, Ev)


def _causal_bias(L, S, keep=None):
    allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    if keep is not None:
        allowed = allowed & keep
    return torch.zeros(L, S).masked_fill(~allowed, float("-inf"))


def test_s_aux_is_the_sink_of_each_query_head():
    q, k, v = _qkv()
    sinks = torch.tensor([2.0, -1.0, 0.5, 3.0])
    hf_out, weights = hf.attention_forward(Layer(), q, k, v, None, s_aux=sinks, output_attentions=True)
    out, expected = _eager(q, k, v, _causal_bias(7, 7), sinks)
    torch.testing.assert_close(hf_out, out)
    torch.testing.assert_close(weights, expected)
    assert (weights.sum(dim=-1) < 1).all()  # the sink took its share of every row
    no_sink, _ = hf.attention_forward(Layer(), q, k, v, None, s_aux=None)  # MiMo's full layers: None, no sink
    torch.testing.assert_close(no_sink, _eager(q, k, v, _causal_bias(7, 7))[0])


def test_sinks_is_one_sink_per_query_as_inkling_2_passes_it():
    """Inkling 2 passes sinks (B, H, L, 1), a column beside the scores, computed from each token."""
    q, k, v = _qkv()
    sinks = torch.randn(2, 4, 7, 1, generator=torch.Generator().manual_seed(1)) * 2
    ours, weights = hf.attention_forward(Layer(), q, k, v, None, sinks=sinks, output_attentions=True)
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))  # (B, Hkv, S, _) -> (B, H, S, _)
    scores = (q @ kk.transpose(-1, -2)) / 5**0.5 + _causal_bias(7, 7)
    expected = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]  # Inkling 2's eager form
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(ours, (expected @ vv).transpose(1, 2))
    with pytest.raises(NotImplementedError, match=r"Layer \(layer_idx=3\) passed both s_aux .* and sinks"):
        hf.attention_forward(Layer(), q, k, v, None, sinks=sinks, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match=r"passed sinks of shape \(2, 4, 7\); expected a column beside the scores, "
                       r"\(B, H, L, 1\)"):
        hf.attention_forward(Layer(), q, k, v, None, sinks=sinks[..., 0])


def test_block_indices_need_the_block_size_and_one_selection():
    q, k, v = _qkv()
    blocks = torch.tensor([[0, 2], [0, 1]]).repeat(4, 1)[:7].expand(2, 2, 7, 2)  # (B, Hkv, L, k)
    with pytest.raises(NotImplementedError, match=r"passed block_indices but has no indexer.block_size"):
        hf.attention_forward(Layer(), q, k, v, None, block_indices=blocks)
    layer = Layer()
    layer.indexer = torch.nn.Module()
    layer.indexer.block_size = 2
    with pytest.raises(NotImplementedError, match=r"passed both indices .* and block_indices"):
        hf.attention_forward(layer, q, k, v, None, block_indices=blocks, indices=torch.zeros(2, 7, 2, dtype=torch.int))
    with pytest.raises(ValueError, match=r"passed block_indices of shape \(2, 3, 7, 2\); expected \(B, H_index, L, k\)"):
        hf.attention_forward(layer, q, k, v, None, block_indices=torch.zeros(2, 3, 7, 2, dtype=torch.long))
    ours, weights = hf.attention_forward(layer, q, k, v, None, block_indices=blocks, output_attentions=True)
    keep = torch.zeros(7, 7, dtype=torch.bool)
    keep[0::2, 0:2] = keep[0::2, 4:6] = True  # rows of [0, 2]: blocks 0 and 2
    keep[1::2, 0:4] = True  # rows of [0, 1]: blocks 0 and 1
    torch.testing.assert_close(ours, _eager(q, k, v, _causal_bias(7, 7, keep))[0])


@pytest.mark.parametrize("mask", ["bool", "float", "none"])
def test_position_bias_is_added_with_the_mask(mask):
    q, k, v = _qkv(H=4, Hkv=4)
    bias = torch.randn(1, 4, 7, 7, generator=torch.Generator().manual_seed(5))  # T5: (1, H, L, S)
    pad = torch.tensor([[True] * 7, [False] * 2 + [True] * 5]).reshape(2, 1, 1, 7)  # (B, 1, 1, S)
    given = {"bool": pad, "float": torch.zeros(2, 1, 1, 7).masked_fill(~pad, -1e9), "none": None}[mask]
    layer = Layer(is_causal=mask == "none")  # without a mask: a T5 decoder's causal rule
    ours, _ = hf.attention_forward(layer, q, k, v, given, position_bias=bias, scaling=1.0 / 5**0.5)
    added = bias + (_causal_bias(7, 7) if mask == "none" else torch.zeros(2, 1, 1, 7).masked_fill(~pad, -1e9))
    torch.testing.assert_close(ours, _eager(q, k, v, added)[0])


@pytest.mark.parametrize("L", [7, 1], ids=["prefill", "decoding"])
def test_a_sliding_window_without_a_mask_is_applied(L):
    """No mask and more keys than the window: the window is applied, never dropped."""
    q, k, v = _qkv(L=L, S=7)
    ours, _ = hf.attention_forward(Layer(), q, k, v, None, sliding_window=3)
    position = torch.arange(7 - L, 7).unsqueeze(-1)  # the queries' positions: (L, 1)
    in_window = torch.arange(7) > position - 3  # transformers: key j kept when j > i - W
    torch.testing.assert_close(ours, _eager(q, k, v, _causal_bias(L, 7, in_window))[0])
    wide, _ = hf.attention_forward(Layer(), q, k, v, None, sliding_window=7)  # W >= S: no key removed
    torch.testing.assert_close(wide, _eager(q, k, v, _causal_bias(L, 7))[0])


def test_a_bidirectional_window_without_a_mask_raises():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=r"sliding_window=3 on a bidirectional layer"):
        hf.attention_forward(Layer(is_causal=False), q, k, v, None, sliding_window=3)


def test_an_unknown_keyword_raises_and_names_itself():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=r"Layer \(layer_idx=3\) passed the keyword 'top_k_keys'"):
        hf.attention_forward(Layer(), q, k, v, None, top_k_keys=torch.zeros(2, 7, 2))
    with pytest.raises(NotImplementedError, match=r"'window_size' \(NoneType\)"):  # unknown: even None
        hf.attention_forward(Layer(), q, k, v, None, window_size=None)


def test_indices_select_the_keys():
    """DeepSeek V3.2's ``indices`` (B, L, k): top-k sparse attention (tests/test_sparse.py has the rest)."""
    q, k, v = _qkv()
    chosen = torch.tensor([0, 2, 6]).expand(2, 7, 3)  # keys 0 and 2, and key 6 where the causal rule allows it
    ours, _ = hf.attention_forward(Layer(), q, k, v, None, indices=chosen)
    keep = torch.zeros(7, 7, dtype=torch.bool)
    keep[:, [0, 2, 6]] = True
    torch.testing.assert_close(ours, _eager(q, k, v, _causal_bias(7, 7, keep))[0])
    hf.attention_forward(Layer(), q, k, v, None, indices=None)  # None: the dense path


@pytest.mark.parametrize("name", ["cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx", "cache",
                                  "cross_attention_mask", "full_text_row_masked_out_mask"])
def test_keywords_that_change_attention_raise_unless_none(name):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=rf"passed {name}=\.\.\., which changes attention"):
        hf.attention_forward(Layer(), q, k, v, None, **{name: torch.tensor([0, 7, 14])})
    hf.attention_forward(Layer(), q, k, v, None, **{name: None})


def test_harmless_keywords_change_nothing():
    q, k, v = _qkv()
    plain, _ = hf.attention_forward(Layer(), q, k, v, None)
    passed = {name: object() for name in hf.HARMLESS_KEYWORDS} | {"position_ids": torch.arange(7).expand(2, 7)}
    ours, _ = hf.attention_forward(Layer(), q, k, v, None, **passed)
    assert torch.equal(ours, plain)


def test_packed_positions_without_a_mask_raise():
    q, k, v = _qkv()
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)  # two sequences in each row
    with pytest.raises(NotImplementedError, match=r"position_ids that restart within a row \(packed sequences\)"):
        hf.attention_forward(Layer(), q, k, v, None, position_ids=packed)


def test_positional_arguments_after_the_mask_are_refused():
    """transformers' eager functions disagree on the order (dropout, scaling): keywords only."""
    q, k, v = _qkv()
    with pytest.raises(TypeError):
        hf.attention_forward(Layer(), q, k, v, None, 0.0, 1.0)


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


def test_from_pretrained_swaps_in_no_hub_kernels(tmp_path):
    """transformers 5.25 turned Hub kernels on by default in ``from_pretrained``: a loaded model's layers may run a
    kernel from the Hub in place of the code eager runs, and a comparison would test that kernel. tests/conftest.py
    sets ``USE_HUB_KERNELS=NO``: a model loaded in the tests is not kernelized (5.23 never does it by default)."""
    _tiny("llama").save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert not loaded.use_kernels


def test_modernbert_equals_eager():
    """ModernBERT passes ``deterministic=`` (FlashAttention's backward flag): accepted, and the masked LM's
    logits equal eager's, padding included (its local layers' window comes in the mask)."""
    config = transformers.ModernBertConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                           num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD,
                                           global_attn_every_n_layers=2, local_attention=4)
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(config).eval()
    ids, mask = _batch(padded=True)
    eager = _run(model, "eager", ids, mask).logits
    ours = _run(model, NAME, ids, mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], eager[real], atol=1e-5, rtol=1e-5)
