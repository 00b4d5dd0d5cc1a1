"""``save`` and ``load``: distributed checkpoints through ``torch.distributed.checkpoint``.

A save writes a DCP checkpoint into ``<path>.partial-<id>``, checksums it, adds the manifest
``vfsdp.json`` and renames the directory to ``<path>`` as its very last step: a save that
stops at any point leaves only a ``.partial-`` directory, which a load never takes for a
checkpoint. Each rank writes only its own pieces (HSDP: the first replica's), with no
collective over the data.

**Parts**: several plans in one checkpoint, named ``(tree, spec)`` parts saved and loaded
together.

A model can live on several plans at once: an expert-parallel MoE plans its router and dense
layers over every rank and its experts over the expert-data mesh (``dp`` x ``ep``). Such parts
are saved as **one** checkpoint (one atomic rename, one manifest, every chunk checksummed):
each part's entries are stored under its name (``experts.params.layers.0.w_up``), and the
manifest lists the parts with the mesh and plan each was saved from. Each part reshards on
load on its own, like a single tree: another data-parallel degree, another ``ep`` or ``tp``.

Parts are given as a dict ``{name: (tree, spec)}`` or ``{name: (tree, spec, mesh)}``, or a
list of such tuples (named ``"0"``, ``"1"``, ...). A load takes the same form and returns it,
with the loaded trees in place of the tuples.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "moe")
    >>> def body(dp, ep):
    ...     mesh = vfsdp.mesh(("dp", dp), ("ep", ep))
    ...     dense, experts = {"router": torch.ones(4, 2)}, {"w": torch.arange(8.0).reshape(2, 4)}
    ...     spec = vfsdp.plan(dense, dp * ep)                       # over every rank
    ...     e_spec = vfsdp.plan(experts, mesh, tp=lambda p: Shard(0), tp_axis="ep")
    ...     d = vfsdp.shard(dense, spec)
    ...     e = vfsdp.shard(experts, e_spec, mesh=mesh)
    ...     parts = {"rest": ({"params": d, "step": 3}, spec), "experts": (e, e_spec, mesh)}
    ...     if not os.path.exists(path):
    ...         return vfsdp.checkpoint.save(path, parts)
    ...     out = vfsdp.checkpoint.load(path, parts)              # each part reshards
    ...     return out["rest"]["step"], e["w"].tolist()         # this rank's expert, flat
    >>> _ = vfsdp.testing.simulate(4, body, 2, 2)                  # save: dp=2 x ep=2
    >>> vfsdp.testing.simulate(2, body, 1, 2)                      # load: dp=1 x ep=2
    [(3, [0.0, 1.0, 2.0, 3.0]), (3, [4.0, 5.0, 6.0, 7.0])]
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from vfsdp._torch_private import groups_are_per_thread
from vfsdp.checkpoint.atomic import commit, prepare
from vfsdp.checkpoint.entries import Entry, flatten, is_state_leaf, tensor_bytes, unflatten
from vfsdp.checkpoint.storage import (
    CheckpointError,
    SafeReader,
    VerifyingLoadPlanner,
    agree,
    agreed,
    checksum_items,
    dcp_state,
    match_manifest,
    read_manifest,
    single_layout,
    verify_files,
    write_manifest,
)
from vfsdp.collectives.comm import control_device, device_for
from vfsdp.collectives.dbuffer import slot_of
from vfsdp.functional.pieces import Planned
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, unit_name

_PENDING: dict = {}   # rank thread -> AsyncSave still running (one dict operation at a time)
_ASYNC_GROUPS: dict = {}


class AsyncSave:
    """A save running in the background (from ``save(..., async_save=True)``).

    The data was copied when ``save`` returned, so training may change the parameters
    at once. ``wait()`` blocks until the checkpoint is committed and re-raises its error.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "step1")
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.arange(8.0)}, 2)
        ...     shards = vfsdp.shard({"w": torch.arange(8.0)}, spec)
        ...     pending = vfsdp.checkpoint.save(path, shards, spec, async_save=True)
        ...     with torch.no_grad():
        ...         shards["w"].zero_()                  # safe: the data was copied
        ...     return pending.wait() == path, pending.done()
        >>> vfsdp.testing.simulate(2, body)
        [(True, True), (True, True)]
    """

    def __init__(self, future: concurrent.futures.Future, path: str) -> None:
        self._future, self.path = future, path

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until committed; returns the path. Raises what the save raised."""
        return self._future.result(timeout)

    def __repr__(self) -> str:
        return f"AsyncSave({self.path!r}, {'done' if self.done() else 'running'})"


