"""What :func:`vfsdp.scatter` gives each rank, computed through the units' global buffers (pack,
cut into ``m`` equal shards, read each tensor's piece at its ``shard_range``): an independent
route to :func:`vfsdp.functional.shard_reference`'s answer."""

from __future__ import annotations

from typing import Any

import optree

from vfsdp.functional import match_tree, unit_buffer_reference
from vfsdp.placements import local_shape
from vfsdp.planner import ShardSpec


def scatter_reference(params: Any, spec: ShardSpec) -> list[Any]:
    """Every rank's shards after :func:`vfsdp.scatter`, one tree per rank (every unit whole).

    Example:
        >>> spec = vfsdp.plan({"a": torch.empty(3), "b": torch.empty(2, 2)}, 2)
        >>> [{k: v.tolist() for k, v in t.items()}
        ...  for t in scatter_reference({"a": torch.arange(3.0), "b": torch.ones(2, 2)}, spec)]
        [{'a': [0.0, 1.0, 2.0], 'b': [1.0]}, {'a': [], 'b': [1.0, 1.0, 1.0]}]
    """
    leaves = match_tree(params, spec, "scatter_reference")
    per_rank = [list(leaves) for _ in range(spec.world_size)]
    for key, members in spec.unit_leaves().items():
        layout = spec.units[key]
        buf = unit_buffer_reference(params, spec, key)
        s = layout.shard_numel
        for r in range(spec.world_size):
            shard = buf[r * s:(r + 1) * s]
            for i, k in members:
                t = layout.tensors[k]
                lo, hi = t.shard_range(r)
                per_rank[r][i] = shard[lo:hi].clone().reshape(local_shape(t.placement, t.shape, r))
    return [optree.tree_unflatten(spec.treespec, leaves_r) for leaves_r in per_rank]
