"""Safetensors files written one unit at a time, and read back one slice per rank.

The format is simple enough to stream: an 8-byte little-endian header length, a JSON header
``{name: {dtype, shape, data_offsets}}`` and the raw bytes. Shapes and dtypes are known from
the spec before any data moves, so the header is written first and each unit's tensors are
appended as the unit is gathered: the writing rank never holds more than one unit. Reading
moves no data between ranks: each rank seeks to the bytes of its own pieces and reads only
those. vfsdp writes and reads the format itself; the ``safetensors`` package is not needed.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import json
import math
import os
import re
import struct
from typing import Any, Optional

import torch
import torch.distributed as dist

from vfsdp.checkpoint.entries import Entry, dtype_name, flatten, tensor_bytes, unflatten
from vfsdp.checkpoint.export import Rename, entries_and_names, name_keys, stream_full, stream_order
from vfsdp.checkpoint.storage import MANIFEST, CheckpointError, agree, agreed, write_file
from vfsdp.planner.spec import ShardSpec

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
          torch.uint32: "U32", torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2"}
_DTYPES = {v: k for k, v in _CODES.items()}
_VALUES = "vfsdp.values"


# ---------------------------------------------------------------------- MoE layouts
#
# Hugging Face's layouts of mixture-of-experts weights in safetensors files.
#
# A ``transformers`` 5 MoE model holds each layer's experts fused: ``experts.gate_up_proj``
# ``(E, 2I, H)`` (each expert's gate rows, then its up rows) and ``experts.down_proj``
# ``(E, H, I)``. Its ``save_pretrained`` writes one tensor per expert instead, and fuses them
# again at load:
#
# * ``"per_expert"`` (Qwen2/3-MoE, DeepSeek, GLM-MoE and the others transformers converts as
#   Qwen2-MoE): ``experts.N.gate_proj.weight`` and ``experts.N.up_proj.weight`` ``(I, H)``,
#   ``experts.N.down_proj.weight`` ``(H, I)``;
# * ``"mixtral"``: the same under ``block_sparse_moe`` (every ``.mlp.`` of the model), named
#   ``w1`` (gate), ``w3`` (up) and ``w2`` (down).
#
# In both, the per-expert tensors, in the order listed (expert by expert, gate before up), are
# the fused tensor's bytes cut into consecutive pieces: a save writes the fused bytes unchanged
# under several header records, and a read maps a rank's flat range of the fused tensor onto
# the pieces it spans.

_FUSED = re.compile(r"(?P<pre>(?:.*\.)?)experts\.(?P<which>gate_up_proj|down_proj)")
_NAMES = {"per_expert": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}

def parts(name: str, shape: tuple, layout: Optional[str]) -> list[tuple[str, tuple]]:
    """The file tensors ``(key, shape)`` whose bytes, concatenated, are tensor ``name``'s in
    ``layout`` (``[(name, shape)]`` when it is stored whole under its own name).

    Args:
        name: The tensor's dotted name.
        shape: Its shape.
        layout: ``None``/``"fused"``, ``"per_expert"`` or ``"mixtral"``.

    Returns:
        ``[(key, shape)]`` in byte order.

    Raises:
        ValueError: an unknown layout.

    Example:
        >>> parts("m.0.mlp.experts.gate_up_proj", (2, 8, 3), "mixtral")[:2]
        [('m.0.block_sparse_moe.experts.0.w1.weight', (4, 3)),
         ('m.0.block_sparse_moe.experts.0.w3.weight', (4, 3))]
        >>> parts("m.0.mlp.experts.down_proj", (2, 3, 4), "per_expert")[1]
        ('m.0.mlp.experts.1.down_proj.weight', (3, 4))
        >>> parts("l.mlp.gate.weight", (4, 3), "mixtral")
        [('l.block_sparse_moe.gate.weight', (4, 3))]
    """
    if layout in (None, "fused"):
        return [(name, tuple(shape))]
    if layout not in _NAMES:
        raise ValueError(f"save_safetensors: hf_layout must be one of {('fused', *_NAMES)} or None, got "
                         f"{layout!r}")
    found = _FUSED.fullmatch(name)
    rename = (lambda n: n.replace(".mlp.", ".block_sparse_moe.")) if layout == "mixtral" else (lambda n: n)
    if found is None or len(shape) != 3 or (found["which"] == "gate_up_proj" and shape[1] % 2):
        return [(rename(name), tuple(shape))]
    gate, up, down = _NAMES[layout]
    pre = rename(found["pre"] + "experts.")
    experts, rows, cols = shape
    if found["which"] == "down_proj":
        return [(f"{pre}{e}.{down}.weight", (rows, cols)) for e in range(experts)]
    return [(f"{pre}{e}.{w}.weight", (rows // 2, cols)) for e in range(experts) for w in (gate, up)]


def save_safetensors(path: str | os.PathLike, tree: Any, spec: ShardSpec, *, dst: int = 0,
                     rename: Rename = None, metadata: Optional[dict] = None,
                     max_shard_size: Optional[int] = None,
                     hf_layout: Optional[str] = None) -> None:
    """Write full tensors to one safetensors file on rank ``dst``, one unit at a time; collective.

    The file is written under a temporary name and renamed when complete. Plain values go
    into the header's metadata (as JSON, under ``"vfsdp.values"``). A tie is written once,
    under the name the plan gives it (the path registered first: ``transformer.wte.weight``,
    as Hugging Face saves GPT-2). With ``max_shard_size``, ``path`` is a directory that gets
    Hugging Face's sharded form: ``model-00001-of-0000N.safetensors`` files of at most that
    many bytes each (a larger tensor alone in its file) and ``model.safetensors.index.json``,
    which ``from_pretrained`` and :func:`load_safetensors` read.

    Args:
        path: The ``.safetensors`` file; a directory (it must exist without
            ``max_shard_size``) gets Hugging Face's file names.
        tree: Shards (``vfsdp.shard``'s tree), optionally with states and values.
        spec: Their spec.
        dst: The writing rank.
        rename: ``dotted name -> tensor name`` in the file.
        metadata: Extra ``str -> str`` header metadata.
        max_shard_size: Bytes per file; ``None``: one file.
        hf_layout: How mixture-of-experts weights are stored. ``None`` or ``"fused"``: as
            the tree holds them (``experts.gate_up_proj`` ``(E, 2I, H)``, which
            ``transformers`` 5's ``from_pretrained`` loads as it is). ``"per_expert"``: one
            tensor per expert, as ``save_pretrained`` writes Qwen2/3-MoE, DeepSeek and the
            like (``experts.N.gate_proj.weight``, ``up_proj``, ``down_proj``);
            ``"mixtral"``: as it writes Mixtral (``block_sparse_moe.experts.N.w1.weight``,
            ``w3``, ``w2``, and ``block_sparse_moe`` for every ``mlp``). Both load with
            ``from_pretrained`` and with readers that know only per-expert names. The bytes
            are the same: only the header's names and offsets differ.

    Raises:
        TypeError: a dtype safetensors cannot store, or non-string metadata.
        ValueError: ``rename`` maps two names to one key, or an unknown ``hf_layout``.
        OSError: the file cannot be written (on ``dst``; the others raise CheckpointError).
        CheckpointError: the directory holds a ``vfsdp.checkpoint.save`` checkpoint (one
            directory holds one checkpoint; a save there replaces the other Hugging Face
            form: a single file removes an index and its shards, and the reverse).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> def body():
        ...     params = {"w": torch.arange(6.0)}
        ...     spec = vfsdp.plan(params, 2)
        ...     vfsdp.checkpoint.save_safetensors(path, vfsdp.shard(params, spec), spec)
        >>> _ = vfsdp.testing.simulate(2, body)
        >>> read_header(path)[0]["w"]["shape"]
        [6]
    """
    path = os.fspath(path)
    rank = dist.get_rank()
    entries, names = entries_and_names(tree, spec, rename, "vfsdp.checkpoint.save_safetensors")

    def prepare() -> tuple:
        parts("", (), hf_layout)  # an unknown layout
        files = _split(entries, max_shard_size)  # [(file name, or "" for one file, [entries])]
        targets = [os.path.join(path, n or SINGLE) if n or os.path.isdir(path) else path for n, _ in files]
        folder = os.path.dirname(os.path.abspath(targets[0]))
        if rank == dst and max_shard_size is not None:
            os.makedirs(folder, exist_ok=True)
        if rank == dst and os.path.exists(os.path.join(folder, MANIFEST)):
            raise CheckpointError(f"save_safetensors: {folder} holds a vfsdp checkpoint "
                                  f"({MANIFEST}); one directory holds one checkpoint: export to "
                                  f"another directory")
        return files, targets, _headers_of(entries, names, files, metadata, hf_layout)

    files, targets, blobs = agreed(prepare)  # a failure on any rank: every rank raises
    stream = stream_full(entries, dst)
    error = None
    if rank == dst:
        tensors = (v for _, v in stream if isinstance(v, torch.Tensor))
        try:
            for target, blob, (_, group) in zip(targets, blobs, files):
                write_file(target, itertools.chain(
                    (struct.pack("<Q", len(blob)), blob),
                    map(tensor_bytes, itertools.islice(tensors, len(group)))))
            if max_shard_size is not None:
                _write_index(path, names, files, hf_layout)
            _remove_other_forms(targets)
        except Exception as exc:  # noqa: BLE001 - e.g. disk full; raised below, on every rank
            error = exc
    collections.deque(stream, maxlen=0)  # drained: the others (and dst after a failure) take part
    agree(error)


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_PARTIAL = re.compile(r"\.partial-[0-9a-f]{12}")


def _remove_other_forms(targets: list[str]) -> None:
    """After a save into Hugging Face's names: what another form (or an older save) left in
    that directory, so that every reader reads this save. A single ``model.safetensors``
    replaces a sharded save's index and files; a sharded save replaces ``model.safetensors``
    and an older save's other shard files. Unfinished files of the same names (a save that
    died) go too."""
    folder = os.path.dirname(os.path.abspath(targets[0]))
    names = {os.path.basename(t) for t in targets}
    single = names == {SINGLE}
    hf = single or all(_SHARD.fullmatch(n) for n in names)
    for name in os.listdir(folder):
        partial = _PARTIAL.search(name)
        base = name if partial is None else name[:partial.start()]
        mine = partial is not None and (base in names or (hf and base == INDEX))
        stale = base not in names and ((base == INDEX and single) or (
            hf and (base == SINGLE or bool(_SHARD.fullmatch(base)))))
        if mine or stale:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))


def _split(entries: list[Entry], max_bytes: Optional[int]) -> list[tuple[str, list[Entry]]]:
    """The files of a save: ``[(file name, [entries])]`` in stream order."""
    order = [e for e in stream_order(entries) if e.kind != "value"]
    if max_bytes is None:
        return [("", order)]
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"save_safetensors: max_shard_size must be a positive int (bytes), "
                         f"got {max_bytes!r}")
    groups, size = [[]], 0
    for e in order:
        n = math.prod(e.shape) * e.dtype.itemsize
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    return [(f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors", g) for k, g in enumerate(groups)]


def _write_index(path: str, names: dict, files: list, layout: Optional[str]) -> None:
    index = {"metadata": {"total_size": sum(math.prod(e.shape) * e.dtype.itemsize
                                            for _, g in files for e in g)},
             "weight_map": {key: file for file, g in files for e in g
                            for key, _ in parts(names[e.name], e.shape, layout)}}
    write_file(os.path.join(path, INDEX), [json.dumps(index, indent=2, sort_keys=True).encode()])


def _headers_of(entries: list[Entry], names: dict, files: list, metadata: Optional[dict],
                layout: Optional[str]) -> list[bytes]:
    """Each file's header: its tensors back to back; the first file's metadata holds
    ``metadata`` and the plain values."""
    meta = dict(metadata or {})
    if any(not isinstance(k, str) or not isinstance(v, str) for k, v in meta.items()):
        raise TypeError("safetensors metadata must map str to str")
    if values := {names[e.name]: e.value for e in entries if e.kind == "value"}:
        meta[_VALUES] = json.dumps(values)
    blobs, stored = [], set()  # every file's keys: one key in two files is as wrong as in one
    for k, (_, group) in enumerate(files):
        header, offset = {}, 0
        for e in group:
            if e.dtype not in _CODES:
                raise TypeError(f"safetensors: {e.name} is {dtype_name(e.dtype)}, which "
                                f"safetensors cannot store")
            for key, shape in parts(names[e.name], e.shape, layout):
                if key in stored:
                    raise ValueError(f"save_safetensors: two tensors are both stored as {key!r} "
                                     f"(hf_layout={layout!r}); rename one")
                stored.add(key)
                n = math.prod(shape) * e.dtype.itemsize
                header[key] = {"dtype": _CODES[e.dtype], "shape": list(shape),
                               "data_offsets": [offset, offset + n]}
                offset += n
        if meta and k == 0:
            header["__metadata__"] = meta
        blob = json.dumps(header, separators=(",", ":")).encode()
        blobs.append(blob + b" " * (-len(blob) % 8))
    return blobs


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """``(header, data start)`` of a safetensors file, its header checked as the format
    requires: each tensor's ``data_offsets`` span exactly ``shape x dtype`` bytes, the tensors
    lie back to back from the data's first byte, without gaps or overlaps, and the last one
    ends where the file does.

    Args:
        path: The ``.safetensors`` file.

    Returns:
        ``(header, data start)``: the parsed JSON header and the byte where the data begins.

    Raises:
        CheckpointError: not a safetensors file, truncated, or a header that breaks the
            format (naming the file, the tensor and what differs).

    Example:
        >>> import os, struct, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "bad.safetensors")
        >>> blob = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
        >>> with open(path, "wb") as f:
        ...     _ = f.write(struct.pack("<Q", len(blob)) + blob + bytes(12))
        >>> read_header(path)
        Traceback (most recent call last):
        ...
        vfsdp.checkpoint.storage.CheckpointError: ...'w' starts at byte 4 of the data...
    """
    if (size := os.path.getsize(path)) < 8:
        raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(f"{path}: header of {n} bytes in a file of {size} (truncated)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is a {type(header).__name__}, "
                              f"not a JSON object")
    end = _check_offsets(path, header)
    if 8 + n + end > size:
        raise CheckpointError(f"{path} has {size} bytes but its header needs {8 + n + end} "
                              f"(truncated)")
    if 8 + n + end < size:
        raise CheckpointError(f"{path} has {size - 8 - n - end} bytes after its last tensor; "
                              f"the safetensors format ends the file with the last tensor "
                              f"(a corrupt or foreign file: re-export it)")
    return header, 8 + n


def _check_offsets(path: str, header: dict) -> int:
    """The data's length in bytes, after checking every record of ``header``."""
    def counts(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(d, int) and d >= 0 for d in v)

    spans = []
    for key, rec in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(rec, dict) and counts(rec.get("shape")) and counts(rec.get("data_offsets"))
                and len(rec["data_offsets"]) == 2):
            raise CheckpointError(f"{path}: tensor {key!r} has a malformed header record "
                                  f"{rec!r}; it needs dtype, shape (non-negative ints) and "
                                  f"data_offsets [begin, end]")
        if rec.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {rec.get('dtype')!r}, "
                                  f"which vfsdp cannot read (it reads {sorted(_DTYPES)})")
        begin, stop = rec["data_offsets"]
        if stop - begin != (need := math.prod(rec["shape"]) * _DTYPES[rec["dtype"]].itemsize):
            raise CheckpointError(f"{path}: tensor {key!r} has data_offsets [{begin}, {stop}] "
                                  f"({stop - begin} bytes), but its shape {rec['shape']} of "
                                  f"{rec['dtype']} needs {need} bytes; the file is corrupt")
        spans.append((begin, stop, key))
    at, last = 0, None
    for begin, stop, key in sorted(spans):
        if begin != at:
            after = f" ({last!r})" if last is not None else ""
            raise CheckpointError(f"{path}: tensor {key!r} starts at byte {begin} of the data, "
                                  f"but the tensors before it end at byte {at}{after}; the "
                                  f"safetensors format requires contiguous, non-overlapping "
                                  f"data_offsets (the file is corrupt)")
        at, last = stop, key
    return at