def _all_gather(obj: Any, group) -> list:
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def _check_consistent(entries: list[Entry], group) -> None:
    """All ranks save the same entries, and replicated tensors and values are equal.

    Ranks exchange a 32-byte digest of their entry list; only when digests differ do they
    exchange the lists themselves, to name the first difference.
    """
    mine = [(e.name, e.kind, e.shape, str(e.dtype), zlib.crc32(tensor_bytes(e.tensor))
             if e.kind == "replicated" else repr(e.value) if e.kind == "value" else None)
            for e in entries]
    if len(set(_all_gather(hashlib.sha256(repr(mine).encode()).hexdigest(), group))) == 1:
        return
    base, *others = _all_gather(mine, group)
    for r, other in enumerate(others, 1):
        if [x[0] for x in other] != [x[0] for x in base]:
            diff = sorted({x[0] for x in other} ^ {x[0] for x in base})
            raise ValueError(f"vfsdp.checkpoint.save: rank {r} saves other entries than rank 0 "
                             f"(e.g. {diff[:3]}); every rank must pass the same tree")
        for a, b in zip(base, other):
            if a != b:
                what = ", different " + ("values" if a[1] == "value" else "tensors")
                raise ValueError(f"vfsdp.checkpoint.save: {a[0]} differs between rank 0 and rank "
                                 f"{r} ({a[1:4]} vs {b[1:4]}{what if a[1:4] == b[1:4] else ''})"
                                 f"; replicated tensors and values must be equal on every rank")


def _check_written_once(entries: list[Entry], group) -> None:
    """No element of a sharded tensor is written twice with different values.

    DCP keeps one of two chunks stored at the same place, so two writers of different data
    would lose one silently: e.g. a plain plan sharded on each expert group's sub-mesh, whose
    groups hold different tensors under one name. One all-reduce of each entry's written
    element count; only where some are written twice, the writers compare CRC-32s (equal
    copies, e.g. a part replicated over its sub-meshes by hand, save as before).
    """
    sharded = [e for e in entries if e.kind == "sharded"]
    if not sharded:
        return
    counts = torch.tensor([e.piece.numel if e.piece.writer else 0 for e in sharded],
                          dtype=torch.int64, device=control_device(device_for(group)))
    dist.all_reduce(counts, group=group)
    twice = {e.name: e for e, got in zip(sharded, counts.tolist()) if got > math.prod(e.shape)}
    if not twice:
        return
    crcs: dict = {}  # (name, start, numel, within) -> the CRC-32s written there
    for rank in _all_gather([(e.name, e.piece.start, e.piece.numel, e.piece.within,
                              zlib.crc32(tensor_bytes(e.piece.local))) for e in twice.values()
                             if e.piece.writer and e.piece.numel], group):
        for *where, crc in rank:
            crcs.setdefault(tuple(where), set()).add(crc)
    # Equal copies are fine, but the distinct ranges must cover each element once.
    conflict = next((w[0] for w, c in crcs.items() if len(c) > 1), None) or next(
        (n for n, e in twice.items() if sum(w[2] for w in crcs if w[0] == n) > math.prod(e.shape)),
        None)
    if conflict is None:
        return
    raise ValueError(
        f"vfsdp.checkpoint.save: ranks write different data for the same elements of {conflict} "
        f"{tuple(twice[conflict].shape)}: shards of one plan made on several sub-meshes (e.g. one per expert "
        f"group) hold different tensors under one name, and all but one would be lost; plan "
        f"them over the whole mesh with tp= over the axis that tells them apart "
        f"(vfsdp.plan(params, mesh, tp=rule, tp_axis=...)), as for expert parallelism")


