"""Unit: one communication unit on this rank, owning its parameter DBuffer and what derives from it.

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

An asynchronous gradient reduction in flight is recorded on the gradient buffer itself, and
:meth:`Unit.grads` waits for it: whoever reads the gradients waits for exactly the work that
writes them.
"""

from __future__ import annotations

from typing import Optional

import torch

from vfsdp.collectives.dbuffer import DBuffer
from vfsdp.collectives.groups import MeshGroups
from vfsdp.collectives.handle import Handle
from vfsdp.collectives.slot import Role
from vfsdp.planner.spec import TensorSpec, UnitLayout

__all__ = ["Unit"]


class Unit:
    """One unit's buffers on this rank.

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
        ...     return full.full(0).tolist(), full.dtype
        >>> vfsdp.testing.simulate(2, body)[1]
        ([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0], torch.bfloat16)
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

    # ------------------------------------------------------------------ parameters

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
        """All-gather the parameters, in ``param_dtype`` if given: one cast over the shard
        (a group op) into the compute buffer, then the in-place all-gather of that.

        Returns:
            The buffer holding the full tensors, and the collective's handle.
        """
        db = self.compute(param_dtype)
        return db, self.regather(db, async_op)

    def regather(self, db: DBuffer, async_op: bool = False) -> Handle:
        """Gather ``db`` (``params`` or one of its compute copies) again: a compute copy
        first casts the master shard straight into its slice of the global buffer."""
        if db is not self.params:
            db.wait()
            db.alloc_global()
            db.copy_(self.params)
        return db.all_gather(async_op=async_op)

    def buffers(self) -> list[DBuffer]:
        """Every buffer the unit holds now: parameters, compute copies, gradients,
        accumulators and staging buffers (for memory accounting)."""
        grads = [self._grads] if self._grads is not None else []
        return [self.params, *self._compute.values(), *grads, *self._accum.values(),
                *self._stage.values()]

    def gathered(self) -> list[DBuffer]:
        """The parameter buffers whose global buffer holds memory now."""
        return [db for db in (self.params, *self._compute.values()) if db.is_allocated]

    def release(self) -> None:
        """Release every gathered parameter buffer of the unit (:meth:`DBuffer.release`): the
        full tensors handed out read as released at once; the memory goes now, or, while a
        backward through them is pending, as soon as it is done or its graph is dropped."""
        for db in (self.params, *self._compute.values()):
            db.release()

    # ------------------------------------------------------------------ gradients

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
        """Tensor ``k``'s piece of the gradient buffer, made once and handed out again (what
        :func:`vfsdp.grads` returns every step, with no op to make it). The unit keeps it and
        its slot refers to the unit weakly, so nothing forms a cycle: dropping the unit frees
        its memory at once. Released and revived with the gradient shard like any view."""
        found = self._grad_views.get(k)
        if found is None:
            found = self._grad_views[k] = self.grads().local(k, weak_unit=True)
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

    def __repr__(self) -> str:
        return (f"Unit({self.layout.key!r}, rank {self.rank}/{self.layout.world_size}, "
                f"S={self.layout.shard_numel}, {self.params.dtype})")
