"""Run SPMD code on N ranks: ``spawn`` (N gloo processes) or ``simulate`` (N threads, one process).

Both take the same arguments and return one result per rank, so the same test body runs under
either::

    def body(x):
        import torch.distributed as dist
        return dist.get_rank() * x

    vfsdp.testing.spawn(body, 4, 10)      # [0, 10, 20, 30], four processes
    vfsdp.testing.simulate(4, body, 10)   # the same, four threads

Inside ``fn`` the default process group is initialised (``gloo`` for ``spawn``, torch's
in-process ``threaded`` backend for ``simulate``). If any rank raises, crashes or hangs, the
call raises :class:`RankError` with every failing rank's traceback, signal, or the collective
it was waiting in. Under torchrun, call your function directly instead: vfsdp only needs an
initialised default process group (gloo or NCCL).
"""

from __future__ import annotations

import os
import re
import traceback
from types import FrameType
from typing import Optional

_COLLECTIVE_FILES = (os.path.join("torch", "distributed", "distributed_c10d.py"),
                     os.path.join("vfsdp", "collectives", "comm.py"))


class RankError(RuntimeError):
    """One or more ranks raised, crashed or hung; ``failures`` maps rank -> what happened.

    Example:
        >>> def body():
        ...     if dist.get_rank() == 1:
        ...         raise ValueError("boom")
        >>> try:
        ...     vfsdp.testing.simulate(2, body)
        ... except RankError as exc:
        ...     print(sorted(exc.failures), "ValueError: boom" in exc.failures[1])
        [1] True
    """

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        first = self.root_cause()
        msg = f"rank(s) {sorted(self.failures)} failed; rank {first}:\n{self.failures[first]}"
        super().__init__(msg)

    def root_cause(self) -> int:
        """The rank to show first: one that failed by itself, not one whose collective broke
        because another rank had already died (connection closed or reset, a peer's
        termination)."""
        return next((rank for rank, text in self.failures.items()
                     if not any(sign in text for sign in _COLLATERAL)), next(iter(self.failures)))


_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
               "Test termination event", "ECONNRESET", "Socket Timeout",
               "connection closed", "Connection refused")


def check_world(world_size: int) -> None:
    """Raise ``ValueError`` unless ``world_size`` is an int >= 1."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def waiting_in(frame: Optional[FrameType]) -> str:
    """Where a hung thread waits: the collective and the code that called it."""
    return _describe([] if frame is None else [  # innermost first
        (f.f_code.co_filename, line, f.f_code.co_name) for f, line in traceback.walk_stack(frame)])


def waiting_in_dump(text: str) -> str:
    """Where a hung process waits, from a ``faulthandler`` dump (its main thread)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    main = next((b for b in reversed(blocks) if "most recent call first" in b), "")
    stack = [(f, int(n), fn) for f, n, fn in
             re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main)]
    return _describe(stack) if stack else "no stack dump was written"


def _describe(stack: list) -> str:
    """``stack``: ``(file, line, function)`` innermost first."""
    for i, (f, line, fn) in enumerate(stack):
        if any(f.endswith(c) for c in _COLLECTIVE_FILES):
            # The first frame that is neither a collective, torch, nor simulate's per-rank
            # RNG mode (every torch call of a rank thread passes through its hook).
            caller = next(((g, ln, name) for g, ln, name in stack[i + 1:]
                           if not any(g.endswith(c) for c in _COLLECTIVE_FILES)
                           and "torch" + os.sep not in g
                           and not g.endswith(os.path.join("testing", "rank_rng.py"))), None)
            # Where vfsdp called it: also the user's line that led there.
            user = next(((g, ln, name) for g, ln, name in stack[i + 1:]
                         if not g.startswith(_PACKAGE) and "torch" + os.sep not in g),
                        None) if caller and caller[0].startswith(_PACKAGE) else None
            where = (f" called from {caller[2]} ({caller[0]}:{caller[1]}), from your code at {user[2]} "
                     f"({user[0]}:{user[1]})" if user else
                     f" called from {caller[2]} ({caller[0]}:{caller[1]})" if caller else "")
            return f"waiting in the collective {fn} ({os.path.basename(f)}:{line}){where}"
    if stack:
        f, line, fn = stack[0]
        return f"busy in {fn} ({f}:{line}), not in a collective"
    return "no stack available"