def _unwrap(exc: CheckpointException, what: str) -> BaseException:
    rank, (inner, _) = min(exc.failures.items())
    if isinstance(inner, (CheckpointError, ValueError, KeyError, FileNotFoundError)):
        out = type(inner)(f"{inner} (rank {rank})") if not isinstance(inner, KeyError) else inner
    else:
        out = CheckpointError(f"{what} failed on rank(s) {sorted(exc.failures)}: "
                              f"{type(inner).__name__}: {inner}")
    out.__cause__ = inner
    return out


def _write(path: str, tmp: str, entries: list[Entry], data: Optional[dict], layout: dict,
           group, thread_count: int) -> str:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        dcp.save(dcp_state(entries, data, rank), process_group=group,
                 storage_writer=FileSystemWriter(tmp, thread_count=thread_count))
    except CheckpointException as exc:
        raise _unwrap(exc, "vfsdp.checkpoint.save") from None
    err, result = None, None
    try:
        result = checksum_items(tmp, SafeReader(tmp).read_metadata().storage_data, rank, world)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        err = f"checksumming {tmp} failed: {exc}"
    gathered = _all_gather((err, result), group)
    if errors := [e for e, _ in gathered if e]:
        raise CheckpointError(errors[0])
    commit_err = None
    if rank == 0:
        try:
            write_manifest(tmp, entries, layout, world, gathered)
            commit(tmp, path)
        except Exception as exc:  # noqa: BLE001
            commit_err = CheckpointError(f"committing {path} failed: {type(exc).__name__}: {exc}")
    agree(commit_err, group)
    return path


def _stage(entries: list[Entry], rank: int) -> dict:
    """Host copies of what this rank writes, so training can go on changing the originals."""
    return {e.name: (e.piece.local if e.kind == "sharded" else e.tensor).detach().to("cpu", copy=True)
            for e in entries if (e.kind == "sharded" and e.piece.writer and e.piece.numel)
            or (e.kind == "replicated" and rank == 0)}


def _async_group() -> tuple:
    """``(gloo group, executor)`` for background saves, so their collectives never interleave
    with training's.

    One per thread, for the current default group only: a new default group (after
    ``destroy_process_group``) replaces the entry, so the table holds one group per thread.
    """
    key, world = threading.get_ident(), dist.group.WORLD
    if (found := _ASYNC_GROUPS.get(key)) is None or found[0] is not world:  # identity: ids are reused
        found = _ASYNC_GROUPS[key] = (world, dist.new_group(backend="gloo"),
                                      concurrent.futures.ThreadPoolExecutor(1, "vfsdp-ckpt"))
    return found[1:]


def wait_pending() -> None:
    """Wait for this rank's background save, if one is running (re-raising its error)."""
    if (pending := _PENDING.pop(threading.get_ident(), None)) is not None:
        pending.wait()


# ---------------------------------------------------------------------- parts


_FORM = ("pass parts as {name: (tree, spec)} or {name: (tree, spec, mesh)}, or a list of such "
         "tuples; for one tree pass save(path, tree, spec)")


def normalize(parts: Any, what: str) -> list[Planned]:
    """The parts of a dict or list form, checked, each a named
    :class:`~vfsdp.functional.pieces.Planned`.

    Raises:
        TypeError: not a dict/list of ``(tree, spec[, mesh])`` tuples, a name that is not a
            string, or a spec that is not a ``ShardSpec`` (naming the part and the fix).
        ValueError: no parts, or a name that is empty or holds a ``"."`` (entry names are
            dotted paths that start with the part's name).
    """
    if isinstance(parts, Mapping):
        items = list(parts.items())
    elif isinstance(parts, Sequence) and not isinstance(parts, (str, bytes)):
        items = [(str(i), p) for i, p in enumerate(parts)]
    else:
        raise TypeError(f"{what}: without a spec the second argument is a set of parts, got a "
                        f"{type(parts).__name__}; {_FORM}")
    if not items:
        raise ValueError(f"{what}: no parts given; {_FORM}")
    out = []
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"{what}: part names must be strings, got {name!r}")
        if not name or "." in name:
            raise ValueError(f"{what}: part name {name!r} is empty or holds a '.'; entries are "
                             f"stored as <part>.<path>, so name parts like 'experts' or 'rest'")
        if not isinstance(value, tuple) or len(value) not in (2, 3):
            raise TypeError(f"{what}: part {name!r} is a {type(value).__name__}, not a (tree, "
                            f"spec) or (tree, spec, mesh) tuple; {_FORM}")
        tree, spec, mesh = (*value, None)[:3]
        if isinstance(tree, ShardSpec):
            raise TypeError(f"{what}: part {name!r} has its spec where its tree goes; the tuple "
                            f"is (tree, spec)")
        if not isinstance(spec, ShardSpec):
            raise TypeError(f"{what}: part {name!r}'s spec must be the ShardSpec vfsdp.plan "
                            f"returned, got {type(spec).__name__}")
        if mesh is not None and not hasattr(mesh, "mesh_dim_names"):
            raise TypeError(f"{what}: part {name!r}'s mesh must be the DeviceMesh its shards were "
                            f"made on (vfsdp.mesh(...)) or None, got {type(mesh).__name__}")
        if mesh is not None:
            _check_mesh(name, spec, mesh, what)
        out.append(Planned(tree, spec, mesh, name=name))
    return out


