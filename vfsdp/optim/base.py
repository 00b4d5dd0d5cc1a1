"""The optimizer protocol (optax-style, in place on DBuffers) and the flat views it works on.

An optimizer is an :class:`Optimizer`: ``state = opt.init(shards, spec)`` and
``state = opt.update(grads, state, shards, spec)``, which updates the parameter shards in
place, as a few fused ops over each unit's flat buffer. ``opt.granularity`` tells the planner
which blocks it needs intact (``None``: any).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import torch

from vfsdp.collectives.dbuffer import owner_of
from vfsdp.functional.gather import wait_reductions
from vfsdp.functional.shard import UnitTensors, unit_buffers
from vfsdp.functional.tree import match_tree
from vfsdp.planner.granularity import format_path
from vfsdp.optim.schedules import constant
from vfsdp.planner.spec import ShardSpec

__all__ = ["Optimizer", "Schedule", "as_schedule", "unit_buffers", "grad_leaves", "flat_grads",
           "UnitTensors"]

Schedule = Union[float, Callable[[int], float]]


class Optimizer(NamedTuple):
    """``init(shards, spec) -> state`` and ``update(grads, state, shards, spec) -> state``."""

    init: Callable[..., Any]
    update: Callable[..., Any]
    granularity: Any = None


def as_schedule(value: Schedule) -> Callable[[int], float]:
    """A learning-rate schedule: a plain callable of the (1-based) step, or a constant."""
    return value if callable(value) else constant(float(value))


def grad_leaves(grads: Any, spec: ShardSpec, what: str) -> list:
    """The gradient tree's leaves in spec order (once per update), after pending reductions."""
    wait_reductions()
    return match_tree(grads, spec, what)


def flat_grads(leaves: list, unit: UnitTensors, what: str) -> torch.Tensor:
    """The unit's gradient as one flat ``S``-element tensor in the parameter layout.

    ``leaves`` come from :func:`grad_leaves`. Zero-copy when they are the gradient DBuffer's
    views (``vfsdp.grads``); otherwise the pieces are copied (one contiguous copy per tensor)
    into a zeroed flat tensor.
    """
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
