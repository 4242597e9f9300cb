r"""Associative recall (MQAR): softmax attention against linear attention and the delta rules.

Multi-query associative recall (MQAR, Zoology: [Arora, Eyuboglu et al. 2023](https://arxiv.org/abs/2312.04927))
shows a sequence of key-value pairs, then asks for the value of each key again, later and in
another order. At every query position the model must output the value that followed that key:

```text
position  0   1     2   3     4   5     6     7   8     9   10  ...
input     k7  v200  k3  v131  k9  v150  k3    0   k9    0   0   ...
target    .   .     .   .     .   .     v131  .   v150  .   .   ...
```

A model that keeps every key (softmax attention, a cache of ``2 d L`` floats per layer) can
look the key up; a model with a fixed-size state (linear attention, the delta rule: ``d x d``
floats per head) must squeeze all the pairs into that state, and recalls only what it kept.

- `mqar_batch` draws the task; `training_batch` mixes pair counts in one batch.
- `RecallModel`: an embedding, ``layers`` blocks of a short causal depthwise convolution and
  a sequence mixer (``"softmax"``, ``"linear"``, ``"delta"``, ``"gated_delta"``), a linear read-out.
- `state_size`: the floats each mixer keeps per sequence and layer.
- `train`, `accuracy`, `accuracy_by_pairs`; `load_recall` loads the models trained by
  ``scripts/train_recall.py``, which ship with the package.
- `MoBA`, `NSASelected`: a trained softmax model evaluated with block-sparse attention in
  place of its full attention, without retraining (``sparse=`` of `RecallModel.forward`).

Shapes: ``B`` batch, ``L`` tokens, ``H`` heads, ``E = d / H`` the head size, ``V`` the vocabulary.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from attention_ref._validation import check_positive_int, fmt_shape
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.linear import gated_delta_rule, linear_attention
from attention_ref.lm import optimise, round_to_half, warmup_cosine  # noqa: F401 - round_to_half: scripts/train_recall.py
from attention_ref.moba import TOPK1, moba_attention
from attention_ref.mods import sliding_window
from attention_ref.nsa import compress_blocks, select_blocks, selected_attention
from attention_ref.positional import rope

__all__ = [
    "IGNORE",
    "MIXERS",
    "PAD",
    "TEST_SEED",
    "MoBA",
    "NSASelected",
    "RecallModel",
    "RecallTraining",
    "accuracy",
    "accuracy_by_pairs",
    "eval_batch",
    "load_recall",
    "mqar_batch",
    "round_to_half",
    "save_recall",
    "state_size",
    "train",
    "training_batch",
    "training_record",
]

MIXERS = ("softmax", "linear", "delta", "gated_delta")
"""The sequence mixers `RecallModel` knows, in the order the page plots them."""

PAD = 0
"""The id at every position that is neither a pair nor a query (no key or value uses it)."""

IGNORE = -100
"""The target at positions without a query: `torch.nn.functional.cross_entropy`'s ``ignore_index``."""

TEST_SEED = 1234
"""Seeds the fixed test batches of `eval_batch` (training uses `RecallTraining.seed`)."""

CHUNK_SIZE = 64
"""Tokens per chunk of the delta rules' chunked form (`attention_ref.linear.gated_delta_rule`)."""

WEIGHTS_FILE = "recall_{mixer}.pt"


# --- the task ----------------------------------------------------------------------------------


def _check_pairs(pairs: object, batch_size: int, length: int) -> torch.Tensor:
    """``pairs`` as a ``(B,)`` int64 tensor, each in ``[1, length // 4]``."""
    limit = length // 4
    if isinstance(pairs, torch.Tensor):
        if pairs.dtype.is_floating_point or pairs.dtype.is_complex or pairs.dtype == torch.bool:
            raise TypeError(f"pairs must be an int or an integer tensor (B,), got {pairs.dtype}")
        if tuple(pairs.shape) != (batch_size,):
            raise ValueError(f"pairs must have shape (B,)={fmt_shape((batch_size,))}, "
                             f"got {fmt_shape(pairs.shape)}")
        counts = pairs.to(torch.int64)
    elif isinstance(pairs, int) and not isinstance(pairs, bool):
        counts = torch.full((batch_size,), pairs, dtype=torch.int64)
    else:
        raise TypeError(f"pairs must be an int or an integer tensor (B,), got {type(pairs).__name__}")
    if counts.numel() and (counts.min() < 1 or counts.max() > limit):
        raise ValueError(f"pairs must lie in [1, length // 4 = {limit}] (4 * pairs <= length={length}), "
                         f"got {counts.min().item()} to {counts.max().item()}")
    return counts


