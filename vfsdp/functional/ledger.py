"""Backward bookkeeping: every unit a backward pass needs on any rank reduces exactly once in
it, in the same order on every rank, even where a rank's loss does not use the unit.

Each differentiable gather (one :class:`Entry` per unit) is recorded in this rank's ledger when
its autograd node is made, in creation order. Every rank makes the same entries in the same
order (the SPMD contract), so a position in the ledger names the same unit everywhere.

At the first vfsdp hook of a backward pass, each rank marks the entries whose nodes this pass
will run, and the ranks OR these marks over the world (two small all-reduces, the way DDP
finds unused parameters): the pass reduces exactly the marked units, on every rank. A rank whose
loss does not reach a marked unit takes part in its reduce-scatter with zero gradients, as
FSDP2 does for unused parameters. The order is the autograd engine's: it runs nodes in
decreasing creation order, so when the pass reaches a node, every marked entry created after
it that has not run here will not run here: its zeros are reduced first. The marked entries
still left at the end of the pass (the engine's final callback) are reduced then.

An entry whose node died before any backward reached it (the unit's full tensors were dropped
without this rank's loss using them: ``run_layers`` and helper functions drop the gathered
tree as soon as the forward is done) is kept as an *orphan*: the next pass reduces its zeros
in place if another rank marks the unit, and forgets it, with no collective, if no rank does
(a forward whose graph was dropped without a backward, e.g. an evaluation with gradients
enabled).

The SPMD contract this needs: on every rank the same differentiable gathers, and the backward
reaches at least one unit gathered for it. A rank whose loss uses no gathered tensor at all
runs none of these hooks, and the other ranks wait in the marks' all-reduce (make such a loss
depend on one, e.g. add ``0 * full["w"].sum()``). Ranks whose ledgers disagree raise.

The ledger is per thread (a rank, also under ``vfsdp.testing.simulate``) and driven by the
autograd engine and the graph's lifetime; no entry point has to drain it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives import comm
from vfsdp.collectives.groups import control_device
from vfsdp.collectives.handle import Handle

__all__ = ["Entry", "Ledger", "Reductions", "ledger"]

_LOCAL = threading.local()


class Entry:
    """One gathered unit awaiting its backward on this rank."""

    __slots__ = ("index", "seq", "node", "reduce_zeros", "buffer", "on_orphan", "ran_in",
                 "closed", "orphan", "holds_graph", "__weakref__")

    def __init__(self, index: int, node: Any, reduce_zeros: Callable[[bool], None], buffer: Any,
                 on_orphan: Optional[Callable[[], None]]) -> None:
        self.index = index                # its place in the ledger: the same on every rank
        self.seq = node._sequence_nr()    # the autograd node's sequence number
        self.node = weakref.ref(node)     # the node itself, while it lives
        self.reduce_zeros = reduce_zeros  # reduce-scatter zeros for this unit
        self.buffer = buffer              # the gathered DBuffer (its .graphs counts us)
        self.on_orphan = on_orphan        # runs when its node dies before any backward
        self.ran_in = -2                  # the last backward pass (task id) it reduced in
        self.closed = False
        self.orphan = False               # its node died before any backward reached it
        self.holds_graph = True           # counted in buffer.graphs (its graph may read it)

    def will_run(self) -> bool:
        """Whether the running backward pass runs this entry's node."""
        node = None if self.orphan else self.node()
        return node is not None and tp.will_execute(node)


