"""What the multi-process tests share: process groups of 1 to 4 ranks inside one spawn of 4.

One `attention_ref.distributed.spawn` of 4 CPU processes (gloo) serves every world size: inside
it, every rank creates the groups of 1, 2 and 3 ranks (the groups of 2 and 3 leave out global
ranks 0 and 2, so that group ranks differ from global ranks, as they do in a real job), and the
default group is the world of 4. A test file's worker runs its cases in each group its rank is
in; `run_in_every_group` gathers what the members of each group sent back, by group rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from attention_ref.distributed import spawn

WORLDS = (1, 2, 3, 4)
GROUP_RANKS = {1: [3], 2: [1, 3], 3: [0, 2, 3]}  # global ranks of each group; 4: the default group


def in_every_group(rank: int, world_size: int, cases: Callable[[Any, int], dict]) -> dict[int, dict]:
    """In a spawned process: ``cases(group, world)`` in every group this rank belongs to.

    Every rank creates every group, in the same order (a group that one rank skips would hang
    the others). Returns ``{world: {"group_rank": ..., **cases(group, world)}}``.
    """
    groups = {size: dist.new_group(ranks) for size, ranks in GROUP_RANKS.items()}
    groups[world_size] = None  # the default group
    results = {}
    for world in WORLDS:
        group = groups[world]
        if group is not None and rank not in GROUP_RANKS[world]:
            continue
        results[world] = {"group_rank": dist.get_rank(group), **cases(group, world)}
    return results


def run_in_every_group(cases: Callable[[Any, int], dict], timeout: float = 240) -> dict[int, dict[int, dict]]:
    """`in_every_group` with ``cases`` (a top-level function: the processes import it) in 4 spawned
    processes; ``result[world][group rank]``."""
    by_world: dict[int, dict[int, dict]] = {}
    for results in spawn(in_every_group, 4, cases, timeout=timeout):
        for world, mine in results.items():
            by_world.setdefault(world, {})[mine["group_rank"]] = mine
    assert {w: sorted(r) for w, r in by_world.items()} == {w: list(range(w)) for w in WORLDS}
    return by_world