def _check_mesh(name: str, spec: ShardSpec, mesh: Any, what: str) -> None:
    """The mesh spans the ranks the spec was planned for (and names its model axis)."""
    axis = spec.model_axis
    want = spec.world_size * spec.replicas * (axis[1] if axis else 1)
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    if math.prod(mesh.shape) != want or (axis and sizes.get(axis[0]) != axis[1]):
        split = f" x {axis[0]}={axis[1]}" if axis else ""
        raise ValueError(f"{what}: part {name!r}'s mesh {dict(sizes) or tuple(mesh.shape)} is "
                         f"not the one its spec was planned on ({spec.replicas * spec.world_size}"
                         f" data ranks{split}); pass the mesh its shards were made on, or none")


def _check_owner(name: str, layout: Any, part: Planned, what: str) -> None:
    """A shard of a vfsdp buffer (of unit ``layout``) belongs to a unit of its part's spec."""
    if (own := part.spec.units.get(layout.key)) is not layout and own != layout:
        raise ValueError(f"{what}: part {part.name!r}: {name} is a shard of unit "
                         f"{unit_name(layout.key)} of another plan than the part's spec; pair "
                         f"each tree with the spec it was sharded with ({{name: (shards, spec)}})")


def _flatten_part(part: Planned, what: str) -> list[Entry]:
    """A part's entries, each named ``<part>.<path>`` (names hold no ".": entries of two parts
    never clash).

    Raises:
        TypeError, ValueError: a leaf that cannot be checkpointed, or a shard paired with
            another plan's spec (naming the part, the tensor path and the fix).
    """
    # Shards first, before optimizer states read their buffers through the spec.
    for path, leaf in zip(*optree.tree_flatten_with_path(part.tree, is_leaf=is_state_leaf)[:2]):
        if (slot := slot_of(leaf)) is not None:
            _check_owner(format_path((part.name, *path)), slot.buffer.layout, part, what)
    try:
        entries = flatten(part.tree, part.spec, what, (part.name,))
    except KeyError as exc:  # an optimizer state's buffers are not the spec's units
        raise ValueError(f"{what}: part {part.name!r}: {exc.args[0] if exc.args else exc}; "
                         f"pair each tree with the spec it was sharded with") from None
    for e in entries:
        if e.kind == "sharded" and e.piece.db is not None:
            _check_owner(e.name, e.piece.db.layout, part, what)
    return entries


def _mesh_record(mesh: Any) -> Optional[list]:
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return [[str(n), int(s)] for n, s in zip(names, mesh.shape)]


