"""The sharded gradients and the DBuffers behind a shards tree."""

from __future__ import annotations

from typing import Any

import optree
import torch

from vfsdp.functional.gather import wait_reductions
from vfsdp.functional.shard import dbuffers
from vfsdp.functional.tree import group_by_unit, match_tree
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec
from vfsdp.planner.spec import unit_name

__all__ = ["grads", "zero_grads"]


def grads(shards: Any, spec: ShardSpec) -> Any:
    """This rank's sharded gradients: a tree of views into each unit's gradient DBuffer.

    After a backward through :func:`vfsdp.gather` (with ``grads="buffer"`` or the default),
    these hold the reduce-scattered gradients; units that had no backward yet hold zeros.

    Raises:
        ValueError: the tree does not match the spec, or a unit's shards are not views into
            a DBuffer (pass the tree returned by :func:`vfsdp.shard`).

    Example:
        >>> loss.backward(); g = vfsdp.grads(shards, spec)   # doctest: +SKIP
    """
    leaves = match_tree(shards, spec, "vfsdp.grads")
    dbs = dbuffers(shards, spec)
    wait_reductions()
    out = list(leaves)
    for key, members in group_by_unit(spec).items():
        db = dbs.get(key)
        if db is None:
            raise ValueError(f"vfsdp.grads: the shards of unit {unit_name(key)} (e.g. "
                             f"{format_path(members[0][1].path)}) are not views into a DBuffer; "
                             f"pass the tree returned by vfsdp.shard")
        gdb = db.grad_buffer()
        gdb.ensure_shard()
        for i, t in members:
            out[i] = gdb.local(db.index(t.path))
    return optree.tree_unflatten(spec.treespec, out)


def zero_grads(shards: Any, spec: ShardSpec, *, set_to_none: bool = True) -> None:
    """Zero every unit's gradients and drop any unsharded accumulator.

    Args:
        shards: The shards tree.
        spec: The plan.
        set_to_none: Release the gradient shards' memory until the next backward writes them
            (like ``optimizer.zero_grad(set_to_none=True)``; reading them through
            :func:`grads` before then gives zeros). ``False`` zero-fills them in place.
    """
    wait_reductions()
    for db in dbuffers(shards, spec).values():
        gdb = db.grad_buffer()
        if set_to_none:
            gdb.release_shard()
        else:
            with torch.no_grad():
                gdb.ensure_shard().zero_()
        for (role, _), comp in db._companions.items():
            if role == "accum":
                comp.free_global()
