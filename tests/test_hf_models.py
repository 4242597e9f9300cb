"""The attention of 2025-26 transformers architectures, through attention_ref.hf, equals eager's.

Each model is built from a tiny config (hidden size 32-64, two to six layers, random weights,
no download, float32). Its windows and chunks are shorter than the 13-token prompts, so each
of them removes keys. With attention_ref registered, the logits equal transformers' own
``eager`` attention within 1e-5 of their size, on a left-padded batch and on an unpadded one
(no ``attention_mask`` given), and greedy generation of 8 tokens with transformers' KV cache
gives identical tokens. They do too with transformers' SDPA masks (boolean, and ``None``
where the causal rule suffices), the other path through the adapter. What each model brings:

| model | what its attention passes or needs |
| --- | --- |
| gpt-oss | ``s_aux``: a learned sink per head, on sliding and full layers (random, nonzero) |
| Llama 4 | chunked layers (mask) and NoPE layers |
| Gemma 3 | 5 local : 1 global layers, ``scaling`` from ``query_pre_attn_scalar`` |
| Qwen3 | ``sliding_window=None`` on full layers, q/k norms |
| Qwen3-Next | its full-attention layers (gated), between linear-attention layers |
| DeepSeek V3 | MLA: query/key size 24, value size 16 (``E != Ev``) |
| MiniMax-M2 | q/k norms over all heads, partial rotary |
| T5 | ``position_bias`` in the encoder, the decoder and cross-attention |

``test_every_decoder_equals_eager_or_refuses`` builds every causal LM of transformers from its
default config with the sizes shrunk, and asserts that each one that calls ``AttentionInterface``
either equals eager or raises: never a silent difference (about 10 s for some 190 architectures).
None counts as compared whose logits stay put with every attention output negated, and none is
dropped: one it does not build must be built by tests/test_hf_sweep.py (a composite's text, or
its ``NOT_BUILT`` config) or named there with the reason.

Two models of the image-text-to-text mapping, which no sweep builds, are compared on their own
where the installed transformers has them (5.25 on): LLaVA-OneVision-1.5, whose keywords
``second_per_grid_ts`` and ``mm_token_type_ids`` reach every attention call, and PI0.5, whose
attention can move its output only once the gates transformers initialises to zero are random.
"""

from __future__ import annotations

import functools
import time
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention_ref import hf  # noqa: E402