def load_safetensors(path: str | os.PathLike, tree_like: Any, spec: ShardSpec, *,
                     strict: bool = True, rename: Rename = None) -> Any:
    """Fill ``tree_like`` from a safetensors file: each rank reads only its own slices.

    Each rank seeks to the byte ranges of its own pieces and reads only those (through a
    host buffer of that size); the only collective is a final exchange of errors, so that
    every rank raises if any rank fails.

    Args:
        path: A safetensors file (written by :func:`save_safetensors`, ``safetensors`` or a
            Hugging Face export), or a directory of a Hugging Face checkpoint: several files
            and ``model.safetensors.index.json`` (or one ``model.safetensors``). Each rank
            reads the files' headers, then only its own pieces' bytes.
        tree_like: Shards (and optionally states) to fill in place. A mixture-of-experts
            tensor (``experts.gate_up_proj``, ``experts.down_proj``) the file lacks is read
            from its per-expert tensors, as ``save_pretrained`` writes them (see
            ``save_safetensors``'s ``hf_layout``).
        spec: Their spec.
        strict: Refuse tensors in the file that ``tree_like`` lacks.
        rename: ``dotted name -> tensor name`` in the file.

    Returns:
        ``tree_like``, filled, with plain values from the file's ``"vfsdp.values"`` metadata.

    Raises:
        CheckpointError: a missing tensor or value, a shape or dtype mismatch, unused tensors
            with ``strict``, a truncated file, a header whose offsets break the format, or a
            directory holding two checkpoints (each naming the file, tensor and difference).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> def body():
        ...     params = {"w": torch.arange(6.0)}
        ...     spec = vfsdp.plan(params, 2)
        ...     vfsdp.checkpoint.save_safetensors(path, vfsdp.shard(params, spec), spec)
        ...     back = vfsdp.shard({"w": torch.zeros(6)}, spec)
        ...     vfsdp.checkpoint.load_safetensors(path, back, spec)
        ...     return back["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    """
    path = os.fspath(path)
    return unflatten(tree_like, spec, agreed(_read_into, path, tree_like, spec, strict, rename))


