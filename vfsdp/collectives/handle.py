"""Async handles, and the CUDA communication stream (explicit events, never ``record_stream``).

On CUDA, collectives are issued from a dedicated communication stream that first waits for the
current (compute) stream; an event recorded after them is what :meth:`Handle.wait` makes the
compute stream wait on. Buffers stay alive because their DBuffer owns them, and a DBuffer never
frees its global buffer while a handle on it is pending (it waits first), so the caching
allocator never needs ``record_stream``. On gloo (and the threaded backend) the collectives
return work objects and ``wait`` blocks on them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch

from vfsdp.collectives.comm import collective_scope

__all__ = ["Handle", "comm_context"]

_STREAMS: dict = {}
_LOCK = threading.Lock()


class Handle:
    """The result of an async operation; ``wait()`` returns it once the collectives are done.

    Args:
        works: Work objects of async collectives (may be empty).
        finish: Called once after the works complete; its return value is the result.
        event: A CUDA event to make the current stream wait on.

    Example:
        >>> def body():
        ...     t = torch.ones(2) * (dist.get_rank() + 1)
        ...     h = Handle([dist.all_reduce(t, async_op=True)], finish=lambda: t.tolist())
        ...     return h.done, h.wait(), h.done
        >>> vfsdp.testing.simulate(2, body)
        [(False, [3.0, 3.0], True), (False, [3.0, 3.0], True)]
        >>> Handle(finish=lambda: "no collectives").wait()
        'no collectives'
    """

    def __init__(self, works: Iterable[Any] = (), finish: Optional[Callable[[], Any]] = None,
                 event: Optional[torch.cuda.Event] = None) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._event = event
        self._done = False
        self._result: Any = None

    def wait(self) -> Any:
        """Block (or make the current CUDA stream wait) until done; return the result."""
        if not self._done:
            with collective_scope():  # the backend may finish its copies here (gloo's async RS)
                for w in self._works:
                    w.wait()
            if self._event is not None:
                torch.cuda.current_stream().wait_event(self._event)
            self._works = []
            self._done = True
            self._result = self._finish() if self._finish is not None else None
            self._finish = None
        return self._result

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has completed."""
        return self._done

    def __repr__(self) -> str:
        return f"Handle({'done' if self._done else 'pending'})"


def _comm_stream(device: torch.device):
    with _LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device=device, priority=-1)
        return stream


@contextlib.contextmanager
def comm_context(device: torch.device) -> Iterator[list]:
    """Run the enclosed collectives on the communication stream (CUDA) or as they are (CPU).

    Yields a list; on CUDA it holds, after the block, the event recorded at its end.
    """
    box: list = []
    if device.type != "cuda":
        yield box
        return
    stream = _comm_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield box
        event = torch.cuda.Event()
        event.record(stream)
    box.append(event)
