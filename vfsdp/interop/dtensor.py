"""DTensor interop: shards as DTensors where DTensor can express their layout, and back.

torch 2.13 has no ragged placement. A tensor's RaggedShard is a DTensor placement only when
it happens to coincide with one DTensor knows:

* world size 1 (or each HSDP replica holding everything): ``Replicate()``;
* every rank's piece equal to ``torch.chunk``'s row split: ``Shard(0)``.

Those tensors become DTensors that **share memory** with the DBuffer (no copy). For the
others (ragged ones), :func:`to_dtensor` refuses by default, or with
``ragged="redistribute"`` builds an even ``Shard(0)`` copy (one ``all_to_all_single`` per
unit), or with ``ragged="keep"`` leaves the local shard as it is.

Why vfsdp does not label ragged shards with a custom DTensor ``Placement``: on torch 2.13
such a DTensor supports only ``to_local()`` and DCP (with hooks). ``redistribute``,
``full_tensor``, element-wise ops, ``_foreach_*`` and optimizers, reductions
(``sum``, ``vector_norm``, ``clip_grad_norm_``), autograd through ``from_local``,
``local_map`` and ``deepcopy`` all fail, and ``num_shards``/``is_sharded`` silently report a
replicated tensor. Use vfsdp's own functions on ragged
shards (``vfsdp.gather``, ``vfsdp.clip_grad_norm``, ``vfsdp.checkpoint``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from vfsdp.collectives.agree import agreed
from vfsdp.collectives.comm import default_mesh, resolve_groups
from vfsdp.collectives.dbuffer import DBuffer
from vfsdp.collectives.redistribute import flat_redistribute, shard0_range
from vfsdp.functional.scatter import make_shards
from vfsdp.functional.tree import match_tree, units_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

RAGGED = ("error", "redistribute", "keep")


def dtensor_placement(t: TensorSpec) -> Optional[Placement]:
    """``Replicate()`` or ``Shard(0)`` when ``t``'s layout is one of them, else ``None``.

    Args:
        t: A tensor's spec (``spec.tensor(path)``).

    Returns:
        The DTensor placement over the shard dim that describes ``t`` exactly, or ``None``.

    Raises:
        AttributeError: ``t`` is not a :class:`vfsdp.TensorSpec` (e.g. a whole ``ShardSpec``:
            pass ``spec.tensor(path)``). Every layout gets an answer.

    Example:
        >>> spec = vfsdp.plan({"w": torch.empty(8, 4)}, 2)
        >>> vfsdp.dtensor_placement(spec.tensor(("w",)))
        Shard(dim=0)
    """
    m = t.world_size
    if m == 1:
        return Replicate()
    return Shard(0) if bool(t.shape) and all(t.local_range(r) == shard0_range(tuple(t.shape), m, r)
                                             for r in range(m)) else None


def _from_local(local: torch.Tensor, mesh: Any, places: list, shape: tuple) -> DTensor:
    return DTensor.from_local(local, mesh, places, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def to_dtensor(shards: Any, spec: ShardSpec, *, mesh: Any = None, ragged: str = "error") -> Any:
    """The shards as DTensors: zero-copy views where DTensor can express the layout.

    Args:
        shards: ``vfsdp.shard``'s tree.
        spec: Its spec.
        mesh: The ``DeviceMesh`` (default: built over the default group for the spec's mesh;
            required, with the model axis, for a plan split by ``tp=``).
        ragged: What to do with tensors whose layout DTensor cannot express: ``"error"``,
            ``"redistribute"`` (an even ``Shard(0)`` copy; later changes to the shards do
            not show; not for ``tp=`` plans) or ``"keep"`` (leave the local shard).

    Returns:
        A tree of the same structure of DTensors (placements ``[Shard(0)]`` or
            ``[Replicate()]``; HSDP: ``[Replicate(), ...]``). For a plan split over a model axis
            (TP x FSDP), DTensors of the **global** shape on the full mesh, e.g.
            ``[Shard(0), Shard(1)]`` on ``(dp, tp)`` for a column-split weight, where DTensor
            can express the layout (the model split even, and not along dim 0 when the data axes
            also cut rows); elsewhere an error says why.

    Raises:
        ValueError: a ragged tensor with ``ragged="error"`` (naming it and its placement),
            or an unknown ``ragged``.

    Example:
        >>> def body():
        ...     params = {"w": torch.arange(8.0).reshape(4, 2), "b": torch.arange(3.0)}
        ...     spec = vfsdp.plan(params, 2)          # "b" is ragged: all 3 on rank 0
        ...     shards = vfsdp.shard(params, spec)
        ...     dts = vfsdp.to_dtensor(shards, spec, ragged="redistribute")
        ...     return dts["b"].placements, dts["b"].full_tensor().tolist()
        >>> vfsdp.testing.simulate(2, body)[0]
        ((Shard(dim=0),), [0.0, 1.0, 2.0])
    """
    if ragged not in RAGGED:
        raise ValueError(f"ragged must be one of {RAGGED}, got {ragged!r}")
    leaves = match_tree(shards, spec, "vfsdp.to_dtensor")
    axis = spec.model_axis[0] if spec.model_axis else None
    if axis is not None and axis not in (getattr(mesh, "mesh_dim_names", None) or ()):
        raise ValueError(f"vfsdp.to_dtensor: the spec is split over the {axis!r} axis; pass "
                         f"mesh= the DeviceMesh it was planned on (with {axis!r})")
    device_mesh = mesh if mesh is not None else default_mesh(spec)
    out = list(leaves)
    for u in units_of(leaves, spec, "vfsdp.to_dtensor"):
        moved = []
        for i, k in u.leaves:
            t = u.db.tensors[k]
            places = _placements(t, spec, device_mesh, ragged)
            if places is not None:
                out[i] = _from_local(u.db.local(k), device_mesh, places, t.global_shape)
            elif ragged == "redistribute":
                moved.append((i, k, t))
        if moved:
            _even_copies(u.db, moved, out, device_mesh, [Replicate()] * (len(spec.mesh_shape) - 1))
    return optree.tree_unflatten(spec.treespec, out)


def _placements(t: TensorSpec, spec: ShardSpec, mesh: Any, ragged: str) -> Optional[list]:
    """The DTensor placements of ``t`` on ``mesh`` (over the data axes, and the model axis of
    a ``tp=`` plan), or ``None`` where DTensor has none and ``ragged`` allows that.

    Raises:
        ValueError: no placements, with ``ragged="error"`` (for a ``tp=`` plan, unless
            ``"keep"``), saying why.
    """
    data = dtensor_placement(t)
    if spec.model_axis is None:
        if data is None and ragged == "error":
            raise ValueError(_ragged_message(t))
        return None if data is None else [Replicate()] * (len(spec.mesh_shape) - 1) + [data]
    # DTensor's Shard cuts like torch.chunk, vfsdp's model split like torch.tensor_split: they
    # agree when the dim divides evenly (or chunk happens to give the same sizes). DTensor
    # applies mesh dims in order, so the data axes' Shard(0) of a piece already cut along dim 0
    # by the model axis (model-major) has no placement either.
    axis, st = spec.model_axis[0], t.strided
    chunk = st.dim is not None and tuple(b - a for a, b in (
        shard0_range((st.global_shape[st.dim],), st.size, r) for r in range(st.size)))
    model = Replicate() if st.dim is None else Shard(st.dim) if chunk == st.lengths else None
    why = "" if model is not None else (f"its {st.describe()} split gives lengths {st.lengths}, "
                                        f"DTensor's Shard({st.dim}) (torch.chunk) {chunk}")
    if isinstance(data, Shard) and isinstance(model, Shard) and model.dim == 0:
        data, why = None, (f"the data axes split its {axis}-piece by rows too "
                           f"({axis}-major); DTensor orders mesh dims data-major")
    elif data is None:
        why = _ragged_message(t).split(": ", 1)[1].split("; pass", 1)[0]
    if data is not None and model is not None:
        return [model if name == axis else data if name == spec.mesh_dim_names[-1]
                else Replicate() for name in mesh.mesh_dim_names]
    if ragged == "keep":
        return None
    raise ValueError(f"vfsdp.to_dtensor: {format_path(t.path)} has no DTensor layout: {why}. "
                     f"Pass ragged='keep' for the local shard, or save with "
                     f"vfsdp.checkpoint.save, which stores it exactly")


def _ragged_message(t: TensorSpec) -> str:
    m, shape = t.world_size, tuple(t.shape)
    need = ([shard0_range(shape, m, r) for r in range(m)] if shape else "a dim to split")
    have = [t.local_range(r) for r in range(m)]
    return (f"vfsdp.to_dtensor: {format_path(t.path)} {shape} is {t.placement!r} (flat ranges "
            f"{have}), which no DTensor placement expresses (Shard(0) needs {need}); pass "
            f"ragged='redistribute' for an even Shard(0) copy, or ragged='keep'")


def _even_copies(db: DBuffer, moved: list, out: list, device_mesh, lead: list) -> None:
    m = db.layout.world_size
    src = [[t.local_range(r) for r in range(m)] for _, _, t in moved]
    dst = [[shard0_range(tuple(t.shape), m, r) if t.shape else (0, t.numel) for r in range(m)]
           for _, _, t in moved]  # a 0-d tensor: replicated
    pieces = flat_redistribute([db.local(k).detach() for _, k, _ in moved], src, dst,
                               db.groups.shard, db.device)
    for (i, _, t), piece in zip(moved, pieces):
        if t.shape:  # this rank's rows of the even split
            rows = piece.numel() // max(1, math.prod(t.shape[1:]))
            local, place = piece.view(rows, *t.shape[1:]), Shard(0)
        else:
            local, place = piece.view(()), Replicate()
        out[i] = _from_local(local, device_mesh, lead + [place], t.shape)


def _source_ranges(x: Any, t: TensorSpec, rank: int, m: int, t_mesh: tuple) -> tuple[list, torch.Tensor]:
    """Per-rank source ranges of a DTensor (or full tensor) leaf, and this rank's piece."""
    path = format_path(t.path)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"vfsdp.from_dtensor: {path} should be a DTensor or tensor, got "
                         f"{type(x).__name__}")
    if tuple(x.shape) != tuple(t.shape) or x.dtype != t.dtype:
        raise ValueError(f"vfsdp.from_dtensor: {path} is {tuple(x.shape)} {x.dtype}, the "
                         f"spec says {tuple(t.shape)} {t.dtype}")
    full = (x.to_local() if isinstance(x, DTensor) else x).detach()
    if isinstance(x, DTensor):
        *lead, last = x.placements
        mesh_shape = tuple(x.device_mesh.shape)
        if len(mesh_shape) != len(t_mesh) or mesh_shape[-1] != m:
            raise ValueError(f"vfsdp.from_dtensor: {path} lives on a mesh of shape {mesh_shape}, "
                             f"the spec was planned for {t_mesh}")
        if any(not isinstance(p, Replicate) for p in lead):
            raise ValueError(f"vfsdp.from_dtensor: {path} has placements {[*lead, last]}; every dim "
                             f"but the last (shard) mesh dim must be Replicate()")
        if type(last) is Shard and last.dim == 0:
            if x.device_mesh.get_local_rank(len(mesh_shape) - 1) != rank:
                raise ValueError(f"vfsdp.from_dtensor: {path}'s mesh orders the shard dim "
                                 f"differently from the spec's groups; pass mesh= (the same "
                                 f"DeviceMesh) to from_dtensor")
            ranges = [shard0_range(tuple(t.shape), m, r) for r in range(m)]
            if full.numel() != ranges[rank][1] - ranges[rank][0]:
                raise ValueError(f"vfsdp.from_dtensor: {path}'s local shard has {full.numel()} "
                                 f"elements, Shard(0) on this rank needs "
                                 f"{ranges[rank][1] - ranges[rank][0]}")
            return ranges, full
        if not isinstance(last, Replicate):
            raise ValueError(f"vfsdp.from_dtensor: {path} has placement {last!r}; vfsdp reads "
                             f"Replicate() and Shard(0): call .redistribute(placements=[...,"
                             f" Shard(0)]) first")
    # replicated: every rank "holds" exactly what it needs (disjoint source ranges)
    ranges = [t.local_range(r) for r in range(m)]
    lo, hi = ranges[rank]
    return ranges, full.reshape(-1)[lo:hi]


