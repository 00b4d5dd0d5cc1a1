"""Unit: one communication unit on this rank, its buffers and its whole life.

``vfsdp.shard`` makes one ``Unit`` per unit of the spec; every shard it returns is a local view
of ``unit.params`` whose :class:`~vfsdp.collectives.Slot` names the unit. Everything the
later stages need hangs off that object, created on first use:

========================  ==========================================================
``unit.params``           the master shard (``Role.PARAM``)
``unit.compute(dtype)``   the ``param_dtype`` copy gathered instead (``COMPUTE``): no
                          memory of its own between gathers, the cast writes straight
                          into this rank's slice of its global buffer
``unit.grads()``          the sharded gradients (``GRAD``)
``unit.unreduced()``      unsharded gradients accumulated without reducing (``ACCUM``)
``unit.stage(dt)``        the reduce-scatter input in the reduction dtype (``STAGE``)
========================  ==========================================================

**The lifecycle.** :attr:`Unit.state` is a stored :class:`UnitState`. The transitions are the
unit's methods; each checks the state it starts from (an :class:`IllegalTransitionError`
names the unit, the state and the fix otherwise), and they are the only code that allocates, gathers,
reduces or frees the unit's DBuffer memory::

    RELEASED --gather(async_op=True): all-gather--> GATHERING --wait()--> GATHERED
    RELEASED --gather(): all-gather-----------------------------------> GATHERED
    GATHERED --reshard() (run_layers, after the unit's forward)------> RESHARDED
    RESHARDED --pre_backward(): all-gather (or wait the prefetch)-----> GATHERED
    GATHERED --release(): no graph reads the full tensors-------------> RELEASED
    GATHERED --release(): a live graph still reads them---------------> HELD
    HELD --graph_done(): the last such graph is done or dropped-------> RELEASED
    post_backward(): reduce-scatter (or accumulate) one gather's gradients, link .grad,
                     release after the backward; once per gather and backward pass

Extensions hook in rather than being wired in: ``unit.on_reduced`` holds callables run with
the unit after each reduction into its gradient buffer lands (``vfsdp.optim.offload``'s host
mirror), and :data:`GATHER_HOOKS` callables see every differentiable gather's full tensors
(``shard_map``'s replication tracking).

**The memory rule.** A release lets go of the memory vfsdp handed out (the full tensors, the
gradient pieces): vfsdp's views of it read as released and point at no memory, and the memory
goes with the last tensor anyone made from them (at once, unless the user kept one); a gather
or a backward gets fresh memory. Memory only vfsdp reads (staging, accumulators) is resized
in place. Nothing counts references, so nothing can point at freed memory.

``repr(unit)`` shows the state, the buffers holding memory and what is pending. An
asynchronous gradient reduction in flight is recorded on the gradient buffer itself, and
:meth:`Unit.grads` waits for it: whoever reads the gradients waits for exactly the work that
writes them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.comm import Handle, MeshGroups
from vfsdp.collectives.dbuffer import DBuffer, ReleasedTensor, Role
from vfsdp.planner.spec import TensorSpec, UnitLayout, unit_name

__all__ = ["Unit", "UnitState", "IllegalTransitionError", "Reductions", "GATHER_HOOKS", "export_full",
           "TracedUnit", "group_name"]


def group_name(group: Any) -> str:
    """The name functional collectives know a process group by (``None``: the default)."""
    return (group if group is not None else torch.distributed.group.WORLD).group_name


class TracedUnit(NamedTuple):
    """What the compiled path reads of a unit (:meth:`Unit.traced_record`), made once, eagerly.

    The anchor is a one-element leaf every rank adds (times 0) to its shard: the shard's
    gradient, the reduce-scatter, then always has a user on every rank, even one that holds
    nothing of the unit's tensors (else the compiler drops it there and the ranks deadlock).
    The accumulator leaf's ``.grad`` is the one record, on every path, of ``grad_sync=False``
    gradients not reduced yet (see :meth:`Unit.unreduced`): a compiled backward adds to it,
    and the eager one makes it the unit's accumulator memory."""

    anchor: torch.Tensor
    accumulator: torch.Tensor
    shard_group: str
    shard_size: int
    replicate_group: Optional[str]
    replicas: int
    model_group: Optional[str]
    shard_rank: int