def check_parts(manifest: dict, parts: Optional[list[Planned]], strict: bool, path: str) -> None:
    """A load of one tree (``parts`` is ``None``) reads a checkpoint of one tree, and a load of
    parts names the checkpoint's parts (all of them, when ``strict``).

    Raises:
        CheckpointError: a checkpoint of parts loaded as one tree or the reverse, a part the
            checkpoint lacks, or (``strict``) a part it holds that the load does not name.
    """
    if parts is None:
        if "parts" in manifest:
            raise CheckpointError(f"{path} holds parts {list(manifest['parts'])}, not one tree; "
                                  f"load it with vfsdp.checkpoint.load(path, {{name: (tree, "
                                  f"spec), ...}}) naming those parts")
        return
    if "parts" not in manifest:
        raise CheckpointError(f"{path} holds one tree (saved with a spec), not parts; load it "
                              f"with vfsdp.checkpoint.load(path, tree, spec)")
    saved, names = list(manifest["parts"]), [p.name for p in parts]
    if (n := next((n for n in names if n not in saved), None)) is not None:
        raise CheckpointError(f"{path} has no part {n!r} (it holds parts {saved}); name the "
                              f"parts as they were saved")
    if strict and (extra := [n for n in saved if n not in names]):
        raise CheckpointError(f"{path} holds part(s) {extra} that the load does not name (it "
                              f"names {names}); add them, or pass strict=False to load a subset")


def _entries(tree: Any, spec: Optional[ShardSpec], what: str) -> tuple[list[Entry], Optional[list]]:
    """The entries of one tree and its spec, or of a set of parts (``spec`` ``None``), and the
    parts (``None`` for one tree)."""
    if spec is not None:
        return flatten(tree, spec, what), None
    parts = normalize(tree, what)
    return [e for part in parts for e in _flatten_part(part, what)], parts


def save(path: str | os.PathLike, tree: Any, spec: Optional[ShardSpec] = None, *,
         overwrite: bool = False, async_save: bool = False,
         thread_count: int = 1) -> Optional[AsyncSave]:
    """Save ``tree`` (shards, optimizer states, step, extras) as a DCP checkpoint; collective.

    ``save(path, parts)`` saves several trees planned apart (e.g. an expert-parallel model's
    dense part and its experts) as one checkpoint: ``parts`` is ``{name: (tree, spec)}`` or
    ``{name: (tree, spec, mesh)}``, or a list of such tuples. Each part's entries are stored
    under its name, and each reshards on load on its own (see :mod:`vfsdp.checkpoint.io`).

    Args:
        path: Directory to create, on a filesystem every rank can read (as DCP needs to
            load). It appears only when the save is complete.
        tree: Any pytree of parameter shards (``vfsdp.shard``'s tree), optimizer states,
            other tensors (replicated: equal on every rank) and ``bool``/``int``/``float``/
            ``str`` values.
        spec: The spec the shards were made with (``None``: ``tree`` is a set of parts).
        overwrite: Replace an existing checkpoint at ``path``.
        async_save: Copy the data to host memory, return an :class:`AsyncSave` and write in
            the background (on a separate gloo group); ``wait()`` on it before the process
            exits. A later ``save``/``load`` waits for it first. Under
            ``vfsdp.testing.simulate`` the write finishes before ``save`` returns.
        thread_count: DCP writer threads per rank.

    Returns:
        ``None``, or the :class:`AsyncSave` when ``async_save``.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
        ValueError: ranks pass different trees, a replicated tensor/value differs, or a part's
            shard belongs to another plan than the part's spec.
        TypeError: a leaf that cannot be saved (naming its path), or malformed parts.
        CheckpointError: writing failed on some rank (every rank raises).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "step5")
        >>> def body():
        ...     params = {"w": torch.arange(8.0)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     opt = vfsdp.optim.adamw()
        ...     vfsdp.checkpoint.save(path, {"params": shards, "opt": opt.init(shards, spec),
        ...                                  "step": 5}, spec)
        >>> _ = vfsdp.testing.simulate(2, body)
        >>> sorted(os.listdir(path))[-1]
        'vfsdp.json'
    """
    path = os.fspath(path)
    wait_pending()
    entries, parts = agreed(_entries, tree, spec, "vfsdp.checkpoint.save")
    layout = single_layout(spec) if parts is None else {"parts": {  # {name: {mesh, plan}}
        p.name: {"mesh": _mesh_record(p.mesh), **single_layout(p.spec)} for p in parts}}
    _check_consistent(entries, None)
    _check_written_once(entries, None)
    if not async_save:
        _write(path, prepare(path, overwrite, None), entries, None, layout, None, thread_count)
        return None
    # Process groups belong to their rank's thread under vfsdp.testing.simulate, so a
    # background thread cannot use them: the write runs now, after the same snapshot.
    here = groups_are_per_thread()
    group, executor = (None, None) if here else _async_group()
    tmp = prepare(path, overwrite, group)
    data = agreed(_stage, entries, dist.get_rank())
    if here:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(_write(path, tmp, entries, data, layout, None, thread_count))
        return AsyncSave(future, path)
    # _stage's copies to the host are complete: no sync
    handle = _PENDING[threading.get_ident()] = AsyncSave(executor.submit(
        _write, path, tmp, entries, data, layout, group, thread_count), path)
    return handle


