"""Reference semantics of ``shard`` and ``gather`` over pytrees: loops over ranks, no process group.

* ``unit_buffer_reference(params, spec, key)``: the unit's global ``m*S`` buffer, each tensor
  flattened at its planned offset, zeros in the padding.
* ``shard_reference(params, spec)``: what every rank holds: ``result[r]`` mirrors ``params``,
  with rank ``r``'s local piece (a tensor of its placement's local shape) at every tensor leaf.
* ``gather_reference(per_rank, spec)``: the full tree back from the per-rank pieces.

The distributed implementations are tested against these.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import optree
import torch

from vfsdp.functional.scatter import check_full
from vfsdp.functional.tree import match_tree
from vfsdp.placements.reference import assemble_reference, split_reference
from vfsdp.planner.spec import PASSTHROUGH, ShardSpec, TensorSpec

__all__ = ["unit_buffer_reference", "shard_reference", "gather_reference"]


def unit_buffer_reference(params: Any, spec: ShardSpec, key: Hashable) -> torch.Tensor:
    """The unit's global flat buffer of ``m * S`` elements (padding zero).

    Args:
        params: Full tensors, shaped like the spec's tree.
        spec: The plan.
        key: The unit key.

    Returns:
        A new 1-D tensor of ``m * S`` elements in the unit's dtype.

    Raises:
        ValueError: a tree, shape or dtype mismatch (naming the path).
        KeyError: no such unit, or a unit only partly in this spec.

    Example:
        >>> spec = vfsdp.plan({"a": torch.empty(3), "b": torch.empty(2)}, 2)
        >>> unit_buffer_reference({"a": torch.ones(3), "b": 2 * torch.ones(2)}, spec, ()).tolist()
        [1.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0]
    """
    leaves = match_tree(params, spec, "unit_buffer_reference")
    by_path = {s.path: leaf for s, leaf in zip(spec.leaves(), leaves) if isinstance(s, TensorSpec)}
    buf = torch.zeros(spec.units[key].padded_numel, dtype=spec.units[key].dtype)  # cpu: reference
    for t in spec.unit_tensors(key):
        buf[t.offset:t.offset + t.numel] = check_full(by_path[t.path], t, "unit_buffer_reference").reshape(-1)
    return buf


def shard_reference(params: Any, spec: ShardSpec) -> list[Any]:
    """Every rank's local pieces, as one tree per rank (clones; non-tensor leaves pass through).

    Args:
        params: Full tensors, shaped like the spec's tree.
        spec: The plan.

    Returns:
        ``[tree of rank 0, ..., tree of rank m-1]`` (the shard group's ranks).

    Raises:
        ValueError: a tree, shape or dtype mismatch (naming the path).

    Example:
        >>> spec = vfsdp.plan({"w": torch.empty(6)}, 3, granularity=2)
        >>> [t["w"].tolist() for t in shard_reference({"w": torch.arange(6.0)}, spec)]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0], []]
    """
    per_leaf = [  # per leaf, its value on each rank
        split_reference(check_full(leaf, s, "shard_reference"), s.placement)
        if isinstance(s, TensorSpec) else [leaf] * spec.world_size
        for s, leaf in zip(spec.leaves(), match_tree(params, spec, "shard_reference"))]
    return [optree.tree_unflatten(spec.treespec, [v[r] for v in per_leaf])
            for r in range(spec.world_size)]  # a tree without leaves too


def gather_reference(per_rank: Sequence[Any], spec: ShardSpec) -> Any:
    """Reassemble full tensors from every rank's pieces (non-tensor leaves from rank 0).

    Args:
        per_rank: One tree of local pieces per rank of the shard group.
        spec: The plan.

    Returns:
        The tree of full tensors.

    Raises:
        ValueError: wrong number of ranks, or a tree that does not match the spec.

    Example:
        >>> spec = vfsdp.plan({"w": torch.empty(6)}, 3, granularity=2)
        >>> gather_reference(shard_reference({"w": torch.arange(6.0)}, spec), spec)["w"].tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    if len(per_rank) != spec.world_size:
        raise ValueError(f"gather_reference: expected {spec.world_size} ranks, got {len(per_rank)}")
    by_leaf = list(zip(*(match_tree(t, spec, "gather_reference") for t in per_rank)))
    return optree.tree_unflatten(spec.treespec, [
        pieces[0] if s is PASSTHROUGH else assemble_reference(list(pieces), s.placement, s.shape)
        for s, pieces in zip(spec.leaves(), by_leaf)])
