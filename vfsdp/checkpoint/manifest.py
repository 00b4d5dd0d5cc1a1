"""The manifest ``vfsdp.json``: what a checkpoint holds, written last, checked first on load.

It lists every entry (name, kind, global shape and dtype, or the value itself), the CRC-32 of
every stored item and of DCP's ``.metadata``, and the size of every file. A load matches the
tree it fills against it before reading any data (:func:`match_manifest`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zlib
from typing import Optional

import torch

from vfsdp.checkpoint.entries import VALUE_TYPES, Entry, dtype_name, parse_dtype
from vfsdp.checkpoint.storage import FORMAT, MANIFEST, METADATA, VERSION, CheckpointError, manifest_checksum
from vfsdp.planner.spec import ShardSpec

__all__ = ["write_manifest", "match_manifest", "single_layout", "describe_mesh"]


def single_layout(spec: ShardSpec) -> dict:
    """What the manifest records of a one-tree save's plan."""
    axis = spec.model_axis
    return {"mesh_shape": list(spec.mesh_shape), "spec_fingerprint": spec.fingerprint,
            "model_axis": None if axis is None else list(axis[:2])}


def describe_mesh(mesh_shape, model_axis) -> str:
    """``data mesh (2,), tp=2``: what a state's shape may follow."""
    split = f", {model_axis[0]}={model_axis[1]}" if model_axis else ""
    return f"data mesh {tuple(mesh_shape)}{split}"


def write_manifest(tmp: str, entries: list[Entry], layout: dict, world: int,
                   gathered: list) -> None:
    """Write ``vfsdp.json``: the entries, ``layout`` (:func:`single_layout`, or the parts'),
    the CRCs and sizes ``gathered`` from every rank."""
    items, files = {}, {}
    for _, (crcs, sizes) in gathered:
        items.update(crcs)
        files.update(sizes)
    meta_path = os.path.join(tmp, METADATA)
    with open(meta_path, "rb") as f:
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
    tmp_manifest = os.path.join(tmp, MANIFEST + ".tmp")
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp_manifest, os.path.join(tmp, MANIFEST))


def match_manifest(manifest: dict, entries: list[Entry], strict: bool, path: str,
                   mesh: Optional[str] = None) -> dict:
    """The saved plain values for ``entries``, after checking each against the manifest.

    ``mesh``: the loading spec's :func:`describe_mesh`; when it differs from the saved one, a
    shape mismatch is reported as what it most likely is, a state that follows the mesh."""
    saved = {e["name"]: e for e in manifest["entries"]}
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
                                  f"{e.describe()}")
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
    if strict:
        extra = sorted(set(saved) - {e.name for e in entries})
        if extra:
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