NAME = hf.register()
BOOL = "attention_ref_boolean_mask"  # the same attention function, with transformers' SDPA mask function
transformers.AttentionInterface.register(BOOL, hf.attention_forward)
transformers.AttentionMaskInterface.register(BOOL, transformers.masking_utils.sdpa_mask)
PAD = 0
VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
              pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def _sharpen(model):
    """Random weights 3x the init's, so the attention is peaked and every mask, window and sink matters."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def _gpt_oss(**over):
    config = transformers.GptOssConfig(**{**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2,
                                          "sliding_window": 4,
                                          "layer_types": ["sliding_attention", "full_attention"], **over})
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # the init draws sinks near 0: make them matter, with both signs
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    return model


def _llama4(**over):
    config = transformers.Llama4TextConfig(**{**COMMON, "intermediate_size_mlp": 64, "num_local_experts": 2,
                                              "attention_chunk_size": 4, "no_rope_layer_interval": 2,
                                              "floor_scale": 4, **over})
    assert config.layer_types == ["chunked_attention", "full_attention"] and config.no_rope_layers == [1, 0]
    return transformers.Llama4ForCausalLM(config)


def _gemma3(**over):
    config = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6, "hidden_size": 32,
                                              "sliding_window": 4, "query_pre_attn_scalar": 24, **over})
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    return transformers.Gemma3ForCausalLM(config)


def _qwen3():
    config = transformers.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    return transformers.Qwen3ForCausalLM(config)


def _qwen3_next():
    config = transformers.Qwen3NextConfig(**COMMON, layer_types=["linear_attention", "full_attention"],
                                          linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                          linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return transformers.Qwen3NextForCausalLM(config)


def _deepseek_v3():
    config = transformers.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4, "head_dim": 8}, n_routed_experts=4,
                                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                           moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
                                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    return transformers.DeepseekV3ForCausalLM(config)


def _minimax_m2():
    config = transformers.MiniMaxM2Config(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MiniMaxM2ForCausalLM(config)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def _mistral(**over):
    return transformers.MistralForCausalLM(transformers.MistralConfig(**{**COMMON, "sliding_window": 4, **over}))


def _gemma2():
    config = transformers.Gemma2Config(**COMMON, sliding_window=4, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=None, query_pre_attn_scalar=16)
    return transformers.Gemma2ForCausalLM(config)


DECODERS = {"gpt-oss": _gpt_oss, "llama4": _llama4, "gemma3": _gemma3, "qwen3": _qwen3, "qwen3-next": _qwen3_next,
            "deepseek-v3": _deepseek_v3, "minimax-m2": _minimax_m2, "llama": _llama, "mistral": _mistral,
            "gemma2": _gemma2}


def _build(make):
    torch.manual_seed(0)
    return _sharpen(make()).eval()


def _batch(padded: bool, length: int = 13):
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :4] = PAD  # left padding, as for generation
        mask[1, :4] = 0
    return ids, mask


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


def _gap(ours, eager, real):
    """max |ours - eager| over the real tokens, relative to max |eager|."""
    return ((ours[real] - eager[real]).abs().max() / eager[real].abs().max()).item()


@pytest.fixture(scope="module", params=list(DECODERS))
def decoder(request):
    return _build(DECODERS[request.param])


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_logits_equal_eager(decoder, padded):
    ids, mask = _batch(padded)
    eager = _logits(decoder, "eager", input_ids=ids, attention_mask=mask)
    ours = _logits(decoder, NAME, input_ids=ids, attention_mask=mask if padded else None)
    assert _gap(ours, eager, mask.bool()) < 1e-5


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_logits_equal_eager_with_sdpas_boolean_masks(decoder, padded):
    """register() hands over eager's float masks; the boolean ones (or None) give the same logits."""
    ids, mask = _batch(padded)
    eager = _logits(decoder, "eager", input_ids=ids, attention_mask=mask)
    ours = _logits(decoder, BOOL, input_ids=ids, attention_mask=mask if padded else None)
    assert _gap(ours, eager, mask.bool()) < 1e-5


def test_greedy_generation_gives_identical_tokens(decoder):
    ids, mask = _batch(True)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    decoder.set_attn_implementation("eager")
    eager = decoder.generate(input_ids=ids, attention_mask=mask, **kw)
    decoder.set_attn_implementation(NAME)
    ours = decoder.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(ours, eager)


def test_gpt_oss_sinks_matter_and_the_weights_keep_them():
    """Without its sinks gpt-oss's logits move far; the recorded weights are the sink-renormalised ones."""
    model = _build(_gpt_oss)
    ids, mask = _batch(True)
    real = mask.bool()
    eager = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    with hf.record_weights() as weights:
        ours = _logits(model, NAME, input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # -inf: no sink
    sinkless = _logits(model, NAME, input_ids=ids, attention_mask=mask)
    assert _gap(ours, eager, real) < 1e-5 and _gap(sinkless, eager, real) > 1e-2
    sums = weights[0].sum(dim=-1)  # (B, H, L)
    assert (sums[0] < 1 - 1e-3).all()  # every real row gives mass to the sink


def _equals_eager_and_needs(model, keyword: str) -> None:
    """``model`` through attention_ref equals eager, padded and not; through an adapter that drops ``keyword``
    (as one that ignored it would), its logits move far."""
    dropping = f"attention_ref_without_{keyword}"
    transformers.AttentionInterface.register(
        dropping, lambda *a, **kw: hf.attention_forward(*a, **{k: v for k, v in kw.items() if k != keyword}))
    transformers.AttentionMaskInterface.register(dropping, transformers.AttentionMaskInterface()[NAME])
    for padded in (True, False):
        ids, mask = _batch(padded)
        eager = _logits(model, "eager", input_ids=ids, attention_mask=mask)
        ours = _logits(model, NAME, input_ids=ids, attention_mask=mask if padded else None)
        assert _gap(ours, eager, mask.bool()) < 1e-5
    assert _gap(_logits(model, dropping, input_ids=ids, attention_mask=mask), eager, mask.bool()) > 1e-2


def test_inkling_2_one_sink_per_query_equals_eager():
    """Inkling 2 computes a sink per query from the hidden states (issue 32: refused before)."""
    torch.manual_seed(0)
    _equals_eager_and_needs(_sharpen(transformers.Inkling2ForCausalLM(_tiny_config("inkling2_text"))).eval(), "sinks")


def test_minimax_m3_block_indices_equal_eager():
    """MiniMax-M3 passes the key blocks its indexer kept (issue 32: refused before); blocks of 2 keys, 3 per
    query, so the 13-token prompts lose keys."""
    config = _tiny_config("minimax_m3_vl_text")
    config.layer_types, config.mlp_layer_types = ["minimax_m3_sparse", "full_attention"], ["dense", "dense"]
    config.num_hidden_layers, config.index_block_size, config.index_topk_blocks = 2, 2, 3
    torch.manual_seed(0)
    _equals_eager_and_needs(_sharpen(transformers.MiniMaxM3VLForCausalLM(config)).eval(), "block_indices")


def test_the_windows_and_chunks_remove_keys():
    """The prompts are longer than every window and chunk: widen one and the logits move."""
    ids, _ = _batch(False)
    for make, field in ((_mistral, "sliding_window"), (_gemma3, "sliding_window"), (_llama4, "attention_chunk_size")):
        narrow = _logits(_build(make), NAME, input_ids=ids)
        wide = _logits(_build(functools.partial(make, **{field: 64})), NAME, input_ids=ids)
        assert (narrow - wide).abs().max() > 1e-3, field


# --- T5: relative position bias in three places -----------------------------------------------


def _t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.0, pad_token_id=PAD, eos_token_id=2, decoder_start_token_id=PAD)
    torch.manual_seed(0)
    return _sharpen(transformers.T5ForConditionalGeneration(config)).eval()


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_t5_logits_equal_eager(padded):
    model = _t5()
    ids, mask = _batch(padded)
    decoder_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    inputs = dict(input_ids=ids, attention_mask=mask if padded else None, decoder_input_ids=decoder_ids)
    eager = _logits(model, "eager", **inputs)
    ours = _logits(model, NAME, **inputs)
    assert _gap(ours, eager, torch.ones_like(decoder_ids, dtype=torch.bool)) < 1e-5


