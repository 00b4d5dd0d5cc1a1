"""Unit: one communication unit on this rank, its buffers and its lifecycle.

``vfsdp.shard`` makes one ``Unit`` per unit of the spec; every shard it returns is a local view
of ``unit.params`` whose :class:`~vfsdp.collectives.Slot` names the unit. Everything the
later stages need hangs off that object, created on first use:

========================  ==========================================================
``unit.params``           the master shard (``Role.PARAM``)
``unit.compute(dtype)``   the ``param_dtype`` copy gathered instead (``COMPUTE``): no
                          memory of its own between gathers, the cast writes straight
                          into this rank's slice of its global buffer
``unit.grads()``          the sharded gradients (``GRAD``)
``unit.accumulator(dt)``  unsharded gradients accumulated without reducing (``ACCUM``)
``unit.stage(dt)``        the reduce-scatter input in the reduction dtype (``STAGE``)
========================  ==========================================================

**The lifecycle.** :attr:`Unit.state` is a :class:`UnitState`; the transitions are methods of
the unit, and they are the only code that issues the unit's collectives (the all-gather on
the way in, the reduce-scatter on the way out)::

    RELEASED --gather(async_op=True): all-gather--> GATHERING --wait()--> GATHERED
    RELEASED --gather(): all-gather-----------------------------------> GATHERED
    GATHERED --reshard() (run_layers, after the unit's forward)------> RESHARDED
    RESHARDED --prepare_backward(): all-gather (or wait the prefetch)-> GATHERED
    GATHERED --release(): no graph reads the full tensors-------------> RELEASED
    GATHERED --release(): a live graph still reads them---------------> HELD
    HELD --the last such graph is done or dropped---------------------> RELEASED
    any --reduce(): reduce-scatter of the gradients (the grads side: reducing until done)

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

import enum
import weakref
from typing import Any, Optional

import torch

from vfsdp.collectives.dbuffer import DBuffer
from vfsdp.collectives.groups import MeshGroups
from vfsdp.collectives.handle import Handle
from vfsdp.collectives.released import ReleasedTensor
from vfsdp.collectives.slot import Role
from vfsdp.planner.spec import TensorSpec, UnitLayout, unit_name

__all__ = ["Unit", "UnitState"]


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


class Unit:
    """One unit's buffers on this rank, and its lifecycle (:class:`UnitState`).

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
        self._compute: dict = {}
        self._grads: Optional[DBuffer] = None
        self._grad_views: dict = {}  # grad_view(), made on first use
        self._accum: dict = {}
        self._stage: dict = {}
        self.grad_task = -2        # the backward pass that last wrote the gradient buffer
        self.grads_mode: Optional[str] = None  # where the last reduction went: buffer/return
        # The shards' .grad were made views of the gradient buffer (a grads="buffer"
        # backward()): the buffer holds the gradients while they still are.
        self.grad_linked = False
        self._resharded: set = set()  # the buffers (ids) reshard() released: gathered again
        # What prepare_backward() prefetches (run_layers: the unit that ran before this one),
        # as (weak unit, dtype); the same on every rank, as the runs are.
        self.backward_prefetch: Optional[tuple] = None
        self.awaiting = 0  # differentiable gathers of this unit whose backward is pending
        # What the compiled path reads of this unit (vfsdp.functional.traced): its groups'
        # names, its anchor and accumulator leaves; made by vfsdp.shard.
        self.traced: Optional[tuple] = None
        self._mirror: Optional[weakref.ref] = None  # grad_mirror, held weakly

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

    @property
    def state(self) -> UnitState:
        """The parameters' :class:`UnitState` (of the buffer gathered last, when several
        dtypes were)."""
        states = [self._state_of(db) for db in (self.params, *self._compute.values())]
        for s in (UnitState.GATHERING, UnitState.GATHERED, UnitState.HELD,
                  UnitState.RESHARDED):
            if s in states:
                return s
        return UnitState.RELEASED

    def _state_of(self, db: DBuffer) -> UnitState:
        if db.is_gathered:
            if db.release_pending:
                return UnitState.HELD
            return UnitState.GATHERING if db.in_flight else UnitState.GATHERED
        return UnitState.RESHARDED if id(db) in self._resharded else UnitState.RELEASED

    def compute(self, dtype: Optional[torch.dtype]) -> DBuffer:
        """The buffer gathered for compute in ``dtype``: ``params`` itself when the dtypes
        match (or ``dtype`` is ``None``), else a ``COMPUTE`` buffer made once, whose shard is
        its rank's slice of its global buffer (no persistent copy)."""
        if dtype is None or dtype == self.params.dtype:
            return self.params
        found = self._compute.get(dtype)
        if found is None:
            found = self._compute[dtype] = DBuffer(self.layout, self.groups, dtype, Role.COMPUTE,
                                                   unit=self)
        return found

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
        self._resharded.discard(id(db))
        if db is not self.params:
            db.wait()
            db.alloc_global()
            db.copy_(self.params)
        return db.all_gather(async_op=async_op)

    def wait(self) -> None:
        """``GATHERING`` -> ``GATHERED``: finish the all-gathers in flight."""
        for db in (self.params, *self._compute.values()):
            if db.in_flight:
                db.wait()

    def reshard(self, db: DBuffer) -> None:
        """``GATHERED`` -> ``RESHARDED`` (``run_layers``, after the unit's forward): free the
        gathered memory now; :meth:`prepare_backward` gathers it again."""
        db.free_global()
        if not db.is_allocated:
            self._resharded.add(id(db))

    def prepare_backward(self, db: DBuffer) -> None:
        """Before the unit's backward or its zero reduction, on every rank alike:
        ``RESHARDED`` -> ``GATHERED`` (finish the prefetch, or all-gather now), then start the
        prefetch of :attr:`backward_prefetch` if that unit is resharded (``GATHERING``)."""
        if db.in_flight:
            db.wait()
        elif id(db) in self._resharded:
            self._all_gather(db, async_op=False)
        link = self.backward_prefetch
        prev = link[0]() if link is not None else None
        if prev is not None:
            pdb = prev.compute(link[1])
            if id(pdb) in prev._resharded and not pdb.in_flight:
                prev._all_gather(pdb, async_op=True)

    def release(self, at_once: bool = True) -> None:
        """``GATHERED`` -> ``RELEASED``, or ``HELD`` while a backward through the full
        tensors is pending (the memory goes as soon as it is done or its graph is dropped):
        every gathered parameter buffer of the unit (:meth:`DBuffer.release`).

        Args:
            at_once: The full tensors handed out read as released at once (``False``:
                ``free_after_backward``, when the memory goes).
        """
        for db in (self.params, *self._compute.values()):
            db.release(at_once)

    def buffers(self) -> list[DBuffer]:
        """Every buffer the unit holds now: parameters, compute copies, gradients,
        accumulators and staging buffers (for memory accounting)."""
        grads = [self._grads] if self._grads is not None else []
        return [self.params, *self._compute.values(), *grads, *self._accum.values(),
                *self._stage.values()]

    def gathered(self) -> list[DBuffer]:
        """The parameter buffers whose global buffer holds memory now."""
        return [db for db in (self.params, *self._compute.values()) if db.is_allocated]

    # ------------------------------------------------------------------ gradients

    def reduce(self, source: torch.Tensor, op: str, reduce_dtype: Optional[torch.dtype],
               accumulate: bool = False, async_op: bool = False,
               release: Optional[DBuffer] = None) -> Handle:
        """Reduce-scatter ``source`` (an ``m*S`` buffer laid out like the unit) into the
        gradient buffer (see :meth:`DBuffer.reduce_scatter`); the grads side is *reducing*
        until the handle is done, and readers of the gradients wait for it."""
        return self.grads().reduce_scatter(source=source, op=op, reduce_dtype=reduce_dtype,
                                           accumulate=accumulate, async_op=async_op,
                                           release=release, mirror=self.grad_mirror)

    @property
    def grad_mirror(self) -> Any:
        """The :class:`~vfsdp.collectives.HostMirror` each reduction ends by copying the
        gradient shard into (``vfsdp.optim.offload``'s), or ``None``."""
        return None if self._mirror is None else self._mirror()

    def mirror_grads(self, mirror: Any) -> None:
        """Copy the gradient shard into ``mirror`` after each reduction (``None``: stop).
        Held weakly: it stops when its owner (an offloaded optimizer state) goes."""
        self._mirror = None if mirror is None else weakref.ref(mirror)

    def grads_shard(self) -> Optional[torch.Tensor]:
        """The gradient buffer's shard as it is (no wait), or ``None`` without a buffer."""
        return None if self._grads is None else self._grads.shard

    def reduce_new(self, source: torch.Tensor, op: str,
                   reduce_dtype: Optional[torch.dtype]) -> torch.Tensor:
        """Reduce-scatter ``source`` into a new ``S``-element tensor (the gradients handed
        to autograd); the unit's buffers are not touched."""
        return self.params.reduce_scatter_new(source, op=op, reduce_dtype=reduce_dtype)

    @property
    def has_grads(self) -> bool:
        """Whether a gradient buffer exists (a backward or :meth:`grads` made it)."""
        return self._grads is not None

    def grads(self) -> DBuffer:
        """The sharded gradient buffer (created zeroed on first use), after any reduction
        still writing it has finished."""
        if self._grads is None:
            self._grads = DBuffer(self.layout, self.groups, self.params.dtype, Role.GRAD,
                                  unit=self)
        self._grads.wait()
        return self._grads

    def grad_view(self, k: int) -> torch.Tensor:
        """Tensor ``k``'s piece of the gradient buffer, made once per allocation of the shard
        and handed out again (what :func:`vfsdp.grads` returns, with no op to make it). The
        unit keeps it and its slot refers to the unit weakly, so nothing forms a cycle:
        dropping the unit frees its memory at once. Released with the gradient shard
        (``set_to_none``); the next one is made over its fresh memory. Making it waits for no
        reduction in flight (it reads nothing)."""
        found = self._grad_views.get(k)
        gdb = self._grads
        if found is None or (type(found) is ReleasedTensor and gdb is not None
                             and gdb.holds_shard):
            gdb = gdb if gdb is not None else self.grads()
            found = self._grad_views[k] = gdb.local(k, weak_unit=True)
        return found

    def accumulator(self, dtype: torch.dtype, create: bool = True) -> Optional[DBuffer]:
        """The unsharded gradient accumulator in ``dtype`` (``None`` if absent and not
        ``create``)."""
        found = self._accum.get(dtype)
        if found is None and create:
            found = self._accum[dtype] = DBuffer(self.layout, self.groups, dtype, Role.ACCUM,
                                                 unit=self)
        return found

    def accumulating(self) -> list[DBuffer]:
        """Accumulators holding gradients that were not reduced yet."""
        return [db for db in self._accum.values() if db.is_allocated]

    def stage(self, dtype: torch.dtype, share_grads: bool = True) -> DBuffer:
        """The reduce-scatter input in ``dtype``: the gradient buffer's own global buffer
        when the dtypes match and ``share_grads``, else a ``STAGE`` buffer."""
        if share_grads and dtype == self.params.dtype:
            return self.grads()
        found = self._stage.get(dtype)
        if found is None:
            found = self._stage[dtype] = DBuffer(self.layout, self.groups, dtype, Role.STAGE,
                                                 unit=self)
        return found

    def drop_accumulators(self) -> None:
        """Forget unreduced gradients (free the accumulators' memory)."""
        for db in self._accum.values():
            db.free_global()

    def link_prefetch(self, prev: Optional[Unit], dtype: Optional[torch.dtype]) -> None:
        """Set :attr:`backward_prefetch`: ``prev`` (held weakly) is gathered, in ``dtype``,
        while this unit's backward runs."""
        self.backward_prefetch = None if prev is None else (weakref.ref(prev), dtype)

    def __repr__(self) -> str:
        held = []
        for db in self.buffers():
            parts = [p for p, on in (("shard", db.role is not Role.COMPUTE and db.holds_shard),
                                     ("full", db.is_allocated)) if on]
            if parts:
                held.append(f"{db.name} {str(db.dtype).replace('torch.', '')} "
                            f"{'+'.join(parts)}")
        pending = []
        if any(db.in_flight for db in (self.params, *self._compute.values())):
            pending.append("all-gather")
        if self._grads is not None and self._grads.in_flight:
            pending.append("reduce-scatter")
        if self.awaiting:
            pending.append(f"{self.awaiting} backward(s)")
        if self.accumulating():
            pending.append("unreduced gradients")
        return (f"Unit({unit_name(self.layout.key)}, rank {self.rank}/{self.layout.world_size}, "
                f"S={self.layout.shard_numel}, {self.params.dtype}, {self.state.value}; "
                f"holding [{', '.join(held)}]; pending [{', '.join(pending)}]"
                f"{'; gradients mirrored to the host' if self.grad_mirror is not None else ''})")
