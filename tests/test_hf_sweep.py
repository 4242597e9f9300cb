"""The sweep of test_hf_models.py beyond causal LMs (issue 32): masked LMs, seq2seq models, composites, hybrids.

Each model is built from its default config with the sizes of ``SMALL`` (and per-model
overrides where a default does not shrink), random weights, no download, float32, and run with
``eager`` and with attention_ref.hf:

| family | model types | inputs (``B = 2``) | compared |
| --- | --- | --- | --- |
| masked LMs | ``MODEL_FOR_MASKED_LM_MAPPING_NAMES`` | 13 ids, right-padded (4) or not | the real tokens |
| seq2seq | ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` | those, and 7 decoder ids | every decoder token |
| composites | the causal LMs whose config has ``sub_configs`` | 13 ids, left-padded (4) or not | the real tokens |
| not built | the causal LMs the causal sweep does not build | 13 ids, left-padded (4) or not | the real tokens |

Padded, both get the mask; unpadded, eager gets the all-ones mask and attention_ref none, as in
the causal sweep. "Not built" are mostly hybrids (Mamba, linear attention or recurrent blocks
beside attention) whose defaults do not shrink, or whose shrunk config does not validate
(zamba2's 54 block types for 2 layers, kolibri1_1's 12 scoring heads): `NOT_BUILT` gives each what it needs, and the
causal sweep fails for any causal LM it does not build that is neither here nor in `EXCLUDED`.

A composite runs on text alone: the model of the causal mapping, or the text tower its
config holds where that model takes the text config (Llama 4's, Qwen3.5's). The speech models
of the seq2seq mapping (an audio encoder before a decoder-only LM) take text alone too, but for
Voxtral Realtime, which needs its audio frames.

Each model is ``equal`` (gap below 1e-5, the causal sweep's criterion), ``refused``
(``NotImplementedError``), ``error`` (another exception, on our path only), ``differs`` (the
silent failure), ``insensitive`` (equal, but equal too with every attention output negated: the
comparison proves nothing), ``no attention`` (never calls ``AttentionInterface``: each listed in
`NO_ATTENTION` with the reason), ``skipped`` (not built) or ``excluded`` (`EXCLUDED`, with the
reason). Each test prints its table and counts and asserts: no difference or error but the known
ones (`KNOWN_DIFFERENCES`, `KNOWN_ERRORS`, with the diagnosis), nothing insensitive, and nothing
skipped: a model type that does not build (a new release's config validation, say) fails its
test until it is given what it needs or named in `EXCLUDED` with the reason. All four take about
10 s of one core.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.sweep  # with dev.py check --newest: in the newest tier only

from test_hf_models import (  # noqa: E402
    MOVES, NAME, PAD, SMALL, VOCAB, _batch, _Counting, _gap, _logits, _sharpen, _tiny,
)

COUNTING = "attention_ref_sweep_counting"
LIMIT = 1e-5  # the causal sweep's: max |ours - eager| / max |eager| on the compared tokens


COUNTER = _Counting()  # counts the calls; with `negate` set, negates every attention output
transformers.AttentionInterface.register(COUNTING, COUNTER)
transformers.AttentionMaskInterface.register(COUNTING, transformers.AttentionMaskInterface()[NAME])


def _size(cls, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in cls(config).parameters())


def _right_padded(padded: bool, length: int = 13):
    """``(ids, mask)`` (2, length): the second row's last 4 tokens padding, as an encoder's batch is."""
    ids, mask = _batch(False, length)
    if padded:
        ids[1, -4:] = PAD
        mask[1, -4:] = 0
    return ids, mask


# A case: (eager's inputs, ours, the compared tokens (B, L) bool).
Case = tuple[dict, dict, torch.Tensor]


def _cases(batch=_batch) -> list[Case]:
    """Padded with its mask, and unpadded (eager gets the all-ones mask, ours none), as in the causal sweep.

    ``batch``: test_hf_models' ``_batch`` (left padding, the causal sweep's) or `_right_padded` (an encoder's).
    """
    cases = []
    for padded in (True, False):
        ids, mask = batch(padded)
        cases.append((dict(input_ids=ids, attention_mask=mask),
                      dict(input_ids=ids, attention_mask=mask if padded else None), mask.bool()))
    return cases


def _seq2seq_cases() -> list[Case]:
    """Encoder ids (2, 13), padded or not; decoder ids (2, 7): every decoder token compared."""
    decoder = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    cases = []
    for padded in (True, False):
        ids, mask = _right_padded(padded)
        cases.append((dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder),
                      dict(input_ids=ids, attention_mask=mask if padded else None, decoder_input_ids=decoder),
                      torch.ones_like(decoder, dtype=torch.bool)))
    return cases


def _case_gap(model, case: Case) -> float:
    """`_gap` of ours from eager on one case; logits past L (Perceiver's extra latent queries) are not compared."""
    eager_inputs, our_inputs, real = case
    L = real.shape[1]
    return _gap(_logits(model, COUNTING, **our_inputs)[:, :L], _logits(model, "eager", **eager_inputs)[:, :L], real)


def _compare(build: Callable[[], torch.nn.Module], cases: list[Case]) -> tuple[str, str]:
    """``(outcome, detail)`` of one model, as ``_sweep_one`` of test_hf_models gives it."""
    try:
        torch.manual_seed(0)
        model = _sharpen(build()).eval()
        _logits(model, "eager", **cases[0][0])
    except Exception as error:  # a tiny config this architecture does not accept, or eager itself fails
        return "skipped", f"not built: {type(error).__name__}: {str(error)[:120]}"
    COUNTER.calls = 0
    try:
        gap = max(_case_gap(model, case) for case in cases)
    except NotImplementedError as error:
        return "refused", str(error)[:200]
    except Exception as error:
        return "error", f"{type(error).__name__}: {str(error)[:200]}"
    if COUNTER.calls == 0:
        return "no attention", "never calls AttentionInterface"
    COUNTER.negate = True
    try:
        moved = _case_gap(model, cases[0])
    finally:
        COUNTER.negate = False
    if not moved > MOVES:
        return "insensitive", f"gap {gap:.1e}, and {moved:.1e} with every attention output negated"
    if gap < LIMIT:
        return "equal", f"gap {gap:.1e}"
    try:  # the diagnosis: float32 rounding leaves no gap in float64, a different computation does
        doubled = f"{max(_case_gap(model.double(), case) for case in cases):.1e}"
    except Exception as error:  # grouped_mm (the experts of MoE models) has no float64
        doubled = f"not run, {type(error).__name__}"
    return "differs", f"gap {gap:.1e} (float64: {doubled})"


def _builder(class_name: str, config_cls, over: dict, sizes=SMALL, then=None, limit: float = 5e7):
    """``class_name`` built from the tiny config of ``config_cls`` with ``over``, then ``then(model)``."""
    def build():
        cls = getattr(transformers, class_name)
        config = _tiny(config_cls, sizes, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in over.items()})
        if not isinstance(config, cls.config_class):  # a text tower (Llama 4's): its sub-config, as Auto picks it
            config = next(getattr(config, k) for k in config.sub_configs
                          if isinstance(getattr(config, k, None), cls.config_class))
        size = _size(cls, config)
        if size > limit:
            raise MemoryError(f"{size / 1e6:.0f}M parameters with the shrunk config")
        model = cls(config)
        if then is not None:
            then(model)
        return model
    return build


def _sweep(name: str, family: dict[str, tuple[Callable, list[Case]] | str]) -> dict[str, tuple[str, str]]:
    """Each model type's ``(outcome, detail)``, on one thread, printed with the counts; a str entry is excluded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 threads on a busy 2-core machine are many times slower than one
    start = time.perf_counter()
    outcomes = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation notices while building old architectures
            for model_type, entry in sorted(family.items()):
                outcomes[model_type] = ("excluded", entry) if isinstance(entry, str) else _compare(*entry)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    print(f"\n--- {name} ---")
    for model_type, (outcome, detail) in outcomes.items():
        print(f"{model_type:28} {outcome:13} {detail}")
    counts = {o: sum(1 for v in outcomes.values() if v[0] == o) for o in sorted({v[0] for v in outcomes.values()})}
    compared = sum(counts.get(o, 0) for o in ("equal", "refused", "error", "differs"))
    due = len(outcomes) - counts.get("excluded", 0) - counts.get("no attention", 0)
    print(f"{name}: {len(outcomes)} model types, {compared} of {due} compared, {counts}, {seconds:.1f} s")
    return outcomes


def _check(outcomes: dict[str, tuple[str, str]]) -> None:
    """No new difference or error, nothing insensitive, every model without attention listed, none skipped."""
    def of(kind):
        return {m: d for m, (o, d) in outcomes.items() if o == kind}

    differs = {m: d for m, d in of("differs").items() if m not in KNOWN_DIFFERENCES}
    assert not differs, f"silently different from eager: {differs}"
    errors = {m: d for m, d in of("error").items() if m not in KNOWN_ERRORS}
    assert not errors, f"errors on attention_ref's path only: {errors}"
    assert not of("insensitive"), f"equal whatever attention computes, so not compared: {of('insensitive')}"
    unlisted = set(of("no attention")) ^ {m for m in NO_ATTENTION if m in outcomes}
    assert not unlisted, f"NO_ATTENTION is wrong about: {sorted(unlisted)}"
    assert not of("skipped"), ("not built: give it what it needs (the family's overrides) or name it in EXCLUDED "
                               f"with the reason: {of('skipped')}")


def _unzeroed(model):
    """Random weights where the init leaves zeros (NeoMME's output projections): else attention adds nothing."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.1)


# --- masked LMs -------------------------------------------------------------------------------

MASKED_SIZES = dict(SMALL, is_decoder=False)  # bidirectional: BERT's family is causal only as a decoder
MASKED_OVER = {
    "esmc": dict(num_key_value_heads=4),  # no grouped-query attention
    "luke": dict(entity_vocab_size=8, entity_emb_size=16),  # 500k entities by default
    "mobilebert": dict(embedding_size=32, intra_bottleneck_size=32, num_feedforward_networks=1),  # 128 > 64 wide
    "perceiver": dict(num_latents=16, d_latents=64, num_self_attends_per_block=2, num_self_attention_heads=4,
                      num_cross_attention_heads=4),  # 26 latent layers 1280 wide by default
    # its axial position embeddings must add up to the width; one local and one LSH layer, chunks of 4
    "reformer": dict(axial_pos_shape=[4, 32], axial_pos_embds_dim=[32, 32], attention_head_size=16,
                     attn_layers=["local", "lsh"], feed_forward_size=64, local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4, num_buckets=2),
    "squeezebert": dict(embedding_size=64),  # its embeddings must be as wide as its layers
}
MASKED_THEN = {"xmod": lambda model: model.set_default_language("en_XX"), "neomme": _unzeroed}


def _masked():
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return {m: EXCLUDED.get(m) or (_builder(c, transformers.CONFIG_MAPPING[m], MASKED_OVER.get(m, {}), MASKED_SIZES,
                                            MASKED_THEN.get(m)), _cases(_right_padded))
            for m, c in MODEL_FOR_MASKED_LM_MAPPING_NAMES.items()}


# --- seq2seq ----------------------------------------------------------------------------------

# T5's family under its own names: head size, feed-forward size, decoder depth (12 layers for Switch by default).
# Its scores are not scaled: with its default init, sharpened, they reach 35 and float32 rounding alone moves
# the logits by up to 4e-5 (Switch; eager's own: attention_ref in float64, rounded once, is 1e-4 from eager,
# and in float64 the whole model is 1e-14 from eager). An init 0.7 times as wide keeps them near 8, as the
# scaled models' scores are, and the gaps near 1e-6.
SEQ2SEQ_SIZES = dict(SMALL, d_kv=16, d_ff=64, num_decoder_layers=2, num_sparse_encoder_layers=1,
                     num_sparse_decoder_layers=1, initializer_factor=0.7)
SEQ2SEQ_OVER = {
    "encoder-decoder": dict(encoder=dict(is_decoder=False), decoder=dict(add_cross_attention=True)),  # BERT + BERT
    "granite_speech": dict(encoder_config=dict(hidden_dim=64, dim_head=16)),  # a 55M-parameter conformer else
    "granite_speech_plus": dict(encoder_config=dict(hidden_dim=64, dim_head=16)),
    # the diarization head reads the audio encoder's width
    "nemo_speechlm": dict(audio_config=dict(diarization_config=dict(head_config=dict(audio_hidden_size=64))),
                          word_timestamp_config=dict(blank_token_id=VOCAB - 1)),  # the last class of the head
    # its two convolutional speech tokenizers: 344M parameters each by default
    "vibevoice_asr": dict(acoustic_tokenizer_encoder_config=dict(num_filters=4, depths=[1] * 7),
                          semantic_tokenizer_encoder_config=dict(num_filters=4, depths=[1] * 7)),
}
# Voxtral Realtime adds 4 audio frames to each token's embedding: (2, 4 * 13, 64) embedded frames
FRAMES = torch.randn(2, 4 * 13, 64, generator=torch.Generator().manual_seed(3))
SEQ2SEQ_INPUTS = {"voxtral_realtime": dict(encoder_inputs_embeds=FRAMES)}


def _plus(cases: list[Case], **extra) -> list[Case]:
    """``cases`` with ``extra`` inputs, the same for eager and ours."""
    return [(dict(e, **extra), dict(o, **extra), r) for e, o, r in cases]


def _seq2seq():
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    family = {}
    for m, c in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.items():
        encoder_decoder = "decoder_input_ids" in inspect.signature(getattr(transformers, c).forward).parameters
        cases = _seq2seq_cases() if encoder_decoder else _cases()
        family[m] = EXCLUDED.get(m) or (_builder(c, transformers.CONFIG_MAPPING[m], SEQ2SEQ_OVER.get(m, {}),
                                                 SEQ2SEQ_SIZES), _plus(cases, **SEQ2SEQ_INPUTS.get(m, {})))
    return family


# --- the causal LMs the causal sweep does not build --------------------------------------------

MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)  # 8 * 16 = 2 * 64 wide
# What each needs beyond SMALL to build tiny; its reason in the comment.
NOT_BUILT = {
    # its own names for the experts, the groups and the linear heads; one linear and one full layer
    "bailing_hybrid": dict(num_experts_per_token=2, num_expert_group=1, layer_group_size=2, linear_num_heads=4,
                           linear_head_dim=16, layer_types=["linear_attention", "full_attention"],
                           mlp_layer_types=["dense", "sparse"]),
    "bamba": dict(MAMBA, attn_layer_indices=[1]),  # layer_types is a read-only alias: the attention layer's index
    # its rotary parameters are per layer type, and the default's are empty
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "falcon_h1": dict(MAMBA, mamba_d_ssm=128),  # 128 Mamba heads and a 1024-wide SSM by default
    # its to_dict lists an mlp block after each layer, and 8 input and 8 output layers by default: one layer
    # in each section (input, recurrent run twice, output), one of them full
    "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], n_input_layers=1,
                 n_recurrent_layers=1, n_output_layers=1),
    # its last layers reuse earlier layers' keys and values: both kinds must produce and use them
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4,
                         num_kv_shared_layers=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # one global and one local layer
    "granitemoehybrid": dict(MAMBA, layer_types=["mamba", "attention"]),  # the default: Mamba layers only
    "kimi_linear": dict(num_experts_per_token=2, linear_num_heads=4, linear_head_dim=16,  # as bailing_hybrid
                        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]),
    # 12 scoring heads by default, more than key head 0's 2 queries; its indexed layer (the 5th) selects from a pool
    # of 8 keys scored in blocks of 2, the top 2 beside 1 sink and 2 local keys, so it drops keys of the 13
    "kolibri1_1": dict(index_num_heads=2, index_topk=2, index_pool_size=8, index_compression=2,
                       index_num_local_tokens=2, index_num_sink_tokens=1, mlp_only_intermediate_size=64),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # no default layer_types
    "longcat_flash": dict(moe_topk=2),  # its top-12 of the 4 experts
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, chunk_size=16),  # heads spanning 2 * 64
    # QSA: each query keeps a budget of 4 keys from blocks of 2
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                           indexer_compress_ratio=2),
    # one recurrent and one attention block (layer_types is a read-only alias), a window of 4
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=4),
    "reformer": MASKED_OVER["reformer"],
    "xlstm": dict(qk_dim_factor=1.0),  # its native recurrent step wants query/key heads as wide as value heads
    "xmod": {},  # needs a default language: NOT_BUILT_THEN
    "zamba": dict(num_hidden_layers=6, attention_head_dim=32, mamba_dt_rank=8),  # shared attention at 2 and 4, tied
    # 54 block types by default (layer_types is a read-only alias): a Mamba layer, then a hybrid (shared attention)
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),  # top-1 routing only
}
NOT_BUILT_THEN = {"xmod": MASKED_THEN["xmod"]}


