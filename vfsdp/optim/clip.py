"""Global gradient-norm clipping over sharded gradients, exact with padding, empty ranks and HSDP."""

from __future__ import annotations

from typing import Any

import torch

import optree

from vfsdp.collectives import comm
from vfsdp.collectives.dbuffer import owner_of
from vfsdp.collectives.groups import resolve_groups
from vfsdp.functional.gather import wait_reductions
from vfsdp.functional.tree import group_by_unit, match_tree
from vfsdp.planner.spec import ShardSpec

__all__ = ["clip_grad_norm", "global_norm"]


def global_norm(grads: Any, spec: ShardSpec, *, mesh: Any = None) -> torch.Tensor:
    """The 2-norm of all gradients across ranks (a replicated fp32 scalar tensor).

    Each rank sums the squares of its gradient pieces (one reduction per unit when they are a
    gradient DBuffer's views; padding is zero and adds nothing, an empty shard adds nothing);
    one all-reduce over the shard group adds the ranks' sums. Over HSDP's replicate dim the
    gradients are already identical, so they are not added again.

    Raises:
        ValueError: the tree does not match the spec.
    """
    wait_reductions()
    leaves = match_tree(grads, spec, "vfsdp.clip_grad_norm")
    groups = resolve_groups(spec, mesh)
    total = torch.zeros((), dtype=torch.float32, device=groups.device)
    for key, members in group_by_unit(spec).items():
        pieces = [leaves[i] for i, _ in members if isinstance(leaves[i], torch.Tensor)]
        gdb = owner_of(pieces[0]) if pieces else None
        if gdb is not None and gdb.role == "grad" and len(pieces) == len(members) and all(
                owner_of(p) is gdb for p in pieces):
            total += gdb.shard.float().pow(2).sum()
        else:
            for p in pieces:
                total += p.float().pow(2).sum()
    comm.all_reduce_(total, "sum", groups.shard)
    return total.sqrt()


def clip_grad_norm(grads: Any, spec: ShardSpec, max_norm: float, *, mesh: Any = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """Scale the gradients in place so their global 2-norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: multiply by
    ``min(1, max_norm / (norm + eps))``.

    Args:
        grads: This rank's gradient pieces (``vfsdp.grads(shards, spec)``: scaled in place).
        spec: The plan.
        max_norm: The largest allowed norm.
        mesh: A ``DeviceMesh`` matching the spec; default: the default group.
        eps: Added to the norm before dividing.

    Returns:
        The norm before clipping, as a plain replicated fp32 scalar tensor.

    Raises:
        ValueError: ``max_norm`` is negative, or the tree does not match the spec.

    Example:
        >>> norm = vfsdp.clip_grad_norm(vfsdp.grads(shards, spec), spec, 1.0)  # doctest: +SKIP
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    norm = global_norm(grads, spec, mesh=mesh)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    with torch.no_grad():
        for g in optree.tree_leaves(grads):
            if isinstance(g, torch.Tensor):
                g.mul_(coef.to(g.dtype))
    return norm