def from_dtensor(tree: Any, spec: ShardSpec, *, mesh: Any = None,
                 requires_grad: bool = True) -> Any:
    """Shards (as ``vfsdp.shard`` returns) from DTensors with ``Shard(0)`` or ``Replicate()``.

    Leaves may also be full tensors (replicated). One ``all_to_all_single`` per unit moves
    the rows each rank needs; nothing is gathered in full.

    Args:
        tree: DTensors (or full tensors) shaped like the spec's tree.
        spec: The target plan.
        mesh: As for ``vfsdp.shard``.
        requires_grad: Make floating-point shards require grad.

    Returns:
        The tree of local shards (views into new DBuffers).

    Raises:
        ValueError: structure, shape or dtype mismatch, a placement other than
            ``Replicate()`` / ``Shard(0)``, or a mesh that does not match the spec (naming
            the path); every rank raises.

    Example:
        >>> def body():
        ...     from torch.distributed.device_mesh import init_device_mesh
        ...     from torch.distributed.tensor import Shard, distribute_tensor
        ...     mesh = init_device_mesh("cpu", (2,))
        ...     dt = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        ...     spec = vfsdp.plan({"w": dt}, mesh)
        ...     return vfsdp.from_dtensor({"w": dt}, spec, mesh=mesh)["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    """
    leaves = match_tree(tree, spec, "vfsdp.from_dtensor")
    if spec.model_axis is not None:
        raise ValueError(f"vfsdp.from_dtensor: the spec is split over the {spec.model_axis[0]!r} "
                         f"axis (tp=), which from_dtensor does not read; shard the global "
                         f"tensors with vfsdp.shard(params, spec, mesh=mesh), or load a "
                         f"vfsdp.checkpoint")
    groups = resolve_groups(spec, mesh)
    m, rank, leaf_specs = spec.world_size, groups.shard_rank, spec.leaves()
    found = agreed(lambda: {  # local checks first: a bad leaf on one rank must not hang the others
        key: [_source_ranges(leaves[i], leaf_specs[i], rank, m, spec.mesh_shape) for i, _ in members]
        for key, members in spec.unit_leaves().items()})

    def fill(db: DBuffer, members: list) -> None:  # one all_to_all_single moves the unit's rows
        src, pieces = zip(*found[db.layout.key])
        dst = [[db.tensors[k].local_range(r) for r in range(m)] for _, k in members]
        got = flat_redistribute([p.to(db.device) for p in pieces], list(src), dst, groups.shard,
                                db.device)
        for k, piece in dict(zip((k for _, k in members), got)).items():  # a tie: once
            db.local(k).reshape(-1).copy_(piece)

    return make_shards(spec, groups, leaves, fill, requires_grad)
