"""Thin wrappers over the ``torch.distributed`` tensor collectives vfsdp uses.

A group of one rank runs no collective: the wrappers copy locally (or do nothing), as
FSDP2 does, and still count the call. Only collectives that work on gloo, NCCL and the
in-process threaded backend are used: the
equal-segment ``all_gather_single`` / ``reduce_scatter_single`` (2.13's names for
``all_gather_into_tensor`` / ``reduce_scatter_tensor``), ``all_reduce``, ``broadcast``,
equal-size ``scatter`` and ``all_to_all_single`` (uneven splits work there). Every call counts
itself in :data:`COUNTS` (per thread), which tests and benchmarks read to assert "one
collective per unit".

Async handles, and the CUDA communication stream (explicit events, never ``record_stream``).

On CUDA, collectives are issued from a dedicated communication stream that first waits for the
current (compute) stream; an event recorded after them is what :meth:`Handle.wait` makes the
compute stream wait on. Buffers stay alive because their DBuffer owns them, and a DBuffer never
frees its global buffer while a handle on it is pending (it waits first), so the caching
allocator never needs ``record_stream``. On gloo (and the threaded backend) the collectives
return work objects and ``wait`` blocks on them.

Process groups for a spec: the shard group (FSDP) and, for HSDP, the replicate group.

A spec planned for ``m`` (or ``(R, m)``) runs on:

* a ``DeviceMesh`` of shape ``(m,)`` or ``(R, m)``: its last dim shards, its first replicates;
* or ``mesh=None``: the default process group, whose size must be ``m`` (or ``R*m``, in
  which case vfsdp builds and caches the ``(R, m)`` mesh: ranks ``[i*m, (i+1)*m)`` shard
  together).

Ranks agree on the spec: checked once per spec and process group, with one small collective.

Every rank of a mesh must run the same plan: the all-gathers and reduce-scatters of a unit pair
up by order and size only, so two ranks with different layouts of the same size would silently
exchange the wrong elements, and different sizes abort the process. The first time a spec is
used on a group (``vfsdp.shard``, ``vfsdp.scatter``, ...), every rank all-gathers the spec's
32-byte fingerprint over the shard group (and the replicate group under HSDP). On a mismatch
the ranks exchange a short description of each unit and every rank raises, naming the first
unit that differs. Each rank remembers the result, per spec and group.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["all_gather_into", "reduce_scatter_into", "all_reduce_", "all_reduce_max_",
           "scatter_into", "broadcast_", "all_to_all_into", "check_op", "counts", "reset_counts",
           "in_collective", "collective_scope", "REDUCE_OPS", "Handle", "launch",
           "MeshGroups", "resolve_groups", "device_for", "default_mesh", "world_mesh", "use_device",
           "control_device", "host_groups", "side_group", "agree_on_spec", "SpecMismatch"]


class Handle:
    """The result of an async operation; ``wait()`` returns it once the collectives are done.

    Args:
        works: Work objects of async collectives (may be empty).
        finish: Called once after the works complete; its return value is the result.
        event: A CUDA event to make the current stream wait on.

    Example:
        >>> def body():
        ...     t = torch.ones(2) * (dist.get_rank() + 1)
        ...     h = Handle([dist.all_reduce(t, async_op=True)], finish=lambda: t.tolist())
        ...     return h.done, h.wait(), h.done
        >>> vfsdp.testing.simulate(2, body)
        [(False, [3.0, 3.0], True), (False, [3.0, 3.0], True)]
        >>> Handle(finish=lambda: "no collectives").wait()
        'no collectives'
    """

    def __init__(self, works: Iterable[Any] = (), finish: Optional[Callable[[], Any]] = None,
                 event: Optional[torch.cuda.Event] = None) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._event = event
        self._done = False
        self._result: Any = None

    def wait(self) -> Any:
        """Block (or make the current CUDA stream wait) until done; return the result."""
        if not self._done:
            with collective_scope():  # the backend may finish its copies here (gloo's async RS)
                for w in self._works:
                    w.wait()
            if self._event is not None:
                torch.cuda.current_stream().wait_event(self._event)
            self._works = []
            self._done = True
            self._result = self._finish() if self._finish is not None else None
            self._finish = None
        return self._result

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has completed."""
        return self._done

    def __repr__(self) -> str:
        return f"Handle({'done' if self._done else 'pending'})"


@functools.cache
def _comm_stream(device: torch.device):
    return torch.cuda.Stream(device=device, priority=-1)