def test_t5_generation_gives_identical_tokens():
    model = _t5()
    ids, mask = _batch(True)
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    model.set_attn_implementation("eager")
    eager = model.generate(input_ids=ids, attention_mask=mask, **kw)
    model.set_attn_implementation(NAME)
    ours = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(ours, eager)


# --- every decoder of transformers ------------------------------------------------------------

# Sizes for any config that has the field: small enough to build every decoder in a second.
SMALL = dict(
    COMMON,
    # mixtures of experts
    moe_intermediate_size=32, shared_expert_intermediate_size=32, expert_intermediate_size=32,
    expert_ffn_hidden_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, zero_expert_num=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    attn_layer_period=2, attn_layer_offset=1,  # Jamba: attention in every second layer
    index_topk=4,  # DeepSeek V3.2's sparse attention: 4 of the 13 keys
    # multi-head latent attention: query/key size 24, value size 16
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    # windows and chunks, shorter than the 13-token prompt
    sliding_window=4, attention_chunk_size=4, window_size=4,
    is_decoder=True,  # BERT's family: a causal LM only as a decoder
    # the older names of the same sizes (GPT-2, BART, XLM, ...)
    n_embd=64, n_layer=2, n_head=4, n_positions=128, n_ctx=128, d_model=64, num_layers=2, num_heads=4,
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=2, encoder_attention_heads=4,
    encoder_ffn_dim=64, ffn_dim=64, rotary_dim=8, emb_dim=64, n_layers=2,
    # per-layer embeddings, character embeddings, linear-attention heads of hybrids
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, shape_embed_dim=16, pronunciation_embed_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
)


