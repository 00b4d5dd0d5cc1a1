"""Process groups for a spec: the shard group (FSDP) and, for HSDP, the replicate group.

A spec planned for ``m`` (or ``(R, m)``) runs on:

* a ``DeviceMesh`` of shape ``(m,)`` or ``(R, m)``: its last dim shards, its first replicates;
* or ``mesh=None``: the default process group, whose size must be ``m`` (or ``R*m``, in
  which case vfsdp builds and caches the ``(R, m)`` mesh: ranks ``[i*m, (i+1)*m)`` shard
  together).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from vfsdp.planner.spec import ShardSpec

__all__ = ["MeshGroups", "resolve_groups", "device_for", "default_mesh", "world_mesh", "use_device",
           "control_device", "host_groups", "side_group"]

_CACHE = threading.local()


@dataclass(frozen=True)
class MeshGroups:
    """Where a spec's collectives run on this rank.

    Attributes:
        shard: Process group of the shard dim (``None`` means the default group).
        replicate: Process group of the replicate dim, or ``None`` for plain FSDP.
        shard_rank: This rank's index in the shard group.
        shard_size: The size of the shard group.
        replicate_rank: This rank's index in the replicate group (0 without one).
        replicate_size: The size of the replicate group (1 without one).
        device: Device for buffers (``cuda`` for NCCL, ``cpu`` otherwise).
        grid: Global ranks of the mesh, ``grid[replicate_rank][shard_rank]``.
        model: Process group of the spec's model axis (``spec.model_axis``: TP or EP) when
            the mesh it runs on has it, else ``None``.

    Example:
        >>> def body():                               # HSDP: 2 replicas of 2 shards
        ...     g = resolve_groups(vfsdp.plan({"w": torch.ones(8)}, (2, 2)))
        ...     return (g.replicate_rank, g.shard_rank), g.grid, g.coords(3)
        >>> vfsdp.testing.simulate(4, body)[2]
        ((1, 0), ((0, 1), (2, 3)), (1, 1))
    """

    shard: Any
    replicate: Any
    shard_rank: int
    shard_size: int
    replicate_rank: int
    replicate_size: int
    device: torch.device
    grid: tuple = ()
    model: Any = None

    def coords(self, global_rank: int) -> tuple[int, int]:
        """``(replicate_rank, shard_rank)`` of a global rank of the mesh.

        Raises:
            ValueError: the rank is not in the mesh.
        """
        for r, row in enumerate(self.grid):
            if global_rank in row:
                return r, row.index(global_rank)
        raise ValueError(f"rank {global_rank} is not in this mesh (ranks {self.grid})")


_DEVICE = threading.local()  # .device: set by use_device() on this thread (rank)


@contextlib.contextmanager
def use_device(device: Union[str, torch.device, None]) -> Iterator[None]:
    """Make :func:`device_for` answer ``device`` on this thread (rank) while the block runs.

    Every buffer vfsdp creates takes its device from the groups (``device_for``) or from its
    inputs, so this moves all of them: ``vfsdp.testing.simulate(..., device="cuda")`` runs
    rank threads on one GPU, and ``device="meta"`` makes any tensor created on another
    device (a missing ``device=``) fail at once, on a machine without a GPU.

    Args:
        device: A device (or its name); ``None`` restores the default rule.

    Returns:
        A context manager.

    Example:
        >>> with use_device("meta"):
        ...     device_for()
        device(type='meta')
    """
    before = getattr(_DEVICE, "device", None)
    _DEVICE.device = None if device is None else torch.device(device)
    try:
        yield
    finally:
        _DEVICE.device = before


def control_device(device: torch.device) -> torch.device:
    """Where small control exchanges whose values vfsdp reads (spec agreement, the backward's
    marks) run: ``device``, or the CPU when buffers are on ``meta`` (no values there)."""
    return torch.device("cpu") if device.type == "meta" else device


def device_for(group=None) -> torch.device:
    """The device of vfsdp's buffers: the one :func:`use_device` set on this thread, else
    ``cuda:<current>`` when the group's backend is NCCL, else ``cpu``."""
    forced = getattr(_DEVICE, "device", None)
    if forced is not None:
        return forced
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _data_mesh(mesh, spec: ShardSpec) -> tuple[Any, Any]:
    """``(data sub-mesh, model axis group)`` of a mesh that also has the spec's model axis
    (``vfsdp.plan(..., tp=rule)`` on the full mesh), else ``(mesh, None)``.

    Raises:
        ValueError: the mesh's index along the model axis is not the spec's.
    """
    names = tuple(mesh.mesh_dim_names or ())
    model = spec.model_axis
    if model is None or model[0] not in names or spec.mesh_dim_names is None:
        return mesh, None
    axis, size, index = model
    here = int(mesh.get_local_rank(axis))
    if here != index:
        raise ValueError(f"the spec is of {axis}={index}'s pieces but this rank is {axis}={here} "
                         f"of the mesh; plan on each rank with its own mesh coordinate "
                         f"(vfsdp.plan(params, mesh, tp=rule) reads it)")
    if int(mesh.mesh.shape[names.index(axis)]) != size:
        raise ValueError(f"the spec splits over {size} {axis!r} ranks, the mesh has "
                         f"{int(mesh.mesh.shape[names.index(axis)])}; re-plan for this mesh")
    data = spec.mesh_dim_names
    sub = mesh[data] if len(data) > 1 else mesh[data[0]]
    return sub, mesh.get_group(axis)