#: Callables ``hook(fulls, spec, members)`` run on every differentiable gather's full tensors
#: (``vfsdp.spmd.shard_map`` adds its replication tracker here; empty by default).
GATHER_HOOKS: list = []


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
        self.wait(self.limit)

    def wait(self, keep: int = 0) -> None:
        """Finish every reduction this object started (but the ``keep`` newest)."""
        while len(self._inflight) > keep:
            self._inflight.pop(0).wait()

    def __len__(self) -> int:
        return sum(not h.done for h in self._inflight)


class UnitState(enum.Enum):
    """Where a unit's parameters are in their life on this rank (see the module diagram).

    Example:
        >>> [s.value for s in UnitState]
        ['released', 'gathering', 'gathered', 'resharded', 'held']
    """

    RELEASED = "released"    #: the shard only: no gathered memory
    GATHERING = "gathering"  #: an all-gather is in flight (``wait()`` finishes it)
    GATHERED = "gathered"    #: the full tensors are valid
    RESHARDED = "resharded"  #: released after its forward; its backward gathers it again
    HELD = "held"            #: released, the memory kept while a graph or tensors use it


class IllegalTransitionError(RuntimeError):
    """A unit was asked for a transition its state does not allow (the message names the
    unit, its state and the fix).

    Example:
        >>> issubclass(IllegalTransitionError, RuntimeError)
        True
    """


@dataclasses.dataclass(slots=True)
class _Life:
    """One parameter buffer's place in its unit's life (the unit's ``state`` is that of the
    buffer gathered last)."""

    state: UnitState = UnitState.RELEASED
    regather: bool = False  # resharded since its last gather: the backward gathers it again
    regathering: int = 0    # run_layers gathers awaiting their backward, on every rank alike
    graphs: int = 0         # live autograd graphs of plain gathers that read the full views

    def wants_gather(self) -> bool:
        """Whether a backward gathers it again (``RESHARDED``, or a reshard a graph holds):
        decided alike on every rank, whatever the local graphs hold."""
        return self.state is UnitState.RESHARDED or (self.state is UnitState.HELD
                                                    and self.regather)


