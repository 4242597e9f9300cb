"""Local processes for tests and the documentation: `spawn` runs a function in ``world`` CPU processes
joined by gloo. No attention code here: it runs any importable function.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):  # pragma: no cover - platforms without if_nameindex
        return None
    return next((name for name in names if name.startswith("lo")), None)


def _run_worker(rank: int, world: int, fn: Callable[..., Any], args: tuple[Any, ...], folder: str, timeout: float
                ) -> None:
    """The body of one spawned process: join the group, run ``fn``, save its result, leave the group."""
    loopback = _loopback_interface()
    if loopback is not None:  # gloo listens on the loopback interface only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the processes share the cores
    # Rendezvous through a file: no TCP store listening on every interface.
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        # torch no longer waits for every rank after building the group: without this barrier a rank whose
        # `fn` does no collective can leave, closing its sockets, while another is still connecting to it
        # (gloo: "connectFullMesh failed ... Connection closed by peer", seen once in a check).
        dist.barrier()
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(folder, f"result_{rank}.pt"))
        dist.barrier()  # and none leaves while another may still be reading what it sent
    finally:
        dist.destroy_process_group()


#: What the server of new processes imports once (multiprocessing's "forkserver"): each process of `spawn`
#: is a fork of it, with torch already imported, where a fresh interpreter spends one to two seconds of a
#: core importing it (measured on 2 cores: the distributed and Ulysses tests kept the machine busy 17.5
#: CPU-seconds this way, 35 with fresh interpreters). Not this package: each process imports it anew, so
#: that an edit of it (``mkdocs serve``, a notebook) is what the next `spawn` runs.
FORKSERVER_PRELOAD = ("torch", "torch.distributed")


def _start_method() -> str:
    """``"forkserver"`` (preloading `FORKSERVER_PRELOAD`) where the platform has it, else ``"spawn"``."""
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - Windows
        return "spawn"
    mp.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return "forkserver"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes joined by gloo; return their results.

    Each process is started with ``torch.multiprocessing``, forked from a server
    process that has imported torch only (the ``"forkserver"`` method; where the
    platform has none, ``"spawn"``: a fresh interpreter). It joins a gloo process
    group of ``world_size`` ranks (rendezvous through a file in a temporary folder; gloo connects the
    processes over the loopback interface), runs ``fn``, saves what it returns,
    and destroys the process group even when ``fn`` raises. Each uses
    ``cpu_count // world_size`` threads. If a process raises, the others are
    stopped and the error is raised here; if they have not all finished after
    ``timeout`` seconds (a rank waiting for one that failed waits at most that
    long too), they are stopped and ``TimeoutError`` is raised. The new processes
    import the caller's main module again: in a script, call ``spawn`` under
    ``if __name__ == "__main__":``.

    Args:
        fn: a function defined at the top level of an importable module (the
            new processes import it), called as ``fn(rank, world_size, *args)``;
            its return value must be picklable (tensors, numbers, dicts, ...).
        world_size: the number of processes, >= 1.
        *args: passed to ``fn``; picklable.
        timeout: seconds for the whole run, and for each collective inside it.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        TypeError: ``fn`` or ``args`` cannot be sent to a new process.
        ValueError: ``world_size < 1`` or a non-positive timeout.
        TimeoutError: the processes did not finish in time.
        RuntimeError: a process exited without a result and without an error.
        torch.multiprocessing.ProcessRaisedException: a process raised (its traceback is in the message).

    Examples:
        >>> from attention_ref.distributed import demo_worker
        >>> spawn(demo_worker, 1)[0]["max_error"] < 1e-12    # one process: the ring has one rank
        True
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            f"spawn needs fn and args that a new process can import and unpickle (fn defined at the top "
            f"level of a module, not in a notebook cell or a page), got {fn!r}: {error}"
        ) from None
    folder = tempfile.mkdtemp(prefix="attention_ref_spawn_")
    try:
        context = mp.start_processes(_run_worker, args=(world_size, fn, args, folder, float(timeout)),
                                     nprocs=world_size, join=False, start_method=_start_method())
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                for process in context.processes:
                    process.join()
                raise TimeoutError(f"spawn: the {world_size} processes did not finish within {timeout} s")
        paths = [os.path.join(folder, f"result_{rank}.pt") for rank in range(world_size)]
        missing = [rank for rank, path in enumerate(paths) if not os.path.exists(path)]
        if missing:  # e.g. a process that exited while importing the caller's main module
            raise RuntimeError(f"spawn: ranks {missing} exited without returning a result")
        return [torch.load(path, weights_only=False) for path in paths]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
