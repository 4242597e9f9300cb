"""The CPU thread budget: how many intra-op threads a call should use while other processes keep cores busy.

The tiled path issues many small parallel operations per block, and each waits for its slowest
thread: a thread that shares its core with another process stalls every one of them
(benchmarks/block_mask_bench.py measured the tiled path 2.0x faster on one thread than on two with
one of two cores busy). `fitting_threads` reads Linux's ``/proc`` to tell how many cores other
processes keep busy; `threads_for` runs a block of code on that many threads. Where ``/proc``
cannot tell (not Linux), the threads stay as they are. The algorithm stays the same: only torch's
thread count changes, which, like any thread setting, may change the order of a sum (one causal
call of 2048 keys gave the same bits on one thread and on two).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from attention_ref._validation import check_device, check_positive_int

__all__ = ["ADAPT_MIN_PAIRS", "ADAPT_THREADS", "fitting_threads", "threads_for"]

ADAPT_THREADS = True
"""Whether a tiled call on CPU runs on fewer intra-op threads while other processes keep cores busy.
Set it to ``False`` to keep ``torch.get_num_threads()`` whatever the load
(``attention_ref.tiled.ADAPT_THREADS`` reads and sets this same flag)."""
ADAPT_MIN_PAIRS = 2**22
"""Calls with fewer (query, key) pairs than this keep their threads (the reading costs about 0.1 ms,
8 ms more when a core looks busy)."""
#: Seconds between the readings of `_others_running`: a task that runs for less than twice this
#: (a short-lived process, this process's OpenMP workers spinning down) is not load. At 1 ms, a
#: quiet process still chose one thread in 1 of 40 calls now and then (benchmarks/threads_bench.py).
_READING_GAP_S = 0.004


def _runnable() -> int:
    """Runnable tasks of the whole machine right now (the count before the slash in /proc/loadavg)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def _own_running() -> int:
    """This process's threads that are running or runnable (state ``R`` in /proc/self/task/*/stat)."""
    own = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        own += stat[stat.rindex(")") + 2] == "R"  # the state follows the command name
    return own


def _others_running() -> int:
    """Runnable tasks of other processes right now: the least of three paired readings, 4 ms apart,
    of the machine's runnable tasks minus this process's own at that moment.

    A process that keeps a core busy shows in every reading; a passing task, or this process's
    OpenMP workers still spinning just after a parallel region, does not (read back to back, the
    three readings counted them, and a quiet call ran at 0.47x: issue 30).
    """
    least = _runnable() - _own_running()
    for _ in range(2):
        if least <= 0:
            break
        time.sleep(_READING_GAP_S)
        least = min(least, _runnable() - _own_running())
    return max(least, 0)


def fitting_threads() -> int | None:
    """The intra-op threads a tiled call should use now, or ``None`` to keep ``torch.get_num_threads()``.

    ``torch.get_num_threads()`` minus the cores other processes keep busy (the
    machine's runnable tasks, least of three readings so a passing task does not
    count, minus this process's own), at least 1; ``None`` when nothing is busy,
    when `ADAPT_THREADS` is False, or where ``/proc`` cannot tell.
    """
    if not ADAPT_THREADS:
        return None
    try:
        busy = _others_running()
        cores = len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux, or /proc unreadable
        return None
    threads = torch.get_num_threads()
    fitting = max(1, min(threads, cores - busy))
    return fitting if fitting < threads else None


@contextlib.contextmanager
def threads_for(pairs: int, device: torch.device | str):
    """Run the body on `fitting_threads` intra-op threads (restored after) when the call is large enough.

    ``pairs`` is the call's (query, key) pairs: below `ADAPT_MIN_PAIRS`, or off the CPU, the
    threads stay as they are. ``device``: a ``torch.device`` or its name (``"cpu"``).
    """
    pairs = check_positive_int("pairs", pairs, allow_zero=True)
    device = check_device("device", device)
    threads = fitting_threads() if device.type == "cpu" and pairs >= ADAPT_MIN_PAIRS else None
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
