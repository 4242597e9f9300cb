"""What the ring and Ulysses send, counted: `CommStats` and `count_communication`.

`record` is how `attention_ref.distributed.ring` and `attention_ref.distributed.ulysses` add to
the counters of every open `count_communication` context.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass
class CommStats:
    r"""What `ring_attention` sent from this rank, and the chunk pairs it computed.

    With ``W`` ranks, local key and value slices of ``|K|`` and ``|V|`` elements
    of ``s`` bytes (the input dtype) and ``s_acc`` bytes for the gradient
    accumulators (the compute dtype: float32 for float16/bfloat16 inputs), one
    call and its backward pass send, from every rank:

    - forward: ``W - 1`` key/value steps, ``(W - 1) (|K| + |V|) s`` bytes;
    - backward: ``W - 1`` key/value steps, ``(W - 1) (|K| + |V|) s`` bytes, and
      ``W - 1`` steps of the dK/dV accumulators, ``(W - 1) (|K| + |V|) s_acc`` bytes.

    That is the whole ring, which every slice travels when every rank needs it (no mask,
    or the zigzag layout under a causal mask). A slice is passed on only while a rank
    further along the ring has a block of it to compute (`ring_hops`): with a causal mask
    on the contiguous layout, a sliding window or packed sequences, fewer sends; the
    ``*_skipped`` counters count the sends of the whole ring this rank did not make. A
    send is one message to rank ``r + 1``, except a dK/dV accumulator's last one, which
    goes from the last rank that needed the slice straight back to its owner.

    Attributes:
        forward_steps: key/value exchanges of the forward pass.
        forward_bytes: bytes of key/value sent in the forward pass.
        backward_kv_steps: key/value exchanges of the backward pass.
        backward_kv_bytes: bytes of key/value sent in the backward pass.
        backward_grad_steps: dK/dV accumulator exchanges of the backward pass.
        backward_grad_bytes: bytes of dK/dV accumulators sent.
        blocks_full: chunk pairs computed without a mask (forward pass).
        blocks_masked: chunk pairs computed with the causal mask (forward pass).
        blocks_skipped: chunk pairs skipped, no query seeing any key (forward pass).
        forward_steps_skipped: key/value sends of the whole ring not made in the forward pass
            (no rank further along needed the slice).
        backward_kv_steps_skipped: the same in the backward pass.
        backward_grad_steps_skipped: dK/dV accumulator sends of the whole ring not made.
        forward_all_to_all: all-to-all exchanges of `ulysses_attention`'s forward pass (4: q, k, v
            to head slices, the output back).
        forward_all_to_all_bytes: bytes this rank sent to the other ranks in them: ``(W - 1) / W``
            of each tensor it exchanged (its own share stays).
        backward_all_to_all: all-to-all exchanges of the backward pass (4: dO to head slices, dQ,
            dK, dV back).
        backward_all_to_all_bytes: bytes sent in them.
    """

    forward_steps: int = 0
    forward_bytes: int = 0
    backward_kv_steps: int = 0
    backward_kv_bytes: int = 0
    backward_grad_steps: int = 0
    backward_grad_bytes: int = 0
    blocks_full: int = 0
    blocks_masked: int = 0
    blocks_skipped: int = 0
    forward_steps_skipped: int = 0
    backward_kv_steps_skipped: int = 0
    backward_grad_steps_skipped: int = 0
    forward_all_to_all: int = 0
    forward_all_to_all_bytes: int = 0
    backward_all_to_all: int = 0
    backward_all_to_all_bytes: int = 0


_ACTIVE: list[CommStats] = []


def record(**increments: int) -> None:
    """Add to the counters of every open `count_communication`; shared by `ring` and `ulysses`."""
    for stats in _ACTIVE:
        for name, value in increments.items():
            setattr(stats, name, getattr(stats, name) + value)


@contextlib.contextmanager
def count_communication() -> Iterator[CommStats]:
    """Count what `ring_attention` sends in this process while the context is open.

    The forward pass counts when the call runs, the backward pass when
    ``backward()`` runs: call it inside the context to count both. Contexts nest;
    each counts everything that runs while it is open.

    Yields:
        A `CommStats`, updated in place.

    Examples:
        >>> with count_communication() as stats:
        ...     pass                              # ring_attention(...) and .backward() here
        >>> stats.forward_steps, stats.backward_grad_bytes
        (0, 0)
    """
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)
