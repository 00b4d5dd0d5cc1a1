"""Run SPMD code on N ranks: ``spawn`` (N gloo processes) or ``simulate`` (N threads, one process).

Both take the same arguments and return one result per rank, so the same test body runs under
either::

    def body(x):
        import torch.distributed as dist
        return dist.get_rank() * x

    vfsdp.testing.spawn(body, 4, 10)      # [0, 10, 20, 30], four processes
    vfsdp.testing.simulate(4, body, 10)   # the same, four threads

Inside ``fn`` the default process group is initialised (``gloo`` for ``spawn``, vfsdp's
in-process ``threaded`` backend for ``simulate``). If any rank raises, the call raises
:class:`RankError` with every failing rank's traceback. Under torchrun, call your function
directly instead: vfsdp only needs an initialised default process group (gloo or NCCL).
"""

from __future__ import annotations

import io
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vfsdp import _torch_private

__all__ = ["spawn", "simulate", "RankError"]


class RankError(RuntimeError):
    """One or more ranks raised; ``failures`` maps rank -> formatted traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        first = next(iter(self.failures))
        msg = f"rank(s) {sorted(self.failures)} failed; rank {first}:\n{self.failures[first]}"
        super().__init__(msg)


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def _spawn_worker(rank, world_size, init_file, fn, args, kwargs, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        try:
            out = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
        # Tensors would travel as shared-memory handles, which die with this process:
        # send bytes instead.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
        code = 1
    # Leave without running C++ static destructors: gloo's background threads may still be
    # joinable at interpreter exit, which aborts with "terminate called without an active
    # exception" although the work is done and reported.
    results.close()
    results.join_thread()  # the queue's feeder thread must deliver the result first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo processes; return each rank's result.

    Args:
        fn: A picklable (module-level) function.
        world_size: Number of processes.
        timeout: Seconds to wait for all ranks.

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (results must be picklable; tensors
        may be in them).

    Raises:
        RankError: a rank raised or timed out.
        ValueError: ``world_size < 1``.

    Example:
        >>> import torch.distributed as dist
        >>> spawn(dist.get_rank, 2)      # any importable function
        [0, 1]
    """
    _check_world(world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="vfsdp-spawn-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_spawn_worker,
                             args=(r, world_size, init_file, fn, args, kwargs, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        # Read results while the ranks run: a large result fills the pipe, and a rank blocked
        # writing it would never exit if we waited for it first.
        deadline = time.monotonic() + timeout
        while len(out) + len(failures) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures[rank] = value
        for p in procs:
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
        for r in range(world_size):
            if r not in out and r not in failures:
                code = procs[r].exitcode
                failures[r] = (f"rank {r} produced no result (exit code {code}"
                               f"{', timed out' if code is None or code < 0 else ''})")
    if failures:
        raise RankError(failures)
    return [out[r] for r in range(world_size)]


def _simulate(world_size: int, fn: Callable, args, kwargs, timeout: float) -> list:
    _check_world(world_size)
    out: list = [None] * world_size
    failures: dict[int, str] = {}
    errors: queue.Queue = queue.Queue()
    with _torch_private.threaded_world() as mtp:
        store = dist.HashStore()

        def worker(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
                try:
                    out[rank] = fn(*args, **kwargs)
                finally:
                    dist.destroy_process_group()
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                errors.put((rank, traceback.format_exc()))
                _torch_private.report_failure(mtp, exc)

        threads = [threading.Thread(target=worker, args=(r,), name=f"vfsdp-rank{r}", daemon=True)
                   for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        for r, t in enumerate(threads):
            if t.is_alive():
                failures[r] = f"rank {r} timed out after {timeout} s"
        while not errors.empty():
            rank, tb = errors.get()
            failures.setdefault(rank, tb)
    # Ranks that only died because another rank failed exit with SystemExit; keep real causes.
    real = {r: tb for r, tb in failures.items() if "Test termination event" not in tb}
    if failures:
        raise RankError(real or failures)
    return out


def simulate(world_size: int, fn: Optional[Callable] = None, *args: Any, timeout: float = 120.0,
             **kwargs: Any) -> Any:
    """Run SPMD code for ``world_size`` ranks in this process, one thread per rank.

    Each thread has its own default process group (backend ``"threaded"``), real tensors and
    real collectives, so storage, views, autograd and ``torch.func`` behave exactly as on a
    real rank. Use it in notebooks and for fast property tests; ``spawn`` runs the same code
    on processes.

    Args:
        world_size: Number of simulated ranks.
        fn: The function to run; without it, ``simulate(n)`` is a decorator.
        timeout: Seconds to wait for all ranks.

    Returns:
        ``[result of rank 0, ...]`` (or a decorator when ``fn`` is omitted).

    Raises:
        RankError: a rank raised or timed out.
        ValueError: ``world_size < 1``.

    Example:
        >>> import torch.distributed as dist
        >>> simulate(3, lambda x: dist.get_rank() * x, 10)
        [0, 10, 20]
    """
    if fn is None:
        def decorate(f):
            return lambda *a, **k: _simulate(world_size, f, a, k, timeout)

        return decorate
    return _simulate(world_size, fn, args, kwargs, timeout)