def load(path: str | os.PathLike, tree_like: Any, spec: Optional[ShardSpec] = None, *,
         strict: bool = True, verify: bool = True) -> Any:
    """Load a checkpoint into ``tree_like``'s tensors, in place; collective.

    ``load(path, parts)`` loads a checkpoint of parts (see :func:`save`): ``parts`` in the
    form it was saved in, each part under any world size, mesh or spec of its own; it returns
    the same form, with each part's loaded tree in place of its tuple.

    Works under any world size, mesh (FSDP or HSDP) or spec: each rank reads exactly the
    pieces it holds now. Tensors may also be plain full tensors (e.g. loading a sharded
    checkpoint on one process).

    Args:
        path: A directory written by :func:`save`.
        tree_like: The tree to fill: same paths as the saved tree (e.g. fresh shards and
            ``opt.init(shards, spec)``), tensors of the saved shapes and dtypes.
        spec: The spec of ``tree_like``'s shards (``None``: ``tree_like`` is a set of parts).
        strict: Refuse a checkpoint holding entries (or parts) ``tree_like`` lacks
            (``False``: load the subset ``tree_like`` names).
        verify: Check each chunk this rank reads against its CRC-32 first (file sizes are
            always checked).

    Returns:
        ``tree_like`` with its tensors filled and its plain values (and optimizer steps)
            taken from the checkpoint; for parts, their dict or list of loaded trees.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: an incomplete save, a missing, truncated or corrupt file, an entry
            missing or of another shape or dtype (naming it), a part missing or not named, or
            parts loaded as one tree and the reverse.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "step5")
        >>> def save():                                  # on 2 ranks
        ...     spec = vfsdp.plan({"w": torch.arange(8.0)}, 2)
        ...     shards = vfsdp.shard({"w": torch.arange(8.0)}, spec)
        ...     vfsdp.checkpoint.save(path, {"params": shards, "step": 5}, spec)
        >>> _ = vfsdp.testing.simulate(2, save)
        >>> def load():                                  # on 3 ranks: it reshards
        ...     spec = vfsdp.plan({"w": torch.zeros(8)}, 3)
        ...     shards = vfsdp.shard({"w": torch.zeros(8)}, spec)
        ...     tree = vfsdp.checkpoint.load(path, {"params": shards, "step": 0}, spec)
        ...     return tree["step"], vfsdp.gather(shards, spec)["w"].tolist()
        >>> vfsdp.testing.simulate(3, load)[0]
        (5, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    """
    path = os.fspath(path)
    wait_pending()

    def check() -> tuple:
        manifest = read_manifest(path)
        entries, parts = _entries(tree_like, spec, "vfsdp.checkpoint.load")
        check_parts(manifest, parts, strict, path)
        values = match_manifest(manifest, entries, strict, path, spec)
        verify_files(path, manifest)
        return manifest, values, entries, parts

    manifest, values, entries, parts = agreed(check)  # a failure on any rank: every rank raises
    try:
        dcp.load(dcp_state(entries), storage_reader=SafeReader(path),
                 planner=VerifyingLoadPlanner(path, manifest, verify))
    except CheckpointException as exc:
        raise _unwrap(exc, "vfsdp.checkpoint.load") from None
    if parts is None:
        return unflatten(tree_like, spec, values)
    loaded = [unflatten(p.tree, p.spec, values, (p.name,)) for p in parts]  # in the form given
    return dict(zip(tree_like, loaded)) if isinstance(tree_like, Mapping) else loaded