class Unit:
    """One unit's buffers on this rank, and its lifecycle (:class:`UnitState`, stored).

    Args:
        layout: The unit's layout (``spec.units[key]``).
        groups: Where its collectives run.
        dtype: The parameters' dtype (default: the layout's).

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     unit = Unit(spec.units[()], resolve_groups(spec))
        ...     unit.params.local(0).data.fill_(dist.get_rank() + 1.0)
        ...     full, _ = unit.gather(torch.bfloat16)
        ...     values, state = full.full(0).tolist(), unit.state.value
        ...     unit.release()
        ...     return values, full.dtype, state, unit.state.value
        >>> vfsdp.testing.simulate(2, body)[1]
        ([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0], torch.bfloat16, 'gathered', 'released')
    """

    def __init__(self, layout: UnitLayout, groups: MeshGroups,
                 dtype: Optional[torch.dtype] = None) -> None:
        self.layout = layout
        self.groups = groups
        self.params = DBuffer(layout, groups, dtype, Role.PARAM, unit=self)
        self.state = UnitState.RELEASED
        self.live: DBuffer = self.params  # the parameter buffer the state describes
        self._compute: dict = {}
        self._grads: Optional[DBuffer] = None
        self._grad_views: dict = {}  # grad_view(), made on first use
        self._accum: Optional[DBuffer] = None  # grad_sync=False's (see unreduced())
        self._accum_link: Optional[torch.Tensor] = None  # what it set as the leaf's .grad
        self._stage: dict = {}
        self.grads_mode: Optional[str] = None  # where the last reduction went: buffer/return
        # The shards' .grad were made views of the gradient buffer (a grads="buffer"
        # backward()): the buffer holds the gradients while they still are.
        self.grad_linked = False
        # What pre_backward() prefetches (run_layers: the unit that ran before this one), as
        # (weak unit, dtype); the same on every rank, as the runs are.
        self.backward_prefetch: Optional[tuple] = None
        self.awaiting = 0  # differentiable gathers of this unit whose backward is pending
        self._life: dict = collections.defaultdict(_Life)  # parameter buffer (by dtype) -> its _Life
        self.traced: Optional[TracedUnit] = None  # see traced_record()
        # Callables run with the unit after each reduction into its gradient buffer lands,
        # held weakly (a bound method's owner goes, the hook goes).
        self.on_reduced: list = []
        self._mirror: Optional[weakref.WeakMethod] = None  # the offload mirror's hook, if any

    @property
    def key(self):
        return self.layout.key

    @property
    def rank(self) -> int:
        """This rank's index in the shard group."""
        return self.groups.shard_rank

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.layout.tensors

    # ------------------------------------------------------------------ the lifecycle

    def _of(self, db: DBuffer) -> _Life:
        return self._life[db.dtype]

    def _illegal(self, what: str) -> IllegalTransitionError:
        return IllegalTransitionError(f"unit {unit_name(self.key)} (rank {self.rank}): {what}")

    def _to(self, db: DBuffer, state: UnitState) -> None:
        self._of(db).state = state
        if db is self.live:
            self.state = state

    def compute(self, dtype: Optional[torch.dtype]) -> DBuffer:
        """The buffer gathered for compute in ``dtype``: ``params`` itself when the dtypes
        match (or ``dtype`` is ``None``), else a ``COMPUTE`` buffer made once, whose shard is
        its rank's slice of its global buffer (no persistent copy)."""
        if dtype is None or dtype == self.params.dtype:
            return self.params
        return self._made(self._compute, dtype, Role.COMPUTE)

    def _made(self, made: dict, dtype: torch.dtype, role: Role) -> DBuffer:
        """The unit's ``role`` buffer in ``dtype`` from ``made``, made on first use."""
        if dtype not in made:
            made[dtype] = DBuffer(self.layout, self.groups, dtype, role, unit=self)
        return made[dtype]

    def gather(self, param_dtype: Optional[torch.dtype] = None,
               async_op: bool = False) -> tuple[DBuffer, Handle]:
        """Any state -> ``GATHERING`` (``async_op``) or ``GATHERED``: all-gather the
        parameters, in ``param_dtype`` if given (one cast over the shard, a group op, into
        the compute buffer, then the in-place all-gather of that). Gathering a gathered unit
        again re-runs its all-gather.

        Returns:
            The buffer holding the full tensors, and the collective's handle.
        """
        db = self.compute(param_dtype)
        return db, self._all_gather(db, async_op)

    def _all_gather(self, db: DBuffer, async_op: bool) -> Handle:
        if db is not self.params:
            db.wait()
            db.alloc_global()
            db.copy_(self.params)
        handle = db.all_gather(async_op=async_op)
        self._of(db).regather = False
        self.live = db
        self._to(db, UnitState.GATHERING if db.in_flight else UnitState.GATHERED)
        return handle

    def wait(self) -> None:
        """``GATHERING`` -> ``GATHERED``: finish the all-gather in flight.

        Raises:
            IllegalTransitionError: nothing is in flight.
        """
        if self.state is not UnitState.GATHERING:
            raise self._illegal(f"wait() is not allowed while it is {self.state.value}: nothing is in "
                                f"flight; start an all-gather first (gather(async_op=True))")
        self.live.wait()
        self._to(self.live, UnitState.GATHERED)

    def reshard(self, db: DBuffer) -> None:
        """``GATHERED`` -> ``RESHARDED`` (``run_layers``, after the unit's forward): free the
        gathered memory now; :meth:`pre_backward` gathers it again. While a graph of a plain
        gather still reads the full tensors (a gather of your own, saved by autograd) the
        memory stays until that graph is done (``HELD``). A unit whose all-gather is in
        flight again (the next layer's prefetch of a shared unit) stays as it is.

        Raises:
            IllegalTransitionError: the unit is not gathered.
        """
        life = self._of(db)
        if life.state is UnitState.GATHERING:
            return  # gathered again for a later use: that gather owns it now
        if life.state is not UnitState.GATHERED:
            raise self._illegal(f"reshard() is not allowed while it is {life.state.value}; reshard a "
                                f"unit only after gathering it")
        life.regather = True
        self._let_go(db, at_once=False)

    def pre_backward(self, db: DBuffer, prefetch: bool = True) -> None:
        """Before the unit's backward or its zero reduction, on every rank alike:
        ``RESHARDED`` -> ``GATHERED`` (finish the prefetch, or all-gather now), then start the
        prefetch of :attr:`backward_prefetch` if that unit is resharded (``GATHERING``; not
        with ``prefetch=False``: a recompute's regather)."""
        if db.in_flight:
            db.wait()
            self._to(db, UnitState.GATHERED)
        elif self._of(db).wants_gather():
            # (a held reshard too: its memory is still there, but another rank's was freed,
            # and every rank issues the same collectives; the values are the same)
            self._all_gather(db, async_op=False)
        link = self.backward_prefetch if prefetch else None
        prev = link[0]() if link is not None else None
        if prev is not None:
            pdb = prev.compute(link[1])
            if prev._of(pdb).wants_gather():
                prev._all_gather(pdb, async_op=True)

    def release(self, at_once: bool = True, every_rank: bool = True,
                db: Optional[DBuffer] = None) -> None:
        """``GATHERED`` -> ``RELEASED``, or ``HELD`` while a backward through the full
        tensors is pending (the memory goes as soon as it is done or its graph is dropped):
        every gathered parameter buffer of the unit. A released unit stays released; one
        whose only readers are ``run_layers`` graphs, which gather it again, is resharded.

        Args:
            at_once: The full tensors handed out read as released at once (``False``:
                ``free_after_backward``, when the memory goes).
            every_rank: Every rank releases it here alike (``False``: only this rank, as a
                graph died, so whether a backward gathers it again is left as it was).
            db: Only this parameter buffer (default: every one).
        """
        for each in (self.params, *self._compute.values()) if db is None else (db,):
            self._let_go(each, at_once, every_rank)

    def _let_go(self, db: DBuffer, at_once: bool, every_rank: bool = True) -> None:
        """Free ``db``'s gathered memory now, or, while a plain gather's graph still reads
        it, when that graph is done (``HELD``). Gathers that regather (``run_layers``') never
        keep it: released on every rank alike while they await their backward, the unit is
        ``RESHARDED`` for them. Whether a backward gathers it again is decided only where
        every rank decides alike: every rank issues the same collectives."""
        life = self._of(db)
        if every_rank and life.regathering > 0:
            life.regather = True
        if not db.is_allocated:  # (freed already on this rank alone: a graph died)
            if every_rank and life.state is UnitState.RELEASED:
                self._settle(db, life)
            return
        db.wait()
        if life.graphs > 0:  # a plain gather's graph reads it: freed at graph_done()
            if at_once:
                db._release_views()
            self._to(db, UnitState.HELD)
        else:
            self._settle(db, life)

    def _settle(self, db: DBuffer, life: _Life) -> None:
        """Free ``db``'s gathered memory (if it still holds any): ``RESHARDED`` if a
        backward gathers it again, else ``RELEASED``."""
        db.free_global()
        self._to(db, UnitState.RESHARDED if life.regather else UnitState.RELEASED)

    def hold(self, db: DBuffer, regathers: bool = False) -> None:
        """A differentiable gather of ``db`` awaits its backward: its graph reads the full
        views until :meth:`graph_done`, or, with ``regathers`` (``run_layers``), it gathers
        them again if they were resharded (it keeps no memory, until :meth:`record_done`)."""
        if regathers:
            self._of(db).regathering += 1
        else:
            self._of(db).graphs += 1

    def graph_done(self, db: DBuffer, regathers: bool = False) -> None:
        """``HELD`` -> ``RELEASED`` (``RESHARDED`` while gathers that regather await their
        backward) once the last plain gather's graph reading ``db``'s full views is done or
        dropped."""
        if not regathers:
            life = self._of(db)
            life.graphs -= 1
            if life.state is UnitState.HELD and life.graphs <= 0:
                self._settle(db, life)

    def keep_gathered(self, db: DBuffer) -> None:
        """A gather that would regather ``db`` for its backward (``run_layers``) was left
        gathered after its forward (the last layer, or no ``reshard_after_forward``): its
        graph reads the full views until :meth:`graph_done`, as a plain gather's does."""
        self._of(db).regathering -= 1
        self._of(db).graphs += 1

    def record_done(self, db: DBuffer, regathers: bool = False) -> None:
        """A gather of ``db`` no longer awaits its backward (it reduced, or no rank needs
        it): the same moment on every rank."""
        if regathers:
            self._of(db).regathering -= 1

    def buffers(self) -> list[DBuffer]:
        """Every buffer the unit holds now: parameters, compute copies, gradients,
        accumulators and staging buffers (for memory accounting)."""
        return [db for db in (self.params, *self._compute.values(), self._grads, self._accum,
                              *self._stage.values()) if db is not None]

    def gathered(self) -> list[DBuffer]:
        """The parameter buffers whose global buffer holds memory now."""
        return [db for db in (self.params, *self._compute.values()) if db.is_allocated]

    # ------------------------------------------------------------------ gradients

    def post_backward(self, rec: Any, grads: Sequence[Optional[torch.Tensor]], *,
                      accumulates: bool, keep: bool = False, inflight: Any = None,
                      zeros: bool = False) -> Optional[list]:
        """One gather's backward (``grads``: its full gradients; ``zeros``: this rank's loss
        did not reach it, so it takes part in the reduction with zeros): the unit is gathered
        again if it was resharded, released after it (``free_after_backward``, unless the
        graph is kept), and its gradients reduced (or accumulated unsharded) as ``rec.policy``
        says, the shards' ``.grad`` linked to the gradient buffer for ``grads="buffer"``.

        Args:
            rec: The gather's record (``vfsdp.functional.gather.Gather``).
            grads: One full gradient per tensor of ``rec.index`` (``None``: none).
            accumulates: The pass writes leaves' ``.grad`` (``backward()``).
            keep: The graph runs again (``retain_graph=True``): keep the memory.
            inflight: Where an asynchronous reduction is queued (at most one in flight).
            zeros: This rank's loss did not reach the gather.

        Returns:
            This rank's gradient pieces, as :meth:`reduce_grads` returns them.

        Raises:
            IllegalTransitionError: this gather already reduced in this backward pass.
        """
        task = tp.graph_task_id()
        if rec.reduced_in == task:
            raise self._illegal("a second post_backward() of one gather in one backward pass is not "
                                "allowed; each gather reduces once per backward")
        rec.reduced_in = task
        self.pre_backward(rec.db)
        if rec.policy.free_after_backward and not keep:
            # Its backward is done: the gathered parameters go before the gradient staging
            # buffer is allocated, now or when the last other graph reading them is done.
            self._let_go(rec.db, at_once=False)
        to_buffer = rec.policy.grads == "buffer"
        if to_buffer:
            self._unlink_stale(rec)
        pieces = self.reduce_grads(rec.index, grads, rec.policy, inflight=inflight,
                                   views=not to_buffer)
        if to_buffer and rec.policy.grad_sync and accumulates:
            self._link_grads(rec)
        if to_buffer or pieces is None:
            return None
        if zeros and accumulates:  # the other ranks' contributions, into .grad (as FSDP2)
            with torch.no_grad():
                for x, p, need in zip(rec.locals, pieces, rec.needs):
                    if need and p is not None:
                        x.grad = p if x.grad is None else x.grad.add_(p)
        return pieces

    def _unlink_stale(self, rec: Any) -> None:
        """The shards' ``.grad`` were the gradient buffer's views and something other than
        vfsdp replaced them (a compiled ``zero_grads`` or backward, ``x.grad = None``): the
        ``.grad`` is the truth, the buffer's values are stale. Drop them; what ``.grad`` holds
        now is added back when it is linked again (:meth:`_link_grads`)."""
        pairs = [(x, k) for x, k, need in zip(rec.locals, rec.index, rec.needs) if need]
        if self.grad_linked and not all(x.grad is self.grad_view(k) for x, k in pairs):
            self.grad_linked = False
            with torch.no_grad():  # a .grad still linked keeps its values (a copy of its own)
                for x, k in pairs:
                    if x.grad is self.grad_view(k):
                        x.grad = x.grad.clone()
            self.grads().release_shard()

    def _link_grads(self, rec: Any) -> None:
        """Each shard's ``.grad`` becomes its piece of the gradient buffer, a view (no memory
        of its own); gradients autograd put in ``.grad`` before (a ``grads="return"``
        backward) are added into the buffer first."""
        with torch.no_grad():
            for x, k, need in zip(rec.locals, rec.index, rec.needs):
                view = self.grad_view(k) if need else x.grad
                if x.grad is not view:
                    if x.grad is not None:
                        self.grads()  # the reduction in flight into the buffer lands first
                        view.add_(x.grad.view(view.shape))
                    x.grad = view
        self.grad_linked = True

    def reduce_grads(self, index: Sequence[int], grads: Sequence[Optional[torch.Tensor]],
                     opts: Any, *, views: bool = True, overwrite: bool = False,
                     inflight: Any = None) -> Optional[list[Optional[torch.Tensor]]]:
        """Reduce-scatter the gradients of tensors ``index`` of the unit (one contiguous
        copy per tensor into the staging buffer, padding zero-filled, one reduce-scatter).

        Args:
            index: Buffer indices of the tensors whose gradients are given (a tied tensor may
                appear more than once: its gradients are summed).
            grads: Their full gradients (``None``: zero, e.g. a frozen tensor).
            opts: The resolved ``vfsdp.Policy``. ``grads="buffer"``: into the gradient
                DBuffer, adding to what it holds, as torch's ``.grad`` does (overwriting only
                a released or new buffer, or with ``overwrite``). ``grads="return"``: into a
                fresh tensor, nothing of vfsdp's is written.
            views: For ``"buffer"``, return the gradient DBuffer's views (``False``: none).
            overwrite: For ``"buffer"``: replace what the gradient buffer holds.
            inflight: A queue for an asynchronous reduction (``opts.async_reduce``).

        Returns:
            This rank's gradient pieces in the order of ``index`` (``None`` at repeats), or
            ``None`` when ``opts.grad_sync`` is off (only accumulated, unsharded).
        """
        index, grads, first = _merge(index, grads)
        fresh = not self.has_grads  # a new gradient buffer holds zeros: nothing to add to
        db = self.params
        rdt = opts.reduce_dtype or next((g.dtype for g in grads if g is not None), db.dtype)
        to_buffer = opts.grads == "buffer"
        accum = self.unreduced(create=not opts.grad_sync)
        pairs = [(i, g) for i, g in zip(index, grads) if g is not None]
        if accum is not None:  # accumulating unsharded (no reduce until the last micro-batch)
            dsts = accum.internal_views()
            with torch.no_grad():  # one op for the unit
                tp.foreach("add_", [dsts[i] for i, _ in pairs], [g for _, g in pairs])
            if not opts.grad_sync:
                return None
            self.traced.accumulator.grad = self._accum_link = None  # reduced below
        # (accumulated in the parameters' dtype: reduced as it is, or after one cast)
        stage = accum if accum is not None and accum.dtype == rdt else self.stage(rdt, to_buffer)
        buf = stage.alloc_global().data
        if accum is not None and stage is not accum:
            with torch.no_grad():
                buf.copy_(accum.global_buffer.data)
            accum.free_global()
        elif accum is None:
            dsts = stage.internal_views()  # made once: no view op per tensor per step
            # (a gradient produced in place has nothing to copy)
            copies = [(dsts[i], g) for i, g in pairs if not _is_slice_of(g, dsts[i])]
            _zero_gaps(buf, db.tensors, {i for i, _ in pairs})
            with torch.no_grad():  # one op for all the unit's pieces, not one per tensor
                tp.foreach("copy_", [dst if dst.shape == g.shape else dst.view(g.shape)
                                       for dst, g in copies], [g for _, g in copies])
        if not to_buffer:  # to autograd: a fresh tensor, nothing of vfsdp's is aliased
            out = self.reduce_new(buf, opts.grad_reduce, rdt)
            stage.free_global()
            self.grads_mode = "return"
            return _expand([out[slice(*db.tensors[i].shard_range(self.rank))].view(
                db.local_shape(i)) for i in index], first)
        gdb = self.grads()
        self.grads_mode = "buffer"
        # Overlaps the next unit's backward (async); the staging buffer is freed once it is
        # done. The on_reduced hooks run once the result is in the gradient buffer. As torch's
        # .grad, it adds to what the buffer holds (a new or released one: nothing).
        async_op = opts.async_reduce and stage is not accum
        handle = gdb.reduce_scatter(source=buf, op=opts.grad_reduce, reduce_dtype=rdt, async_op=async_op,
                                    accumulate=not overwrite and gdb.holds_shard and not fresh,
                                    release=stage if async_op else None, then=self._reduced)
        if not async_op:
            stage.free_global()
        elif inflight is not None:
            inflight.add(handle)  # at most one in flight on this rank
        return _expand([gdb.local(i) for i in index], first) if views else None

    def _reduced(self) -> None:
        hooks = [(ref, hook) for ref in self.on_reduced if (hook := ref()) is not None]
        self.on_reduced[:] = [ref for ref, _ in hooks]
        for _, hook in hooks:
            hook(self)

    @property
    def grad_mirror(self) -> Any:
        """The :class:`~vfsdp.collectives.HostMirror` whose ``refresh`` is among the
        :attr:`on_reduced` hooks (``vfsdp.optim.offload``'s), or ``None``."""
        hook = self._mirror() if self._mirror is not None else None
        return None if hook is None else hook.__self__

    def mirror_grads(self, mirror: Any) -> None:
        """Copy the gradient shard into ``mirror`` after each reduction (``None``: stop):
        its ``refresh`` as an :attr:`on_reduced` hook, held weakly (it stops when its owner,
        an offloaded optimizer state, goes)."""
        self.on_reduced[:] = [r for r in self.on_reduced if r is not self._mirror]
        self._mirror = None if mirror is None else weakref.WeakMethod(mirror.refresh)
        self.on_reduced += [self._mirror] if mirror is not None else []

    def reduce_new(self, source: torch.Tensor, op: str,
                   reduce_dtype: Optional[torch.dtype]) -> torch.Tensor:
        """Reduce-scatter ``source`` into a new ``S``-element tensor (the gradients handed
        to autograd); the unit's buffers are not touched."""
        return self.params.reduce_scatter(source, op, reduce_dtype, new=True).wait()

    @property
    def has_grads(self) -> bool:
        """Whether a gradient buffer exists (a backward or :meth:`grads` made it)."""
        return self._grads is not None

    def grads(self) -> DBuffer:
        """The sharded gradient buffer (created zeroed on first use), after any reduction
        still writing it has finished."""
        if self._grads is None:
            self._grads = self.params.like(role=Role.GRAD)
        self._grads.wait()
        return self._grads

    def grad_view(self, k: int) -> torch.Tensor:
        """Tensor ``k``'s piece of the gradient buffer, made once per allocation of the shard
        and handed out again (what :func:`vfsdp.grads` returns, with no op to make it). The
        unit keeps it and its slot refers to the unit weakly, so nothing forms a cycle.
        Released with the gradient shard (``set_to_none``); the next one is made over its
        fresh memory. Making it waits for no reduction in flight (it reads nothing)."""
        found = self._grad_views.get(k)
        gdb = self._grads
        if found is None or (type(found) is ReleasedTensor and gdb is not None
                             and gdb.holds_shard):
            gdb = gdb if gdb is not None else self.grads()
            found = self._grad_views[k] = gdb.local(k, weak_unit=True)
        return found

    def traced_record(self) -> TracedUnit:
        """What the compiled path reads of this unit (:class:`TracedUnit`), made once, eagerly
        (``vfsdp.shard`` makes it), kept as :attr:`traced`."""
        if self.traced is None:
            groups, layout = self.groups, self.layout
            anchor = torch.zeros(1, dtype=layout.dtype, device=groups.device, requires_grad=True)
            full = layout.shard_numel * groups.shard_size
            acc = torch.zeros(1, dtype=layout.dtype, device=groups.device).expand(full)
            replicate = group_name(groups.replicate) if groups.replicate is not None else None
            model = group_name(groups.model) if groups.model is not None else None
            self.traced = TracedUnit(anchor, acc.requires_grad_(), group_name(groups.shard),
                                     groups.shard_size, replicate, groups.replicate_size, model,
                                     groups.shard_rank)
        return self.traced

    def unreduced(self, create: bool = False) -> Optional[DBuffer]:
        """The one accumulator of ``grad_sync=False`` gradients, eager and compiled alike, in
        the parameters' dtype (as plain torch's ``.grad``), holding every gradient not reduced
        yet (``None``: there are none, and not ``create``).

        The compiled path's accumulator leaf's ``.grad`` says whether there are any: the eager
        accumulation makes it this accumulator's memory, a compiled backward adds to it (in
        place, or making a new one, which is taken in here), and a compiled sync or
        ``zero_grads`` sets it to ``None``, so that what the compiled path reduced or dropped
        is not reduced again."""
        held = self.traced.accumulator.grad if self.traced is not None else None
        if held is None:  # nothing unreduced: an eager accumulator left is stale
            self.drop_accumulators()
            if not create:
                return None
        leaf = self.traced_record().accumulator
        if self._accum is None:
            self._accum = DBuffer(self.layout, self.groups, leaf.dtype, Role.ACCUM, unit=self)
        if held is not None and held is self._accum_link:
            return self._accum
        mem = self._accum.alloc_global().data
        with torch.no_grad():
            if held is None:
                mem.zero_()
            else:
                mem.copy_(held.reshape(-1))
        leaf.grad = self._accum_link = mem.view(leaf.shape)
        return self._accum

    def stage(self, dtype: torch.dtype, share_grads: bool = True) -> DBuffer:
        """The reduce-scatter input in ``dtype``: the gradient buffer's own global buffer
        when the dtypes match and ``share_grads``, else a ``STAGE`` buffer."""
        if share_grads and dtype == self.params.dtype:
            return self.grads()
        return self._made(self._stage, dtype, Role.STAGE)

    def drop_accumulators(self) -> None:
        """Forget unreduced gradients, on every path (free the accumulator's memory)."""
        if self._accum is not None:
            self._accum.free_global()
        if self.traced is not None and self.traced.accumulator.grad is self._accum_link:
            self.traced.accumulator.grad = None
        self._accum_link = None

    def link_prefetch(self, prev: Optional[DBuffer]) -> None:
        """Set :attr:`backward_prefetch`: ``prev``'s unit (held weakly) is gathered, in its
        dtype, while this unit's backward runs."""
        self.backward_prefetch = None if prev is None else (weakref.ref(prev.unit), prev.dtype)

    def __repr__(self) -> str:
        held = [f"{db.name} {str(db.dtype).replace('torch.', '')} {'+'.join(parts)}"
                for db in self.buffers() if (parts := [p for p, on in (
                    ("shard", db.role not in (Role.COMPUTE, Role.STAGE, Role.ACCUM) and db.holds_shard),
                    ("full", db.is_allocated)) if on])]
        pending = [what for what, on in (
            ("all-gather", any(db.in_flight for db in (self.params, *self._compute.values()))),
            ("reduce-scatter", self._grads is not None and self._grads.in_flight),
            (f"{self.awaiting} backward(s)", self.awaiting),
            ("unreduced gradients", self.traced is not None and self.traced.accumulator.grad is not None),
        ) if on]
        return (f"Unit({unit_name(self.layout.key)}, rank {self.rank}/{self.layout.world_size}, "
                f"S={self.layout.shard_numel}, {self.params.dtype}, {self.state.value}; "
                f"holding [{', '.join(held)}]; pending [{', '.join(pending)}]"
                f"{'; gradients mirrored to the host' if self.grad_mirror is not None else ''})")


