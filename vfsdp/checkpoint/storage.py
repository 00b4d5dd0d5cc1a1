"""The on-disk side: entries as DCP state dicts, DCP's metadata read safely, checksums, and
the manifest.

DCP sees each sharded entry as a tensor of the **global** shape (a zero-stride placeholder, no
memory) that carries three hooks DCP looks for on any tensor:

* ``__create_write_items__``: one write item per box of this rank's range (none when the
  range is empty or the rank is an HSDP replica that does not write);
* ``__create_chunk_list__``: the boxes this rank wants at load time (none when empty);
* ``__get_tensor_shard__``: the box's slice of the local data, so reads land directly in the
  destination buffer.

DCP stores its ``.metadata`` as a pickle, and a pickle can name any importable callable to
run on load. :class:`SafeReader` unpickles it resolving only the classes a DCP metadata file
is made of (the ``torch.distributed.checkpoint.metadata`` types, ``_StorageInfo``,
``torch.Size``, dtypes, layouts, paths) and refuses every other name, so a crafted
``.metadata`` is an error, never code.

Integrity: after DCP has written the data and its ``.metadata``, every stored item's byte
range gets a CRC-32 and every file its size, in the manifest ``vfsdp.json``, written last and
checked first on load. It lists every entry (name, kind, global shape and dtype, or the value
itself), the CRC-32 of every stored item and of DCP's ``.metadata``, and the size of every
file. A load matches the tree it fills against it before reading any data
(:func:`match_manifest`), checks sizes of every file, and CRCs of exactly the items this rank
reads, before it copies anything.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import pickle
import re
import time
import uuid
import warnings
import zlib
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from vfsdp.checkpoint.entries import VALUE_TYPES, Entry, dtype_name, parse_dtype
from vfsdp.collectives.agree import agree as _agree
from vfsdp.collectives.agree import agreed as _agreed
from vfsdp.collectives.piece import Piece
from vfsdp.planner.spec import ShardSpec

MANIFEST = "vfsdp.json"
METADATA = ".metadata"  # DCP's
FORMAT = "vfsdp-checkpoint"
VERSION = 2  # 2: the manifest carries its own checksum
_BLOCK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not match what is loaded into.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     vfsdp.checkpoint.save(path, vfsdp.shard({"w": torch.ones(8)}, spec), spec)
        ...     spec = vfsdp.plan({"w": torch.zeros(6)}, 2)          # another model
        ...     try:
        ...         vfsdp.checkpoint.load(path, vfsdp.shard({"w": torch.zeros(6)}, spec), spec)
        ...     except CheckpointError as e:
        ...         return str(e).split(": ", 1)[1]                  # after the path
        >>> vfsdp.testing.simulate(2, body)[0]
        'w was saved as (8,) float32, the tree has (6,) float32; ...'
    """


# Collective (see vfsdp.collectives.agree): every rank raises, those that did not fail a
# CheckpointError.
agree = functools.partial(_agree, error_type=CheckpointError)
agreed = functools.partial(_agreed, error_type=CheckpointError)


def item_key(fqn: str, offsets) -> str:
    """Manifest key of a stored item: ``name@offsets``."""
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def _carrier(piece: Piece, data: torch.Tensor, write: bool) -> torch.Tensor:
    shape = torch.Size(piece.shape)
    carrier = torch.zeros((), dtype=data.dtype).expand(shape)  # cpu: metadata, one element
    boxes = {tuple(o): s for o, s in piece.boxes()}  # DCP asks only for the boxes declared
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes.items()]
    props = TensorProperties(dtype=data.dtype)
    carrier.__create_write_items__ = lambda fqn, _obj: [
        WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                  tensor_data=TensorWriteData(chunk=c, properties=props, size=shape))
        for c in chunks if write]
    carrier.__create_chunk_list__ = lambda: chunks
    carrier.__get_tensor_shard__ = lambda index: piece.box_data(
        tuple(index.offset), boxes[tuple(index.offset)], data)
    return carrier


def dcp_state(entries: list[Entry], data: Optional[dict] = None,
              rank: Optional[int] = None) -> dict:
    """The DCP state dict to save from global rank ``rank`` (replicated tensors are written by
    rank 0; ``data[name]`` overrides a tensor's data: a staged copy), or, with ``rank``
    ``None``, to load into (reads land in the entries' own memory). 0-size sharded tensors
    live in the manifest only."""
    data = data or {}
    out = {}
    for e in entries:
        if e.kind == "sharded" and 0 not in e.piece.shape:
            out[e.name] = _carrier(e.piece, data.get(e.name, e.piece.local.detach()),
                                   rank is not None and e.piece.writer)
        elif e.kind == "replicated" and e.tensor.numel() and rank in (None, 0):
            out[e.name] = data.get(e.name, e.tensor.detach())
    return out