def _from_mesh(mesh, spec: ShardSpec) -> MeshGroups:
    mesh, model = _data_mesh(mesh, spec)
    shape = tuple(int(d) for d in mesh.mesh.shape)
    if shape != spec.mesh_shape:
        raise ValueError(
            f"the spec was planned for mesh {spec.mesh_shape} but runs on a DeviceMesh of shape "
            f"{shape}; re-plan with vfsdp.plan(params, mesh) for this mesh"
        )
    if len(shape) > 2:
        raise ValueError(f"vfsdp supports 1-D (FSDP) and 2-D (HSDP) meshes, got shape {shape}")
    shard = mesh.get_group(len(shape) - 1)
    replicate = mesh.get_group(0) if len(shape) == 2 else None
    grid = mesh.mesh.reshape(-1, shape[-1]).tolist()
    return MeshGroups(
        shard=shard,
        replicate=replicate,
        shard_rank=dist.get_rank(shard),
        shard_size=shape[-1],
        replicate_rank=dist.get_rank(replicate) if replicate is not None else 0,
        replicate_size=shape[0] if len(shape) == 2 else 1,
        device=device_for(shard),
        grid=tuple(tuple(int(r) for r in row) for row in grid),
        model=model,
    )


def resolve_groups(spec: ShardSpec, mesh: Optional[Any] = None, check: bool = True) -> MeshGroups:
    """The groups a spec's collectives use on this rank.

    The first time a spec is used on a process group, every rank checks (one small
    collective) that all ranks hold the same spec (:mod:`vfsdp.collectives.consistency`).

    Args:
        spec: A plan.
        mesh: A ``DeviceMesh`` matching ``spec.mesh_shape``, or ``None`` for the default group.
        check: Check that the ranks agree on the spec (once per spec and group).

    Returns:
        A :class:`MeshGroups`.

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: the group or mesh does not match the world size the spec was planned for,
            or the ranks hold different specs (naming the first unit that differs).

    Example:
        >>> def body():
        ...     g = resolve_groups(vfsdp.plan({"w": torch.ones(8)}, 2))
        ...     return g.shard_rank, g.shard_size, g.replicate, g.device
        >>> vfsdp.testing.simulate(2, body)
        [(0, 2, None, device(type='cpu')), (1, 2, None, device(type='cpu'))]
        >>> resolve_groups(vfsdp.plan({"w": torch.ones(8)}, 2))     # no process group here
        Traceback (most recent call last):
        ...
        RuntimeError: vfsdp needs an initialised process group ...
    """
    groups = _groups_for(spec, mesh)
    if check:
        from vfsdp.collectives.consistency import agree_on_spec  # (it builds on this module)

        agree_on_spec(spec, groups)
    return groups


def _groups_for(spec: ShardSpec, mesh: Optional[Any]) -> MeshGroups:
    if mesh is not None:
        return _from_mesh(mesh, spec)
    if not dist.is_initialized():
        raise RuntimeError(
            "vfsdp needs an initialised process group (torchrun, vfsdp.testing.spawn or "
            "vfsdp.testing.simulate); planning alone needs none"
        )
    world = dist.get_world_size()
    want = spec.world_size * spec.replicas
    if spec.model_axis is not None and world != want:
        axis, size, _ = spec.model_axis
        raise ValueError(f"the spec is of one {axis!r} index's pieces over the data axes "
                         f"{spec.mesh_dim_names or spec.mesh_shape}; pass the mesh it was planned "
                         f"on (mesh=vfsdp.mesh(..., ({axis!r}, {size}))) so vfsdp runs over the "
                         f"data axes only")
    if world != want:
        raise ValueError(
            f"the spec was planned for mesh {spec.mesh_shape} ({want} ranks) but the default "
            f"process group has {world}; re-plan with vfsdp.plan(params, {world}) or pass the "
            f"matching DeviceMesh"
        )
    if len(spec.mesh_shape) == 1:
        return MeshGroups(None, None, dist.get_rank(), world, 0, 1, device_for(),
                          (tuple(range(world)),))
    return _from_mesh(default_mesh(spec), spec)


