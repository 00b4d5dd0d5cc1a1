"""Buffer events for observers (the memory probes in ``vfsdp.testing``).

A DBuffer reports ``"create"`` when it is made, ``"alloc"`` when its global buffer gets memory
and ``"free"`` when it gives it back. Observers are callables ``(event, dbuffer)`` installed
for a block of code on the current thread (one rank under ``simulate``) with :func:`observe`;
no DBuffer is recorded anywhere unless an observer keeps it. Outside an ``observe`` block an
event costs one thread-local attribute read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["observe", "emit"]

Observer = Callable[[str, Any], None]
_LOCAL = threading.local()


@contextlib.contextmanager
def observe(observer: Observer) -> Iterator[None]:
    """Call ``observer(event, dbuffer)`` for every buffer event on this thread inside the block.

    Example:
        >>> seen = []
        >>> with observe(lambda event, db: seen.append(event)):
        ...     emit("alloc", None)
        >>> seen
        ['alloc']
    """
    stack = getattr(_LOCAL, "observers", None)
    if stack is None:
        stack = _LOCAL.observers = []
    stack.append(observer)
    try:
        yield
    finally:
        stack.remove(observer)


def emit(event: str, db: Any) -> None:
    """Report ``event`` about ``db`` to this thread's observers (none: nothing happens)."""
    stack = getattr(_LOCAL, "observers", None)
    if stack:
        for observer in list(stack):
            observer(event, db)
