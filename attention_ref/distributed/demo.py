"""`demo_worker`: ring, Ulysses or USP attention on the ranks of `attention_ref.distributed.spawn`,
checked against one process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from attention_ref import mods as _mods
from attention_ref.distributed.counting import count_communication
from attention_ref.distributed.layouts import shard, unshard
from attention_ref.distributed.ring import ring_attention
from attention_ref.distributed.ulysses import ulysses_attention, usp_attention
from attention_ref.functional import scaled_dot_product_attention


def demo_worker(rank: int, world: int, seed: int = 0, layout: str = "zigzag", is_causal: bool = True,
                strategy: str = "ring", window: int | None = None) -> dict[str, Any]:
    """Ring, Ulysses or USP attention on ``world`` ranks, forward and backward, checked against one process.

    Every rank draws the same full float64 tensors from ``seed`` (``B=1``,
    ``H=4`` query heads, ``Hkv=2`` key/value heads, ``L = 12 * world``
    positions, ``E=Ev=8``), takes its part with `shard`, runs `ring_attention`
    (or `ulysses_attention`, `usp_attention`) and its backward pass (incoming
    gradient ``dO`` drawn from the seed too), gathers the output and the
    gradients with `unshard`, and compares them with
    `attention_ref.functional.scaled_dot_product_attention` on the full tensors.
    Run it with `spawn`.

    USP runs on a grid of ``U x R`` ranks, ``U = 2`` when ``world`` is even (else
    1) and ``R = world / U``: each row, ``U`` consecutive ranks, is a Ulysses group,
    each column (the ranks at one place in every row) a ring. Every rank creates
    every group with ``torch.distributed.new_group``, in the same order (the rows,
    then the columns). A tensor is cut across the column first (`shard` with
    ``layout``), then within the row (``"contiguous"``), as `usp_attention` takes it.

    Args:
        rank: this process's rank (given by `spawn`).
        world: the number of ranks (given by `spawn`).
        seed: the seed of the inputs.
        layout: ``"zigzag"`` or ``"contiguous"`` (Ulysses: ``"contiguous"`` only; USP:
            the ring's layout).
        is_causal: causal attention.
        strategy: ``"ring"`` (`ring_attention`), ``"ulysses"`` (`ulysses_attention`) or
            ``"usp"`` (`usp_attention` on the grid above).
        window: a sliding window of that many earlier keys (and the query's own),
            ``mask_mod=attention_ref.mods.sliding_window(window)`` for any strategy; the
            ring's plan then skips the slices no rank further along needs.

    Returns:
        A dict: ``"inputs"`` (the full ``q, k, v``), ``"output"`` (the gathered
        output), ``"grads"`` (the gathered ``dq, dk, dv``), ``"max_error"`` (the
        largest absolute difference from one process, output and gradients),
        ``"stats"`` (this rank's `CommStats` as a dict) and ``"positions"`` (the
        global positions this rank held).

    Raises:
        ValueError: an unknown ``strategy``, or ``"ulysses"`` with a layout other than
            ``"contiguous"``.

    Examples:
        >>> import os, tempfile, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> result = demo_worker(0, 1, 3, "contiguous")     # what one of spawn's processes runs
        >>> result["output"].shape, result["max_error"] < 1e-12
        (torch.Size([1, 4, 12, 8]), True)
        >>> demo_worker(0, 1, 3, strategy="usp")["max_error"] < 1e-12   # a 1 x 1 grid
        True
        >>> dist.destroy_process_group()
    """
    if strategy not in ("ring", "ulysses", "usp"):
        raise ValueError(f"strategy must be 'ring', 'ulysses' or 'usp', got {strategy!r}")
    if strategy == "ulysses" and layout != "contiguous":
        raise ValueError(f"Ulysses takes contiguous slices: layout must be 'contiguous', got {layout!r}")
    mask_mod = None if window is None else _mods.sliding_window(window)
    gen = torch.Generator().manual_seed(seed)
    B, H, Hkv, E = 1, 4, 2, 8
    L = 12 * world

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, d_out = draw(B, H, L, E), draw(B, Hkv, L, E), draw(B, Hkv, L, E), draw(B, H, L, E)
    if strategy == "usp":
        # U x R ranks: rows of U = 2 (an even world) or 1, columns of R = world / U
        U = 2 if world % 2 == 0 else 1
        # every rank creates every group, in one order: the rows, then the columns
        rows = [dist.new_group(list(range(i, i + U))) for i in range(0, world, U)]
        columns = [dist.new_group(list(range(j, world, U))) for j in range(U)]
        row, column = rows[rank // U], columns[rank % U]
    # how a full tensor is cut: by each (group, layout) in turn
    cuts: list[tuple[dist.ProcessGroup | None, str]] = [(None, layout)]
    attend: Callable[..., torch.Tensor]
    attend = functools.partial(ring_attention, layout=layout, mask_mod=mask_mod)
    if strategy == "ulysses":
        attend = functools.partial(ulysses_attention, mask_mod=mask_mod)
    if strategy == "usp":
        # across the ring (the column), then within the row
        cuts = [(column, layout), (row, "contiguous")]
        attend = functools.partial(usp_attention, ulysses_group=row,
                                   ring_group=column, layout=layout, mask_mod=mask_mod)

    def part(t: torch.Tensor) -> torch.Tensor:
        for group, how in cuts:
            t = shard(t, group=group, layout=how)
        return t

    def whole(t: torch.Tensor) -> torch.Tensor:
        for group, how in reversed(cuts):
            t = unshard(t, group=group, layout=how)
        return t

    # this rank's parts: (B, H | Hkv, L / world, E)
    local = [part(t).requires_grad_() for t in (q, k, v)]
    with count_communication() as stats:
        out = attend(*local, is_causal=is_causal, enable_gqa=True)
        out.backward(part(d_out))  # this rank's part of dO
    # the full output and gradients, on every rank
    gathered = [whole(t.detach()) for t in (out, *(x.grad for x in local))]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = scaled_dot_product_attention(*full, is_causal=is_causal, enable_gqa=True, mask_mod=mask_mod)
    expected_grads = torch.autograd.grad(expected, full, d_out)
    error = max((a - b).abs().max().item() for a, b in zip(gathered, (expected, *expected_grads)))
    return {
        "inputs": (q, k, v),
        "output": gathered[0],
        "grads": tuple(gathered[1:]),
        "max_error": error,
        "stats": dataclasses.asdict(stats),
        "positions": part(torch.arange(L)[:, None]).flatten().tolist(),
    }
