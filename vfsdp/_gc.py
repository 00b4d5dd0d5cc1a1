"""Pausing Python's cyclic garbage collector while a plan's many small objects are built.

Planning a large model makes tens of thousands of tuples and specs in a burst. Each burst
triggers full collections that walk every live object again, and on a 45,000-tensor MoE that
was a third of a sweep's time, to free next to nothing (what a plan builds is freed by
reference counting; the few cycles, such as a unit's layout and its tensor specs, are collected
once the collector is back). :func:`paused_gc` turns it off for the burst and back on after,
counting nested and concurrent users (``simulate``'s ranks plan on threads), so it is
enabled again only when the last one leaves, and only if it was enabled before the first.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_users = 0
_was_enabled = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (reference counting still frees
    memory at once).

    Example:
        >>> import gc
        >>> with paused_gc():
        ...     inside = gc.isenabled()
        >>> inside, gc.isenabled()
        (False, True)
    """
    global _users, _was_enabled
    with _lock:
        if _users == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _was_enabled:
                gc.enable()