# ---------------------------------------------------------------------- integrity


def _crcs(root: str, recs: dict) -> dict:
    """CRC-32 of each stored item ``{key: [file, offset, length, ...]}``, each file read once,
    in offset order."""
    out = {}
    ordered = sorted(recs.items(), key=lambda kv: tuple(kv[1][:2]))
    for rel, items in itertools.groupby(ordered, key=lambda kv: kv[1][0]):
        path = os.path.join(root, rel)
        with open(path, "rb") as f:
            for key, (_, offset, length, *_) in items:
                f.seek(offset)
                crc, left = 0, length
                while left:
                    chunk = f.read(min(_BLOCK, left))
                    if not chunk:
                        raise CheckpointError(f"{path} ends {left} bytes early (truncated)")
                    crc = zlib.crc32(chunk, crc)
                    left -= len(chunk)
                out[key] = crc
    return out


def checksum_items(root: str, storage_data: dict, rank: int, world: int) -> tuple[dict, dict]:
    """CRCs of the stored items in the files this rank wrote, and those files' sizes."""
    # The rank that wrote a DCP file (``__<rank>_<n>.distcp``) checksums it, still in its page
    # cache; other names are spread round-robin.
    rels = sorted({info.relative_path for info in storage_data.values()})
    mine = {rel for i, rel in enumerate(rels)
            if (int(w[1]) if (w := re.match(r"__(\d+)_", rel)) else i) % world == rank}
    recs = {item_key(index.fqn, index.offset or ()): [info.relative_path, info.offset, info.length]
            for index, info in storage_data.items() if info.relative_path in mine}
    for key, crc in _crcs(root, recs).items():
        recs[key].append(crc)
    return recs, {rel: os.path.getsize(os.path.join(root, rel)) for rel in mine}


def verify_files(root: str, manifest: dict) -> None:
    """Every file the manifest lists exists with its recorded size, and DCP's ``.metadata``
    has its CRC-32 and reads (safely).

    Raises:
        CheckpointError: a file is missing or has another size (naming the entries in it), or
            the metadata is corrupt or names what a DCP metadata file never holds.
    """
    holds: dict = {}
    for key, rec in manifest["items"].items():
        holds.setdefault(rec[0], set()).add(key.rsplit("@", 1)[0])
    for rel, size in sorted(manifest["files"].items()):
        path = os.path.join(root, rel)
        inside = sorted(holds.get(rel, ()))
        names = ", ".join(inside[:4]) + (f" (+{len(inside) - 4} more)" if len(inside) > 4 else "")
        names = f" (it holds {names})" if names else ""
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {root}: file {rel} is missing{names}")
        if (got := os.path.getsize(path)) != size:
            raise CheckpointError(f"checkpoint {root}: file {rel} has {got} bytes, {size} were "
                                  f"written (truncated or overwritten){names}")
    with open(os.path.join(root, METADATA), "rb") as f:
        if zlib.crc32(f.read()) != manifest["metadata_crc"]:
            raise CheckpointError(f"checkpoint {root}: {METADATA} is corrupt (CRC-32)")
    # Read (safely) here, not only inside DCP: torch 2.11's loader swallows a reader's refusal
    # and only says "metadata is None".
    SafeReader(root).read_metadata()


class VerifyingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that CRC-checks the stored items this rank will read first."""

    def __init__(self, root: str, manifest: dict, verify: bool) -> None:
        super().__init__()
        self._root, self._manifest, self._verify = root, manifest, verify

    def create_local_plan(self):
        plan = super().create_local_plan()
        if not self._verify:
            return plan
        wanted = {}
        for item in plan.items:
            key = item_key(item.storage_index.fqn, item.storage_index.offset or ())
            if key not in self._manifest["items"]:
                raise CheckpointError(f"checkpoint {self._root}: {item.storage_index.fqn} has a "
                                      f"stored chunk the manifest does not list ({key})")
            wanted[key] = self._manifest["items"][key]
        for key, actual in _crcs(self._root, wanted).items():
            rel, off, length, crc = wanted[key]
            if actual != crc:
                raise CheckpointError(
                    f"checkpoint {self._root}: {key.rsplit('@', 1)[0]} is corrupt (chunk at "
                    f"[{key.rsplit('@', 1)[1]}] in {rel}, bytes {off}..{off + length}: CRC-32 "
                    f"{actual:08x}, expected {crc:08x})")
        return plan


def read_manifest(root: str) -> dict:
    """The manifest of a complete checkpoint.

    Raises:
        FileNotFoundError: nothing at ``root`` (mentioning unfinished saves next to it).
        CheckpointError: ``root`` is not a complete vfsdp checkpoint.
    """
    if not os.path.isdir(root):
        parent, base = os.path.split(os.path.abspath(root))
        near = os.listdir(parent) if os.path.isdir(parent) else []
        partial = sorted(n for n in near if n.startswith(base + ".partial-"))
        old = sorted(n for n in near if n.startswith(base + ".old-"))
        hint = (f"; {len(partial)} unfinished save(s) exist ({partial[0]}), which are never "
                f"loaded") if partial else ""
        if old:
            hint += (f"; an overwrite of it was interrupted and the previous checkpoint is "
                     f"intact at {os.path.join(parent, old[-1])} (rename it back, or save to "
                     f"{root} again, which restores it first)")
        raise FileNotFoundError(f"no checkpoint at {root}{hint}")
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{root} is not a complete vfsdp checkpoint (no {MANIFEST}); the "
                              f"save that wrote it did not finish") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{root}/{MANIFEST} is unreadable ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in (1, VERSION):
        raise CheckpointError(f"{root}/{MANIFEST}: format {manifest.get('format')!r} version "
                              f"{manifest.get('version')!r}, expected {FORMAT!r} {VERSION}")
    if manifest["version"] == 1:  # vfsdp 0.1 wrote no checksum
        warnings.warn(f"{root} was saved by vfsdp 0.1, whose manifest has no checksum, so an "
                      f"edit to it cannot be detected; save it again to add one", FutureWarning,
                      stacklevel=5)  # load's caller
    elif manifest.get("checksum") != manifest_checksum(manifest):
        raise CheckpointError(f"{root}/{MANIFEST} was edited after the save (its checksum does not "
                              f"match its contents); refusing to trust what it describes")
    return manifest


def manifest_checksum(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON, without its ``checksum`` field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


# ---------------------------------------------------------------------- DCP metadata


ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorProperties", "StorageMeta", "ChunkStorageMetadata",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.where} refers to {module}.{name}, which a DCP metadata "
                              f"file never holds; refusing to load it (the file was crafted or "
                              f"written by another tool)")


class SafeReader(FileSystemReader):
    """A DCP ``FileSystemReader`` that unpickles the checkpoint's one ``.metadata`` with only
    the metadata classes allowed.

    Raises:
        CheckpointError: the file names anything else, or is not a pickle.
    """

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = os.path.join(str(self.path), METADATA)
        try:
            with open(path, "rb") as f:
                metadata = _Unpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a corrupt file
            raise CheckpointError(f"{path} is not a readable DCP metadata file ({exc})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------- the manifest


def single_layout(spec: ShardSpec) -> dict:
    """What the manifest records of a one-tree save's plan."""
    axis = spec.model_axis
    return {"mesh_shape": list(spec.mesh_shape), "spec_fingerprint": spec.fingerprint,
            "model_axis": None if axis is None else list(axis[:2])}


def describe_mesh(mesh_shape, model_axis) -> str:
    """``data mesh (2,), tp=2``: what a state's shape may follow."""
    return f"data mesh {tuple(mesh_shape)}" + (f", {model_axis[0]}={model_axis[1]}" if model_axis else "")


def write_manifest(tmp: str, entries: list[Entry], layout: dict, world: int,
                   gathered: list) -> None:
    """Write ``vfsdp.json``: the entries, ``layout`` (:func:`single_layout`, or the parts'),
    the CRCs and sizes ``gathered`` from every rank."""
    items = {key: rec for _, (crcs, _) in gathered for key, rec in crcs.items()}
    files = {rel: size for _, (_, sizes) in gathered for rel, size in sizes.items()}
    with open(os.path.join(tmp, METADATA), "rb") as f:
        meta = f.read()
    files[METADATA] = len(meta)
    described = [{"name": e.name, "kind": "value", "value": e.value} if e.kind == "value" else
                 {"name": e.name, "kind": e.kind, "shape": list(e.shape),
                  "dtype": dtype_name(e.dtype)} for e in entries]
    manifest = {
        "format": FORMAT, "version": VERSION, "created": time.time(),
        "torch": torch.__version__, "world_size": world, **layout,
        "bytes": sum(v[2] for v in items.values()),
        "metadata_crc": zlib.crc32(meta), "entries": described, "files": files, "items": items,
    }
    manifest["checksum"] = manifest_checksum(manifest)
    write_file(os.path.join(tmp, MANIFEST), [json.dumps(manifest).encode()])  # visible once committed