def _headers(path: str) -> tuple[dict, dict]:
    """``({tensor name: its header record plus "file" and "base"}, plain values)`` of a file
    or of a Hugging Face checkpoint directory."""
    weight_map, files = {}, [path]
    if os.path.isdir(path):
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        if os.path.exists(index) and os.path.exists(single):
            raise CheckpointError(f"{path} holds two checkpoints: {SINGLE} and a sharded one "
                                  f"({INDEX}), which readers choose between differently; "
                                  f"delete the stale one, or save again with "
                                  f"vfsdp.checkpoint.save_safetensors (it removes the other)")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        elif os.path.exists(single):
            files = [single]
        else:
            raise CheckpointError(f"{path} holds neither {INDEX} nor model.safetensors")
    merged, values = {}, {}
    for file in files:
        header, base = read_header(file)
        values.update(json.loads(header.pop("__metadata__", {}).get(_VALUES, "{}")))
        for key, rec in header.items():
            if key in merged:
                raise CheckpointError(f"{path}: tensor {key!r} is in both "
                                      f"{os.path.basename(merged[key]['file'])} and "
                                      f"{os.path.basename(file)}; the checkpoint is corrupt")
            merged[key] = {**rec, "file": file, "base": base}
    for key, name in weight_map.items():
        if (found := os.path.basename(merged[key]["file"]) if key in merged else "no file") != name:
            raise CheckpointError(f"{path}: {INDEX} puts tensor {key!r} in {name}, but it is in "
                                  f"{found}; the checkpoint is corrupt or mixes two saves")
    return merged, values