def _tiny(cls, sizes=SMALL, **over):
    """The default config of class ``cls``, every size in `SMALL` it has shrunk, its sub-configs too, then ``over``.

    ``over`` may hold a sub-config's overrides as a dict (``text_config={...}``). A default
    ``layer_types`` pattern is cut to its shortest prefix holding every kind of layer (Gemma 3's
    5 local : 1 global keeps 6 layers, Qwen3-Next's 3 linear : 1 full keeps 4).
    """
    try:
        default = cls()
    except Exception:  # a default that does not validate (Gemma 4's assistant): the overrides make it
        default = cls(**over)
    fields = set(default.to_dict())
    kw = {k: v for k, v in sizes.items() if k in fields}
    if "qk_rope_head_dim" in fields:  # MLA: head_dim is the rotary part, one key/value head per query head
        kw.update(head_dim=kw["qk_rope_head_dim"], num_key_value_heads=kw["num_attention_heads"])
    types = getattr(default, "layer_types", None) if "layer_types" in fields else None  # else an alias (Bamba's)
    if isinstance(types, list) and types and not isinstance(getattr(cls, "layer_types", None), property):
        n = max(types.index(t) for t in set(types)) + 1
        kw["layer_types"] = types[:n] if n > 1 else types[:1] * 2
        kw["num_hidden_layers"] = len(kw["layer_types"])
    if isinstance(over.get("layer_types"), list) and "num_hidden_layers" not in over:
        kw["num_hidden_layers"] = len(over["layer_types"])
    for key in default.sub_configs or {}:
        sub = getattr(default, key, None)
        if isinstance(sub, transformers.PreTrainedConfig):  # None: a tower the default leaves out
            kw[key] = _tiny(type(sub), sizes, **over.pop(key, {}))
    return cls(**{**kw, **over})


def _tiny_config(model_type: str):
    """The default config of ``model_type``, shrunk by `_tiny`; a composite config raises (tests/test_hf_sweep.py
    sweeps the text towers)."""
    cls = transformers.CONFIG_MAPPING[model_type]
    if cls().sub_configs:
        raise LookupError("a composite config (text with vision or audio): its text model is swept on its own")
    return _tiny(cls)


def _decoders():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class _Counting:
    """attention_ref.hf's function, counting its calls: a model that never calls it does not route through it.

    With `negate` set it returns every attention output negated. A model whose logits do not move then discards
    what attention computes (an output projection or gate initialised to zero): it equals eager whatever attention
    computes, and its comparison proves nothing.
    """

    def __init__(self, negate: bool = False):
        self.calls = 0
        self.negate = negate

    def __call__(self, *args, **kwargs):
        self.calls += 1
        output, weights = hf.attention_forward(*args, **kwargs)
        return (-output if self.negate else output), weights


NEGATED = "attention_ref_negated"  # attention_ref.hf with every attention output negated, eager's masks
transformers.AttentionInterface.register(NEGATED, _Counting(negate=True))
transformers.AttentionMaskInterface.register(NEGATED, transformers.AttentionMaskInterface()[NAME])
MOVES = 1e-3  # the least gap from eager that negating attention must leave: below it, attention is not compared


def _sweep_one(model_type: str, class_name: str, counting: _Counting, name: str) -> tuple[str, str]:
    """``(outcome, detail)``: ``equal``, ``refused`` (NotImplementedError), ``error`` (another exception of
    ours), ``differs`` (the silent failure), or why it was not compared: ``composite`` (tests/test_hf_sweep.py
    sweeps its text), ``skipped`` (not built), ``no attention``, ``insensitive`` (equal, and equal too with every
    attention output negated)."""
    try:
        config = _tiny_config(model_type)
    except LookupError as error:
        return "composite", str(error)
    except Exception as error:  # a tiny config that does not validate
        return "skipped", f"not built: {type(error).__name__}: {str(error)[:120]}"
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in getattr(transformers, class_name)(config).parameters())
        if size > 5e7:
            return "skipped", f"{size / 1e6:.0f}M parameters with the shrunk config"
        torch.manual_seed(0)
        model = _sharpen(getattr(transformers, class_name)(config)).eval()
        cases = [(padded, *_batch(padded)) for padded in (True, False)]
        eagers = [_logits(model, "eager", input_ids=ids, attention_mask=mask) for _, ids, mask in cases]
    except Exception as error:  # a tiny config this architecture does not accept, or eager itself fails
        return "skipped", f"not built: {type(error).__name__}: {str(error)[:120]}"
    counting.calls = 0
    try:
        gaps = [_gap(_logits(model, name, input_ids=ids, attention_mask=mask if padded else None), eager, mask.bool())
                for (padded, ids, mask), eager in zip(cases, eagers)]
    except NotImplementedError as error:
        return "refused", str(error)[:200]
    except Exception as error:
        return "error", f"{type(error).__name__}: {str(error)[:200]}"
    if counting.calls == 0:
        return "no attention", "never calls AttentionInterface"
    _, ids, mask = cases[0]
    moved = _gap(_logits(model, NEGATED, input_ids=ids, attention_mask=mask), eagers[0], mask.bool())
    if not moved > MOVES:
        return "insensitive", f"gap {max(gaps):.1e}, and {moved:.1e} with every attention output negated"
    return ("equal" if max(gaps) < 1e-5 else "differs"), f"gap {max(gaps):.1e}"


