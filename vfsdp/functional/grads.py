"""The sharded gradients and the DBuffers behind a shards tree."""

from __future__ import annotations

from typing import Any

import optree
import torch

from vfsdp.functional.gather import wait_reductions
from vfsdp.functional.shard import dbuffers, unit_buffers
from vfsdp.functional.tree import match_tree
from vfsdp.planner.spec import ShardSpec

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
    wait_reductions()
    out = list(leaves)
    for u in unit_buffers(shards, spec, "vfsdp.grads"):
        gdb = u.db.grad_buffer()
        gdb.ensure_shard()
        for i, k in u.leaves:
            out[i] = gdb.local(k)
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