def launch(device: torch.device, fn: Callable[[bool], Any], async_op: bool = False,
           finish: Optional[Callable[[], Any]] = None) -> Handle:
    """Run ``fn(works)``, which issues collectives, on the communication stream (CUDA; it
    first waits for the current stream) or as it is (CPU): ``works`` tells ``fn`` to issue
    them asynchronously and return their work (off CUDA, when ``async_op``).

    Returns:
        A :class:`Handle` of them and ``finish``: already waited for unless ``async_op``.
    """
    works = async_op and device.type != "cuda"  # CUDA: the streams order them
    stream = _comm_stream(device) if device.type == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.stream(stream):  # None: a no-op
        work = fn(works)
        event = stream.record_event() if stream is not None else None
    handle = Handle([work] if works else [], finish, event)
    if not async_op:
        handle.wait()
    return handle


class _PerThread(threading.local):
    """What this thread (rank) keeps: its caches of groups and meshes, its forced device,
    its collective depth and its counts."""

    def __init__(self) -> None:
        # made once: ("mesh", shape, names), ("host", grid), ("side",), ("axes", mesh id, axes)
        # of several axes (mesh.axis_of), ("agreed", id(spec), grid): checked -> (owner, made)
        self.cached: dict = {}
        self.stack: list = []  # meshes entered with vfsdp.lax.use_mesh
        self.observers: list = []  # of DBuffer events (dbuffer.observe)
        self.device: Optional[torch.device] = None
        self.depth = 0
        self.counts: Counter = Counter()


_TLS = _PerThread()


@atexit.register
def _forget_groups() -> None:
    """Drop the main thread's cached groups (the side group, offload's host groups, meshes)
    while the interpreter still runs: a gloo group first freed during the interpreter's
    finalization can abort the process ("terminate called without an active exception")
    after its work is done."""
    _TLS.__init__()


@dataclasses.dataclass(frozen=True)
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
    before = _TLS.device
    _TLS.device = None if device is None else torch.device(device)
    try:
        yield
    finally:
        _TLS.device = before


def control_device(device: torch.device) -> torch.device:
    """Where small control exchanges whose values vfsdp reads (spec agreement, the backward's
    marks) run: ``device``, or the CPU when buffers are on ``meta`` (no values there)."""
    return torch.device("cpu") if device.type == "meta" else device


def device_for(group=None) -> torch.device:
    """The device of vfsdp's buffers: the one :func:`use_device` set on this thread, else
    ``cuda:<current>`` when the group's backend is NCCL, else ``cpu``."""
    if _TLS.device is not None:
        return _TLS.device
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _from_mesh(mesh, spec: ShardSpec) -> MeshGroups:
    names, model, group = tuple(mesh.mesh_dim_names or ()), spec.model_axis, None
    if model is not None and model[0] in names and spec.mesh_dim_names is not None:
        # the full mesh of a plan(..., tp=rule): run on its data axes, keep the model axis group
        axis, size, index = model
        here = int(mesh.get_local_rank(axis))
        if here != index:
            raise ValueError(f"the spec is of {axis}={index}'s pieces but this rank is {axis}={here} "
                             f"of the mesh; plan on each rank with its own mesh coordinate "
                             f"(vfsdp.plan(params, mesh, tp=rule) reads it)")
        if int(mesh.mesh.shape[names.index(axis)]) != size:
            raise ValueError(f"the spec splits over {size} {axis!r} ranks, the mesh has "
                             f"{int(mesh.mesh.shape[names.index(axis)])}; re-plan for this mesh")
        data, group = spec.mesh_dim_names, mesh.get_group(axis)
        mesh = mesh[data] if len(data) > 1 else mesh[data[0]]
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
    grid = tuple(map(tuple, mesh.mesh.reshape(-1, shape[-1]).tolist()))
    return MeshGroups(shard, replicate, dist.get_rank(shard), shape[-1],
                      dist.get_rank(replicate) if replicate is not None else 0, len(grid),
                      device_for(shard), grid, group)


