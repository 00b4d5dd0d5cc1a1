"""``simulate``: SPMD code on N ranks as N threads of this process (notebook-grade).

Each thread has its own default process group (torch's in-process ``"threaded"`` backend),
real tensors and real collectives, so storage, views, autograd and ``torch.func`` behave as on
a real rank. What differs from processes, and what ``simulate`` does about it:

* torch's default random generator is per process: each rank gets its own while it runs
  (:mod:`vfsdp.testing.rank_rng`), so ``torch.manual_seed(rank)`` works as under torchrun;
* torch's intra-op thread pool is per process: ``simulate`` runs one torch thread per rank (it
  sets ``torch.set_num_threads(1)`` for the duration and restores it);
* ``init_process_group`` replaces ``sys.excepthook`` with a rank-prefixing one: restored after;
* Python objects are shared: a ``nn.Module`` or any object used by several rank threads is one
  object. Build per-rank objects inside ``fn`` (or pass pure data in); never share a module
  through ``torch.func.functional_call`` from several ranks.
* A rank that hangs (a collective some ranks never call) is reported after ``timeout`` seconds
  (one deadline for all ranks, not one per rank) with the collective it waits in; the other
  ranks are woken and end. A later ``simulate`` refuses to start while threads of an earlier
  one are still alive.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from vfsdp import _torch_private
from vfsdp.collectives.comm import use_device
from vfsdp.testing.rank_rng import on_this_thread, rank_generators
from vfsdp.testing.runners import RankError, check_world, waiting_in

# torch.nn.init as torch made it. A library that swaps these functions for a block of code
# (transformers' no_init_weights) and runs in several rank threads at once can restore them
# out of order and leave its no-op in place for the whole process: every later module would
# then start from uninitialised memory, different on each rank. simulate puts torch's back.
_NN_INIT = {name: fn for name, fn in vars(torch.nn.init).items()
            if callable(fn) and not name.startswith("_")}


_THREADS: list[threading.Thread] = []  # rank threads of earlier runs (to refuse leftovers)


def _simulate(world_size: int, fn: Callable, args, kwargs, timeout: Optional[float],
              device=None) -> list:
    check_world(world_size)
    _THREADS[:] = left = [t for t in _THREADS if t.is_alive()]
    if left:
        raise RuntimeError(
            f"vfsdp.testing.simulate: {len(left)} rank thread(s) of an earlier simulate are still "
            f"running ({', '.join(t.name for t in left[:4])}): it timed out or was interrupted "
            f"while they were busy outside a collective. Wait for them to finish, or restart the "
            f"Python process (notebook kernel)")
    vars(torch.nn.init).update(_NN_INIT)
    out: list = [None] * world_size
    errors: dict[int, str] = {}  # rank -> its traceback, written by its thread
    hook, threads_before = sys.excepthook, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _torch_private.threaded_world() as mtp, rank_generators() as rng_state:
            store = dist.HashStore()

            def worker(rank: int) -> None:
                try:
                    with on_this_thread(rng_state), use_device(device):
                        dist.init_process_group("threaded", rank=rank, world_size=world_size,
                                                store=store)
                        try:
                            out[rank] = fn(*args, **kwargs)
                        finally:
                            dist.destroy_process_group()
                except BaseException as exc:  # noqa: BLE001 - reported to the caller
                    errors[rank] = traceback.format_exc()
                    _torch_private.report_failure(mtp, exc)

            threads = [threading.Thread(target=worker, args=(r,), name=f"vfsdp-rank{r}",
                                        daemon=True) for r in range(world_size)]
            _THREADS.extend(threads)
            for t in threads:
                t.start()
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in threads:  # one deadline for all ranks
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            hung = {r: t for r, t in enumerate(threads) if t.is_alive()}
            frames = sys._current_frames() if hung else {}
            failures = dict(errors)  # a hung rank's report names where it waits
            for r, t in hung.items():
                failures[r] = f"rank {r} did not finish within {timeout} s; {waiting_in(frames.get(t.ident))}"
            if hung:
                _torch_private.report_failure(mtp, TimeoutError("simulate timed out"))
                for t in hung.values():  # woken from their collectives, they end
                    t.join(2.0)
    finally:
        sys.excepthook = hook
        torch.set_num_threads(threads_before)
        vars(torch.nn.init).update(_NN_INIT)
    # Ranks that only died because another rank failed exit with SystemExit; keep real causes.
    real = {r: tb for r, tb in failures.items() if "Test termination event" not in tb}
    if failures:
        raise RankError(real or failures)
    return out


def simulate(world_size: int, fn: Optional[Callable] = None, *args: Any,
             timeout: Optional[float] = 120.0, device: Any = None, **kwargs: Any) -> Any:
    """Run SPMD code for ``world_size`` ranks in this process, one thread per rank.

    Use it in notebooks and for fast property tests; :func:`vfsdp.testing.spawn` runs the same
    code on processes. See the module docstring for what differs from processes.

    Args:
        world_size: Number of simulated ranks.
        fn: The function to run; without it, ``simulate(n)`` is a decorator.
        timeout: Seconds to wait for all ranks (one deadline for all); ``None``: no limit.
        device: Where vfsdp puts every buffer on every rank (default: the CPU). ``"cuda"``:
            all rank threads share the current GPU, so W=2..8 runs on one GPU and can be
            checked against one process; ``"meta"``: shapes only, and any tensor vfsdp
            creates on another device fails at once (a missing ``device=``).

    Returns:
        ``[result of rank 0, ...]`` (or a decorator when ``fn`` is omitted).

    Raises:
        RankError: a rank raised, or did not finish in time (naming the collective it waits
            in).
        RuntimeError: rank threads of an earlier ``simulate`` are still running.
        ValueError: ``world_size < 1``.

    Example:
        >>> import torch.distributed as dist
        >>> simulate(3, lambda x: dist.get_rank() * x, 10)
        [0, 10, 20]
        >>> def seeded():
        ...     torch.manual_seed(dist.get_rank())     # per rank, as under torchrun
        ...     return torch.rand(1).item()
        >>> simulate(2, seeded) == [torch.rand(1, generator=torch.Generator().manual_seed(r)).item()
        ...                         for r in (0, 1)]
        True
    """
    if fn is None:  # a decorator
        return lambda f: lambda *a, **k: _simulate(world_size, f, a, k, timeout, device)
    return _simulate(world_size, fn, args, kwargs, timeout, device)