@pytest.mark.sweep  # with dev.py check --newest: in the newest tier only
def test_every_decoder_equals_eager_or_refuses():
    """Every causal LM of transformers: equal to eager, or an error. Never a silent difference, and none dropped:
    each one this sweep does not build is built by tests/test_hf_sweep.py (a composite's text, or with the config
    of its `NOT_BUILT`) or named there with the reason (`EXCLUDED`)."""
    from test_hf_sweep import EXCLUDED, NOT_BUILT  # imports this module: imported here, once both are loaded

    counting = _Counting()
    name = "attention_ref_counting"
    transformers.AttentionInterface.register(name, counting)
    transformers.AttentionMaskInterface.register(name, transformers.AttentionMaskInterface()[NAME])
    outcomes: dict[str, tuple[str, str]] = {}
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: on a busy 2-core machine two threads took 91 s, one 10 s
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation notices while building old architectures
            for model_type, class_name in sorted(_decoders().items()):
                if model_type in NOT_BUILT or model_type in EXCLUDED:
                    outcomes[model_type] = ("elsewhere", "tests/test_hf_sweep.py: "
                                            + ("NOT_BUILT" if model_type in NOT_BUILT else EXCLUDED[model_type]))
                else:
                    outcomes[model_type] = _sweep_one(model_type, class_name, counting, name)
    finally:
        torch.set_num_threads(threads)
    for model_type, (outcome, detail) in outcomes.items():
        print(f"{model_type:28} {outcome:13} {detail}")
    counts = {o: sum(1 for v in outcomes.values() if v[0] == o) for o in {v[0] for v in outcomes.values()}}
    print(counts, f"{time.perf_counter() - start:.0f} s")

    def of(kind):
        return {m: d for m, (o, d) in outcomes.items() if o == kind}

    assert not of("differs"), f"silently different from eager: {of('differs')}"
    assert not of("error"), f"errors on attention_ref's path only: {of('error')}"
    assert not of("insensitive"), f"equal whatever attention computes, so not compared: {of('insensitive')}"
    assert not of("skipped"), ("not built here, and not in tests/test_hf_sweep.py's NOT_BUILT (with the config that "
                               f"builds it) or EXCLUDED (with the reason): {of('skipped')}")
    assert counts.get("equal", 0) >= 100  # the sweep compared most of them, it did not skip its way to a pass


def test_deepseek_v4_gets_the_mask_eager_gets():
    """DeepSeek V4 appends its compressed keys' bias with ``.to(mask.dtype)``: a bool mask would be inverted."""
    torch.manual_seed(0)
    model = _sharpen(transformers.DeepseekV4ForCausalLM(_tiny_config("deepseek_v4"))).eval()
    ids, mask = _batch(True)
    eager = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    ours = _logits(model, NAME, input_ids=ids, attention_mask=mask)
    assert _gap(ours, eager, mask.bool()) < 1e-5
    boolean = _logits(model, BOOL, input_ids=ids, attention_mask=mask)
    assert _gap(boolean, eager, mask.bool()) > 1e-2


def test_deepseek_v32_top_k_keys_equal_eager():
    """V3.2 passes ``indices`` (the 4 keys each query keeps) to every implementation but eager and sdpa."""
    torch.manual_seed(0)
    model = _sharpen(transformers.DeepseekV32ForCausalLM(_tiny_config("deepseek_v32"))).eval()
    ids, mask = _batch(True)
    eager = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    assert _gap(_logits(model, NAME, input_ids=ids, attention_mask=mask), eager, mask.bool()) < 1e-5


# --- models of the image-text-to-text mapping that no sweep builds (transformers 5.25 on) -------------------------


def _offered(model_type: str):
    """Skip where the installed transformers has no ``model_type`` (a release before it came)."""
    return pytest.mark.skipif(model_type not in transformers.CONFIG_MAPPING,
                              reason=f"transformers {transformers.__version__} has no {model_type}")


IMAGE = VOCAB - 1  # the image token of the multimodal models below; the text ids stay below VOCAB - 4