def _not_built():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {m: EXCLUDED.get(m) or (_builder(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[m], transformers.CONFIG_MAPPING[m], over,
                                            then=NOT_BUILT_THEN.get(m)), _cases())
            for m, over in NOT_BUILT.items() if m in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}  # dory, kolibri1_1: 5.25 on


# --- composites: the causal LMs whose config has sub-configs, on text alone ---------------------

COMPOSITE_OVER = {
    # 500k hashed byte n-grams by default; the local models' view of the global one as wide as it
    "blt": dict(encoder_hash_byte_group_vocab=64, encoder_config=dict(hidden_size_global=64),
                decoder_config=dict(hidden_size_global=64)),
    # its attention reads rope_theta and clamps to clip_qkv, both None by default
    "dbrx": dict(attn_config=dict(rope_theta=1e4, clip_qkv=8.0)),
    # a vision tower of 2 dense layers, not a 42-layer expert pyramid; the adapters as wide as the towers
    "dots3_note": dict(vision_config=dict(mlp_layer_types=["dense"] * 2, adapter_in_dim=64, adapter_out_dim=64),
                       audio_config=dict(adapter_input_size=64, adapter_out_dim=64, downsample_hidden_size=16)),
    "gemma3n": dict(text_config=NOT_BUILT["gemma3n_text"]),
    "musicgen": dict(decoder=dict(num_codebooks=1)),  # one codebook: input ids (2, 13), not (2 * 4, 13)
    "musicgen_melody": dict(decoder=dict(num_codebooks=1)),
    "qwen4_exp": dict(text_config=NOT_BUILT["qwen4_exp_text"]),
}
# Gemma 3n's vision tower needs timm, not installed: its text tower, from its text config
COMPOSITE_CLASS = {"gemma3n": "Gemma3nForCausalLM"}
# BLT's forward builds its cache from the composite config, which has no num_hidden_layers: no cache
COMPOSITE_INPUTS = {"blt": dict(use_cache=False)}