def _read_into(path: str, tree_like: Any, spec: ShardSpec, strict: bool, rename: Rename) -> dict:
    header, values = _headers(path)
    entries = flatten(tree_like, spec, "vfsdp.checkpoint.load_safetensors")
    names = name_keys(entries, rename, "vfsdp.checkpoint.load_safetensors")
    stored: dict = {}  # entry name -> [(file tensor key, its record)], in the tensor's order
    for e in entries:
        key = names[e.name]
        if e.kind == "value":
            if key not in values:
                raise CheckpointError(f"{path}: no value {key!r} (for {e.name})")
            continue
        # Whole under its own name, then each per-expert layout, then under Mixtral's names.
        options = [[(key, tuple(e.shape))], *(parts(key, e.shape, layout) for layout in _NAMES)]
        found = next((c for c in options if all(k in header for k, _ in c)), None)
        if found is None:
            other = next((f" nor its per-expert tensors ({c[0][0]}, ...)" for c in options[1:]
                          if c != options[0]), "")
            raise CheckpointError(f"{path}: no tensor {key!r}{other} (for {e.name})")
        for k, shape in found:
            rec = header[k]
            if tuple(rec["shape"]) != shape or _DTYPES.get(rec["dtype"]) != e.dtype:
                raise CheckpointError(f"{path}: {k!r} is {tuple(rec['shape'])} {rec['dtype']}, "
                                      f"{e.name} needs {shape} {dtype_name(e.dtype)}")
        stored[e.name] = [(k, header[k]) for k, _ in found]
    if strict and (extra := sorted(set(header) - {k for found in stored.values() for k, _ in found})):
        raise CheckpointError(f"{path} holds tensors the tree does not: {extra[:5]}; pass "
                              f"strict=False to load a subset")
    with contextlib.ExitStack() as stack, torch.no_grad():
        opened = {file: stack.enter_context(open(file, "rb"))
                  for file in {rec["file"] for found in stored.values() for _, rec in found}}
        _read_pieces(entries, stored, opened, path)
    return {e.name: values[names[e.name]] for e in entries if e.kind == "value"}


