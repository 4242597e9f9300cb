"""Today's hybrids end to end (issue 34): every layer computed by attention_ref, logits and tokens equal.

Tiny random transformers models (5.23, built from configs, nothing downloaded) of the hybrid
architectures: their linear-attention / state-space layers run through `attention_ref.linear`
(`attention_ref.hf_linear.use_attention_ref_linear`; MiniMax through a replaced layer forward,
below) and their softmax-attention layers through `attention_ref.hf` (registered, eager's
mask). Against transformers' eager model with its own torch fallbacks, in float32:

- the logits of a 70-token prefill (real tokens only; 70 > 64, so the chunked delta-rule
  fallbacks cross a chunk boundary) and of one cached decoding step, on a left-padded batch
  and an unpadded one, agree to 1e-5 relative (measured: below 6e-7; float32 is enough);
- greedy generation with the cache (``do_sample=False``) gives identical tokens, padded and
  not;
- the adapters ran (counted: the chunked form for the prefill, the recurrent form for the
  decoding step, once per linear layer) and they matter: zeroing attention_ref's output moves
  the logits by over 100 times the tolerance, and starting the decoding step from zeros
  instead of the cached state moves the step's logits (the prefill's stay equal).

The Mamba-2 mixers get a larger convolution and a smaller ``D`` than the init's: at the init's
scale the recurrence ``C^T h`` is 1e-4 of the skip ``D x``, and a test would check only the
skip. Falcon-H1's Mamba-2 branch is weighted up (``ssm_out_multiplier=8``) for the same reason.

| model | linear layers: attention_ref computes | softmax layers |
| --- | --- | --- |
| Qwen3-Next | Gated DeltaNet: `gated_delta_rule` | GQA, `attention_ref.hf` |
| Kimi Linear | KDA: `kimi_delta_attention` | MLA, `attention_ref.hf` |
| Bamba, Granite 4.0-H, Falcon-H1 | Mamba-2's SSD with its ``D`` skip: `ssd` | GQA, `attention_ref.hf` |
| MiniMax | lightning attention: `gated_linear_attention`, ``g = -slope_rate`` | GQA, `attention_ref.hf` |
"""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from transformers_api import returned_cache, with_cache  # tests/transformers_api.py

from attention_ref import hf, linear
from attention_ref.hf_linear import SUPPORTED, use_attention_ref_linear

NAME = hf.register()
PAD, VOCAB = 0, 97
CONV_GAIN = 30.0  # Mamba-2: B and C come out of the convolution: larger, and D smaller, see _model
TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32 models; the logits are O(1)