def _composites():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = {}
    for m, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config_cls = transformers.CONFIG_MAPPING[m]
        if config_cls.sub_configs:
            family[m] = EXCLUDED.get(m) or (_builder(COMPOSITE_CLASS.get(m, c), config_cls, COMPOSITE_OVER.get(m, {})),
                                            _plus(_cases(), **COMPOSITE_INPUTS.get(m, {})))
    return family


# --- what is not compared, and why --------------------------------------------------------------

# Model types no tiny model of which can be compared here: each with the reason.
EXCLUDED = {
    "gemma4_assistant": "every layer reuses the target model's keys and values (num_kv_shared_layers == "
    "num_hidden_layers), and nothing here is the target model: transformers 5.23's Gemma4TextModel refuses to build "
    "it ('The set of layer types producing a cache is different ...'); 5.25 builds it, and its forward raises "
    "without the target's shared_kv_states ('inputs_embeds and shared_kv_states cannot be None'). Its default config "
    "does not validate either (its per-layer inputs must be 0)",
    "gemma4_unified_assistant": "as gemma4_assistant: every layer reuses the target model's keys and values; 5.23 "
    "refuses to build it (the default config too), 5.25's forward raises without the target's shared_kv_states",
}

# Model types whose attention never calls AttentionInterface (transformers: "does not support setting its
# attention implementation dynamically"): nothing of attention_ref runs, so nothing is compared.
NO_ATTENTION = {
    # masked LMs
    "big_bird": "BigBirdSelfAttention and its block-sparse attention compute softmax(QK^T)V in their own code",
    "convbert": "ConvBertSelfAttention: span-based dynamic convolution beside attention, in its own code",
    "deberta": "DisentangledSelfAttention: content-to-position and position-to-content scores, its own code",
    "deberta-v2": "DisentangledSelfAttention: content-to-position and position-to-content scores, its own code",
    "flaubert": "XLM's MultiHeadAttention, in its own code",
    "fnet": "no attention: Fourier transforms mix the tokens",
    "funnel": "FunnelRelMultiheadAttention: relative attention between pooled sequences, its own code",
    "ibert": "IBertSelfAttention: integer-only (quantised) softmax, its own code",
    "longformer": "LongformerSelfAttention: sliding chunks and global tokens, its own code",
    "luke": "LukeSelfAttention: entity-aware attention, its own code",
    "megatron-bert": "MegatronBertSelfAttention, in its own code",
    "mpnet": "MPNetSelfAttention: relative position bias, its own code",
    "mra": "MraSelfAttention: multi-resolution approximate attention, its own code",
    "mvp": "MvpAttention: BART's attention with prompt keys, its own code",
    "nystromformer": "NystromformerSelfAttention: Nystrom approximation, its own code",
    "perceiver": "PerceiverSelfAttention: latent cross- and self-attention, its own code",
    "reformer": "LSHSelfAttention and LocalSelfAttention: hashed and chunked attention, its own code",
    "rembert": "RemBertSelfAttention, in its own code",
    "roformer": "RoFormerSelfAttention: rotary positions, its own code",
    "squeezebert": "SqueezeBertSelfAttention: grouped convolutions for q, k and v, its own code",
    "tapas": "TapasSelfAttention, in its own code",
    "xlm": "XLM's MultiHeadAttention, in its own code",
    "yoso": "YosoSelfAttention: LSH-sampled approximate attention, its own code",
    # seq2seq
    "fsmt": "FSMT's Attention (fairseq's), in its own code",
    "led": "LEDEncoderSelfAttention (Longformer's sliding chunks) and LEDDecoderAttention, their own code",
    "prophetnet": "ProphetNetNgramSelfAttention: n-gram streams, its own code",
    # composites
    "git": "GitSelfAttention, the text decoder's, in its own code (only its vision tower, not run on text, "
    "calls AttentionInterface)",
    "mpt": "MptAttention: ALiBi, in its own code",
    # not built by the causal sweep
    "gpt_neo": "GPTNeoSelfAttention, in its own code",
    "mamba2": "no attention: a state-space model",
    "xlstm": "no attention: mLSTM recurrences",
}

