"""Backward bookkeeping: every unit gathered for autograd reduces exactly once per backward, in
the same order on every rank, even where a rank's loss does not use it.

Each differentiable gather (one :class:`Entry` per unit) is recorded in this rank's ledger when
its autograd node is made, in creation order, and removed when the graph is freed. The autograd
engine runs nodes in decreasing creation order (its ready queue is ordered by sequence number),
so when a unit's backward runs, every recorded node created after it that has not run will not
run in this pass: its unit is unused by this rank's loss. Its reduce-scatter is issued first,
with zero gradients, so every rank issues the same reduce-scatters in the same order, as FSDP2
does for unused parameters. At the end of the pass (the engine's final callback) the units
still left, created before every node that ran, are reduced with zeros the same way.

A node can also die before any backward: the unit's full tensors were dropped without this
rank's loss reaching them (``run_layers`` and helper functions drop the gathered tree as soon as
the forward is done). Such an entry is kept as an *orphan* and reduced with zeros, in its
place, by the next backward pass, since another rank's loss may use the unit. A graph
dropped without a backward (an evaluation forward with gradients enabled) leaves orphans too:
they cost the next backward one zero reduce-scatter per unit (gather under
``torch.no_grad()`` to avoid it).

The SPMD contract this needs: on every rank, the backward reaches at least one unit gathered
for it. A rank whose loss uses no gathered tensor at all runs none of these hooks, and the
other ranks wait in their reduce-scatters (make such a loss depend on one, e.g. add
``0 * full["w"].sum()``).

The ledger is per thread (a rank, also under ``vfsdp.testing.simulate``) and driven by the
autograd engine and the graph's lifetime; no entry point has to drain it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

from vfsdp import _torch_private as tp
from vfsdp.collectives.handle import Handle

__all__ = ["Entry", "Ledger", "Reductions", "ledger"]

_LOCAL = threading.local()


class Entry:
    """One gathered unit awaiting its backward on this rank."""

    __slots__ = ("seq", "reduce_zeros", "buffer", "on_orphan", "ran_in", "closed", "orphan",
                 "__weakref__")

    def __init__(self, seq: int, reduce_zeros: Callable[[bool], None], buffer: Any,
                 on_orphan: Optional[Callable[[], None]]) -> None:
        self.seq = seq                    # the autograd node's sequence number
        self.reduce_zeros = reduce_zeros  # reduce-scatter zeros for this unit
        self.buffer = buffer              # the gathered DBuffer (its .graphs counts us)
        self.on_orphan = on_orphan        # runs when its node dies before any backward
        self.ran_in = -2                  # the last backward pass (task id) it reduced in
        self.closed = False
        self.orphan = False               # its node died before any backward reached it


class Reductions:
    """Asynchronous gradient reductions in flight on this rank (``async_reduce``).

    Each one holds its unit's staging buffer, so at most ``limit`` run at once, across every
    ``gather`` and ``run_layers`` call: adding one more first finishes the oldest. The
    gradient buffer a reduction writes also records it, and every reader of the gradients
    (``vfsdp.grads``, clipping, optimizers, ``zero_grads``) waits for exactly the reductions
    of the units it reads.
    """

    def __init__(self, limit: int = 1) -> None:
        self.limit = limit
        self._inflight: list[Handle] = []

    def add(self, handle: Handle) -> None:
        self._inflight.append(handle)
        while len(self._inflight) > self.limit:
            self._inflight.pop(0).wait()

    def wait(self) -> None:
        """Finish every reduction this object started."""
        while self._inflight:
            self._inflight.pop(0).wait()

    def __len__(self) -> int:
        return sum(not h.done for h in self._inflight)


class Ledger:
    """This rank's gathered units awaiting their backward (see the module docstring)."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.dying: list[Entry] = []  # entries whose nodes died, to settle
        self.inflight = Reductions(limit=1)
        self.callback_task = -2   # the pass whose final callback is queued
        self.accumulates = True   # whether that pass writes leaves' .grad (not autograd.grad)

    def add(self, ctx: Any, reduce_zeros: Callable[[bool], None], buffer: Any,
            on_orphan: Optional[Callable[[], None]] = None) -> Entry:
        """Record a gathered unit's autograd node ``ctx`` (called when the node is made).

        ``on_orphan`` runs when the node dies before any backward reached it (e.g. to
        release the gathered memory)."""
        self.settle()
        entry = Entry(ctx._sequence_nr(), reduce_zeros, buffer, on_orphan)
        self.entries.append(entry)
        buffer.graphs += 1
        weakref.finalize(ctx, self.died, weakref.ref(entry))
        return entry

    def died(self, ref) -> None:
        """The entry's autograd node was freed: settle it at the next ledger operation.

        Not now: the node usually dies inside the destruction of the last tensor holding it,
        a view of the unit's memory still being torn down, so the memory cannot be judged
        free yet (see :meth:`DBuffer.free_global`)."""
        entry = ref()
        if entry is not None:
            self.dying.append(entry)

    def settle(self) -> None:
        """Settle the entries whose nodes died: one that reduced in a pass is done; one never
        reached by a backward stays as an orphan for the next pass to reduce (another rank's
        loss may use the unit), and its memory is no longer read by any graph."""
        while self.dying:
            entry = self.dying.pop(0)
            if entry.closed or entry.orphan:
                continue
            if entry.ran_in != -2:
                self.close(entry)
                continue
            entry.orphan = True
            entry.buffer.graph_done()
            if entry.on_orphan is not None:
                entry.on_orphan()

    def close(self, entry: Entry) -> None:
        """The graph holding the entry was freed, will not run again, or (an orphan) its
        zeros were reduced: forget it."""
        if entry.closed:
            return
        entry.closed = True
        if not entry.orphan:
            entry.buffer.graph_done()
        if entry in self.entries:
            self.entries.remove(entry)

    def ran(self, entry: Entry, accumulates: Callable[[], bool]) -> None:
        """``entry``'s backward is running: first reduce, with zeros, the units created after
        it that did not run in this pass (:meth:`reach`).

        ``accumulates()`` tells whether this pass writes leaves' ``.grad`` (``backward()``,
        not ``autograd.grad``); asked once per pass."""
        task = self.reach(entry.seq, accumulates)
        entry.ran_in = task
        if not tp.keep_graph():
            self.close(entry)

    def reach(self, seq: int, accumulates: Callable[[], bool]) -> int:
        """The backward is running the node numbered ``seq``: the units created after it that
        did not run in this pass will not run in it; reduce them, with zeros, now (before any
        collective the caller issues next). Queues the end-of-pass callback once per pass.

        Returns:
            The pass (graph task) id.
        """
        self.settle()
        task = tp.graph_task_id()
        if self.callback_task != task:
            self.callback_task = task
            self.accumulates = accumulates()
            tp.queue_final_callback(lambda: self.finish(task))
        for other in sorted((e for e in self.entries if e.seq > seq and e.ran_in != task),
                            key=lambda e: -e.seq):
            self._zeros(other, task)
        return task

    def finish(self, task: int) -> None:
        """End of a backward pass: reduce, with zeros, every unit left that did not run."""
        self.settle()
        for entry in sorted((e for e in self.entries if e.ran_in != task), key=lambda e: -e.seq):
            self._zeros(entry, task)
        self.callback_task = -2

    def _zeros(self, entry: Entry, task: int) -> None:
        entry.ran_in = task
        entry.reduce_zeros(self.accumulates)
        if entry.orphan:
            self.close(entry)


def ledger() -> Ledger:
    """This thread's (rank's) ledger."""
    found = getattr(_LOCAL, "ledger", None)
    if found is None:
        found = _LOCAL.ledger = Ledger()
    return found
