"""``vfsdp.gather`` (differentiable) and ``gather_async`` over pytrees.

One all-gather per unit, in place: each unit's shard is the collective's input as it is, the
unit's global buffer its output, and every full tensor a view of that buffer. No copy runs
before or after the collective. The call reads straight down the layers: the tree's leaves
name their units (:mod:`vfsdp.functional.tree`), each unit gathers itself
(:class:`vfsdp.collectives.Unit`), and the backward reduce-scatters
(:mod:`vfsdp.functional.reduce`).

With ``grads="return"`` the backward hands autograd fresh tensors holding this rank's reduced
pieces (nothing vfsdp later overwrites or frees); with ``grads="buffer"`` the pieces stay in
the unit's gradient DBuffer, which later backwards add to until it is zeroed, and whose views
``backward()`` makes the shards' ``.grad``.

The backward's bookkeeping: every unit a backward pass needs on any rank reduces exactly
once in it, in the same order on every rank, even where a rank's loss does not use the unit.

Two objects hold it, both with a ``repr`` that shows it:

* :class:`RankGathers` (:func:`pending`): this rank's differentiable gathers whose backward
  has not run, in creation order, one entry each, recorded when the gather's
  autograd node is made. Every rank makes the same entries in the same order (the SPMD
  contract), so a position names the same unit everywhere. An entry is the gather's own
  record (:class:`vfsdp.functional.gather.Gather`). It belongs to the rank's default
  process group (a rank of ``vfsdp.testing.simulate`` has its own), not to a thread.
* :class:`BackwardPass`: the record of one backward pass, made at its first vfsdp hook. Its
  :class:`Agreement` is the one cross-rank call: each rank marks the entries whose
  nodes this pass will run, and the ranks OR these marks over the world (two small
  all-reduces of host tensors over a side group, the way DDP finds unused parameters,
  started without waiting). The pass then reduces exactly the marked
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
enabled). Such forwards with no backward after them do not pile up orphans: every
:data:`SWEEP` gathers made outside a backward, the ranks exchange which orphans are still alive
anywhere (:meth:`RankGathers.sweep`) and forget the others.

What an entry does is its unit's transitions (``Gather.post_backward`` with zeros,
``orphaned()``); nothing is injected from elsewhere.

The SPMD contract this needs: on every rank the same differentiable gathers, and the backward
reaches at least one unit gathered for it. A rank whose loss uses no gathered tensor at all
runs none of these hooks, and the other ranks wait in the marks' all-reduce (make such a loss
depend on one, e.g. add ``0 * full["w"].sum()``). Ranks whose records disagree raise.

The sharded gradients of a shards tree: ``vfsdp.grads`` and ``vfsdp.zero_grads``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Optional

import optree
import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from vfsdp import _torch_private as tp
from vfsdp.collectives import comm
from vfsdp.collectives.comm import Handle, side_group
from vfsdp.collectives.dbuffer import slot_of
from vfsdp.collectives.unit import GATHER_HOOKS, Reductions, UnitState, drop_traced_grads
from vfsdp.functional.options import Policy, merge, refuse, resolve
from vfsdp.functional.reduce import _reduce_functional
from vfsdp.functional.traced import traced_gather, traced_leaves, unit_context
from vfsdp.functional.tree import match_tree, own_mesh, unit_for, units_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.local import local_plan
from vfsdp.planner.spec import ShardSpec, TensorSpec, unit_name

__all__ = ["gather", "gather_async", "start_gather", "Gather", "GatherHandle", "writes_leaf_grads",
           "RankGathers", "BackwardPass", "Agreement", "pending", "grads", "zero_grads"]


def grads(shards: Any, spec: ShardSpec) -> Any:
    """This rank's sharded gradients: a tree of views into each unit's gradient DBuffer.

    For units reduced with ``grads="buffer"`` (and ``run_layers``) these are views of the
    unit's gradient DBuffer, which ``backward()`` also makes the shards' ``.grad``; for units
    whose gradients went to autograd (``grads="return"``, the default of
    :func:`vfsdp.gather`, or a compiled backward) they are the shards' ``.grad`` (zeros where
    ``None``).
    Units that had no backward yet read zeros. Reductions still in flight
    (``async_reduce``) into these units are waited for first.

    Args:
        shards: The shards tree (``vfsdp.shard``'s), or a subtree with its sub-spec.
        spec: The (sub-)spec.

    Returns:
        A tree like ``shards`` of this rank's gradient pieces (views into the gradient
            DBuffers; a unit with no backward yet reads zeros).

    Raises:
        ValueError: the tree does not match the spec, or a unit's leaves are not shards
            (pass the tree returned by :func:`vfsdp.shard`).

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     full = vfsdp.gather(shards, spec, grads="buffer")
        ...     (full["w"] * 2).sum().backward()
        ...     g = vfsdp.grads(shards, spec)["w"]
        ...     return g.tolist(), shards["w"].grad is g     # .grad: the buffer's view
        >>> vfsdp.testing.simulate(2, body)
        [([2.0, 2.0, 2.0, 2.0], True), ([2.0, 2.0, 2.0, 2.0], True)]
    """
    what = "vfsdp.grads"
    if tp.compiling():  # torch.compile: the gradients are the shards' .grad
        leaves, treespec = traced_leaves(shards, spec, what)
        found = [(i, leaves[i].grad) for i in local_plan(spec, None)[1]]
    else:
        leaves, treespec, found = match_tree(shards, spec, what), spec.treespec, []
        for u in units_of(leaves, spec, what):
            dot = _in_dot_grad(u.unit, leaves, u.leaves)
            if not dot:
                u.unit.grads().ensure_shard()
            # a buffer's view: the same tensor each step, no op to make it
            found += [(i, leaves[i].grad if dot else u.unit.grad_view(k)) for i, k in u.leaves]
    out = list(leaves)
    for i, g in found:
        out[i] = g if g is not None else torch.zeros_like(leaves[i])
    return optree.tree_unflatten(treespec, out)


def _in_dot_grad(unit: Any, leaves: list, members: tuple) -> bool:
    """Whether a unit's gradients are its shards' ``.grad`` rather than its gradient buffer:
    they went to autograd (``grads="return"``), a compiled backward put them there, or
    something replaced the ``.grad`` that were the buffer's views (a compiled
    ``zero_grads``)."""
    if unit.grads_mode == "return":
        return True
    if unit.grad_linked:
        return not all(leaves[i].grad is unit.grad_view(k) for i, k in members
                       if leaves[i].requires_grad)
    return unit.grads_mode is None and any(leaves[i].grad is not None for i, _ in members)


def zero_grads(shards: Any, spec: ShardSpec, *, set_to_none: bool = True) -> None:
    """Zero every unit's gradients (its gradient buffer and the shards' ``.grad``) and drop
    any unreduced accumulator.

    Args:
        shards: The shards tree.
        spec: The plan.
        set_to_none: Release the gradient shards' memory until the next backward writes them
            (like ``optimizer.zero_grad(set_to_none=True)``; reading them through
            :func:`grads` before then gives zeros). ``False`` zero-fills them in place.

    Returns:
        ``None``.

    Raises:
        ValueError: as :func:`grads`.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(5.0)
        ...     vfsdp.zero_grads(shards, spec)
        ...     return vfsdp.grads(shards, spec)["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    what = "vfsdp.zero_grads"
    compiled = tp.compiling()  # torch.compile: the gradients are the shards' .grad
    leaves = traced_leaves(shards, spec, what)[0] if compiled else match_tree(shards, spec, what)
    units = [] if compiled else units_of(leaves, spec, what)
    index = local_plan(spec, None)[1] if compiled else [i for u in units for i, _ in u.leaves]
    tensors = [leaves[i] for i in index]
    # the .grad autograd accumulated (grads="return") and the buffers: one op
    zero = [] if set_to_none else [x.grad for x in tensors if x.grad is not None]
    for x in tensors if set_to_none else ():  # (compiled: unconditionally, asking would be a guard)
        x.grad = None
    for _u, runtime in unit_context(leaves, spec, what) if compiled else ():
        drop_traced_grads(runtime)
    for u in units:
        u.unit.drop_accumulators()
        drop_traced_grads(u.unit.traced, keep=not set_to_none)  # the compiled path's leaves
        u.unit.grads_mode = None  # no reduction since: .grad or the buffer, whichever comes
        u.unit.grad_linked = False
        if u.unit.has_grads and set_to_none:  # (no gradient buffer yet: nothing to zero)
            u.unit.grads().release_shard()
        elif u.unit.has_grads:
            zero.append(u.unit.grads().ensure_shard())
    with torch.no_grad():
        tp.foreach("zero_", zero)


def gradient_leaves(grads: Any, spec: ShardSpec, what: str) -> list:
    """The leaves of a gradient tree in spec order, refusing the parameter shards in its place.

    ``clip_grad_norm(shards, spec, ...)``, the habit of ``torch.nn.utils.clip_grad_norm_(
    params)``, would otherwise scale the parameters, and ``opt.update(shards, ...)`` read them
    as gradients, silently: every shard names its buffer, so such a tree is refused.

    Args:
        grads: A tree shaped like the spec: ``vfsdp.grads(shards, spec)`` or the shards'
            ``.grad`` s.
        spec: The (sub-)spec.
        what: The entry point, for messages.

    Returns:
        The leaves, one per leaf of ``spec``.

    Raises:
        ValueError: a leaf is a parameter shard (naming its path), or the tree does not match
            the spec.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        ...     try:
        ...         vfsdp.clip_grad_norm(shards, spec, 1.0)
        ...     except ValueError as e:
        ...         return str(e).split(": pass")[0]
        >>> vfsdp.testing.simulate(2, body)[0]
        'vfsdp.clip_grad_norm: w is a parameter shard, not a gradient'
    """
    leaves = match_tree(grads, spec, what)
    for leaf, t in zip(leaves, spec.leaves()):
        slot = slot_of(leaf)
        if slot is not None and slot.buffer.role.holds_params and isinstance(t, TensorSpec):
            raise ValueError(
                f"{what}: {format_path(t.path)} is a parameter shard, not a gradient: pass "
                f"vfsdp.grads(shards, spec) (the gradients), not the shards; taking the "
                f"shards as gradients would change or read the parameters")
    return leaves


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
        self._alive: set = set()  # places whose node is alive on some rank
        # (no functools.cached_property: on Python 3.11 its lock is one per class, shared by
        # every rank thread of vfsdp.testing.simulate, and held while the agreement waits)
        self._marked: Optional[set] = None  # ids of the entries it reduces (on some rank)

    @property
    def marked(self) -> set:
        """The ids of the entries some rank's pass runs (waits for the agreement the first
        time; forgets orphans no rank marks, with no collective).

        Raises:
            RuntimeError: the ranks' records disagree (raised on every rank).
        """
        if self._marked is None:
            runs, self._alive = self.agreement.marked()
            self._marked = {id(e) for e in runs}
        return self._marked

    def reach(self, seq: int) -> None:
        """The pass is running the node numbered ``seq``: the marked units created after it
        that did not run here will not run here; reduce them, with zeros, now (before any
        collective the caller issues next). Only then does it wait for the agreement: a rank
        whose pass ran every unit after ``seq`` goes on without it."""
        self.gathers.settle()
        later = [e for e in self.gathers.entries if e.seq > seq and e.ran_in != self.task
                 and id(e) in self.marked]  # (marked, which waits, asked only if one is later)
        for other in sorted(later, key=lambda e: -e.seq):
            self._zeros(other)

    def ran(self, entry: Any) -> None:
        """``entry``'s backward ran in this pass (its node called it)."""
        entry.ran_in = self.task
        if not tp.keep_graph():
            self.gathers.close(entry)

    def finish(self) -> None:
        """End of the pass (the engine's final callback): finish the agreement, reduce, with
        zeros, every marked unit left that did not run, then wait for the reductions in
        flight."""
        self.reach(-1)  # (a node's sequence number is never negative)
        g = self.gathers
        g.forget(self.marked, self._alive)  # (marked first: its agreement sets _alive)
        if not tp.keep_graph():
            for unit in list(g.frozen.values()):
                unit.release(at_once=False)
            g.frozen.clear()
        g.current = None
        # As FSDP2 at the end of its backward: the last reductions land before the backward
        # returns, so .grad (the gradient buffers' views) is complete for any reader.
        g.inflight.wait()

    def _zeros(self, entry: Any) -> None:
        entry.ran_in = self.task
        keep = tp.keep_graph()  # as on the ranks that run it
        entry.post_backward([None] * len(entry.index), self.accumulates, keep, zeros=True)
        if not keep:  # (kept: the graph runs again on the ranks that run it, so does this)
            # Done in this pass on every rank; the node of an entry that is no orphan, alive
            # here but not run, may still be read by its graph until it dies.
            self.gathers.close(entry, graph_done=entry.orphan)

    def __repr__(self) -> str:
        marked = "?" if self._marked is None else len(self._marked)
        return (f"BackwardPass(task {self.task}, {marked} unit(s) marked, "
                f"{'backward()' if self.accumulates else 'autograd.grad'})")


class Agreement:
    """Which awaiting entries some rank's pass runs, and which are still alive on some rank:
    every rank's marks ORed over the world, in two small all-reduces over the side group,
    both started at once and not waited for (on host tensors: the exchange costs the device
    nothing, no host sync on CUDA). No rank stops at them until it needs the result
    (:meth:`BackwardPass.reach`), so where a pass's first vfsdp node falls (routing that
    leaves a rank's experts without tokens) never orders the exchange against the data
    collectives.

    The header carries the number of entries made (equal on every rank, or the ranks raise)
    and the oldest place still awaiting; the marks cover the places from the oldest one the
    previous exchange found awaiting on any rank (``base``: nothing older awaits anywhere)
    to the newest, in a window rounded up to a power of two (so ranks that made different
    numbers of gathers still exchange alike, and raise). Every rank made the same entries,
    so a place names the same unit everywhere."""

    def __init__(self, gathers: RankGathers, mine: list) -> None:
        self.gathers, self.awaiting = gathers, list(gathers.entries)
        created, base = gathers.created, gathers.base
        oldest = min((e.place for e in self.awaiting), default=created)
        self.width = max(64, 1 << max(created - base - 1, 0).bit_length())
        on = [e.place - base for e in mine] + [  # runs here, then: its node is alive here
            self.width + e.place - base for e in self.awaiting if not e.orphan]
        with comm.collective_scope():  # the exchange's own small tensors: not data movement
            self.header = torch.tensor([-oldest, created, -created], dtype=torch.int64)  # cpu: gloo
            self.marks = torch.zeros(2 * self.width, dtype=torch.uint8)  # cpu: the gloo side group
            self.marks[on] = 1
            self.works = [comm.all_reduce_max_(t, side_group(), "backward_marks", async_op=True)
                          for t in (self.header, self.marks)]

    def marked(self) -> tuple[list, set]:
        """Wait for the exchange: the awaiting entries some rank runs, and the places whose
        node is alive on some rank.

        Raises:
            RuntimeError: the ranks' records disagree (raised on every rank).
        """
        g = self.gathers
        base, width = g.base, self.width
        with comm.collective_scope():
            self.works[0].wait()
            neg_oldest, most, neg_least = self.header.tolist()  # host values: no device sync
            if most != -neg_least:
                raise RuntimeError(
                    f"vfsdp: ranks made different numbers of differentiable gathers "
                    f"({-neg_least} to {most}, {g.created} here): every rank must make the same "
                    f"vfsdp.gather/run_layers calls, in the same order, with the same "
                    f"requires_grad flags")
            self.works[1].wait()
            bits = self.marks.tolist()
        g.base = max(g.base, -neg_oldest)
        alive = {base + k for k in range(width) if bits[width + k]}
        by_place = {e.place: e for e in self.awaiting}
        runs = [base + k for k in range(width) if bits[k]]
        for k in runs:
            if k not in by_place:
                raise RuntimeError(
                    f"vfsdp: another rank's backward runs gathered unit #{k} (its place in "
                    f"the record), which this rank had already reduced or dropped: every rank "
                    f"must keep or drop its graphs alike (retain_graph, a second backward "
                    f"through one graph)")
        return [by_place[k] for k in runs], alive


SWEEP = 256
"""Every this many differentiable gathers made outside a backward, :meth:`RankGathers.sweep`
forgets the orphans dead on every rank."""


class RankGathers:
    """This rank's differentiable gathers awaiting their backward (see the module)."""

    def __init__(self) -> None:
        self.entries: list = []  # the Gather records awaiting their backward
        self.dying: list = []  # entries whose nodes died, to settle
        self.inflight = Reductions(limit=1)
        self.current: Optional[BackwardPass] = None  # the backward pass running now
        self.created = 0  # entries made so far (the next one's index)
        self.base = 0  # no place older than this awaits on any rank (the last agreement's)
        # Units run_layers gathered with no record (frozen): the next pass releases them.
        self.frozen: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def add(self, ctx: Any, entry: Any) -> None:
        """Record the gather ``entry`` whose autograd node ``ctx`` was just made."""
        self.settle()
        entry.place, entry.seq, entry.node = self.created, tp.node_seq(ctx), weakref.ref(ctx)
        self.created += 1
        self.entries.append(entry)
        entry.holds_graph = True
        entry.unit.hold(entry.db, entry.regathers)
        entry.unit.awaiting += 1
        # Its node freed: settled at the next operation, not now: the node usually dies inside
        # the destruction of the last tensor holding it, a view of the unit's memory still
        # being torn down, so the memory cannot be judged free yet (DBuffer.free_global). (The
        # node holds the entry itself, as ctx.call: this keeps it no longer.)
        weakref.finalize(ctx, self.dying.append, entry)
        if self.created % SWEEP == 0 and tp.graph_task_id() == -1:
            self.sweep()

    def sweep(self) -> None:
        """Forget the orphans dead on every rank, between backward passes: an agreement with
        no pass (nothing runs), so that forwards whose graphs are dropped without a backward
        (evaluations with gradients enabled) do not pile up records until the next backward.
        Called every :data:`SWEEP` gathers outside a backward: the same gathers on every rank
        (the SPMD contract), so the same call everywhere; one small exchange on the side
        group, waited for here (host values only)."""
        self.settle()
        self.forget((), Agreement(self, []).marked()[1])

    def forget(self, marked: Any, alive: set) -> None:
        """Forget, with no collective, the orphans no rank's pass runs (their ids not in
        ``marked``) and dead on every rank (their places not in ``alive``)."""
        for e in [e for e in self.entries if e.orphan and id(e) not in marked and e.place not in alive]:
            self.close(e)

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
            else:
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
        entry.unit.record_done(entry.db, entry.regathers)
        if entry in self.entries:
            self.entries.remove(entry)

    @staticmethod
    def _release_graph(entry: Any) -> None:
        if entry.holds_graph:
            entry.holds_graph = False
            entry.unit.graph_done(entry.db, entry.regathers)

    def backward(self, accumulates: Callable[[], bool], running: Any = None) -> BackwardPass:
        """The record of the backward pass running now: at its first vfsdp hook made, agreed
        with every rank (:class:`Agreement`) and given the end-of-pass callback.
        ``accumulates()`` tells whether the pass writes leaves' ``.grad`` (asked once)."""
        self.settle()
        task = tp.graph_task_id()
        if self.current is None or self.current.task != task:
            record = self.current = BackwardPass(self, task, accumulates())
            tp.queue_final_callback(record.finish)
            # the one cross-rank exchange, started: which units this pass reduces
            record.agreement = Agreement(self, [e for e in self.entries if e is running or e.will_run()])
        return self.current

    def __repr__(self) -> str:
        return (f"RankGathers({len(self.entries)} awaiting of {self.created} made, "
                f"{len(self.inflight)} reduction(s) in flight, running: {self.current})")


class _NoGroup:
    """The key of a process that has no default process group (yet)."""


_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pending() -> RankGathers:
    """This rank's :class:`RankGathers`: the one of its default process group (a rank of
    ``vfsdp.testing.simulate`` has its own)."""
    key = dist.group.WORLD if dist.is_initialized() else _NoGroup
    if key not in _BY_GROUP:
        _BY_GROUP[key] = RankGathers()
    return _BY_GROUP[key]


class Gather:
    """The record of one unit's gather: its arguments, its unit and gathered buffer, and,
    once autograd made its node, its place in the rank's record of gathers awaiting their
    backward (:class:`~vfsdp.functional.gather.RankGathers`).

    An object that pytree utilities and ``torch.func`` leave alone.
    """

    __slots__ = ("spec", "key", "index", "mesh", "what", "policy", "unit", "db",
                 "locals", "versions", "flat_version", "needs", "recording", "regathers",
                 "place", "seq", "node", "ran_in", "reduced_in", "closed", "orphan",
                 "holds_graph", "__weakref__")

    def __init__(self, spec, key, index, mesh, what, policy, regathers: bool = False) -> None:
        self.spec, self.key, self.index, self.mesh, self.what = spec, key, index, mesh, what
        self.policy = policy  # resolved (vfsdp.functional.options.resolve)
        self.regathers = regathers  # run_layers: gathered again for the backward if resharded
        self.unit = None
        self.db = None
        self.locals: tuple = ()   # the shards (to check their versions, to write .grad)
        self.versions: tuple = ()
        self.flat_version = -1    # the unit's flat parameter shard's (optimizers write that)
        self.needs: tuple = ()    # which of them require grad
        self.recording = True     # autograd records the gather (grad mode was on at apply)
        self.place = -1           # its place in the rank's record: the same on every rank
        self.seq = -1             # its autograd node's sequence number
        self.node: Any = None     # the node itself (weakly), while it lives
        self.ran_in = -2          # the last backward pass (task id) that reduced it
        self.reduced_in = -2      # the same, as the unit's post_backward saw it
        self.closed = False
        self.orphan = False       # its node died before any backward reached it
        self.holds_graph = False  # its graph reads the buffer's full views (unit.hold)

    @property
    def recorded(self) -> bool:
        """Whether the rank's record of gathers awaiting their backward holds it."""
        return self.place >= 0

    def will_run(self) -> bool:
        """Whether the running backward pass runs this gather's node."""
        node = None if self.orphan or self.node is None else self.node()
        return node is not None and tp.will_execute(node)

    def check_versions(self) -> None:
        """Raise if a shard was changed in place since the forward gathered it.

        Raises:
            RuntimeError: naming the tensor.
        """
        for x, v, k in zip(self.locals, self.versions, self.index):
            if tp.version(x) != v:
                path = format_path(self.spec.units[self.key].paths[k])
                raise RuntimeError(
                    f"{path} was modified in place after vfsdp.gather used it for the forward; "
                    f"the backward would mix old and new values (torch raises the same for a "
                    f"tensor saved for backward). Change shards only after the backward, e.g. "
                    f"in the optimizer step")
        if self.flat_version >= 0 and tp.version(self.unit.params.shard) != self.flat_version:
            raise RuntimeError(
                f"the parameters of unit {unit_name(self.key)} were updated in place (an "
                f"optimizer update, vfsdp.scatter or a checkpoint load) after {self.what} used "
                f"them for the forward, before its backward; the backward would mix old and "
                f"new values. Run the backward first, then update (for several micro-batches, "
                f"update once after the last backward)")

    def post_backward(self, grads: list, accumulates: bool, keep: bool = False,
                      zeros: bool = False) -> Optional[list]:
        """The unit's post-backward transition for this gather (inside ``torch.func``: its
        gradients reduced into fresh tensors, nothing of vfsdp's written)."""
        if tp.functorch_active():
            self.unit.pre_backward(self.db)
            if self.policy.free_after_backward and not keep:
                self.unit.release(at_once=False, db=self.db)
            return _reduce_functional(self.unit, self.index, grads, self.policy)
        return self.unit.post_backward(self, grads, accumulates=accumulates, keep=keep,
                                       inflight=pending().inflight, zeros=zeros)

    def orphaned(self) -> None:
        """The gather's autograd node died before any backward reached it: with
        ``free_after_backward``, its gathered memory can go now (the next backward reduces
        its zeros if another rank's runs the unit; a resharded unit is gathered again
        then)."""
        if self.policy.free_after_backward:
            self.unit.release(at_once=False, every_rank=False, db=self.db)

    def __repr__(self) -> str:
        what = ("orphan" if self.orphan else "closed" if self.closed else
                "awaiting" if self.recorded else "unrecorded")
        return f"Gather(#{self.place}, unit {unit_name(self.key)}, {what})"


class _GatherUnit(torch.autograd.Function):
    """Forward: full views of one gathered unit. Backward: the unit's post-backward.

    The unit is resolved inside ``forward``, where ``torch.func`` transforms hand over the
    plain (unwrapped) shard tensors, so the same code serves ``backward()``,
    ``autograd.grad`` and ``torch.func.grad``.
    """

    @staticmethod
    def forward(rec: Gather, *local):
        if rec.unit is None:  # the shards (unwrapped here under torch.func), or packed
            rec.unit = unit_for(local, rec.spec, rec.key, rec.index, rec.mesh, rec.what)
        if rec.db is None:  # not prefetched by gather_async
            rec.db, _ = rec.unit.gather(rec.policy.param_dtype)
        return tuple(rec.db.full(i) for i in rec.index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        rec = ctx.call = inputs[0]
        ctx.set_materialize_grads(False)
        needs = tuple(ctx.needs_input_grad[1:])
        if any(needs) and rec.recording and not tp.functorch_active():
            rec.locals, rec.needs = tuple(inputs[1:]), needs
            rec.versions = tuple(tp.version(x) for x in rec.locals)
            rec.flat_version = tp.version(rec.unit.params.shard)
            pending().add(ctx, rec)

    @staticmethod
    def backward(ctx, *grads):
        rec = ctx.call
        needs = ctx.needs_input_grad[1:]
        keep, accumulates = False, False
        if rec.recorded:
            rec.check_versions()
            keep = tp.keep_graph()
            record = pending().backward(lambda: writes_leaf_grads(rec), running=rec)
            record.reach(rec.seq)  # the units after it that do not run here: zeros
            record.ran(rec)
            accumulates = writes_leaf_grads(rec)
        grads = [g if need else None for g, need in zip(grads, needs)]  # frozen: no gradient
        pieces = rec.post_backward(grads, accumulates, keep) or [None] * len(needs)
        return (None, *[p if need else None for p, need in zip(pieces, needs)])


def writes_leaf_grads(rec: Gather) -> bool:
    """Whether the running backward writes leaves' ``.grad`` (``backward()``, not
    ``autograd.grad``): the engine will run a gathered shard's AccumulateGrad node."""
    x = next((x for x, need in zip(rec.locals, rec.needs) if need), None)
    if x is None:
        return False
    try:
        with torch.enable_grad():
            node = get_gradient_edge(x).node
    except (AttributeError, RuntimeError):  # e.g. inside torch.func: not a plain leaf
        return False
    return tp.will_execute(node)


def gather(shards: Any, spec: ShardSpec, policy: Optional[Policy] = None, *,
           mesh: Any = None, **options: Any) -> Any:
    """Full tensors from this rank's shards: one in-place all-gather per unit. Differentiable.

    Works on the whole tree or any subtree with its sub-spec (``spec["layers"][3]``). The
    result's tensors are views into each unit's global buffer; they stay valid until
    :func:`vfsdp.release` (or a later gather refreshes them: gathering a gathered unit again
    is allowed and re-runs its all-gather). Non-tensor leaves pass through.

    Args:
        shards: The tree returned by :func:`vfsdp.shard` (or plain tensors of the right local
            shapes; those are copied into a temporary unit, one copy per tensor).
        spec: The plan (or the sub-spec of the subtree).
        policy: A :class:`vfsdp.Policy`: every option below at once, the same object for
            ``gather``, ``gather_async`` and ``run_layers``, eager and compiled.
        mesh: For plain-tensor shards: a ``DeviceMesh`` matching the spec (default: the
            default group). Shards from ``vfsdp.shard`` carry the mesh they were made on:
            passing one with them is refused.
        options: Any :class:`vfsdp.Policy` field as a keyword, overriding the policy's:

            * ``param_dtype``: gather in this dtype (e.g. ``torch.bfloat16`` for fp32 master
              shards): one cast over the unit's shard (a group op) into the all-gather input.
            * ``grad_reduce``: ``"avg"`` (default) or ``"sum"``: how the backward reduces
              across ranks.
            * ``reduce_dtype``: dtype of the backward's reduce-scatter (default: the gradient
              dtype).
            * ``accumulate_grads``: ``None`` (default) or ``True``: the reduced gradients add
              up across backwards until they are zeroed (:func:`vfsdp.zero_grads`), in the
              gradient DBuffer as in ``.grad``, as torch does. ``False`` is refused (call
              :func:`vfsdp.zero_grads` to start afresh).
            * ``grad_sync``: ``False`` accumulates this backward's gradients unsharded (in
              ``reduce_dtype``) without communicating; the next backward with ``True`` adds
              its own and reduce-scatters the sum.
            * ``grads``: ``"return"`` (the default here) hands the gradient pieces to autograd
              (``.grad``, ``autograd.grad``, ``torch.func``); ``"buffer"`` leaves them in the
              gradient DBuffer (read them with :func:`vfsdp.grads`); ``backward()`` makes the
              shards' ``.grad`` its views, so ``.grad`` costs no memory.
            * ``free_after_backward``: release the unit's gathered buffer once its backward
              is done (default here: no, you hold the full tensors).
            * ``async_reduce``: with ``grads="buffer"``, start each unit's reduce-scatter and
              go on with the backward; readers of the gradients wait for it (default here:
              no).
            * ``all_gather``: low-precision all-gather hooks, e.g.
              ``vfsdp.functional.lowp.Float8()`` (float8 with per-tensor scales, half a bf16
              gather's bytes): each unit's shard goes through ``pre_all_gather`` /
              ``post_all_gather`` (:mod:`vfsdp.functional.lowp`); the backward
              reduce-scatters in ``reduce_dtype`` (float32 by default) into ``.grad``. A
              functional gather (no persistent buffers), eager and compiled alike.

    Returns:
        A tree like ``shards`` with full tensors.

    Raises:
        ValueError: structure, shape or dtype mismatch (naming the path), shards made for
            another spec or world size, a bad option value, or an option this path cannot
            honour (see :mod:`vfsdp.functional.options`).

    Example:
        >>> def step():
        ...     params = {"w": torch.arange(6.0).reshape(3, 2)}
        ...     spec = vfsdp.plan(params, 2, granularity=vfsdp.rows(1))
        ...     shards = vfsdp.shard(params, spec)
        ...     full = vfsdp.gather(shards, spec)
        ...     (full["w"] * (dist.get_rank() + 1)).sum().backward()
        ...     return full["w"].tolist(), shards["w"].grad.tolist()
        >>> for full, grad in vfsdp.testing.simulate(2, step):
        ...     print(full, grad)
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] [[1.5, 1.5], [1.5, 1.5]]
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] [[1.5, 1.5]]
    """
    what = "vfsdp.gather"
    policy = merge(policy, options, what)
    out = _gather(shards, spec, mesh, policy, what, start=False)
    return out.wait() if isinstance(out, GatherHandle) else out  # (the functional path's tree)


def _gather(shards: Any, spec: ShardSpec, mesh: Any, policy: Policy, what: str, start: bool) -> Any:
    """The gather of ``gather`` (``start``: ``gather_async``), after refusing what its path
    cannot honour: the eager one's handle, or the functional one's tree (while compiling, or
    with ``all_gather=`` hooks, of shards made by ``vfsdp.shard`` only: ``mesh`` is refused
    with them, as on the eager path)."""
    functional = tp.compiling() or policy.all_gather is not None
    if tp.functorch_active():
        refuse(policy, "torch.func", what)
    refuse(policy, "compiled" if tp.compiling() else "all_gather" if functional else "eager", what)
    mesh = None if tp.compiling() else own_mesh(shards, mesh, what)
    if functional:
        return traced_gather(shards, spec, policy)
    return start_gather(shards, spec, mesh, resolve(policy, layers=False), what, start=start)


def start_gather(shards: Any, spec: ShardSpec, mesh: Any, policy: Policy, what: str,
                 regathers: bool = False, start: bool = True) -> Handle:
    """Start a tree's all-gathers; ``wait()`` returns what :func:`gather` would.

    The building block of :func:`gather`, :func:`gather_async` and :func:`vfsdp.run_layers`
    (``policy``: resolved; ``regathers``: its backward gathers a resharded unit again, so its
    graph does not keep the memory). ``start=False``: none starts now; each unit gathers as
    ``wait()`` assembles it.
    """
    leaves = match_tree(shards, spec, what)
    pending().settle()
    make = functools.partial(Gather, spec, mesh=mesh, what=what, policy=policy, regathers=regathers)
    calls, handles = {}, []
    if start and not tp.functorch_active():  # under torch.func the shards are wrapped until forward
        for u in units_of(leaves, spec, what, mesh=mesh, pack=True):
            call = make(u.key, tuple(k for _, k in u.leaves))
            call.unit = u.unit
            call.db, handle = u.unit.gather(policy.param_dtype, async_op=True)
            calls[u.key] = call
            handles.append(handle)
    return GatherHandle(handles, leaves, spec, calls, make)


class GatherHandle(Handle):
    """The result of :func:`gather_async`: ``wait()`` finishes the unit's all-gathers and
    returns the full tree (what :func:`gather` returns, differentiable)."""

    def __init__(self, handles: list, leaves: list, spec: ShardSpec, calls: dict, make) -> None:
        super().__init__()
        self._handles, self._leaves, self._spec, self._make = handles, leaves, spec, make
        self.calls = calls  # unit key -> its gather (its unit, gathered buffer, shards)

    def wait(self) -> Any:
        if self._done:  # (not Handle's finish: collectives would call up into functional)
            return self._result
        for rec in self.calls.values():  # the units' GATHERING -> GATHERED
            if rec.unit.state is UnitState.GATHERING and rec.unit.live is rec.db:
                rec.unit.wait()
        for h in self._handles:
            h.wait()
        out, spec = list(self._leaves), self._spec
        for key, members in spec.unit_leaves().items():
            call = self.calls.get(key) or self._make(key, tuple(k for _, k in members))
            call.recording = torch.is_grad_enabled()
            fulls = _GatherUnit.apply(call, *(self._leaves[i] for i, _ in members))
            for hook in GATHER_HOOKS:  # e.g. shard_map's replication tracking
                hook(fulls, spec, members)
            for (i, _), f in zip(members, fulls):
                out[i] = f
        self._result, self._done = optree.tree_unflatten(spec.treespec, out), True
        self._handles = self._leaves = self._make = None
        return self._result


def gather_async(shards: Any, spec: ShardSpec, policy: Optional[Policy] = None, *,
                 mesh: Any = None, **options: Any) -> Handle:
    """Start the all-gathers now; ``handle.wait()`` returns what :func:`gather` would.

    Takes the same policy and options as :func:`gather`. Use it to overlap the next unit's
    gather with the current unit's compute::

        nxt = vfsdp.gather_async(shards["layers"][i + 1], spec["layers"][i + 1])
        x = layer(full_i, x)
        full_next = nxt.wait()

    With ``all_gather=`` hooks the functional gather runs at once, and ``wait()`` returns
    its result.

    Args:
        shards: As for :func:`gather`.
        spec: As for :func:`gather`.
        policy: As for :func:`gather`.
        mesh: As for :func:`gather`.
        options: The keyword options of :func:`gather`.

    Returns:
        A :class:`GatherHandle` (a :class:`vfsdp.collectives.Handle`).

    Raises:
        TypeError: an unknown option.
        ValueError: as :func:`gather`; and under ``torch.compile`` (use :func:`gather`).

    Example:
        >>> def body():
        ...     params = {"layers": [{"w": torch.full((2,), float(i))} for i in range(2)]}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     nxt = vfsdp.gather_async(shards["layers"][1], spec["layers"][1])
        ...     return nxt.wait()["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[1.0, 1.0], [1.0, 1.0]]
    """
    what = "vfsdp.gather_async"
    if tp.compiling():
        raise ValueError("vfsdp.gather_async under torch.compile is not supported: its handle "
                         "is eager state the compiler cannot trace; call vfsdp.gather, whose "
                         "all-gathers the compiler schedules (and overlaps) itself")
    policy = merge(policy, options, what)
    if policy.all_gather is not None:
        done = GatherHandle([], [], None, {}, None)  # its gathers are done: wait() returns it
        done._result, done._done = _gather(shards, spec, mesh, policy, what, start=True), True
        return done
    return _gather(shards, spec, mesh, policy, what, start=True)
