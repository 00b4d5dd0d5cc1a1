"""``spawn``: SPMD code on N gloo processes, with crashes and hangs reported, not just timeouts.

* ``fn`` must be importable by a new process: a module-level function of a file. A function
  from a notebook (or an interactive ``__main__``), a lambda or a nested function is refused
  at once, saying so, instead of every rank failing to start.
* Each rank's stderr goes to a file that the parent copies to its own stderr as it runs, so
  output stays visible; a failed rank's report ends with the tail of its stderr.
* A rank killed by a signal is reported by name (SIGSEGV, SIGABRT, ...), with the stack
  ``faulthandler`` wrote; a rank still running at the deadline is reported as hung, with the
  collective it waits in (from a ``faulthandler`` dump taken just before the deadline).
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vfsdp.testing.runners import RankError, check_world, waiting_in_dump


def _check_importable(fn: Callable) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    if "<lambda>" in name or "<locals>" in name:
        raise ValueError(f"vfsdp.testing.spawn: {name} is a lambda or a nested function, which a "
                         f"new process cannot import; define it at the top level of a .py file "
                         f"(or use vfsdp.testing.simulate, which runs threads)")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"vfsdp.testing.spawn: {name} is defined in a notebook or an "
                         f"interactive session, which a new process cannot import; put it in a "
                         f".py file next to the notebook and import it from there (or use "
                         f"vfsdp.testing.simulate, which runs threads in this process)")


def _worker(rank, world_size, init_file, err_path, dump_at, fn, args, kwargs, results):
    # this rank's stderr, Python's and C++'s, goes to its file
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    faulthandler.enable()  # fatal signals: write every thread's stack there
    # a hang: where it waits, written shortly before the parent's deadline (wall clock)
    faulthandler.dump_traceback_later(max(0.5, dump_at - time.time()))
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
    faulthandler.cancel_dump_traceback_later()
    # Leave without running C++ static destructors: gloo's background threads may still be
    # joinable at interpreter exit, which aborts with "terminate called without an active
    # exception" although the work is done and reported.
    results.close()
    results.join_thread()  # the queue's feeder thread must deliver the result first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _pump(path: str, seen: bytearray) -> None:
    """Copy what a rank's stderr file at ``path`` gained to ours, and keep it in ``seen``."""
    try:
        with open(path, "rb") as f:
            f.seek(len(seen))
            new = f.read()
    except OSError:
        return
    seen += new
    sys.stderr.write(new.decode("utf-8", "replace"))
    sys.stderr.flush()


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo processes; return each rank's result.

    Args:
        fn: A module-level function of an importable file (see the module docstring).
        world_size: Number of processes.
        timeout: Seconds to wait for all ranks.

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (results must be picklable; tensors
            may be in them).

    Raises:
        RankError: a rank raised, was killed by a signal (named), or hung (with the collective
            it waits in); each with the tail of its stderr.
        ValueError: ``world_size < 1``, or ``fn`` cannot be imported by a new process.

    Example:
        >>> import torch.distributed as dist
        >>> spawn(dist.get_rank, 2)      # any importable function
        [0, 1]
    """
    check_world(world_size)
    _check_importable(fn)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="vfsdp-spawn-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        errs = [os.path.join(tmp, f"rank{r}.stderr") for r in range(world_size)]
        tails = [bytearray() for _ in range(world_size)]  # what each rank wrote to its stderr
        dump_at = time.time() + timeout - min(3.0, 0.15 * timeout)
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, errs[r],
                                                   dump_at, fn, args, kwargs, results),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        # Read results while the ranks run: a large result fills the pipe, and a rank blocked
        # writing it would never exit if we waited for it first.
        deadline = time.monotonic() + timeout
        while len(out) + len(failures) < world_size and time.monotonic() < deadline:
            for r in range(world_size):
                _pump(errs[r], tails[r])
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            (out if ok else failures)[rank] = (torch.load(io.BytesIO(value), weights_only=False)
                                               if ok else value)
        for p in procs:
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
        hung = {r for r, p in enumerate(procs) if p.is_alive()}
        for r in hung:
            procs[r].kill()
            procs[r].join(5.0)
        for r in range(world_size):
            _pump(errs[r], tails[r])
            if r in out or (r in failures and r not in hung):
                continue
            code, text = procs[r].exitcode, tails[r].decode("utf-8", "replace")
            tail = "\n".join(text.rstrip().splitlines()[-30:])  # its last lines
            failures[r] = (
                f"rank {r} did not finish within {timeout} s; {waiting_in_dump(text)}" if r in hung
                else f"rank {r} was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                else f"rank {r} produced no result (exit code {code})"
            ) + (f"\n--- rank {r} stderr (last lines) ---\n{tail}" if tail and r not in failures else "")
    if failures:
        raise RankError(failures)
    return [out[r] for r in range(world_size)]