def resolve_groups(spec: ShardSpec, mesh: Optional[Any] = None, check: bool = True,
                   build: bool = True) -> MeshGroups:
    """The groups a spec's collectives use on this rank.

    The first time a spec is used on a process group, every rank checks (one small
    collective) that all ranks hold the same spec (:mod:`vfsdp.collectives.comm`).

    Args:
        spec: A plan.
        mesh: A ``DeviceMesh`` matching ``spec.mesh_shape``, or ``None`` for the default group.
        check: Check that the ranks agree on the spec (once per spec and group).
        build: Build the default group's 2-D mesh if this rank has none yet; ``False``
            (while ``torch.compile`` traces, which cannot make process groups): refuse.

    Returns:
        A :class:`MeshGroups`.

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: the group or mesh does not match the world size the spec was planned for,
            the ranks hold different specs (naming the first unit that differs), or a mesh
            to build with ``build=False``.

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
    if mesh is None:
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
                             f"{spec.mesh_dim_names or spec.mesh_shape}; pass the mesh it was "
                             f"planned on (mesh=vfsdp.mesh(..., ({axis!r}, {size}))) so vfsdp runs "
                             f"over the data axes only")
        if world != want:
            raise ValueError(
                f"the spec was planned for mesh {spec.mesh_shape} ({want} ranks) but the default "
                f"process group has {world}; re-plan with vfsdp.plan(params, {world}) or pass the "
                f"matching DeviceMesh"
            )
    if mesh is None and len(spec.mesh_shape) == 1:
        groups = MeshGroups(None, None, dist.get_rank(), world, 0, 1, device_for(),
                            (tuple(range(world)),))
    else:
        found = mesh if mesh is not None else default_mesh(spec, build)
        if found is None:
            raise ValueError(f"the spec runs on a {spec.mesh_shape} mesh over the default group, "
                             f"whose groups this rank has not made yet and cannot make while "
                             f"torch.compile traces; pass mesh= the DeviceMesh the shards were "
                             f"made on")
        groups = _from_mesh(found, spec)
    if check:
        agree_on_spec(spec, groups)
    return groups


def default_mesh(spec: ShardSpec, build: bool = True):
    """The ``DeviceMesh`` of ``spec.mesh_shape`` over the default group (built once, cached;
    ``build=False``: ``None`` where not built yet).

    The last dim shards: ranks ``[i*m, (i+1)*m)`` shard together.

    Raises:
        ValueError: a spec of more than 2 dims (naming the 2-D plan with the same ranks).
    """
    if len(spec.mesh_shape) > 2:
        raise ValueError(f"vfsdp runs 1-D (FSDP) and 2-D (HSDP) meshes over the default "
                         f"group, and the spec was planned for {spec.mesh_shape}: plan for "
                         f"({spec.replicas}, {spec.world_size}) (replicate, shard), the same "
                         f"ranks and the same shards")
    return world_mesh(spec.mesh_shape, ("replicate", "shard")[-len(spec.mesh_shape):], build)


def world_mesh(shape: tuple, names: tuple, build: bool = True):
    """The ``DeviceMesh`` of ``shape`` with dim ``names`` over the default group, built once
    per group and kept (building one creates process groups), on :func:`device_for`'s device
    type (the CPU for ``meta``, whose small exchanges need values); ``build=False``: the one
    kept, or ``None``."""
    from torch.distributed.device_mesh import init_device_mesh

    return _cached(("mesh", tuple(shape), tuple(names)), (lambda: init_device_mesh(
        control_device(device_for()).type, tuple(shape), mesh_dim_names=tuple(names))) if build else None)


def _cached(key: Any, make: Optional[Callable[[], Any]], owner: Any = None) -> Any:
    """``make()``, made once per ``key`` on this thread and kept while ``owner``
    (default: the default process group; a new one makes it again) is the one it was made for
    (``make=None``: ``None`` where none is kept)."""
    owner = dist.group.WORLD if owner is None else owner
    entry = _TLS.cached.get(key)
    if entry is None or entry[0] is not owner:
        if make is None:
            return None
        entry = _TLS.cached[key] = (owner, make())
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
    def make() -> MeshGroups:
        rows = [dist.new_group(list(row), backend="gloo") for row in groups.grid]
        cols = ([dist.new_group(list(col), backend="gloo") for col in zip(*groups.grid)]
                if groups.replicate is not None else None)
        return dataclasses.replace(groups, shard=rows[groups.replicate_rank], device=torch.device("cpu"),
                                   replicate=None if cols is None else cols[groups.shard_rank])

    return _cached(("host", groups.grid), make)


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
    return _cached(("side",), lambda: dist.new_group(backend="gloo"))


class SpecMismatch(ValueError):
    """Ranks of one mesh hold different specs."""


def _digest(obj: Any) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:12]


def _describe(spec: ShardSpec) -> list:
    """What the fingerprint covers, part by part: each unit (its size, and a digest of its
    layout: tensors, offsets, blocks, alignment, placements), then the tree and mesh."""
    return [(f"unit {unit_name(u.key)}",
             f"m={u.world_size}, S={u.shard_numel}, {u.dtype}, {len(u.paths)} tensors",
             _digest((u.paths, u.offsets, u.numels, u.shapes, u.blocks, u.alignment,
                      [t._key() for t in u.tensors]))) for u in spec.units.values()] + [
        ("the tree and mesh", f"mesh {spec.mesh_shape}, {spec.treespec.num_leaves} leaves",
         _digest((str(spec.treespec), spec.mesh_shape, spec.mesh_dim_names)))]


def _check(spec: ShardSpec, group, device: torch.device) -> None:
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = control_device(device)
    mine = torch.frombuffer(bytearray(bytes.fromhex(spec.fingerprint)), dtype=torch.uint8).to(device)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    all_gather_into(every, mine, group, count="spec_check")
    rows = every.view(world, -1).cpu()
    if bool((rows == rows[0]).all()):
        return
    described: list = [None] * world
    dist.all_gather_object(described, _describe(spec), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    raise SpecMismatch(f"ranks hold different specs{_difference(described, ranks)}")


_FIX = "every rank must plan the same tree the same way (same shapes, granularity and units)"


def _difference(described: list, ranks: list) -> str:
    """How the first rank whose :func:`_describe` differs from the first one's differs: its
    first unit that differs, else its number of units, else the tree and mesh."""
    first = described[0]
    for r, other in zip(ranks[1:], described[1:]):
        a, b = next(((a, b) for a, b in zip(first[:-1], other[:-1]) if a != b), (None, None))
        if a is not None and a[:2] == b[:2]:
            return (f": {a[0]} ({a[1]}) has the same size on rank {ranks[0]} and rank {r} but a "
                    f"different layout (its tensors, their offsets, block sizes, alignment or "
                    f"placements: e.g. another granularity); {_FIX}")
        if a is not None:
            return f": {a[0]} is ({a[1]}) on rank {ranks[0]} but {b[0]} is ({b[1]}) on rank {r}; {_FIX}"
        if len(first) != len(other):
            return f": rank {ranks[0]} has {len(first) - 1} units, rank {r} has {len(other) - 1}; {_FIX}"
        if first[-1] != other[-1]:
            return (f": the units agree but the tree structure or the mesh differs ({first[-1][1]} on "
                    f"rank {ranks[0]}, {other[-1][1]} on rank {r}); {_FIX}")
    return f" (the same units and layouts; their leaves differ); {_FIX}"


def agree_on_spec(spec: ShardSpec, groups: MeshGroups) -> None:
    """Collective, once per spec and group: every rank holds this spec.

    Raises:
        SpecMismatch: on every rank, naming the first unit that differs.
    """
    # by identity, not the fingerprint: a rank that plans again runs the check again, so an
    # equal re-plan on one rank meets a different one on another inside the check (every
    # rank raises), not inside the next collective; forgotten when the spec goes
    def check() -> bool:
        for group in (groups.shard, groups.replicate)[:2 if groups.replicate is not None else 1]:
            _check(spec, group, groups.device)
        if key not in _TLS.cached:  # (checked again under a new default group: one finalizer)
            weakref.finalize(spec, _TLS.cached.pop, key, None)
        return True

    key = ("agreed", id(spec), groups.grid)
    _cached(key, check)


REDUCE_OPS = ("sum", "avg")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def collective_scope(t: Optional[torch.Tensor] = None) -> Iterator[None]:
    """Marks the enclosed work as part of a collective (e.g. waiting on an async one), so op
    counters can leave it out. With ``t`` (the collective's tensor) on CUDA under
    ``vfsdp.testing.simulate`` (rank threads sharing one GPU through the threaded group, whose
    collectives copy between the threads' tensors on the host's schedule, not the streams'),
    the device is synchronized before and after, so every rank's writes are complete when
    another rank's thread reads them."""
    sync = t is not None and t.is_cuda and tp.groups_are_per_thread()
    _TLS.depth += 1
    try:
        if sync:
            torch.cuda.synchronize(t.device)
        yield
        if sync:
            torch.cuda.synchronize(t.device)
    finally:
        _TLS.depth -= 1


def in_collective() -> bool:
    """Whether this thread is inside a vfsdp collective call right now."""
    return _TLS.depth > 0


def counts() -> Counter:
    """Collectives issued by this thread (rank) since the last :func:`reset_counts`.

    Returns:
        A ``Counter``: per collective name, calls, and under ``"<name>_bytes"`` the bytes
            they moved. It is the live counter, not a copy.

    Raises:
        KeyError: never for a name not issued: a ``Counter`` gives 0 for it. (Counting
            needs no process group.)

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     reset_counts()
        ...     vfsdp.gather(shards, spec)
        ...     return dict(counts()), counts()["reduce_scatter"]
        >>> vfsdp.testing.simulate(2, body)[0]
        ({'all_gather': 1, 'all_gather_bytes': 32}, 0)
    """
    return _TLS.counts


def reset_counts() -> None:
    """Zero this thread's (rank's) :func:`counts`.

    Raises:
        RuntimeError: never: it clears a thread-local counter, with or without a process
            group, and touches no other rank's.

    Example:
        >>> def body():
        ...     t = torch.ones(2)
        ...     all_reduce_(t, "sum")
        ...     before = counts()["all_reduce"]
        ...     reset_counts()
        ...     return before, counts()["all_reduce"]
        >>> vfsdp.testing.simulate(2, body)
        [(1, 0), (1, 0)]
    """
    counts().clear()


def check_op(op: str):
    """The ``ReduceOp`` of a reduce op vfsdp supports (``"sum"``, ``"avg"``).

    Args:
        op: The op's name.

    Returns:
        ``dist.ReduceOp.SUM`` or ``dist.ReduceOp.AVG``.

    Raises:
        ValueError: any other value.

    Example:
        >>> check_op("sum") == dist.ReduceOp.SUM
        True
        >>> check_op("max")
        Traceback (most recent call last):
        ...
        ValueError: reduce op must be one of ('sum', 'avg'), got 'max'
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
    return dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG


def _issue(count: str, nbytes: int, group, out: torch.Tensor, call: Callable[[], Any],
           async_op: bool = False, inp: Optional[torch.Tensor] = None) -> Any:
    """Count one collective (``nbytes`` under ``count``) and run ``call()`` (the backend's
    collective writing ``out``). A group of this rank alone runs none: ``out`` gets ``inp``
    by a local copy (if given and not the same memory; op counters leave it out, as the
    backend's). Returns the work when ``async_op`` (a done :class:`Handle` alone), else ``out``."""
    counts().update({count: 1, f"{count}_bytes": nbytes})
    if dist.get_world_size(group) == 1:  # this rank alone: no call into the backend (as FSDP2)
        if inp is not None and (out.data_ptr() != inp.data_ptr() or out.dtype != inp.dtype):
            with torch.no_grad(), collective_scope():
                out.copy_(inp.reshape(out.shape))
        return Handle() if async_op else out
    with collective_scope(out):
        work = call()
    return work if async_op else out


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False,
                    count: str = "all_gather"):
    """``out`` (m*S) <- every rank's ``inp`` (S), in rank order (counted under ``count``)."""
    return _issue(count, out.nbytes, group, out,
                  lambda: _all_gather(out, inp, group=group, async_op=async_op), async_op, inp)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, op: str = "sum", group=None,
                        async_op: bool = False):
    """``out`` (S) <- ``op`` over ranks of their ``inp[r*S:(r+1)*S]``."""
    rop = check_op(op)
    return _issue("reduce_scatter", inp.nbytes, group, out,
                  lambda: _reduce_scatter(out, inp, op=rop, group=group, async_op=async_op), async_op, inp)


def all_reduce_(t: torch.Tensor, op: str = "sum", group=None):
    """In-place all-reduce; ``avg`` is SUM then a division (gloo has no AVG all-reduce)."""
    check_op(op)
    _issue("all_reduce", t.nbytes, group, t, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group))
    if op == "avg" and (n := dist.get_world_size(group)) > 1:
        t.div_(n)
    return t