def write_file(target: str, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` under a temporary name, renamed to ``target`` once complete."""
    tmp = f"{os.path.abspath(target)}.partial-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            f.writelines(chunks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def match_manifest(manifest: dict, entries: list[Entry], strict: bool, path: str,
                   spec: Optional[ShardSpec] = None) -> dict:
    """The saved plain values for ``entries``, after checking each against the manifest.

    ``spec``: the loading spec; when its mesh (:func:`describe_mesh`) differs from the saved
    one, a shape mismatch is reported as what it most likely is, a state that follows the mesh."""
    saved = {e["name"]: e for e in manifest["entries"]}
    mesh = None if spec is None else describe_mesh(spec.mesh_shape, spec.model_axis)
    was = describe_mesh(manifest["mesh_shape"], manifest.get("model_axis")) \
        if "mesh_shape" in manifest else None
    moved = mesh is not None and was is not None and was != mesh
    for e in entries:
        s = saved.get(e.name)
        if s is None:
            near = [n for n in saved if n.split(".")[-1] == e.name.split(".")[-1]][:3]
            raise CheckpointError(f"{path} has no entry {e.name!r}"
                                  + (f" (similar: {near})" if near else "")
                                  + "; the tree's paths differ from the saved tree's")
        if (s["kind"] == "value") != (e.kind == "value"):
            raise CheckpointError(f"{path}: {e.name}: the checkpoint holds a "
                                  f"{'value' if s['kind'] == 'value' else 'tensor'}, the tree a "
                                  + (f"{type(e.value).__name__} value" if e.kind == "value" else
                                     f"{e.kind} tensor {tuple(e.shape)} {dtype_name(e.dtype)}"))
        if e.kind != "value":
            shape, dtype = tuple(s["shape"]), parse_dtype(s["dtype"])
            if shape != tuple(e.shape) and dtype == e.dtype and moved:
                raise CheckpointError(f"{path}: {e.name} was saved as {shape} {s['dtype']}, the "
                                      f"tree has {tuple(e.shape)}: the mesh changed (saved on "
                                      f"{was}, loading on {mesh}), and this "
                                      f"state's shape follows each rank's TP/EP piece (e.g. "
                                      f"8-bit AdamW's per-piece scales), so it does not "
                                      f"reshard. Load on a mesh of the saved shape, or load "
                                      f"the parameters alone (strict=False, without this "
                                      f"state) and initialise the optimizer state afresh")
            if shape != tuple(e.shape) or dtype != e.dtype:
                raise CheckpointError(f"{path}: {e.name} was saved as {shape} {s['dtype']}, the "
                                      f"tree has {tuple(e.shape)} {dtype_name(e.dtype)}; "
                                      f"re-create the model and optimizer with the saved "
                                      f"configuration")
        elif _kind(s["value"]) != _kind(e.value):
            raise CheckpointError(f"{path}: {e.name} was saved as the {type(s['value']).__name__} "
                                  f"{s['value']!r}, the tree has a {type(e.value).__name__}")
    if strict and (extra := sorted(set(saved) - {e.name for e in entries})):
        raise CheckpointError(f"{path} holds entries the tree does not: {extra[:5]}"
                              f"{' ...' if len(extra) > 5 else ''}; pass strict=False to "
                              f"load a subset")
    return {e.name: _coerce(saved[e.name]["value"], e.value) for e in entries if e.kind == "value"}


def _kind(value) -> type:
    """bool, int, float or str: what JSON keeps of a value (an IntEnum is an int)."""
    return next(t for t in VALUE_TYPES if isinstance(value, t))


def _coerce(saved, like):
    """The saved value as the like value's own type where it is a subclass (e.g. an IntEnum)."""
    with contextlib.suppress(TypeError, ValueError):
        return saved if type(like) in VALUE_TYPES else type(like)(saved)
    return saved
