"""Every rank raises when any rank fails: no rank is left waiting in a collective.

Distributed functions do local work (flattening a tree, opening a file, checking a leaf)
between collectives. If that work fails on some ranks only, the others would block in the next
collective forever. So failures are exchanged first, and every rank raises: the failing rank
its own error, the others ``error_type`` naming the failing rank and its error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["agree", "agreed"]


def agree(error: Optional[BaseException], group: Optional[Any] = None,
          error_type: type = RuntimeError) -> None:
    """Collective: raise ``error`` here, or ``error_type`` if another rank had one.

    Without an initialised process group it raises ``error`` if there is one.

    Args:
        error: This rank's failure, or ``None``.
        group: The process group of the ranks that agree (default: every rank).
        error_type: What the ranks without an error raise.

    Raises:
        BaseException: ``error`` itself, on the rank that had it.
        RuntimeError: on the other ranks (or ``error_type``), naming the first failing
            rank and its error.

    Example:
        >>> def body():
        ...     err = ValueError("bad file") if dist.get_rank() == 1 else None
        ...     try:
        ...         agree(err)
        ...     except Exception as exc:
        ...         return f"{type(exc).__name__}: {exc}"
        >>> vfsdp.testing.simulate(2, body)
        ['RuntimeError: rank 1 failed: ValueError: bad file', 'ValueError: bad file']
    """
    msg = None if error is None else f"{type(error).__name__}: {error}"
    errors: list = [msg]  # without a process group: this rank's alone
    if dist.is_initialized():
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, msg, group=group)
    if error is not None:
        raise error
    for r, e in enumerate(errors):
        if e is not None:
            raise error_type(f"rank {r} failed: {e}")


def agreed(fn: Callable[..., Any], *args: Any, group: Optional[Any] = None,
           error_type: type = RuntimeError, **kwargs: Any) -> Any:
    """Collective: ``fn(*args, **kwargs)`` on every rank; if it raises anywhere, all raise.

    Args:
        fn: The local work.
        *args: Its positional arguments.
        group: The process group of the ranks that agree (default: every rank).
        error_type: What the ranks where ``fn`` succeeded raise when another failed.
        **kwargs: Its keyword arguments.

    Returns:
        What ``fn`` returned, once every rank has succeeded.

    Raises:
        Exception: what ``fn`` raised, on the rank where it did.
        RuntimeError: on the other ranks (or ``error_type``), naming the first failing
            rank and its error.

    Example:
        >>> def body():
        ...     def read(rank):
        ...         if rank == 1:
        ...             raise FileNotFoundError("shard_1.bin")
        ...         return "read"
        ...     try:
        ...         return agreed(read, dist.get_rank())
        ...     except Exception as exc:
        ...         return f"{type(exc).__name__}: {exc}"
        >>> vfsdp.testing.simulate(2, body)
        ['RuntimeError: rank 1 failed: FileNotFoundError: shard_1.bin', 'FileNotFoundError: shard_1.bin']
        >>> vfsdp.testing.simulate(2, lambda: agreed(sum, [1, 2]))
        [3, 3]
    """
    out, error = None, None
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        error = exc
    agree(error, group, error_type)
    return out