def drop_traced_grads(runtime: Any, keep: bool = False) -> None:
    """What ``zero_grads`` does, on every path, to the compiled path's own leaves of a unit
    (its ``unit.traced``, or ``None``): ``grad_sync=False``'s unreduced gradients are
    dropped, and the anchor's (always zero) gradient too, or with ``keep`` (eager
    ``set_to_none=False``) zeroed where it exists, so that a compiled step finds what it
    found before (one graph). While compiling ``keep`` is off: asking whether a gradient is
    ``None`` would be a guard."""
    if runtime is not None:
        if keep and runtime.anchor.grad is not None:
            runtime.anchor.grad.zero_()
        else:
            runtime.anchor.grad = None
        runtime.accumulator.grad = None


@contextlib.contextmanager
def export_full(db: DBuffer) -> Iterator[DBuffer]:
    """``db`` gathered for reading its full views (a full-state export), then released
    again if it was not gathered before: a unit's parameters through its transitions, any
    other buffer (an optimizer state) directly.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     unit = Unit(spec.units[()], resolve_groups(spec))
        ...     unit.params.local(0).data.fill_(dist.get_rank() + 1.0)
        ...     with export_full(unit.params) as db:
        ...         values = db.full(0).tolist()
        ...     return values, unit.state.value
        >>> vfsdp.testing.simulate(2, body)[0]
        ([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0], 'released')
    """
    unit = db.unit
    owned = unit is not None and (db is unit.params or db in unit._compute.values())
    was = db.is_allocated
    if owned:
        unit._all_gather(db, async_op=False)
    else:
        db.all_gather()
    try:
        yield db
    finally:
        if not was:
            if owned:
                unit._let_go(db, at_once=True)
            else:
                db.free_global()


