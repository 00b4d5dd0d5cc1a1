"""The DCP side: entries as DCP state dicts, checksums, and the manifest.

DCP sees each sharded entry as a tensor of the **global** shape (a zero-stride placeholder, no
memory) that carries three hooks DCP looks for on any tensor:

* ``__create_write_items__``: one write item per box of this rank's range (none when the
  range is empty or the rank is an HSDP replica that does not write);
* ``__create_chunk_list__``: the boxes this rank wants at load time (none when empty);
* ``__get_tensor_shard__``: the box's slice of the local data, so reads land directly in the
  destination buffer.

Integrity: after DCP has written the data and its ``.metadata``, every stored item's byte
range gets a CRC-32 and every file its size, in the manifest. A load checks sizes of every
file, and CRCs of exactly the items this rank reads, before it copies anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import warnings
import zlib
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from vfsdp.checkpoint.entries import Entry
from vfsdp.collectives.agree import agree as _agree
from vfsdp.collectives.agree import agreed as _agreed
from vfsdp.collectives.piece import Piece

__all__ = ["CheckpointError", "agree", "agreed", "MANIFEST", "METADATA", "FORMAT", "dcp_state",
           "checksum_items", "verify_files", "VerifyingLoadPlanner",
           "read_manifest", "manifest_checksum"]

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
    shape = tuple(piece.shape)
    one = torch.zeros((), dtype=data.dtype)  # cpu: metadata only, never moved
    carrier = one.expand(shape) if shape else one  # the global shape, owning one element
    bxs = piece.boxes() if piece.numel else []
    props = TensorProperties(dtype=data.dtype)

    def write_items(fqn: str, _obj: Any) -> list:
        if not write:
            return []
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(o), torch.Size(s)),
                              properties=props, size=torch.Size(shape)))
                for o, s in bxs]

    def chunk_list() -> list:
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in bxs]

    def shard(index: MetadataIndex) -> torch.Tensor:
        for o, s in bxs:
            if tuple(index.offset) == tuple(o):
                return piece.box_data(o, s, data)
        raise ValueError(f"{index.fqn}: no box at {tuple(index.offset)} on this rank")

    carrier.__create_write_items__ = write_items
    carrier.__create_chunk_list__ = chunk_list
    carrier.__get_tensor_shard__ = shard
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


def _crc_ranges(path: str, ranges: list) -> list:
    """CRC-32 of each ``(offset, length)`` byte range of a file."""
    out = []
    with open(path, "rb") as f:
        for offset, length in ranges:
            f.seek(offset)
            crc, left = 0, length
            while left:
                chunk = f.read(min(_BLOCK, left))
                if not chunk:
                    raise CheckpointError(f"{path} ends {left} bytes early (truncated)")
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
            out.append(crc)
    return out


def _writer_of(rel: str, i: int, world: int) -> int:
    """The rank that wrote a DCP file (``__<rank>_<n>.distcp``), so each rank checksums what
    it wrote itself, still in its page cache; other names are spread round-robin."""
    m = re.match(r"__(\d+)_", rel)
    return int(m.group(1)) % world if m else i % world


def checksum_items(root: str, storage_data: dict, rank: int, world: int) -> tuple[dict, dict]:
    """CRCs of the stored items in the files this rank wrote, and those files' sizes."""
    by_file: dict = {}
    for index, info in storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    crcs, sizes = {}, {}
    for i, rel in enumerate(sorted(by_file)):
        if _writer_of(rel, i, world) != rank:
            continue
        items = sorted(by_file[rel], key=lambda x: x[1].offset)
        path = os.path.join(root, rel)
        sizes[rel] = os.path.getsize(path)
        for (index, info), crc in zip(items, _crc_ranges(path, [(x.offset, x.length) for _, x in items])):
            crcs[item_key(index.fqn, index.offset or ())] = [rel, info.offset, info.length, crc]
    return crcs, sizes


def verify_files(root: str, manifest: dict) -> None:
    """Every file the manifest lists exists with its recorded size.

    Raises:
        CheckpointError: a file is missing or has another size (naming the entries in it).
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
        got = os.path.getsize(path)
        if got != size:
            raise CheckpointError(f"checkpoint {root}: file {rel} has {got} bytes, {size} were "
                                  f"written (truncated or overwritten){names}")


class VerifyingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that CRC-checks the stored items this rank will read first."""

    def __init__(self, root: str, manifest: dict, verify: bool) -> None:
        super().__init__()
        self._root, self._manifest, self._verify = root, manifest, verify

    def create_local_plan(self):
        plan = super().create_local_plan()
        if not self._verify:
            return plan
        by_file: dict = {}
        for item in plan.items:
            key = item_key(item.storage_index.fqn, item.storage_index.offset or ())
            rec = self._manifest["items"].get(key)
            if rec is None:
                raise CheckpointError(f"checkpoint {self._root}: {item.storage_index.fqn} has a "
                                      f"stored chunk the manifest does not list ({key})")
            rel, off, length, crc = rec
            by_file.setdefault(rel, set()).add((off, length, crc, key))
        for rel, recs in sorted(by_file.items()):
            recs = sorted(recs)
            got = _crc_ranges(os.path.join(self._root, rel), [(o, n) for o, n, _, _ in recs])
            for (off, length, crc, key), actual in zip(recs, got):
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
        parent = os.path.dirname(os.path.abspath(root)) or "."
        base = os.path.basename(os.path.abspath(root))
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
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{root} is not a complete vfsdp checkpoint (no {MANIFEST}); the "
                              f"save that wrote it did not finish")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{root}/{MANIFEST} is unreadable ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in (1, VERSION):
        raise CheckpointError(f"{root}/{MANIFEST}: format {manifest.get('format')!r} version "
                              f"{manifest.get('version')!r}, expected {FORMAT!r} {VERSION}")
    if manifest["version"] == 1:  # vfsdp 0.1 wrote no checksum
        warnings.warn(f"{root} was saved by vfsdp 0.1, whose manifest has no checksum, so an "
                      f"edit to it cannot be detected; save it again to add one", FutureWarning,
                      stacklevel=3)
    elif manifest.get("checksum") != manifest_checksum(manifest):
        raise CheckpointError(f"{root}/{MANIFEST} was edited after the save (its checksum does not "
                              f"match its contents); refusing to trust what it describes")
    return manifest


def manifest_checksum(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON, without its ``checksum`` field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()