def _runs(e: Entry, numel: int) -> list[tuple[int, int]]:
    """``[(flat start, count)]``: the runs of the stored tensor's elements that make up the
    entry's ``numel`` elements, in their own order (a TP/EP piece's boxes row by row)."""
    if e.kind != "sharded" or e.piece.within is None or not e.shape:
        return [(e.piece.start if e.kind == "sharded" else 0, numel)]
    strides = [math.prod(e.shape[d + 1:]) for d in range(len(e.shape))]
    return [(sum(i * st for i, st in zip((*lead, offsets[-1]), strides)), sizes[-1])
            for offsets, sizes in e.piece.boxes()
            for lead in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:-1], sizes)))]


def _read_pieces(entries: list, stored: dict, opened: dict, path: str) -> None:
    """Each entry's bytes, from the tensor stored whole or as consecutive pieces (per-expert
    tensors), read from the pieces its runs span into one host buffer, then copied in."""
    for e in entries:
        target = None if e.kind == "value" else e.piece.local if e.kind == "sharded" else e.tensor
        if target is None or not target.numel():
            continue
        recs = [rec for _, rec in stored[e.name]]
        starts = list(itertools.accumulate((math.prod(r["shape"]) for r in recs), initial=0))
        item = target.element_size()
        raw = bytearray(target.numel() * item)  # a host buffer: numpy views would pin the storage
        view = memoryview(raw)
        for at, count in _runs(e, target.numel()):
            k, end = bisect.bisect_right(starts, at) - 1, at + count
            while at < end:
                rec, stop = recs[k], min(starts[k + 1], end)
                f = opened[rec["file"]]
                f.seek(rec["base"] + rec["data_offsets"][0] + (at - starts[k]) * item)
                n = (stop - at) * item
                if f.readinto(view[:n]) != n:
                    raise CheckpointError(f"{path}: {e.name} ends early (truncated)")
                view, at, k = view[n:], stop, k + 1
        target.copy_(torch.frombuffer(raw, dtype=target.dtype).view(target.shape))