def mqar_batch(generator: torch.Generator, batch_size: int, *, length: int = 64,
               pairs: int | torch.Tensor = 8, vocab: int = 256
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of multi-query associative recall (Zoology's ``multiquery_ar``).

    Each sequence starts with ``pairs`` key-value pairs, ``key value key value ...``: keys
    are distinct ids from ``1 .. V/2 - 1``, values distinct ids from ``V/2 .. V - 1``. The
    rest of the sequence, ``length - 2 pairs`` tokens, is cut into two-token slots; each key
    is asked again once, at the first token of a slot drawn at random (the queries come in
    random order, each slot used at most once). Every other position holds `PAD` (Zoology
    fills them with random ids instead, its ``random_non_queries``; and it draws the slots
    from a power law that favours early ones, where here every slot is equally likely).

    The target at a query position is the value that followed the same key in the pairs;
    at every other position it is `IGNORE`.

    Args:
        generator: the random numbers (a seeded `torch.Generator` gives the same batch).
        batch_size: ``B``, sequences.
        length: ``L``, tokens per sequence.
        pairs: key-value pairs per sequence, an int or a ``(B,)`` integer tensor (one count
            per sequence, so one batch can mix them); each in ``[1, L // 4]``.
        vocab: ``V``, the vocabulary size; more than ``L`` (as Zoology asks).

    Returns:
        ``(inputs, targets, mask)``, each ``(B, L)``: the int64 ids, the int64 targets
        (`IGNORE` off the queries), and the bool mask of the query positions (True = a
        query, where the model is scored).

    Raises:
        TypeError: ``generator`` is not a `torch.Generator`, an int argument is not an int,
            ``pairs`` is neither an int nor an integer tensor.
        ValueError: a size is not positive, ``vocab <= length``, ``pairs`` is outside
            ``[1, L // 4]`` or a tensor not of shape ``(B,)``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> inputs, targets, mask = mqar_batch(g, 2, length=16, pairs=torch.tensor([2, 4]), vocab=32)
        >>> inputs.shape, targets.shape, mask.shape
        (torch.Size([2, 16]), torch.Size([2, 16]), torch.Size([2, 16]))
        >>> mask.sum(dim=1).tolist()                   # one query per pair
        [2, 4]
        >>> bool(((inputs[:, 0:8:2] >= 1) & (inputs[:, 0:8:2] < 16))[1].all())  # keys: 1 .. V/2 - 1
        True
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    B = check_positive_int("batch_size", batch_size)
    L = check_positive_int("length", length)
    V = check_positive_int("vocab", vocab)
    if L < 4:
        raise ValueError(f"length must be >= 4 (4 * pairs <= length for one pair), got {L}")
    if V <= L:
        raise ValueError(f"vocab must be > length={L}, got {V}")
    counts = _check_pairs(pairs, B, L)  # (B,)
    P = int(counts.max())  # the most pairs of any sequence
    half = V // 2
    # distinct keys and values per row: the first P of a random permutation (ties: probability 0)
    keys = torch.rand(B, half - 1, generator=generator).argsort(dim=1)[:, :P] + 1  # (B, P) in 1 .. V/2 - 1
    values = torch.rand(B, V - half, generator=generator).argsort(dim=1)[:, :P] + half  # (B, P) in V/2 .. V - 1
    # the query slots: (L - 2 p) // 2 two-token slots after the pairs, P of them drawn without repeats
    slots = (L - 2 * counts) // 2  # (B,) >= p since 4 p <= L
    draw = torch.rand(B, L // 2, generator=generator)  # (B, L // 2)
    draw = draw.masked_fill(torch.arange(L // 2) >= slots[:, None], 2.0)  # slots past the end sort last
    slot = draw.argsort(dim=1)[:, :P]  # (B, P): distinct slots, in random order
    query_at = 2 * counts[:, None] + 2 * slot  # (B, P): the first token of each slot
    b, j = (torch.arange(P) < counts[:, None]).nonzero(as_tuple=True)  # the pairs that exist
    inputs = torch.full((B, L), PAD, dtype=torch.int64)
    targets = torch.full((B, L), IGNORE, dtype=torch.int64)
    inputs[b, 2 * j] = keys[b, j]
    inputs[b, 2 * j + 1] = values[b, j]
    inputs[b, query_at[b, j]] = keys[b, j]
    targets[b, query_at[b, j]] = values[b, j]
    return inputs, targets, targets != IGNORE


# --- the model ---------------------------------------------------------------------------------


def state_size(mixer: str, d: int, heads: int, length: int) -> int:
    """The floats one layer's sequence mixer keeps per sequence to go on from token ``length``.

    Softmax attention keeps every key and value, its KV cache: ``2 d L``. The recurrent
    mixers keep a state of ``E x E`` per head (``E = d / H``), ``H E^2 = d^2 / H`` whatever
    the length; normalised linear attention keeps the running key sum too, ``E`` more per
    head (`attention_ref.linear.linear_attention`'s extra value column). The short
    convolution in front of every mixer keeps ``(kernel - 1) d`` more, the same for all.

    Args:
        mixer: one of `MIXERS`.
        d: the model width.
        heads: ``H``, which divides ``d``.
        length: ``L``, the tokens seen.

    Returns:
        The number of floats.

    Raises:
        TypeError: a size that is not an int.
        ValueError: an unknown ``mixer``, a size that is not positive, ``heads`` not dividing ``d``.

    Example:
        >>> state_size("softmax", 64, 1, 64), state_size("delta", 64, 1, 64), state_size("linear", 64, 1, 64)
        (8192, 4096, 4160)
        >>> state_size("delta", 64, 1, 10_000)         # fixed, whatever the length
        4096
    """
    _check_mixer(mixer)
    check_positive_int("d", d)
    check_positive_int("heads", heads)
    check_positive_int("length", length)
    if d % heads:
        raise ValueError(f"heads must divide d={d}, got heads={heads}")
    E = d // heads
    if mixer == "softmax":
        return 2 * d * length
    if mixer == "linear":
        return heads * E * (E + 1)
    return heads * E * E


def _check_mixer(mixer: object) -> str:
    if mixer not in MIXERS:
        raise ValueError(f"mixer must be one of {', '.join(map(repr, MIXERS))}, got {mixer!r}")
    return mixer


# --- block-sparse attention in place of the trained full attention ------------------------------


@dataclass(frozen=True)
class MoBA:
    """MoBA's block choice in place of full attention: `attention_ref.moba.moba_attention`.

    Given as ``sparse=`` to `RecallModel.forward` (or `accuracy`), every softmax layer
    attends with ``moba_attention(q, k, v, chunk_size=..., topk=..., topk1=...)`` on its
    rotated queries and keys, ``(B, H, L, E)``, where it would call full causal attention:
    each query reads its own chunk up to itself and the ``topk - 1`` past chunks whose mean
    key scores highest against it. Nothing is retrained; MoBA's gate has no parameters.

    A query reads at most ``topk * chunk_size`` keys (its own chunk only up to itself).

    Attributes:
        chunk_size: keys per chunk.
        topk: chunks per query, the own chunk counted.
        topk1: what ``topk = 1`` means, ``"block_local"`` or ``"full"`` (`attention_ref.moba`);
            required when ``topk == 1``, ignored otherwise.

    Raises:
        TypeError: ``chunk_size`` or ``topk`` not an int.
        ValueError: ``chunk_size`` or ``topk`` not positive, an unknown ``topk1``, or
            ``topk = 1`` without ``topk1``.

    Example:
        >>> model, _ = load_recall("softmax")
        >>> batch = eval_batch(4, size=8)
        >>> every_chunk = MoBA(chunk_size=8, topk=8)   # 8 chunks of 8: all 64 keys
        >>> accuracy(model, batch, sparse=every_chunk) == accuracy(model, batch)
        True
    """

    chunk_size: int
    topk: int
    topk1: str | None = None

    def __post_init__(self) -> None:
        check_positive_int("MoBA.chunk_size", self.chunk_size)
        check_positive_int("MoBA.topk", self.topk)
        if self.topk1 is not None and self.topk1 not in TOPK1:
            raise ValueError(f"MoBA.topk1 must be one of {', '.join(map(repr, TOPK1))} or None, "
                             f"got {self.topk1!r}")
        if self.topk == 1 and self.topk1 is None:
            raise ValueError("MoBA.topk1 must be given when topk = 1: 'block_local' (the own chunk only) "
                             "or 'full' (every chunk up to the own one), see attention_ref.moba")

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``(B, H, L, E)`` each -> ``(B, H, L, E)``: `attention_ref.moba.moba_attention`."""
        return moba_attention(query, key, value, chunk_size=self.chunk_size, topk=self.topk, topk1=self.topk1)


@dataclass(frozen=True)
class NSASelected:
    """NSA's selected branch alone in place of full attention (`attention_ref.nsa`).

    Given as ``sparse=`` to `RecallModel.forward` (or `accuracy`), every softmax layer
    attends, on its rotated queries and keys ``(B, H, L, E)``, with the blocks that NSA's
    selection picks: the keys are mean-pooled per block of ``block_size``
    (`attention_ref.nsa.compress_blocks`), each query scores the blocks that end at or
    before it by its softmax over their pooled keys (`attention_ref.nsa.select_blocks`),
    and reads, causally, the ``block_counts`` best (`attention_ref.nsa.selected_attention`).
    The first block, the query's own block and the one before it are forced, and count in
    ``block_counts`` (ranked by index: with fewer than 3, the own block is the first left
    out).

    NSA mixes three branches with learned gates; the trained model has none. The gates
    are fixed at ``g_slc = 1``, ``g_cmp = g_swa = 0``:
    ``attention_ref.nsa.nsa_attention(q, k, v, 0, 1, 0, ...)`` gives the same output. So
    selecting every block is full attention, the output the model was trained on; equal
    gates of 1/3 would mix in branches it never saw, at every budget.

    A query reads at most ``block_counts * block_size`` keys (its own block only up to
    itself).

    Attributes:
        block_size: keys per block, pooled and selected alike.
        block_counts: blocks per query, the forced ones counted.

    Raises:
        TypeError: ``block_size`` or ``block_counts`` not an int.
        ValueError: ``block_size`` or ``block_counts`` not positive.

    Example:
        >>> model, _ = load_recall("softmax")
        >>> batch = eval_batch(4, size=8)
        >>> every_block = NSASelected(block_size=8, block_counts=8)   # all 64 keys
        >>> accuracy(model, batch, sparse=every_block) == accuracy(model, batch)
        True
    """

    block_size: int
    block_counts: int

    def __post_init__(self) -> None:
        check_positive_int("NSASelected.block_size", self.block_size)
        check_positive_int("NSASelected.block_counts", self.block_counts)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``(B, H, L, E)`` each -> ``(B, H, L, E)``: NSA's selection, then its selected branch."""
        pooled = compress_blocks(key, self.block_size)  # (B, H, L, E) -> (B, H, L // block_size, E)
        # (B, H, L, block_counts): block numbers, the forced ones first, -1 in unused slots
        chosen = select_blocks(query, pooled, block_size=self.block_size, block_counts=self.block_counts)
        return selected_attention(query, key, value, chosen, block_size=self.block_size)


Sparse = MoBA | NSASelected
"""What ``sparse=`` of `RecallModel.forward` takes."""


class _ShortConv(nn.Module):
    """A causal depthwise convolution: channel ``c`` of token ``t`` mixes tokens ``t - kernel + 1 .. t``."""

    def __init__(self, d: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(d, d, kernel, groups=d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, d)`` -> ``(B, L, d)``."""
        x = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))  # (B, d, L) -> (B, d, kernel - 1 + L), zeros in front
        return self.conv(x).transpose(1, 2)  # (B, d, L) -> (B, L, d)


class _Mixer(nn.Module):
    """One sequence mixer: ``(B, L, d)`` -> ``(B, L, d)``, queries, keys and values from ``x``."""

    def __init__(self, mixer: str, d: int, heads: int) -> None:
        super().__init__()
        self.mixer, self.heads = mixer, heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        if mixer in ("delta", "gated_delta"):
            self.beta = nn.Linear(d, heads)  # the delta rule's step, sigmoid(beta(x)) in (0, 1)
        if mixer == "gated_delta":
            self.gate = nn.Linear(d, heads)  # the log decay, logsigmoid(gate(x)) <= 0

    def reset_gate(self) -> None:
        """Start the gated delta rule near no decay: ``exp(logsigmoid(3)) ~ 0.95``."""
        if self.mixer == "gated_delta":
            nn.init.constant_(self.gate.bias, 3.0)

    def forward(self, x: torch.Tensor, window: int | None = None, sparse: Sparse | None = None) -> torch.Tensor:
        B, L, d = x.shape
        H = self.heads
        # each (B, L, d) -> (B, L, H, E): tokens before heads, the layout of attention_ref.linear
        q, k, v = (f(x).view(B, L, H, d // H) for f in (self.q, self.k, self.v))
        if self.mixer == "softmax":
            # (B, L, H, E) -> (B, H, L, E), rotated by their positions 0 .. L - 1
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            q, k = rope(q), rope(k)
            if sparse is not None:
                out = sparse(q, k, v)  # (B, H, L, E), block-sparse and causal
            elif window is None:
                out = scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = scaled_dot_product_attention(q, k, v, mask_mod=sliding_window(window - 1))
            out = out.transpose(1, 2)  # (B, H, L, E) -> (B, L, H, E)
        elif self.mixer == "linear":
            # positive features elu + 1, normalised by the running sum of the scores
            out, _ = linear_attention(F.elu(q) + 1, F.elu(k) + 1, v, normalize=True, mode="quadratic")
        else:
            beta = torch.sigmoid(self.beta(x))  # (B, L, H)
            if self.mixer == "delta":
                g = beta.new_zeros(B, L, H)  # log 1: no decay
            else:
                g = F.logsigmoid(self.gate(x))  # (B, L, H), <= 0
            # q and k L2-normalised inside (use_qk_l2norm), as DeltaNet and Qwen3-Next do
            out, _ = gated_delta_rule(q, k, v, g, beta, mode="chunked", chunk_size=CHUNK_SIZE)
        return self.out(out.reshape(B, L, d))  # (B, L, H, E) -> (B, L, d)


class _Block(nn.Module):
    """``x + conv(norm(x))``, ``x + mixer(norm(x))``, and with ``mlp``, ``x + mlp(norm(x))``."""

    def __init__(self, mixer: str, d: int, heads: int, kernel: int, mlp: bool) -> None:
        super().__init__()
        self.norm_conv, self.conv = nn.LayerNorm(d), _ShortConv(d, kernel)
        self.norm_mix, self.mix = nn.LayerNorm(d), _Mixer(mixer, d, heads)
        if mlp:
            self.norm_mlp = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.has_mlp = mlp

    def forward(self, x: torch.Tensor, window: int | None = None, sparse: Sparse | None = None) -> torch.Tensor:
        x = x + self.conv(self.norm_conv(x))
        x = x + self.mix(self.norm_mix(x), window, sparse)
        if self.has_mlp:
            x = x + self.mlp(self.norm_mlp(x))
        return x


class RecallModel(nn.Module):
    """A small model for `mqar_batch`: ids ``(B, L)`` -> logits ``(B, L, V)``.

    An embedding of width ``d``, then ``layers`` pre-norm blocks, each a short causal
    depthwise convolution (``kernel`` tokens: it lets a value's position see the key just
    before it) and a sequence mixer, each added back to its input, then a LayerNorm and a
    linear read-out. The mixers:

    - ``"softmax"``: causal `attention_ref.scaled_dot_product_attention` with rotary
      positions (`attention_ref.positional.rope`) on queries and keys;
    - ``"linear"``: `attention_ref.linear.linear_attention`, normalised, on the positive
      features ``elu(x) + 1``;
    - ``"delta"``: `attention_ref.linear.gated_delta_rule` with L2-normalised queries and
      keys, a learned step ``beta = sigmoid(w . x)`` and no decay (``g = 0``), run in its
      chunked form;
    - ``"gated_delta"``: the same with a learned decay, ``g = logsigmoid(w . x + b)``.

    Args:
        mixer: one of `MIXERS`.
        vocab: ``V``.
        d: the width.
        heads: ``H``, dividing ``d``; the head size ``d / H`` must be even (rotary pairs).
        layers: blocks.
        kernel: the convolution's width in tokens.
        mlp: add a ``d -> 4d -> d`` GELU MLP to every block.

    Raises:
        TypeError: a size that is not an int, ``mlp`` not a bool.
        ValueError: an unknown ``mixer``, a size that is not positive, ``heads`` not
            dividing ``d`` into even head sizes.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = RecallModel("delta", vocab=32, d=8, heads=2)
        >>> inputs, targets, mask = mqar_batch(torch.Generator().manual_seed(0), 3, length=16, vocab=32, pairs=2)
        >>> model(inputs).shape                        # (B, L, V)
        torch.Size([3, 16, 32])
    """

    def __init__(self, mixer: str, *, vocab: int = 256, d: int = 64, heads: int = 1, layers: int = 2,
                 kernel: int = 3, mlp: bool = False) -> None:
        super().__init__()
        _check_mixer(mixer)
        for name, value in (("vocab", vocab), ("d", d), ("heads", heads), ("layers", layers), ("kernel", kernel)):
            check_positive_int(name, value)
        if d % heads or (d // heads) % 2:
            raise ValueError(f"heads must divide d into even head sizes: got d={d}, heads={heads}")
        if not isinstance(mlp, bool):
            raise TypeError(f"mlp must be a bool, got {type(mlp).__name__}")
        self.config = {"mixer": mixer, "vocab": vocab, "d": d, "heads": heads, "layers": layers,
                       "kernel": kernel, "mlp": mlp}
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(mixer, d, heads, kernel, mlp) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every weight again from torch's global generator (PyTorch's default init of
        each layer, the gated delta rule's gate bias at 3)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv1d)):
                module.reset_parameters()
            if isinstance(module, _Mixer):
                module.reset_gate()

    def forward(self, ids: torch.Tensor, *, window: int | None = None, sparse: Sparse | None = None
                ) -> torch.Tensor:
        """Logits ``(B, L, V)`` for ids ``(B, L)``.

        Args:
            ids: ``(B, L)`` int64 ids in ``[0, V)``.
            window: softmax mixers only: each query sees its last ``window`` keys, itself
                included (`attention_ref.mods.sliding_window`), as a model that keeps a KV
                cache of ``window`` tokens would. None: every earlier key.
            sparse: softmax mixers only: a `MoBA` or `NSASelected`, the block-sparse
                attention every layer computes instead of full causal attention, on the
                same rotated queries, keys and values, with the trained weights. None:
                full attention (or the ``window``); not with a ``window``.

        Raises:
            TypeError: ``ids`` not an integer tensor, ``window`` not an int, ``sparse`` not
                a `MoBA` or `NSASelected`.
            ValueError: ``ids`` not 2-D, or out of range; a ``window`` that is not positive;
                a ``window`` or ``sparse`` given to a recurrent mixer; both given.
        """
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor (B, L), got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape (B, L), got {fmt_shape(ids.shape)}")
        V = self.config["vocab"]
        if ids.numel() and (ids.min() < 0 or ids.max() >= V):
            raise ValueError(f"ids must lie in [0, vocab={V}), got {ids.min().item()} to {ids.max().item()}")
        if window is not None:
            check_positive_int("window", window)
            if self.config["mixer"] != "softmax":
                raise ValueError(f"window applies to the softmax mixer only, got mixer={self.config['mixer']!r}")
        if sparse is not None:
            if not isinstance(sparse, (MoBA, NSASelected)):
                raise TypeError(f"sparse must be a MoBA, an NSASelected or None, got {type(sparse).__name__}")
            if self.config["mixer"] != "softmax":
                raise ValueError(f"sparse applies to the softmax mixer only, got mixer={self.config['mixer']!r}")
            if window is not None:
                raise ValueError(f"window and sparse must not be given together (each replaces full "
                                 f"attention), got window={window} and sparse={sparse!r}")
        x = self.embed(ids)  # (B, L) -> (B, L, d)
        for block in self.blocks:
            x = block(x, window, sparse)
        return self.head(self.norm(x))  # (B, L, d) -> (B, L, V)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the query positions (targets other than `IGNORE`)."""
        logits = self(inputs)  # (B, L, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


# --- training and evaluation -------------------------------------------------------------------


@dataclass(frozen=True)
class RecallTraining:
    """How `train` trains: AdamW, linear warm-up then cosine decay to ``min_lr``, clipped gradients.

    Attributes:
        steps: optimiser steps.
        batch_size: sequences per step (`training_batch`).
        lr, min_lr: the peak and the final learning rate.
        warmup: steps of linear warm-up.
        weight_decay: AdamW's, on matrices only (not biases, norms).
        clip: the largest gradient norm.
        seed: seeds the initial weights and the batches.
        length: tokens per sequence.
        min_pairs, max_pairs: each sequence's pair count is drawn uniformly from this range
            (both ends included).
        vocab: the vocabulary of the task.

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size that is not positive, or not ``min_pairs <= max_pairs <= length // 4``.

    Example:
        >>> config = RecallTraining()
        >>> config.lr_at(0), config.lr_at(49), round(config.lr_at(config.steps - 1), 6)
        (6e-05, 0.003, 0.0003)
    """

    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    length: int = 64
    min_pairs: int = 2
    max_pairs: int = 16
    vocab: int = 256

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "length", "min_pairs", "max_pairs", "vocab"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("warmup", self.warmup, allow_zero=True)
        check_positive_int("seed", self.seed, allow_zero=True)
        if not self.min_pairs <= self.max_pairs <= self.length // 4:
            raise ValueError(f"pairs must satisfy min_pairs <= max_pairs <= length // 4 = {self.length // 4}, "
                             f"got {self.min_pairs} and {self.max_pairs}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimiser step ``step`` (0-based): `attention_ref.lm.warmup_cosine`."""
        return warmup_cosine(step, self.lr, self.min_lr, self.warmup, self.steps)


def training_batch(generator: torch.Generator, config: RecallTraining
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One training batch: `mqar_batch` with each sequence's pair count drawn uniformly from
    ``config.min_pairs .. config.max_pairs``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> inputs, targets, mask = training_batch(g, RecallTraining(batch_size=4))
        >>> mask.sum(dim=1).tolist()                   # pairs per sequence, mixed
        [16, 11, 10, 2]
    """
    pairs = torch.randint(config.min_pairs, config.max_pairs + 1, (config.batch_size,), generator=generator)
    return mqar_batch(generator, config.batch_size, length=config.length, pairs=pairs, vocab=config.vocab)


def train(model: RecallModel, config: RecallTraining, *, first: int | None = None,
          progress: Callable[[int, float], None] | None = None) -> dict:
    """Train ``model`` in place on `training_batch` batches; returns the log.

    The weights are drawn again from ``config.seed`` first (`RecallModel.reset_parameters`)
    and the batches come from a generator seeded with it too: the same call gives the same
    losses (on the same torch build and thread count).

    Args:
        model: a `RecallModel`.
        config: a `RecallTraining`.
        first: run only the first ``first`` steps of ``config``'s schedule (to replay the
            start of a run); None runs all ``config.steps``.
        progress: called as ``progress(step, loss)`` after every step.

    Returns:
        ``{"loss": [the loss of every step], "seconds": the time it took}``.

    Raises:
        TypeError: ``model`` or ``config`` of the wrong type.
        ValueError: ``config.vocab`` is not the model's, ``first`` is not in ``[1, config.steps]``.

    Example:
        >>> model = RecallModel("softmax", vocab=32, d=8)
        >>> log = train(model, RecallTraining(steps=3, batch_size=4, vocab=32, length=16, max_pairs=4))
        >>> len(log["loss"])
        3
    """
    if not isinstance(model, RecallModel):
        raise TypeError(f"model must be a RecallModel, got {type(model).__name__}")
    if not isinstance(config, RecallTraining):
        raise TypeError(f"config must be a RecallTraining, got {type(config).__name__}")
    if config.vocab != model.config["vocab"]:
        raise ValueError(f"config.vocab must be the model's vocab={model.config['vocab']}, got {config.vocab}")
    if first is not None and not 1 <= check_positive_int("first", first) <= config.steps:
        raise ValueError(f"first must lie in [1, config.steps={config.steps}], got {first}")
    torch.manual_seed(config.seed)
    model.reset_parameters()
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []

    def after_step(step: int, loss: float) -> None:
        losses.append(loss)
        if progress is not None:
            progress(step, loss)

    seconds = optimise(model, config, lambda: training_batch(generator, config)[:2],  # type: ignore[arg-type]
                       config.steps if first is None else first, after_step)
    return {"loss": losses, "seconds": seconds}


@torch.no_grad()
def accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], **kwargs: Any) -> float:
    """The share of query positions where the model's most likely id is the right value.

    Args:
        model: ids ``(B, L)`` -> logits ``(B, L, V)``, e.g. a `RecallModel`.
        batch: ``(inputs, targets, mask)`` from `mqar_batch`.
        **kwargs: passed on to the model (``window=`` or ``sparse=`` for `RecallModel`).

    Returns:
        A float in ``[0, 1]``.

    Raises:
        ValueError: ``batch`` is not three ``(B, L)`` tensors, or has no query.

    Example:
        >>> batch = mqar_batch(torch.Generator().manual_seed(0), 2, length=8, pairs=2, vocab=16)
        >>> cheat = lambda ids: F.one_hot(batch[1].clamp(min=0), 16).float()   # knows the answers
        >>> accuracy(cheat, batch)
        1.0
    """
    if not (isinstance(batch, (tuple, list)) and len(batch) == 3
            and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in batch)
            and batch[0].shape == batch[1].shape == batch[2].shape):
        raise ValueError("batch must be (inputs, targets, mask), three (B, L) tensors, as mqar_batch returns")
    inputs, targets, mask = batch
    if not bool(mask.any()):
        raise ValueError("batch must hold at least one query (mask all False)")
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()
    predicted = model(inputs, **kwargs).argmax(dim=-1)  # (B, L, V) -> (B, L)
    if was_training:
        model.train()
    return (predicted == targets)[mask].float().mean().item()


def eval_batch(pairs: int, *, size: int = 256, length: int = 64, vocab: int = 256, seed: int = TEST_SEED
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed test batch for ``pairs`` pairs: `mqar_batch` from a generator seeded with ``seed``.

    Example:
        >>> torch.equal(eval_batch(4, size=3)[0], eval_batch(4, size=3)[0])
        True
    """
    return mqar_batch(torch.Generator().manual_seed(seed), size, length=length, pairs=pairs, vocab=vocab)



def accuracy_by_pairs(model: nn.Module, pair_counts: Iterable[int], *, size: int = 256, length: int = 64,
                      vocab: int = 256, **kwargs) -> dict[int, float]:
    """`accuracy` on the `eval_batch` of every pair count: ``{pairs: accuracy}``.

    Example:
        >>> model = RecallModel("linear", vocab=32, d=8)
        >>> sorted(accuracy_by_pairs(model, [2, 4], size=4, length=16, vocab=32))
        [2, 4]
    """
    return {p: accuracy(model, eval_batch(p, size=size, length=length, vocab=vocab), **kwargs)
            for p in pair_counts}


# --- the shipped models ------------------------------------------------------------------------


def save_recall(path: str | io.BytesIO, model: RecallModel, record: dict) -> None:
    """Write what `load_recall` reads: the weights in float16, the model's config and ``record``.

    Args:
        path: a file name, or a binary buffer.
        model: a `RecallModel`.
        record: what to keep beside the weights (`training_record`).

    Example:
        >>> buffer = io.BytesIO()
        >>> save_recall(buffer, RecallModel("linear", vocab=16, d=8), {"note": "untrained"})
        >>> model, record = load_recall("linear", buffer.getvalue())
        >>> model.config["d"], record
        (8, {'note': 'untrained'})
    """
    torch.save({"model_config": dict(model.config),
                "state": {k: v.detach().half() for k, v in model.state_dict().items()},
                "record": record}, path)


def load_recall(mixer: str, source: str | bytes | None = None) -> tuple[RecallModel, dict]:
    """A trained `RecallModel` and the record of the run that trained it.

    The models ship with the package (``data/recall_<mixer>.pt``, weights in float16, loaded
    as float32), written by ``scripts/train_recall.py``. The record holds the model's config
    (``"model"``) and the training's (``"training"``, a `RecallTraining` as a dict), the loss
    of every step (``"loss"``), the accuracy of the float16 weights on the `eval_batch` of
    each pair count (``"accuracy"``, keyed by the count as a string), the seconds of training
    (``"seconds"``), and the torch version and thread count that produced it.

    Args:
        mixer: one of `MIXERS`.
        source: a path or the bytes of another file the script wrote; default the shipped one.

    Raises:
        ValueError: an unknown ``mixer``, or a file holding another mixer's model.

    Example:
        >>> model, record = load_recall("softmax")
        >>> training = record["training"]
        >>> model.config["mixer"], training["length"]
        ('softmax', 64)
    """
    _check_mixer(mixer)
    if source is None:
        raw = importlib.resources.files("attention_ref").joinpath("data", WEIGHTS_FILE.format(mixer=mixer)).read_bytes()
    else:
        raw = source if isinstance(source, bytes) else Path(source).read_bytes()
    saved = torch.load(io.BytesIO(raw), weights_only=True)
    if saved["model_config"]["mixer"] != mixer:
        raise ValueError(f"mixer must match the file's, {saved['model_config']['mixer']!r}, got {mixer!r}")
    model = RecallModel(**saved["model_config"])
    model.load_state_dict({k: v.float() for k, v in saved["state"].items()})
    model.eval()
    return model, saved["record"]



def training_record(model: RecallModel, config: RecallTraining, log: dict, pair_counts: Iterable[int]) -> dict:
    """The record `save_recall` stores: configs, losses, accuracy per pair count, seconds, versions.

    Args:
        model: the trained `RecallModel` (its accuracy is measured now).
        config: the `RecallTraining` it was trained with.
        log: what `train` returned.
        pair_counts: the pair counts to measure the accuracy at (`accuracy_by_pairs`).

    Example:
        >>> model, config = RecallModel("softmax", vocab=32, d=8), RecallTraining(length=16, vocab=32, max_pairs=4)
        >>> record = training_record(model, config, {"loss": [3.5], "seconds": 0.1}, [2, 4])
        >>> training = record["training"]
        >>> sorted(record["accuracy"]), training["length"]
        (['2', '4'], 16)
    """
    return {"model": dict(model.config), "training": dataclasses.asdict(config), "loss": log["loss"],
            "seconds": log["seconds"],
            "accuracy": {str(p): a for p, a in accuracy_by_pairs(model, pair_counts, length=config.length,
                                                                  vocab=config.vocab).items()},
            "torch": str(torch.__version__), "threads": torch.get_num_threads()}