def _with_images(padded: bool, first: int = 6):
    """`_batch` with 4 image tokens in each row from ``first`` (after the 4 of left padding)."""
    ids, mask = _batch(padded)
    ids = ids.clamp(max=VOCAB - 5)
    ids[:, first:first + 4] = IMAGE
    return ids, mask


@_offered("llava_onevision1_5")
def test_llava_onevision_1_5_equals_eager_with_its_multimodal_keywords():
    """LLaVA-OneVision-1.5 threads ``second_per_grid_ts`` and ``mm_token_type_ids`` into every attention call, the
    vision tower's and the text model's (``None`` unless given): refused as unknown before. It reads them nowhere,
    so eager's logits are the same given or not (`hf.HARMLESS_KEYWORDS`); ours equal eager's with an image in each
    row, given or not, and move when attention is negated."""
    config = _tiny(transformers.CONFIG_MAPPING["llava_onevision1_5"], image_token_id=IMAGE,
                   video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4,
                   vision_config=dict(out_hidden_size=64, depth=2, patch_size=2))
    torch.manual_seed(0)
    model = _sharpen(transformers.LlavaOnevision15ForConditionalGeneration(config)).eval()
    # an image of 4 x 4 patches of 2 x 2 pixels per row, merged 2 x 2 into its 4 tokens: (32, 3 * 2 * 2)
    images = dict(pixel_values=torch.randn(2 * 16, 12, generator=torch.Generator().manual_seed(4)),
                  image_grid_thw=torch.tensor([[1, 4, 4]] * 2))
    for padded in (True, False):
        ids, mask = _with_images(padded)
        given = dict(mm_token_type_ids=(ids == IMAGE).long(), second_per_grid_ts=torch.tensor([2.0]))
        eager = _logits(model, "eager", input_ids=ids, attention_mask=mask, **images)
        assert torch.equal(_logits(model, "eager", input_ids=ids, attention_mask=mask, **images, **given), eager)
        for extra in ({}, given):
            ours = _logits(model, NAME, input_ids=ids, attention_mask=mask if padded else None, **images, **extra)
            assert _gap(ours, eager, mask.bool()) < 1e-5
    negated = _logits(model, NEGATED, input_ids=ids, attention_mask=mask, **images)
    assert _gap(negated, eager, mask.bool()) > MOVES


@_offered("pi05")
def test_pi05_equals_eager_once_its_attention_can_move_the_output():
    """PI0.5's action expert adds each attention output through a gate computed from the timestep by
    ``PI05AdaptiveRMSNorm.dense``, which transformers initialises to zero: as initialised, no attention (the
    expert's, or the VLM's whose keys and values it reads) can move the predicted velocity, and a comparison
    proves nothing. With those weights random it moves, and ours equals eager's, padded or not. Each case gives
    both the same mask: PI0.5 positions its tokens differently without a mask than with an all-ones one (eager's
    own velocities differ, by 3e-3 measured on 5.25)."""
    from transformers.models.pi05.modeling_pi05 import PI05AdaptiveRMSNorm

    config = _tiny(transformers.CONFIG_MAPPING["pi05"], chunk_size=4, max_action_dim=8,
                   vlm_config=dict(image_token_id=IMAGE, projection_dim=64,
                                   vision_config=dict(image_size=8, patch_size=4)))  # 4 tokens per image
    torch.manual_seed(0)
    model = transformers.PI05ForConditionalGeneration(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PI05AdaptiveRMSNorm):
                module.dense.weight.normal_(0.0, 0.1)
    model = _sharpen(model).eval()
    generator = torch.Generator().manual_seed(4)
    # one camera per row, a chunk of 4 noisy actions of 8 values
    fixed = dict(pixel_values=torch.randn(2, 1, 3, 8, 8, generator=generator),
                 pixel_attention_mask=torch.ones(2, 1, dtype=torch.bool),
                 noise=torch.randn(2, 4, 8, generator=generator), timestep=torch.tensor([0.3, 0.8]))
    every_action = torch.ones(2, 4, dtype=torch.bool)
    for padded, masked in ((True, True), (False, True), (False, False)):
        ids, mask = _with_images(padded, first=4)
        inputs = dict(input_ids=ids, attention_mask=mask if masked else None, **fixed)
        eager = _logits(model, "eager", **inputs)
        assert _gap(_logits(model, NAME, **inputs), eager, every_action) < 1e-5
    negated = _logits(model, NEGATED, **inputs)
    assert _gap(negated, eager, every_action) > MOVES
