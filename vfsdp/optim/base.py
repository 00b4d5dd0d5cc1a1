"""The optimizer protocol (optax-style, in place on DBuffers) and the flat views it works on.

An optimizer is an :class:`Optimizer`: ``state = opt.init(shards, spec)`` and
``state = opt.update(grads, state, shards, spec)``, which updates the parameter shards in
place, as a few fused ops over each unit's flat buffer. ``opt.granularity`` tells the planner
which blocks it needs intact (``None``: any).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple, Optional, Union

import torch

from vfsdp.collectives.dbuffer import DBuffer, owner_of
from vfsdp.functional.gather import wait_reductions
from vfsdp.functional.shard import dbuffers
from vfsdp.functional.tree import group_by_unit, match_tree
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["Optimizer", "Schedule", "as_schedule", "unit_buffers", "flat_grads", "UnitTensors"]

Schedule = Union[float, Callable[[int], float]]


class Optimizer(NamedTuple):
    """``init(shards, spec) -> state`` and ``update(grads, state, shards, spec) -> state``."""

    init: Callable[..., Any]
    update: Callable[..., Any]
    granularity: Any = None


def as_schedule(value: Schedule) -> Callable[[int], float]:
    """A learning-rate schedule: a plain callable of the (1-based) step, or a constant."""
    if callable(value):
        return value
    return lambda step: float(value)


@dataclass(frozen=True)
class UnitTensors:
    """One unit's parameter DBuffer and, for each tensor, its path and buffer index."""

    key: Hashable
    db: DBuffer
    leaves: tuple  # (leaf index in the spec, buffer index)


def unit_buffers(shards: Any, spec: ShardSpec, what: str) -> list[UnitTensors]:
    """The parameter DBuffer of every unit of ``shards``.

    Raises:
        ValueError: a unit's shards are not views into a DBuffer (pass ``vfsdp.shard``'s tree).
    """
    dbs = dbuffers(shards, spec)
    out = []
    for key, members in group_by_unit(spec).items():
        db = dbs.get(key)
        if db is None:
            raise ValueError(f"{what}: the shards of unit {unit_name(key)} (e.g. "
                             f"{format_path(members[0][1].path)}) are not views into a DBuffer; "
                             f"pass the tree returned by vfsdp.shard")
        out.append(UnitTensors(key, db, tuple((i, db.index(t.path)) for i, t in members)))
    return out


def flat_grads(grads: Any, spec: ShardSpec, unit: UnitTensors, what: str) -> torch.Tensor:
    """The unit's gradient as one flat ``S``-element tensor in the parameter layout.

    Zero-copy when ``grads`` are the gradient DBuffer's views (``vfsdp.grads``); otherwise the
    pieces are copied (one contiguous copy per tensor) into a zeroed flat tensor.
    """
    wait_reductions()
    leaves = match_tree(grads, spec, what) if not isinstance(grads, list) else grads
    gdb = unit.db.grad_buffer()
    if all(owner_of(leaves[i]) is gdb and gdb.is_local_view(k, leaves[i]) for i, k in unit.leaves):
        return gdb.shard
    flat = torch.zeros_like(unit.db.shard)
    for i, k in unit.leaves:
        g = leaves[i]
        t = unit.db.tensors[k]
        lo, hi = t.shard_range(unit.db.rank)
        if g is None:
            continue
        if g.numel() != hi - lo:
            raise ValueError(f"{what}: gradient of {format_path(t.path)} has {g.numel()} "
                             f"elements, this rank's shard has {hi - lo}")
        flat[lo:hi].copy_(g.reshape(-1))
    return flat


def maybe_schedule(step: int, value: Optional[Schedule]) -> Optional[float]:
    return None if value is None else as_schedule(value)(step)