def all_reduce_max_(t: torch.Tensor, group=None, count: str = "all_reduce_max",
                    async_op: bool = False):
    """In-place element-wise MAX over ranks (counted under ``count``); ``async_op``: return
    the work (``wait()`` it before reading ``t``)."""
    return _issue(count, t.nbytes, group, t, lambda: dist.all_reduce(
        t, op=dist.ReduceOp.MAX, group=group, async_op=async_op), async_op)


def scatter_into(out: torch.Tensor, chunks: Optional[list], group=None, group_src: int = 0):
    """Equal-size scatter from ``group_src`` (``chunks`` there, ``None`` elsewhere)."""
    return _issue("scatter", out.nbytes, group, out, lambda: dist.scatter(
        out, chunks, group=group, group_src=group_src), inp=chunks[0] if chunks else None)


def all_to_all_into(out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list,
                    group=None, async_op: bool = False, count: str = "all_to_all"):
    """``all_to_all_single`` with uneven splits (element counts per rank; counted under
    ``count``).

    Returns:
        ``out``, or the work object when ``async_op``.
    """
    return _issue(count, inp.nbytes, group, out, lambda: dist.all_to_all_single(
        out, inp, out_splits, in_splits, group=group, async_op=async_op), async_op, inp)


def broadcast_(t: torch.Tensor, group=None, group_src: int = 0):
    return _issue("broadcast", t.nbytes, group, t,
                  lambda: dist.broadcast(t, group=group, group_src=group_src))
