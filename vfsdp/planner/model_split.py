"""The model-parallel step of ``vfsdp.plan(..., tp=rule)``: global tensors to this rank's
pieces over a model axis (TP or EP), each with its :class:`StridedRaggedShard`.

Pure: a ``DeviceMesh`` is only read (its shape, names and this rank's coordinate), a tuple
of ``(name, size)`` axes with ``tp_index`` needs no process group at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import optree

from vfsdp.placements.strided import StridedRaggedShard
from vfsdp.planner.abstract import ShapeDtype, is_tensor_leaf, leaf_meta
from vfsdp.planner.granularity import format_path

__all__ = ["split_params"]


def _index_of(mesh: Any, axis: str, tp_index: Optional[int], size: int) -> int:
    if tp_index is None:
        if not hasattr(mesh, "get_local_rank"):
            raise ValueError(f"vfsdp.plan(..., tp=rule): with a mesh given as (name, size) axes, "
                             f"say which {axis!r} index this plan is for: tp_index=i (a "
                             f"DeviceMesh gives this rank's own)")
        tp_index = int(mesh.get_local_rank(axis))
    if isinstance(tp_index, bool) or not isinstance(tp_index, int) or not 0 <= tp_index < size:
        raise ValueError(f"vfsdp.plan: tp_index must be an int in [0, {size}) for the "
                         f"{size}-rank {axis!r} axis, got {tp_index!r}")
    return tp_index


def _placement(place: Any, path: tuple, shape: tuple) -> Optional[int]:
    """The dim of a ``Shard(dim)``, ``None`` for ``Replicate()``.

    Raises:
        ValueError: anything else, or a dim outside the tensor (naming the path).
    """
    kind = type(place).__name__
    if kind == "Replicate":
        return None
    if kind == "Shard" and isinstance(getattr(place, "dim", None), int):
        dim = place.dim
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"vfsdp.plan: tp rule gave Shard({dim}) for {format_path(path)} of "
                             f"shape {tuple(shape)}, which has no dim {dim}")
        return dim % len(shape)
    raise ValueError(f"vfsdp.plan: the tp rule returned {place!r} for {format_path(path)}; "
                     f"return torch.distributed.tensor.Shard(dim) or Replicate()")


def split_params(params: Any, mesh: Any, mesh_shape: tuple, mesh_names: Optional[tuple],
                 rule: Callable[[tuple], Any], axis: str, tp_index: Optional[int]) -> tuple:
    """Cut every tensor of ``params`` (global shapes) as ``rule`` says over ``axis``.

    Args:
        params: The global tree (tensors, meta tensors or :class:`ShapeDtype` leaves).
        mesh: The mesh as given to ``plan`` (a ``DeviceMesh`` is asked for this rank's
            coordinate when ``tp_index`` is ``None``).
        mesh_shape, mesh_names: Its shape and names.
        rule: ``path -> Shard(dim) | Replicate()``.
        axis: The model axis' name.
        tp_index: The index along ``axis`` to plan for (``None``: this rank's).

    Returns:
        ``(local, strided, data_shape, data_names)``: the tree with every tensor leaf replaced
        by a :class:`ShapeDtype` of its piece (ties kept: one object per tensor); per leaf
        (optree order) its :class:`StridedRaggedShard`, or ``None`` (not a tensor); the mesh
        shape without the model axis, and its dim names.

    Raises:
        ValueError: no named mesh, no such axis, no data axis left, a bad index or rule
            result (naming the path).
    """
    if not callable(rule):
        raise TypeError(f"vfsdp.plan: tp must be a rule path -> Shard(dim) | Replicate(), got "
                        f"{type(rule).__name__}")
    if not mesh_names or axis not in mesh_names:
        raise ValueError(f"vfsdp.plan(..., tp=rule) splits over the mesh axis {axis!r}, but the "
                         f"mesh has axes {mesh_names}; pass vfsdp.mesh(('dp', d), ({axis!r}, t)) "
                         f"or ((\"dp\", d), ({axis!r}, t)) with tp_index=, or tp_axis=")
    if len(mesh_names) < 2:
        raise ValueError(f"vfsdp.plan: the mesh {dict(zip(mesh_names, mesh_shape))} has no data "
                         f"axis besides {axis!r}; add one, of size 1 if need be: ('dp', 1)")
    d = mesh_names.index(axis)
    size = mesh_shape[d]
    index = _index_of(mesh, axis, tp_index, size)
    paths, leaves, treespec = optree.tree_flatten_with_path(params)
    local: list = []
    strided: list = []
    by_id: dict = {}
    for path, leaf in zip(paths, leaves):
        piece, st = leaf, None  # a non-tensor leaf passes through
        if is_tensor_leaf(leaf):
            shape, dtype, _ = leaf_meta(leaf)
            dim = _placement(rule(path), path, shape)
            st = StridedRaggedShard(axis, size, index, dim, shape)
            # a tie (the same tensor again) gets the first one's piece
            piece, st, first = by_id.setdefault(id(leaf), (ShapeDtype(st.local_shape, dtype), st, path))
            if dim != st.dim:
                raise ValueError(
                    f"vfsdp.plan: {format_path(path)} is the same tensor as "
                    f"{format_path(first)} (a tie), but tp= places it {_name(st.dim)} there "
                    f"and {_name(dim)} here; a tied tensor is one tensor with one placement: "
                    f"give both paths the same rule")
        local.append(piece)
        strided.append(st)
    return (optree.tree_unflatten(treespec, local), strided, mesh_shape[:d] + mesh_shape[d + 1:],
            mesh_names[:d] + mesh_names[d + 1:])


def _name(dim: Optional[int]) -> str:
    return "Replicate()" if dim is None else f"Shard({dim})"