def _config(kind: str):
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "pad_token_id": PAD,
              "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    mamba = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
             "mamba_chunk_size": 4}  # chunks of 4: transformers' chunked scan crosses chunk boundaries
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **common, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
    if kind == "kimi_linear":
        return transformers.KimiLinearConfig(
            **common, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8,
            linear_num_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=16, num_local_experts=4,
            num_experts_per_tok=2, n_shared_experts=1,
            layer_types=["linear_attention", "full_attention", "linear_attention"])
    if kind == "bamba":
        return transformers.BambaConfig(**common, **mamba, num_hidden_layers=3, num_attention_heads=2,
                                        num_key_value_heads=1, attn_layer_indices=[1])
    if kind == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(
            **common, **mamba, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"])
    if kind == "falcon_h1":  # every layer runs attention and Mamba-2 side by side; no rms norm: the z gate
        return transformers.FalconH1Config(**common, **mamba, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16, mamba_d_ssm=64,
                                           mamba_rms_norm=False, ssm_out_multiplier=8.0)
    assert kind == "minimax"
    return transformers.MiniMaxConfig(**common, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=4,
                                      layer_types=["linear_attention", "full_attention", "linear_attention"])


KINDS = ["qwen3_next", "kimi_linear", "bamba", "granitemoehybrid", "falcon_h1", "minimax"]


def _model(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    with torch.no_grad():  # larger weights than the init's, so that every layer moves the logits
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
        for module in model.modules():  # Mamba-2 mixers: at the init's scale, C^T h is 1e-4 of D x
            if hasattr(module, "A_log") and hasattr(module, "D"):
                module.conv1d.weight.mul_(CONV_GAIN)
                module.D.mul_(0.1)
    return model


# --- MiniMax: the lightning attention is inline in a forward, so the whole forward is replaced ----


def _minimax_forward(calls):
    """``MiniMaxLightningAttention.forward`` of transformers 5.23 (5.24's is the same, its cache named
    ``cache``) with its block loop and its token loop replaced by
    `attention_ref.linear.gated_linear_attention`: ``S_t = exp(-slope) S_{t-1} + k_t v_t^T``,
    ``o_t = S_t^T q_t``, scale 1. Everything else is transformers' code, verbatim."""
    modeling = importlib.import_module("transformers.models.minimax.modeling_minimax")

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, cache=None,
                **kwargs):
        # the cache comes as past_key_values up to transformers 5.23, as cache from 5.24
        past_key_values = cache if cache is not None else past_key_values
        batch_size, seq_len, _ = hidden_states.shape
        qkv_states = self.act_fn(self.qkv_proj(hidden_states))
        qkv_states = modeling.apply_mask_to_padding_states(qkv_states, attention_mask)
        qkv_states = qkv_states.reshape(batch_size, seq_len, self.num_attention_heads, 3 * self.head_dim)
        q, k, v = torch.split(qkv_states, self.head_dim, dim=3)  # (B, L, H, E) each: attention_ref's layout
        state = None if past_key_values is None else past_key_values.get_linear_cache(self.layer_idx)
        g = (-self.slope_rate.reshape(1, 1, -1)).expand(batch_size, seq_len, -1).to(q.dtype)  # (B, L, H) log decay
        calls["minimax_lightning_attention"] += 1
        out, state = linear.gated_linear_attention(
            q, k, v, g, initial_state=None if state is None else state.to(q.dtype), output_final_state=True,
            mode="quadratic" if state is None else "recurrent", scale=1.0)  # out (B, L, H, E); state (B, H, E, E)
        state = state.to(v.dtype)
        attn_output = out.reshape(batch_size, seq_len, self.num_attention_heads * self.head_dim)
        attn_output = self.norm(attn_output)
        attn_output = F.sigmoid(self.output_gate(hidden_states)) * attn_output
        attn_output = self.out_proj(attn_output)
        if past_key_values is not None:
            past_key_values.set_linear_cache(self.layer_idx, state)
        return attn_output, state

    return forward


class _Swap:
    """Everything through attention_ref: softmax layers by `attention_ref.hf`, linear layers by
    `use_attention_ref_linear` (MiniMax: by `_minimax_forward`). ``calls`` counts the linear calls."""

    def __init__(self, model, monkeypatch):
        self.model, self.monkeypatch = model, monkeypatch

    def __enter__(self):
        self.model.set_attn_implementation(NAME)
        kind = self.model.config.model_type
        if kind == "minimax":
            self.calls, self._ctx = Counter(), None
            modeling = importlib.import_module("transformers.models.minimax.modeling_minimax")
            self.monkeypatch.setattr(modeling.MiniMaxLightningAttention, "forward", _minimax_forward(self.calls))
        else:
            self._ctx = use_attention_ref_linear(self.model)
            self.calls = self._ctx.__enter__()
        return self.calls

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        else:
            self.monkeypatch.undo()
        self.model.set_attn_implementation("eager")
        return False


PROMPT = 70  # > 64: Qwen3-Next's and Kimi Linear's chunked prefill (chunks of 64) crosses a chunk boundary


def _ids(padded: bool):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, PROMPT + 1), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :5] = PAD  # left padding, as for generation
        mask[1, :5] = 0
    return ids, mask


def _logits(model, padded: bool):
    """Logits of a prefill of PROMPT tokens (real tokens only) and of one cached decoding step."""
    ids, mask = _ids(padded)
    with torch.no_grad():
        prefill = model(input_ids=ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], use_cache=True)
        step = model(input_ids=ids[:, PROMPT:], attention_mask=mask, use_cache=True,
                     **with_cache(returned_cache(prefill)))
    return [prefill.logits[mask[:, :PROMPT].bool()], step.logits]


def _generate(model, padded: bool):
    ids, mask = _ids(padded)
    with torch.no_grad():  # min_new_tokens: no row stops early at the end-of-sequence token
        return model.generate(input_ids=ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], max_new_tokens=4,
                              min_new_tokens=4, do_sample=False, pad_token_id=PAD)


def _gap(got, want):
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))


EXPECTED_CALLS = {  # (prefill, decode) function names per family
    "qwen3_next": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "kimi_linear": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
    "bamba": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    "granitemoehybrid": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    "falcon_h1": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    "minimax": ("minimax_lightning_attention", "minimax_lightning_attention"),
}


def _linear_layers(model):
    kind = model.config.model_type
    if kind == "falcon_h1":
        return model.config.num_hidden_layers  # a Mamba-2 mixer in every layer
    return sum(t in ("linear_attention", "mamba") for t in model.config.layer_types)