def default_mesh(spec: ShardSpec):
    """The ``DeviceMesh`` of ``spec.mesh_shape`` over the default group (built once, cached).

    The last dim shards: ranks ``[i*m, (i+1)*m)`` shard together.

    Raises:
        ValueError: a spec of more than 2 dims (naming the 2-D plan with the same ranks).
    """
    if len(spec.mesh_shape) > 2:
        raise ValueError(f"vfsdp runs 1-D (FSDP) and 2-D (HSDP) meshes over the default "
                         f"group, and the spec was planned for {spec.mesh_shape}: plan for "
                         f"({spec.replicas}, {spec.world_size}) (replicate, shard), the same "
                         f"ranks and the same shards")
    return world_mesh(spec.mesh_shape, ("replicate", "shard")[-len(spec.mesh_shape):])


def world_mesh(shape: tuple, names: tuple):
    """The ``DeviceMesh`` of ``shape`` with dim ``names`` over the default group, built once
    per group and kept (building one creates process groups), on :func:`device_for`'s device
    type (the CPU for ``meta``, whose small exchanges need values)."""
    cache = getattr(_CACHE, "meshes", None)
    if cache is None:
        cache = _CACHE.meshes = {}
    key = (id(dist.group.WORLD), tuple(shape), tuple(names))
    entry = cache.get(key)
    if entry is None or entry[0] is not dist.group.WORLD:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = control_device(device_for()).type
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        entry = cache[key] = (dist.group.WORLD, mesh)
    return entry[1]


def host_groups(groups: MeshGroups) -> MeshGroups:
    """The groups of host (CPU) copies of a spec's buffers (``vfsdp.optim.offload``): the
    same groups when they already run on the CPU (gloo), else gloo groups over the same ranks
    (built once per mesh, by every rank in the same order: call it collectively).

    Args:
        groups: The device buffers' groups (``unit.groups``).

    Returns:
        A :class:`MeshGroups` whose ``device`` is the CPU.

    Raises:
        ValueError: buffers on ``meta`` (no values to copy), or a CUDA mesh with a model axis
            (TP/EP), whose host groups vfsdp does not build.

    Example:
        >>> def body():
        ...     g = resolve_groups(vfsdp.plan({"w": torch.ones(8)}, 2))
        ...     return host_groups(g) is g, host_groups(g).device
        >>> vfsdp.testing.simulate(2, body)[0]
        (True, device(type='cpu'))
    """
    if groups.device.type == "cpu":
        return groups
    if groups.device.type == "meta":
        raise ValueError("offload: the buffers are on meta, which holds no values to copy to "
                         "the host; offload real parameters")
    if groups.model is not None:
        raise ValueError("offload: a spec with a model axis (TP/EP) on a GPU needs host groups "
                         "for that axis, which vfsdp does not build; offload FSDP/HSDP specs, "
                         "or run the optimizer on the device")
    cache = getattr(_CACHE, "hosts", None)
    if cache is None:
        cache = _CACHE.hosts = {}
    found = cache.get(groups.grid)
    if found is None:
        rows = [dist.new_group(list(row), backend="gloo") for row in groups.grid]
        cols = ([dist.new_group(list(col), backend="gloo") for col in zip(*groups.grid)]
                if groups.replicate is not None else None)
        found = cache[groups.grid] = MeshGroups(
            rows[groups.replicate_rank], None if cols is None else cols[groups.shard_rank],
            groups.shard_rank, groups.shard_size, groups.replicate_rank, groups.replicate_size,
            torch.device("cpu"), groups.grid)
    return found


def side_group():
    """A gloo group over every rank that no collective but its caller's uses
    (``vfsdp.optim.offload``'s failure flag), so its exchanges never pair with one another
    rank is in the middle of. Built once per default group, by every rank: call it
    collectively.

    Returns:
        The process group.

    Raises:
        RuntimeError: no process group is initialised.

    Example:
        >>> def body():
        ...     flag = torch.tensor([float(dist.get_rank())])
        ...     dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=side_group())
        ...     return flag.item(), side_group() is side_group()
        >>> vfsdp.testing.simulate(2, body)
        [(1.0, True), (1.0, True)]
    """
    if not dist.is_initialized():
        raise RuntimeError("side_group: no process group is initialised; call it inside "
                           "vfsdp.testing.simulate/spawn or after init_process_group")
    entry = getattr(_CACHE, "side", None)
    if entry is None or entry[0] is not dist.group.WORLD:
        entry = _CACHE.side = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return entry[1]