def _merge(index, grads) -> tuple[list, list, list]:
    """Sum the gradients of repeated indices (a tied tensor used at two paths): the unique
    indices, their summed gradients, and for each original position the position of its
    index among the unique ones (``None`` for a repeat)."""
    if len(set(index)) == len(index):
        return list(index), list(grads), list(range(len(index)))
    unique, first = {}, []
    for i, g in zip(index, grads):
        first.append(None if i in unique else len(unique))
        prev = unique.get(i)
        unique[i] = g if prev is None else prev if g is None else prev + g
    return list(unique), list(unique.values()), first


def _expand(pieces: list, first: list) -> list:
    return [pieces[k] if k is not None else None for k in first]


def _is_slice_of(g: torch.Tensor, dst: torch.Tensor) -> bool:
    try:
        return (g.is_contiguous() and g.numel() == dst.numel() and g.dtype == dst.dtype
                and g.data_ptr() == dst.data_ptr())
    except RuntimeError:
        return False


def _zero_gaps(buf: torch.Tensor, tensors, covered: set) -> None:
    """Zero everything but the tensors about to be written: padding and missing gradients
    (one op for all the gaps)."""
    end, gaps, n = 0, [], buf.numel()
    for lo, hi in [(t.offset, t.offset + t.numel) for i, t in enumerate(tensors) if i in covered] + [(n, n)]:
        if lo > end:
            gaps.append(buf[end:lo])
        end = max(end, hi)
    with torch.no_grad():
        tp.foreach("zero_", gaps)