class Reductions:
    """Asynchronous gradient reductions in flight on this rank (``async_reduce``).

    Each one holds its unit's staging buffer, so at most ``limit`` run at once, across every
    ``gather`` and ``run_layers`` call: adding one more first finishes the oldest. The
    gradient buffer a reduction writes also records it, and every reader of the gradients
    (``vfsdp.grads``, clipping, optimizers, ``zero_grads``) waits for exactly the reductions
    of the units it reads.

    Example:
        >>> inflight = Reductions(limit=1)
        >>> inflight.add(Handle(finish=lambda: print("a reduced")))
        >>> inflight.add(Handle(finish=lambda: print("b reduced")))   # finishes a first
        a reduced
        >>> len(inflight)
        1
        >>> inflight.wait()
        b reduced
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
        self.marked: set = set()  # ids of the entries that pass reduces (on some rank)
        self.created = 0          # entries made so far (the next one's index)

    def add(self, ctx: Any, reduce_zeros: Callable[[bool], None], buffer: Any,
            on_orphan: Optional[Callable[[], None]] = None) -> Entry:
        """Record a gathered unit's autograd node ``ctx`` (called when the node is made).

        ``on_orphan`` runs when the node dies before any backward reached it (e.g. to
        release the gathered memory)."""
        self.settle()
        entry = Entry(self.created, ctx, reduce_zeros, buffer, on_orphan)
        self.created += 1
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
        """Settle the entries whose nodes died: no graph reads their memory any more. One that
        reduced in a pass is done; one never reached by a backward stays, as an orphan, for
        the next pass (another rank's loss may use the unit)."""
        while self.dying:
            entry = self.dying.pop(0)
            self._release_graph(entry)
            if entry.closed or entry.orphan:
                continue
            if entry.ran_in != -2:
                self.close(entry)
                continue
            entry.orphan = True
            if entry.on_orphan is not None:
                entry.on_orphan()

    def close(self, entry: Entry, graph_done: bool = True) -> None:
        """Forget the entry: it reduced in a pass that will not run again, or (an orphan) no
        rank needs it. ``graph_done``: its graph no longer reads the memory either (else that
        is settled when its node dies)."""
        if graph_done:
            self._release_graph(entry)
        if entry.closed:
            return
        entry.closed = True
        if entry in self.entries:
            self.entries.remove(entry)

    @staticmethod
    def _release_graph(entry: Entry) -> None:
        if entry.holds_graph:
            entry.holds_graph = False
            entry.buffer.graph_done()

    def ran(self, entry: Entry, accumulates: Callable[[], bool]) -> None:
        """``entry``'s backward is running: first reduce, with zeros, the units created after
        it that did not run in this pass (:meth:`reach`).

        ``accumulates()`` tells whether this pass writes leaves' ``.grad`` (``backward()``,
        not ``autograd.grad``); asked once per pass."""
        task = self.reach(entry.seq, accumulates, entry.buffer.device, running=entry)
        entry.ran_in = task
        if not tp.keep_graph():
            self.close(entry)

    def reach(self, seq: int, accumulates: Callable[[], bool], device: torch.device,
              running: Optional[Entry] = None) -> int:
        """The backward is running the node numbered ``seq`` (``running``'s, when it is a
        gather's): the marked units created after it that did not run here will not run here;
        reduce them, with zeros, now (before any collective the caller issues next). The
        pass's first call marks its units (a collective on ``device``) and queues the
        end-of-pass callback.

        Returns:
            The pass (graph task) id.
        """
        self.settle()
        task = tp.graph_task_id()
        if self.callback_task != task:
            self._begin(task, accumulates(), device, running)
        for other in sorted((e for e in self.entries if e.seq > seq and e.ran_in != task
                             and id(e) in self.marked), key=lambda e: -e.seq):
            self._zeros(other, task)
        return task

    def _begin(self, task: int, accumulates: bool, device: torch.device,
               running: Optional[Entry]) -> None:
        """A backward pass starts on this rank: mark, with every rank, the units it reduces;
        forget orphans no rank marks."""
        self.callback_task, self.accumulates = task, accumulates
        tp.queue_final_callback(lambda: self.finish(task))
        pending = sorted(self.entries, key=lambda e: e.seq)
        mine = [e for e in pending if e is running or e.will_run()]
        marked = _agree(pending, mine, self.created, device)
        self.marked = {id(e) for e in marked}
        for e in pending:
            if e.orphan and id(e) not in self.marked:
                self.close(e)  # died unused on every rank: no collective

    def finish(self, task: int) -> None:
        """End of a backward pass: reduce, with zeros, every unit left that did not run."""
        self.settle()
        for entry in sorted((e for e in self.entries if e.ran_in != task
                             and id(e) in self.marked), key=lambda e: -e.seq):
            self._zeros(entry, task)
        self.callback_task, self.marked = -2, set()
        # As FSDP2 at the end of its backward: the last reductions land before the backward
        # returns, so .grad (the gradient buffers' views) is complete for any reader.
        self.inflight.wait()

    def _zeros(self, entry: Entry, task: int) -> None:
        entry.ran_in = task
        entry.reduce_zeros(self.accumulates)
        if entry.orphan:
            self.close(entry)
        elif not tp.keep_graph():
            # Done in this pass on every rank; its node, alive here but not run, may still be
            # read by its graph until it dies.
            self.close(entry, graph_done=False)


def _agree(pending: list[Entry], mine: list[Entry], created: int,
           device: torch.device) -> list[Entry]:
    """The pending entries some rank's pass runs: every rank's marks ORed over the world (two
    small all-reduces: the span of ledger places that any rank runs, then one mark per place
    in it). Every rank made the same entries, so a place names the same unit everywhere.

    Raises:
        RuntimeError: the ranks' ledgers disagree (raised on every rank).
    """
    lo = min((e.index for e in mine), default=created)
    with comm.collective_scope():  # the exchange's own small tensors: not data movement
        device = control_device(device)
        span = torch.tensor([-lo, created, -created], dtype=torch.int64, device=device)
        comm.all_reduce_max_(span, count="backward_marks")
        neg_lo, most, neg_least = span.tolist()  # one sync
        lo, least = -neg_lo, -neg_least
        if most != least:
            raise RuntimeError(
                f"vfsdp: ranks made different numbers of differentiable gathers ({least} to "
                f"{most}, {created} here): every rank must make the same vfsdp.gather/"
                f"run_layers calls, in the same order, with the same requires_grad flags")
        bits = [0] * (created - lo)
        for e in mine:
            bits[e.index - lo] = 1
        marks = torch.tensor(bits, dtype=torch.uint8, device=device)
        comm.all_reduce_max_(marks, count="backward_marks")
        marked = [k for k, bit in enumerate(marks.tolist()) if bit]  # one sync
    by_index = {e.index: e for e in pending}
    out = []
    for k in marked:
        e = by_index.get(lo + k)
        if e is None:
            raise RuntimeError(
                f"vfsdp: another rank's backward runs gathered unit #{lo + k} (its ledger "
                f"place), which this rank had already reduced or dropped: every rank must keep "
                f"or drop its graphs alike (retain_graph, a second backward through one graph)")
        out.append(e)
    return out


def ledger() -> Ledger:
    """This thread's (rank's) ledger."""
    found = getattr(_LOCAL, "ledger", None)
    if found is None:
        found = _LOCAL.ledger = Ledger()
    return found
