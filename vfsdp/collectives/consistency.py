"""Ranks agree on the spec: checked once per spec and process group, with one small collective.

Every rank of a mesh must run the same plan: the all-gathers and reduce-scatters of a unit pair
up by order and size only, so two ranks with different layouts of the same size would silently
exchange the wrong elements, and different sizes abort the process. The first time a spec is
used on a group (``vfsdp.shard``, ``vfsdp.scatter``, ...), every rank all-gathers the spec's
32-byte fingerprint over the shard group (and the replicate group under HSDP). On a mismatch
the ranks exchange a short description of each unit and every rank raises, naming the first
unit that differs. The result is remembered on the spec, per group.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch
import torch.distributed as dist

from vfsdp.collectives import comm
from vfsdp.collectives.groups import MeshGroups, control_device
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["agree_on_spec", "SpecMismatch"]


class SpecMismatch(ValueError):
    """Ranks of one mesh hold different specs."""


def _digest(obj: Any) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:12]


def _describe(spec: ShardSpec) -> list:
    """What the fingerprint covers, part by part: each unit (its size, and a digest of its
    layout: tensors, offsets, blocks, alignment, placements), then the tree and mesh."""
    parts = []
    for u in spec.units.values():
        keys = [t._key() for t in u.tensors]
        parts.append((f"unit {unit_name(u.key)}",
                      f"m={u.world_size}, S={u.shard_numel}, {u.dtype}, {len(u.paths)} tensors",
                      _digest((u.paths, u.offsets, u.numels, u.shapes, u.blocks, u.alignment,
                               keys))))
    parts.append(("the tree and mesh", f"mesh {spec.mesh_shape}, {spec.treespec.num_leaves} "
                  f"leaves", _digest((str(spec.treespec), spec.mesh_shape, spec.mesh_dim_names))))
    return parts


def _check(spec: ShardSpec, group, device: torch.device) -> None:
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = control_device(device)
    mine = torch.frombuffer(bytearray(bytes.fromhex(spec.fingerprint)), dtype=torch.uint8)
    mine = mine.to(device)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    comm.all_gather_into(every, mine, group, count="spec_check")
    rows = every.view(world, -1).cpu()
    if bool((rows == rows[0]).all()):
        return
    described: list = [None] * world
    dist.all_gather_object(described, _describe(spec), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    fix = "every rank must plan the same tree the same way (same shapes, granularity and units)"
    first = described[0]
    for r, other in enumerate(described[1:], 1):
        # units first (the tree and mesh, last, only if every unit agrees)
        pairs = list(zip(first[:-1], other[:-1]))
        if len(first) == len(other):
            pairs.append((first[-1], other[-1]))
        for a, b in pairs:
            if a == b:
                continue
            if a[0] == b[0] == "the tree and mesh":
                raise SpecMismatch(f"ranks hold different specs: the units agree but the tree "
                                   f"structure or the mesh differs ({a[1]} on rank {ranks[0]}, "
                                   f"{b[1]} on rank {ranks[r]}); {fix}")
            if a[0] == b[0] and a[1] == b[1]:
                raise SpecMismatch(
                    f"ranks hold different specs: {a[0]} ({a[1]}) has the same size on rank "
                    f"{ranks[0]} and rank {ranks[r]} but a different layout (its tensors, their "
                    f"offsets, block sizes, alignment or placements: e.g. another granularity); "
                    f"{fix}")
            raise SpecMismatch(f"ranks hold different specs: {a[0]} is ({a[1]}) on rank "
                               f"{ranks[0]} but {b[0]} is ({b[1]}) on rank {ranks[r]}; {fix}")
        if len(first) != len(other):
            raise SpecMismatch(f"ranks hold different specs: rank {ranks[0]} has "
                               f"{len(first) - 1} units, rank {ranks[r]} has {len(other) - 1}; "
                               f"{fix}")
    raise SpecMismatch(f"ranks hold different specs (the same units and layouts; their leaves "
                       f"differ); {fix}")


# This process's record of the specs its ranks checked, per world and grid (the spec itself is
# never written: a plan is data).
_AGREED: dict = {}  # id(spec) -> {(id(world), grid): the world}, while the spec lives


def agree_on_spec(spec: ShardSpec, groups: MeshGroups) -> None:
    """Collective, once per spec and group: every rank holds this spec.

    Raises:
        SpecMismatch: on every rank, naming the first unit that differs.
    """
    world = dist.group.WORLD
    key = (id(world), groups.grid)
    agreed = _AGREED.get(id(spec))
    if agreed is None:  # by identity: equal specs of two simulated ranks are two records
        agreed = _AGREED[id(spec)] = {}
        weakref.finalize(spec, _AGREED.pop, id(spec), None)
    ref = agreed.get(key)
    if ref is not None and ref() is world:
        return
    _check(spec, groups.shard, groups.device)
    if groups.replicate is not None:
        _check(spec, groups.replicate, groups.device)
    try:
        agreed[key] = weakref.ref(world)
    except TypeError:  # a process group without weak references: remember it by identity
        agreed[key] = lambda w=world: w