# Model types silently different from eager, with the measured gap and the diagnosis: none.
KNOWN_DIFFERENCES: dict[str, str] = {}
# Model types that raise something other than NotImplementedError on attention_ref's path only: none.
KNOWN_ERRORS: dict[str, str] = {}


def test_every_masked_lm_equals_eager_or_refuses():
    """Bidirectional: padding on the right, only the real tokens compared."""
    _check(_sweep("masked LMs", _masked()))


def test_every_seq2seq_lm_equals_eager_or_refuses():
    """Encoder, decoder and cross-attention (T5's family with its position bias); t5gemma and t5gemma2 among them."""
    outcomes = _sweep("seq2seq", _seq2seq())
    _check(outcomes)
    assert outcomes["t5gemma"][0] == outcomes["t5gemma2"][0] == "equal"


def test_every_composite_text_tower_equals_eager_or_refuses():
    """Four composites thread a keyword through ``**kwargs`` to every attention call, which eager ignores: Gemma 4
    and Gemma 4 Unified ``labels=None``, GOT-OCR2 ``logits_to_keep=0``, BLT ``cross_attention_mask=None`` and
    ``full_text_row_masked_out_mask=None``. They were refused; now the first two are harmless keywords and the
    masks are accepted as ``None`` only (`attention_ref.hf`), and each equals eager."""
    outcomes = _sweep("composites", _composites())
    _check(outcomes)
    assert {m: outcomes[m][0] for m in ("gemma4", "gemma4_unified", "got_ocr2", "blt")} == dict.fromkeys(
        ("gemma4", "gemma4_unified", "got_ocr2", "blt"), "equal")


def test_every_causal_lm_the_causal_sweep_does_not_build_equals_eager_or_refuses():
    """The hybrids (Mamba, linear attention, recurrent blocks beside attention) and the other defaults that do not
    shrink: `NOT_BUILT` gives each what it needs."""
    _check(_sweep("not built by the causal sweep", _not_built()))
