r"""Context-parallel (ring) attention on ``torch.distributed``: one sequence split across devices.

When a sequence no longer fits one device, it is cut along its length: each rank
(process, usually one per GPU) holds a slice of the queries, keys and values.
The queries stay where they are; the key/value slices travel around a ring of
ranks, one hop per step, and after ``world`` steps every query slice has met
every key slice. Each rank merges its partial results with the log-sum-exp
algebra of the online softmax (`attention_ref.functional.merge_attention`), so
the result equals `attention_ref.functional.scaled_dot_product_attention` on
the whole sequence up to rounding.

Three layouts say which positions a rank holds (`shard`, `unshard`), for a full
length ``N`` and ``world`` ranks:

- ``"contiguous"``: rank ``r`` holds the ``r``-th of ``world`` equal slices.
  Under a causal mask the last rank does most of the work: its queries see
  every key, rank 0's only its own.
- ``"zigzag"`` (the default): the sequence is cut into ``2 * world`` equal chunks
  and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``, one early and one
  late, so that every rank does the same causal work (`ring_schedule` lists it).
- ``"zigzag-per-sequence"``: Megatron's sharding of packed (THD) batches, the zigzag
  of every packed sequence (``cu_seqlens``) at once, which balances many causal
  triangles where the whole-row zigzag balances one.

What the module gives:

- `ring_attention`: the local slices in, this rank's output slice out, with a
  backward pass that sends the key/value gradients around the ring to their owners;
  a ``mask_mod`` over global positions (a sliding window, a block mask) makes it skip
  the chunk pairs no query sees and the slices no rank further along needs;
- `ulysses_attention` and `usp_attention`: DeepSpeed-Ulysses' all-to-all from sequence
  slices to head slices, and USP, Ulysses inside groups with the ring across them;
- `shard` / `unshard`: a full tensor to this rank's part and back; `shard_positions`:
  which positions each rank holds, without a process group;
- `ring_schedule`: which key/value chunk each rank meets at each step, and whether
  it is computed in full, with a mask, or skipped; `ring_hops`: how far each slice travels;
- `count_communication` / `CommStats`: the sends of `ring_attention`, counted;
- `spawn` / `demo_worker`: run a function in ``world`` local CPU processes joined
  by the gloo backend (for tests and the documentation), and a worker that
  checks the ring, Ulysses or USP against one process.

Where each part lives, one file per idea: ``layouts.py`` (the layouts, `shard`, `unshard`,
`shard_positions`), ``schedule.py`` (`ring_schedule`, `ring_hops`, the plan the ring runs by),
``counting.py`` (`CommStats`, `count_communication`), ``ring.py`` (`ring_attention` and its
autograd), ``ulysses.py`` (`ulysses_attention`, `usp_attention`), ``launch.py`` (`spawn`: local
processes, no attention code) and ``demo.py`` (`demo_worker`). This file only gathers their names.

Every rank must call the collective functions in the same order with tensors of
the same shapes (as every ``torch.distributed`` program): nothing checks it, a
mismatch hangs until the process group's timeout. The code runs unchanged with
the NCCL backend on GPUs (the tensors on each rank's own device); it has been
tested on CPU with gloo. Shapes use the package legend (``B``, ``H``, ``Hkv``,
``L``, ``E``, ``Ev``); a local slice has ``L / world`` positions.

Examples:
    >>> from attention_ref.distributed import ring_schedule
    >>> for rank, blocks in enumerate(ring_schedule(2, layout="zigzag")):   # causal, 2 ranks
    ...     print(rank, [(b.step, b.q_chunk, b.kv_chunk, b.kind) for b in blocks if b.kind != "skipped"])
    0 [(0, 0, 0, 'masked'), (0, 3, 0, 'full'), (0, 3, 3, 'masked'), (1, 3, 1, 'full'), (1, 3, 2, 'full')]
    1 [(0, 1, 1, 'masked'), (0, 2, 1, 'full'), (0, 2, 2, 'masked'), (1, 1, 0, 'full'), (1, 2, 0, 'full')]
"""

from __future__ import annotations

from attention_ref.distributed.counting import CommStats, count_communication
from attention_ref.distributed.demo import demo_worker
from attention_ref.distributed.launch import FORKSERVER_PRELOAD as FORKSERVER_PRELOAD
from attention_ref.distributed.launch import spawn
from attention_ref.distributed.layouts import LAYOUTS as LAYOUTS
from attention_ref.distributed.layouts import shard, shard_positions, unshard
from attention_ref.distributed.ring import ring_attention
from attention_ref.distributed.schedule import RingBlock, ring_hops, ring_schedule
from attention_ref.distributed.ulysses import ulysses_attention, usp_attention

__all__ = [
    "CommStats",
    "RingBlock",
    "count_communication",
    "demo_worker",
    "ring_attention",
    "ring_hops",
    "ring_schedule",
    "shard",
    "shard_positions",
    "spawn",
    "ulysses_attention",
    "unshard",
    "usp_attention",
]