def _softmax_layers(model):
    if model.config.model_type == "falcon_h1":
        return model.config.num_hidden_layers  # attention beside Mamba-2 in every layer
    return model.config.layer_types.count("full_attention")


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return _model(request.param)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_logits_and_greedy_tokens_equal_eager(model, padded, monkeypatch):
    kind, n = model.config.model_type, _linear_layers(model)
    want, want_tokens = _logits(model, padded), _generate(model, padded)
    with _Swap(model, monkeypatch) as calls, hf.record_weights() as softmax_layers:
        got = _logits(model, padded)
        counted = dict(calls)
        softmax_calls = len(softmax_layers)
        got_tokens = _generate(model, padded)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert torch.equal(got_tokens, want_tokens), (got_tokens, want_tokens)
    prefill, decode = EXPECTED_CALLS[kind]
    expected = {prefill: 2 * n} if prefill == decode else {prefill: n, decode: n}
    assert counted == expected
    assert softmax_calls == 2 * _softmax_layers(model)  # attention_ref.hf ran every softmax layer, twice
    print(f"{kind} {'padded' if padded else 'unpadded'}: max relative logit gap {_gap(got, want):.2e}, "
          f"calls {counted}, softmax calls {softmax_calls}, tokens {got_tokens[:, -4:].tolist()}")


FUNCTIONS = {"qwen3_next": "gated_delta_rule", "kimi_linear": "kimi_delta_attention", "bamba": "ssd",
             "granitemoehybrid": "ssd", "falcon_h1": "ssd", "minimax": "gated_linear_attention"}


def test_the_swap_matters(model, monkeypatch):
    """attention_ref's output returned as zeros moves the logits by over 100 times the tolerance: its
    numbers are the ones used (Falcon-H1's Mamba-2 branch weighs least: about 7e-3)."""
    kind = model.config.model_type
    want = _logits(model, False)
    real = getattr(linear, FUNCTIONS[kind])

    def zeros(*args, **kwargs):
        out, state = real(*args, **kwargs)
        return torch.zeros_like(out), state

    monkeypatch.setattr(linear, FUNCTIONS[kind], zeros)
    with _Swap(model, monkeypatch):
        got = _logits(model, False)
    gap = _gap(got, want)
    print(f"{kind}: zeroed attention_ref.linear.{FUNCTIONS[kind]} output moves the logits by {gap:.2e}")
    assert gap > 100 * TOL["rtol"]


def test_the_state_is_carried_into_decoding(model, monkeypatch):
    """attention_ref started from zeros instead of the cached state: the prefill still agrees, the
    decoding step does not. The state goes from transformers' cache to attention_ref and back."""
    kind = model.config.model_type
    want = _logits(model, False)
    real = getattr(linear, FUNCTIONS[kind])

    def forgetful(*args, initial_state=None, **kwargs):
        return real(*args, initial_state=None, **kwargs)

    monkeypatch.setattr(linear, FUNCTIONS[kind], forgetful)
    with _Swap(model, monkeypatch):
        got = _logits(model, False)
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert _gap(got[1:], want[1:]) > 100 * TOL["rtol"]


def test_transformers_own_functions_come_back():
    model = _model("bamba")
    modeling = importlib.import_module("transformers.models.bamba.modeling_bamba")
    before = (modeling.mamba2_chunk_scan, modeling.mamba2_selective_state_update)
    with pytest.raises(RuntimeError, match="inside"), use_attention_ref_linear(model):
        assert modeling.mamba2_chunk_scan is not before[0]
        raise RuntimeError("inside")
    assert (modeling.mamba2_chunk_scan, modeling.mamba2_selective_state_update) == before


def test_refusals_name_the_model_type_and_the_keyword():
    minimax, qwen = _model("minimax"), _model("qwen3_next")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1))
    with pytest.raises(ValueError, match=r"model type 'minimax' is not supported: .*inline"), \
            use_attention_ref_linear(minimax):
        pass
    with pytest.raises(ValueError, match=r"model type 'llama' is not supported; .*'bamba'"), \
            use_attention_ref_linear(llama):
        pass
    with pytest.raises(TypeError, match=r"config.model_type, got Linear"), \
            use_attention_ref_linear(torch.nn.Linear(2, 2)):
        pass
    assert set(SUPPORTED) == set(KINDS) - {"minimax"}
    modeling = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    q = k = torch.randn(1, 3, 1, 4)
    v, g, beta = torch.randn(1, 3, 1, 2), -torch.rand(1, 3, 1), torch.rand(1, 3, 1)
    with use_attention_ref_linear(qwen), \
            pytest.raises(NotImplementedError, match=r"torch_chunk_gated_delta_rule was passed seq_idx=Tensor"):
        modeling.torch_chunk_gated_delta_rule(q, k, v, g, beta, seq_idx=torch.zeros(3))
