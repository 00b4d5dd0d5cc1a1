"""The backward's bookkeeping: every unit a backward pass needs on any rank reduces exactly
once in it, in the same order on every rank, even where a rank's loss does not use the unit.

Two objects hold it, both with a ``repr`` that shows it:

* :class:`RankGathers` (:func:`pending`): this rank's differentiable gathers whose backward
  has not run, in creation order, one entry each, recorded when the gather's
  autograd node is made. Every rank makes the same entries in the same order (the SPMD
  contract), so a position names the same unit everywhere. An entry is the gather's own
  record (:class:`vfsdp.functional.gather.Gather`). It belongs to the rank's default
  process group (a rank of ``vfsdp.testing.simulate`` has its own), not to a thread.
* :class:`BackwardPass`: the record of one backward pass, made at its first vfsdp hook. Its
  :meth:`~BackwardPass.agree` is the one cross-rank call: each rank marks the entries whose
  nodes this pass will run, and the ranks OR these marks over the world (two small
  all-reduces of host tensors over a side group, the way DDP finds unused parameters,
  started without waiting: :class:`Agreement`). The pass then reduces exactly the marked
  units, on every rank. A rank whose loss does not reach a marked unit takes part in its
  reduce-scatter with zero gradients, as FSDP2 does for unused parameters. The order is the
  autograd engine's: it runs nodes in decreasing creation order, so when the pass reaches a
  node, every marked entry created after it that has not run here will not run here: its
  zeros are reduced first (:meth:`~BackwardPass.reach`). The marked entries still left at the
  end of the pass (the engine's final callback) are reduced then.

An entry whose node died before any backward reached it (the unit's full tensors were dropped
without this rank's loss using them: ``run_layers`` and helper functions drop the gathered
tree as soon as the forward is done) is kept as an *orphan*: the next pass reduces its zeros
if another rank marks the unit, and forgets it, with no collective, if no rank does (a
forward whose graph was dropped without a backward, e.g. an evaluation with gradients
enabled).

What an entry does is its unit's transitions (``Gather.post_backward`` with zeros,
``orphaned()``); nothing is injected from elsewhere.

The SPMD contract this needs: on every rank the same differentiable gathers, and the backward
reaches at least one unit gathered for it. A rank whose loss uses no gathered tensor at all
runs none of these hooks, and the other ranks wait in the marks' all-reduce (make such a loss
depend on one, e.g. add ``0 * full["w"].sum()``). Ranks whose records disagree raise.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp.collectives import comm
from vfsdp.collectives.groups import side_group
from vfsdp.collectives.handle import Handle

__all__ = ["RankGathers", "BackwardPass", "Agreement", "Reductions", "pending"]


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


class BackwardPass:
    """The record of one backward pass on this rank: which units it reduces (agreed with
    every rank), and which of them have.

    Made by :meth:`RankGathers.backward` at the pass's first vfsdp hook, which starts the
    agreement (:class:`Agreement`) without waiting for it."""

    def __init__(self, gathers: RankGathers, task: int, accumulates: bool) -> None:
        self.gathers = gathers
        self.task = task
        self.accumulates = accumulates  # the pass writes leaves' .grad (not autograd.grad)
        self.agreement: Optional[Agreement] = None
        self._frozen: dict = {}  # units regathered for the pass with no gather to release them
        self._marked: Optional[set] = None  # ids of the entries it reduces (on some rank)

    def agree(self, running: Any) -> None:
        """Start the one cross-rank exchange: which units this pass reduces."""
        g = self.gathers
        mine = [e for e in g.entries if e is running or e.will_run()]
        self.agreement = Agreement(g, mine)

    @property
    def marked(self) -> set:
        """The entries some rank's pass runs (waits for the agreement the first time; forgets
        orphans no rank marks, with no collective).

        Raises:
            RuntimeError: the ranks' records disagree (raised on every rank).
        """
        if self._marked is None:
            g = self.gathers
            self._marked = {id(e) for e in self.agreement.marked()}
            for e in list(g.entries):
                if e.orphan and id(e) not in self._marked:
                    g.close(e)  # died unused on every rank: no collective
        return self._marked

    def reach(self, seq: int) -> None:
        """The pass is running the node numbered ``seq``: the marked units created after it
        that did not run here will not run here; reduce them, with zeros, now (before any
        collective the caller issues next). Only then does it wait for the agreement: a rank
        whose pass ran every unit after ``seq`` goes on without it."""
        self.gathers.settle()
        later = [e for e in self.gathers.entries if e.seq > seq and e.ran_in != self.task]
        if not later:
            return
        marked = self.marked
        for other in sorted((e for e in later if id(e) in marked), key=lambda e: -e.seq):
            self._zeros(other)

    def release_at_end(self, unit: Any) -> None:
        """Release ``unit`` (frozen: regathered for its inputs' gradients only) when the pass
        ends."""
        self._frozen[id(unit)] = unit

    def ran(self, entry: Any) -> None:
        """``entry``'s backward ran in this pass (its node called it)."""
        entry.ran_in = self.task
        if not tp.keep_graph():
            self.gathers.close(entry)

    def finish(self) -> None:
        """End of the pass (the engine's final callback): finish the agreement, reduce, with
        zeros, every marked unit left that did not run, then wait for the reductions in
        flight."""
        g = self.gathers
        g.settle()
        marked = self.marked
        for entry in sorted((e for e in g.entries if e.ran_in != self.task
                             and id(e) in marked), key=lambda e: -e.seq):
            self._zeros(entry)
        for unit in self._frozen.values():
            unit.release(at_once=False)
        g.current = None
        # As FSDP2 at the end of its backward: the last reductions land before the backward
        # returns, so .grad (the gradient buffers' views) is complete for any reader.
        g.inflight.wait()

    def _zeros(self, entry: Any) -> None:
        entry.ran_in = self.task
        entry.post_backward([None] * len(entry.index), self.accumulates, zeros=True)
        if entry.orphan:
            self.gathers.close(entry)
        elif not tp.keep_graph():
            # Done in this pass on every rank; its node, alive here but not run, may still be
            # read by its graph until it dies.
            self.gathers.close(entry, graph_done=False)

    def __repr__(self) -> str:
        marked = "?" if self._marked is None else len(self._marked)
        return (f"BackwardPass(task {self.task}, {marked} unit(s) marked, "
                f"{'backward()' if self.accumulates else 'autograd.grad'})")


class Agreement:
    """Which awaiting entries some rank's pass runs: every rank's marks ORed over the world,
    in two small all-reduces over the side group, both started at once and not waited for
    (on host tensors: the exchange costs the device nothing, no host sync on CUDA). No rank
    stops at them until it needs the result (:meth:`BackwardPass.reach`), so where a pass's
    first vfsdp node falls (routing that leaves a rank's experts without tokens) never orders
    the exchange against the data collectives.

    The header carries the number of entries made (equal on every rank, or the ranks raise)
    and the oldest place still awaiting; the marks cover the places from the oldest one the
    previous pass found awaiting on any rank (``base``: nothing older awaits anywhere) to the
    newest. Every rank made the same entries, so a place names the same unit everywhere."""

    def __init__(self, gathers: RankGathers, mine: list) -> None:
        self.gathers, self.awaiting = gathers, list(gathers.entries)
        created, base = gathers.created, gathers.base
        oldest = min((e.place for e in self.awaiting), default=created)
        self.header = torch.tensor([-oldest, created, -created], dtype=torch.int64)
        bits = [0] * (created - base)
        for e in mine:
            bits[e.place - base] = 1
        self.marks = torch.tensor(bits, dtype=torch.uint8)
        group = side_group()
        self.works = [comm.all_reduce_max_(t, group, "backward_marks", async_op=True)
                      for t in (self.header, self.marks)]

    def marked(self) -> list:
        """Wait for the exchange; the awaiting entries it marks.

        Raises:
            RuntimeError: the ranks' records disagree (raised on every rank).
        """
        g = self.gathers
        with comm.collective_scope():  # the exchange's own small tensors: not data movement
            self.works[0].wait()
            neg_oldest, most, neg_least = self.header.tolist()  # host values: no device sync
            if most != -neg_least:
                raise RuntimeError(
                    f"vfsdp: ranks made different numbers of differentiable gathers "
                    f"({-neg_least} to {most}, {g.created} here): every rank must make the same "
                    f"vfsdp.gather/run_layers calls, in the same order, with the same "
                    f"requires_grad flags")
            self.works[1].wait()
            places = [g.base + k for k, bit in enumerate(self.marks.tolist()) if bit]
        g.base = max(g.base, -neg_oldest)
        by_place = {e.place: e for e in self.awaiting}
        out = []
        for k in places:
            e = by_place.get(k)
            if e is None:
                raise RuntimeError(
                    f"vfsdp: another rank's backward runs gathered unit #{k} (its place in "
                    f"the record), which this rank had already reduced or dropped: every rank "
                    f"must keep or drop its graphs alike (retain_graph, a second backward "
                    f"through one graph)")
            out.append(e)
        return out


class RankGathers:
    """This rank's differentiable gathers awaiting their backward (see the module)."""

    def __init__(self) -> None:
        self.entries: list = []  # the Gather records awaiting their backward
        self.dying: list = []  # entries whose nodes died, to settle
        self.inflight = Reductions(limit=1)
        self.current: Optional[BackwardPass] = None  # the backward pass running now
        self.created = 0  # entries made so far (the next one's index)
        self.base = 0  # no place older than this awaits on any rank (the last agreement's)

    def add(self, ctx: Any, entry: Any) -> None:
        """Record the gather ``entry`` whose autograd node ``ctx`` was just made."""
        self.settle()
        entry.place, entry.seq, entry.node = self.created, ctx._sequence_nr(), weakref.ref(ctx)
        self.created += 1
        self.entries.append(entry)
        entry.holds_graph = True
        entry.unit.hold(entry.db, entry.regathers)
        entry.unit.awaiting += 1
        weakref.finalize(ctx, self.died, weakref.ref(entry))

    def died(self, ref) -> None:
        """The entry's autograd node was freed: settle it at the next operation.

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
            entry.orphaned()

    def close(self, entry: Any, graph_done: bool = True) -> None:
        """Forget the entry: it reduced in a pass that will not run again, or (an orphan) no
        rank needs it. ``graph_done``: its graph no longer reads the memory either (else that
        is settled when its node dies)."""
        if graph_done:
            self._release_graph(entry)
        if entry.closed:
            return
        entry.closed = True
        entry.unit.awaiting -= 1
        if entry in self.entries:
            self.entries.remove(entry)

    @staticmethod
    def _release_graph(entry: Any) -> None:
        if entry.holds_graph:
            entry.holds_graph = False
            entry.unit.graph_done(entry.db, entry.regathers)

    def backward(self, accumulates: Callable[[], bool], running: Any = None) -> BackwardPass:
        """The record of the backward pass running now: at its first vfsdp hook made, agreed
        with every rank (:meth:`BackwardPass.agree`) and given the end-of-pass callback.
        ``accumulates()`` tells whether the pass writes leaves' ``.grad`` (asked once)."""
        self.settle()
        task = tp.graph_task_id()
        if self.current is None or self.current.task != task:
            record = self.current = BackwardPass(self, task, accumulates())
            tp.queue_final_callback(record.finish)
            record.agree(running)
        return self.current

    def __repr__(self) -> str:
        return (f"RankGathers({len(self.entries)} awaiting of {self.created} made, "
                f"{len(self.inflight)} reduction(s) in flight, running: {self.current})")


class _NoGroup:
    """The key of a process that has no default process group (yet)."""


_NO_GROUP = _NoGroup()
_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pending() -> RankGathers:
    """This rank's :class:`RankGathers`: the one of its default process group (a rank of
    ``vfsdp.testing.simulate`` has its own)."""
    key = dist.group.WORLD if dist.is_initialized() else _NO_GROUP
    found = _BY_GROUP.get(key)
    if found is None:
        found = _BY_GROUP[key] = RankGathers()
    return found
