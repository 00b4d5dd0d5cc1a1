"""``vfsdp.scatter``: full tensors become this rank's shards, one unit at a time.

The public inverse of :func:`vfsdp.gather`. Each unit gets a new
:class:`~vfsdp.collectives.Unit`; its parameter shard is filled either from full tensors every
rank holds (each rank copies its own pieces, no communication) or from full tensors on one
source rank, which packs one unit at a time and scatters it
(:func:`vfsdp.collectives.scatter_unit`), so it never holds the model twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import optree
import torch
import torch.distributed as dist

from vfsdp.collectives import comm
from vfsdp.collectives.agree import agree
from vfsdp.collectives.comm import resolve_groups
from vfsdp.collectives.scatter import scatter_unit
from vfsdp.collectives.unit import Unit
from vfsdp.functional.traced import prepare
from vfsdp.functional.tree import match_tree
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["scatter", "check_full", "make_shards"]


def check_full(x: Any, t: TensorSpec, what: str, whole: bool = False) -> torch.Tensor:
    """``x`` if it is a full tensor matching ``t`` (shape and dtype), with real data. For a
    tensor a model axis splits (``t.strided``), ``x`` may be the global tensor (``whole``: must
    be, as on the source of such a plan, since every index's piece comes from it): its piece
    (a view) is returned.

    Raises:
        ValueError: naming the path, what was found and the fix.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: {format_path(t.path)} should be a tensor, got {type(x).__name__}")
    st = t.strided
    if whole and st is not None and tuple(x.shape) != st.global_shape:
        raise ValueError(f"{what}: {format_path(t.path)} has shape {tuple(x.shape)}; the source "
                         f"of a plan split over {st.axis!r} must hold the global tensors "
                         f"{st.global_shape} (every {st.axis} index's piece comes from it)")
    if st is not None and tuple(x.shape) == st.global_shape and st.dim is not None \
            and tuple(x.shape) != tuple(t.shape):
        x = x.narrow(st.dim, st.start, st.lengths[st.index])
    if tuple(x.shape) != tuple(t.shape):
        if st is not None:
            raise ValueError(f"{what}: {format_path(t.path)} has shape {tuple(x.shape)}; the "
                             f"spec wants the global {st.global_shape} or this rank's "
                             f"{st.describe()} piece {tuple(t.shape)}")
        raise ValueError(f"{what}: {format_path(t.path)} has shape {tuple(x.shape)}, the spec "
                         f"says {tuple(t.shape)}; re-plan for this model")
    if x.dtype != t.dtype:
        raise ValueError(f"{what}: {format_path(t.path)} is {x.dtype}, the spec says {t.dtype}; "
                         f"cast it or re-plan")
    if x.device.type == "meta":
        raise ValueError(f"{what}: {format_path(t.path)} is a meta tensor, which holds no "
                         f"values; pass real tensors (on the source rank), or shard with init_fn")
    return x


def _pieces_from_source(leaves: list, whole: dict, tensors: list, groups: Any,
                        src_index: int) -> None:
    """The source's model group (the ranks at its data coordinates, one per model index):
    each tensor's global values are broadcast from the source, and each rank keeps its own
    piece, which it then scatters to its index's data ranks (set-up: one broadcast per
    tensor; a rank holds its pieces plus one global tensor at a time)."""
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if not isinstance(t, TensorSpec):
                continue
            shape = t.strided.global_shape if t.strided is not None else tuple(t.shape)
            buf = whole[i].detach().contiguous() if i in whole else torch.empty(
                shape, dtype=t.dtype, device=groups.device)
            comm.broadcast_(buf, group=groups.model, group_src=src_index)
            if i not in whole:  # (the source's piece is already a view of the global tensor)
                leaves[i] = check_full(buf, t, "vfsdp.scatter").clone()  # this index's piece


def scatter(full_tree: Any, spec: ShardSpec, src: Optional[int] = 0, *, mesh: Any = None,
            requires_grad: bool = True) -> Any:
    """This rank's shards of full tensors: the inverse of :func:`vfsdp.gather`. Collective
    when ``src`` is a rank.

    Args:
        full_tree: The tree the spec was planned for, with full tensors on ``src`` (other
            ranks pass a tree of the same structure, ``meta`` tensors are fine, or ``None``,
            as ``torch.distributed.scatter`` takes it), or on every rank when ``src`` is
            ``None``.
        spec: The plan.
        src: The global rank holding the full tensors, or ``None``: every rank holds them
            and copies its own pieces (no communication, beyond the one-time check that the
            ranks agree on the spec). For a plan split over a model axis (``tp=``), ``src``
            holds the global tensors and broadcasts each, one at a time, to the ranks at its
            data coordinates (one per model index), which scatter their index's pieces.
        mesh: A ``DeviceMesh`` matching ``spec.mesh_shape``; default: the default group.
        requires_grad: Make floating-point shards require grad, except the frozen ones
            (``spec.frozen``: parameters with ``requires_grad=False``, which stay so).

    Returns:
        The tree of local shards, as :func:`vfsdp.shard` returns it.

    Raises:
        ValueError: a structure, shape or dtype mismatch or a meta tensor where values are
            needed (naming the path; with ``src``, every rank raises), or ``src`` not a rank
            of the mesh.
        RuntimeError: no process group.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.empty(6, device="meta")}, 3)
        ...     full = {"w": torch.arange(6.0)} if dist.get_rank() == 0 else \\
        ...         {"w": torch.empty(6, device="meta")}
        ...     return vfsdp.scatter(full, spec, src=0)["w"].tolist()
        >>> vfsdp.testing.simulate(3, body)
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0], []]
    """
    what = "vfsdp.scatter" if src is None or src == 0 else f"vfsdp.scatter(src={src})"
    source = src is None or dist.get_rank() == src
    # Off the source, None is fine (as torch.distributed.scatter takes it): the spec holds
    # the structure, and non-tensor leaves are the spec's own.
    if full_tree is None and src is not None:
        leaves = None if source else list(spec.leaves())  # None on the source: refused below
    else:
        leaves = match_tree(full_tree, spec, what)
    groups = resolve_groups(spec, mesh)
    tensors = spec.leaves()
    if src is None:
        for i, t in enumerate(tensors):
            if isinstance(t, TensorSpec):
                leaves[i] = check_full(leaves[i], t, what)

        def copy(db, members):  # each rank copies its own pieces
            for i, k in members:
                lo, hi = db.tensors[k].local_range(groups.shard_rank)
                local = db.local(k)
                local.copy_(leaves[i].detach().reshape(-1)[lo:hi].reshape(local.shape))

        return make_shards(spec, groups, leaves, copy, requires_grad)
    if not isinstance(src, int) or isinstance(src, bool):
        raise ValueError(f"{what}: src must be a global rank (int) or None, got {src!r}")
    error = None
    local_src, src_index = src, None
    if spec.model_axis is not None and spec.model_axis[1] > 1:
        if groups.model is None:  # the same on every rank: each raises
            raise ValueError(f"{what}: the plan is split over {spec.model_axis[0]!r}, but "
                             f"the mesh given has no such axis; pass the whole mesh "
                             f"(mesh=vfsdp.mesh(..., ({spec.model_axis[0]!r}, "
                             f"{spec.model_axis[1]}))), so the source can reach every "
                             f"index")
        # the rank at src's data coordinates and this rank's model index (it scatters this
        # index's pieces), and src's model index
        axis, _, index = spec.model_axis
        where = (mesh.mesh == src).nonzero().tolist()
        if not where:
            raise ValueError(f"{what}: rank {src} is not in this mesh (ranks {mesh.mesh.tolist()})")
        coord, k = where[0], tuple(mesh.mesh_dim_names).index(axis)
        src_index, coord[k] = coord[k], index
        local_src = int(mesh.mesh[tuple(coord)])
    coords = groups.coords(local_src)  # raises for a rank outside the mesh
    whole: dict = {}  # on the source: the full (with a model axis, global) tensors
    if full_tree is None and not source and any(not isinstance(t, TensorSpec)
                                                for t in tensors):
        error = ValueError(f"{what}: rank {dist.get_rank()} passed None, but the tree has "
                           f"leaves that are not tensors (their values are not in the "
                           f"spec); pass the tree there too (meta tensors are fine)")
    if dist.get_rank() == src:
        try:
            if leaves is None:
                raise ValueError(f"{what}: the full tensors are None on rank {src}, the "
                                 f"source; pass them there (the other ranks may pass None)")
            for i, t in enumerate(tensors):
                if isinstance(t, TensorSpec):
                    whole[i], leaves[i] = leaves[i], check_full(leaves[i], t, what, src_index is not None)
        except ValueError as exc:
            error = exc
    agree(error, error_type=ValueError)  # every rank raises, none waits in the scatter
    if src_index is not None and local_src == dist.get_rank():
        _pieces_from_source(leaves, whole, tensors, groups, src_index)
    errors = []

    def scatter_from_source(db, members):
        def pack(buf):
            for i, k in members:
                t = db.tensors[k]
                buf[t.offset:t.offset + t.numel].copy_(leaves[i].detach().reshape(-1))

        errors.append(scatter_unit(db, pack, coords))

    out = make_shards(spec, groups, leaves, scatter_from_source, requires_grad)
    agree(next((e for e in errors if e is not None), None))
    return out


def make_shards(spec: ShardSpec, groups: Any, leaves: list, fill: Callable, requires_grad: bool
                ) -> Any:
    """A new :class:`~vfsdp.collectives.Unit` per unit of ``spec``, its parameter shard
    written by ``fill(db, members)`` (``(leaf index, buffer index)`` of its tensors), and the
    shards tree of its local views (one tensor per buffer index: a tie stays one tensor);
    floating-point views require grad with ``requires_grad``, but the frozen ones
    (``spec.frozen``)."""
    out = list(leaves)
    units = {}
    with torch.no_grad():
        for key, members in spec.unit_leaves().items():
            unit = units[key] = Unit(spec.units[key], groups)  # the views' slots keep it alive
            db = unit.params
            fill(db, members)
            views = {k: db.local(k) for _, k in members}  # a tie stays one tensor
            for k, view in views.items():
                if requires_grad and view.is_floating_point() and db.tensors[k].path not in spec.frozen:
                    view.requires_grad_(True)
            for i, k in members:
                out[i] = views[k]
    prepare(spec, units)  # what a compiled step reads (vfsdp.functional.traced)
    return optree.tree_unflatten(spec.treespec, out)
