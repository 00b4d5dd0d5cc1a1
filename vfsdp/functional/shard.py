"""``vfsdp.shard``: this rank's shards of a parameter tree, as views into per-unit DBuffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import optree
import torch

from vfsdp.collectives import comm
from vfsdp.collectives.dbuffer import DBuffer, owner_of
from vfsdp.collectives.groups import resolve_groups
from vfsdp.functional.tree import group_by_unit, match_tree
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec, unit_name

__all__ = ["shard", "release", "dbuffers", "unit_buffers", "UnitTensors"]

InitFn = Callable[[tuple, torch.Tensor, TensorSpec], Optional[torch.Tensor]]


def _check_full(x: Any, t: TensorSpec, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: {format_path(t.path)} should be a tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(t.shape):
        raise ValueError(f"{what}: {format_path(t.path)} has shape {tuple(x.shape)}, the spec "
                         f"says {tuple(t.shape)}; re-plan for this model")
    if x.dtype != t.dtype:
        raise ValueError(f"{what}: {format_path(t.path)} is {x.dtype}, the spec says {t.dtype}; "
                         f"cast it or re-plan")
    return x


def shard(
    params: Any,
    spec: ShardSpec,
    *,
    mesh: Any = None,
    src: Optional[int] = None,
    init_fn: Optional[InitFn] = None,
    requires_grad: bool = True,
) -> Any:
    """This rank's shards of ``params``: a tree of the same structure, of views into DBuffers.

    Every unit of the spec gets one parameter DBuffer holding this rank's ``S`` elements; each
    tensor leaf of the result is a leaf tensor aliasing its slice (shape: its local shape, 0
    rows on ranks that hold none of it). Non-tensor leaves pass through.

    Three ways to provide the values:

    * ``src=None``, real tensors on every rank: each rank copies its own pieces (no
      communication).
    * ``src=0``: real tensors on rank 0 only; other ranks pass a tree of the same structure
      (``meta`` tensors are fine). Rank 0 packs one unit at a time into its global buffer and
      scatters it (then broadcasts over HSDP replicas), so it never holds the model twice.
    * ``init_fn``: ``params`` may be ``meta``; each rank calls ``init_fn(path, local, tspec)``
      for each of its pieces, which fills ``local`` in place or returns its values.

    Args:
        params: The parameter tree the spec was planned for.
        spec: The plan.
        mesh: A ``DeviceMesh`` matching ``spec.mesh_shape``; default: the default group.
        src: ``0`` to read full tensors on rank 0 only.
        init_fn: Per-piece initialiser (exclusive with ``src``).
        requires_grad: Make floating-point shards require grad.

    Returns:
        The tree of local shards.

    Raises:
        ValueError: a tree, shape or dtype mismatch (naming the path), a spec planned for
            another world size or mesh, or ``src`` other than ``None``/``0``.
        RuntimeError: no process group.

    Example:
        >>> spec = vfsdp.plan(params, dist.get_world_size())   # doctest: +SKIP
        >>> shards = vfsdp.shard(params, spec)                 # doctest: +SKIP
    """
    if src not in (None, 0):
        raise ValueError(f"src must be None (full tensors everywhere) or 0, got {src!r}")
    if src is not None and init_fn is not None:
        raise ValueError("pass either src=0 or init_fn, not both")
    leaves = match_tree(params, spec, "vfsdp.shard")
    groups = resolve_groups(spec, mesh)
    rank0 = groups.shard_rank == 0 and groups.replicate_rank == 0
    out = list(leaves)
    with torch.no_grad():
        for key, members in group_by_unit(spec).items():
            db = DBuffer(spec, key, groups)
            by_path = {t.path: (i, t) for i, t in members}
            if src == 0:
                _scatter_unit(db, by_path, leaves, groups, rank0)
            for k, t in enumerate(db.tensors):
                if t.path not in by_path:
                    continue
                i, _ = by_path[t.path]
                local = db.local(k)
                if init_fn is not None:
                    got = init_fn(t.path, local, t)
                    if got is not None:
                        local.copy_(torch.as_tensor(got).reshape(local.shape))
                elif src is None:
                    full = _check_full(leaves[i], t, "vfsdp.shard")
                    lo, hi = t.local_range(groups.shard_rank)
                    local.copy_(full.detach().reshape(-1)[lo:hi].reshape(local.shape))
                if requires_grad and local.is_floating_point():
                    local.requires_grad_(True)
                out[i] = local
    return optree.tree_unflatten(spec.treespec, out)


def _scatter_unit(db: DBuffer, by_path, leaves, groups, rank0: bool) -> None:
    """Rank 0 packs the unit and scatters equal segments; replicas get a broadcast."""
    chunks = None
    if groups.replicate_rank == 0:
        if rank0:
            buf = db.alloc_global().data
            buf.zero_()
            for t in db.tensors:
                if t.path in by_path:
                    full = _check_full(leaves[by_path[t.path][0]], t, "vfsdp.shard(src=0)")
                    buf[t.offset:t.offset + t.numel].copy_(full.detach().reshape(-1))
            chunks = list(buf.chunk(db.layout.world_size))
        comm.scatter_into(db.shard, chunks, group=groups.shard, group_src=0)
        if rank0:
            db.free_global()
    if groups.replicate is not None:
        comm.broadcast_(db.shard, group=groups.replicate, group_src=0)


def dbuffers(tree: Any, spec: ShardSpec) -> dict:
    """``unit key -> parameter DBuffer`` for the shards in ``tree`` (units whose leaves alias one).

    Raises:
        ValueError: the tree does not match the spec.
    """
    leaves = match_tree(tree, spec, "vfsdp.dbuffers")
    out = {}
    for key, members in group_by_unit(spec).items():
        for i, _ in members:
            db = owner_of(leaves[i]) if isinstance(leaves[i], torch.Tensor) else None
            if db is not None and db.key == key and db.role.startswith("param"):
                out[key] = db
                break
    return out


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


def release(tree: Any, spec: ShardSpec) -> None:
    """Free the global (gathered) buffers of the units in ``tree``; views stay valid objects.

    ``tree`` may be the shards or the gathered full tree. After this, full tensors must not be
    read until the next ``gather``.

    Example:
        >>> full = vfsdp.gather(shards, spec); loss = f(full); vfsdp.release(shards, spec)  # doctest: +SKIP
    """
    leaves = match_tree(tree, spec, "vfsdp.release")
    seen = set()
    for key, members in group_by_unit(spec).items():
        for i, _ in members:
            db = _owner_any(leaves[i])
            if db is not None and db.key == key and id(db) not in seen:
                seen.add(id(db))
                db.free_global()


def _owner_any(t: Any) -> Optional[DBuffer]:
    return owner_of(t) if isinstance(t, torch.Tensor) else None
