"""Full state dicts out of shards, and back: streamed one unit at a time.

:func:`to_state_dict` gathers one unit (one DBuffer) at a time, copies its full tensors out
on the destination rank and releases the unit's global buffer before the next, so no rank
ever holds the model twice: the destination holds the result plus one unit, the others one
unit. :func:`from_state_dict` is the reverse: the source packs one unit and scatters it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from vfsdp.checkpoint.entries import Entry, dtype_name, flatten, unflatten
from vfsdp.checkpoint.storage import CheckpointError, agree, agreed
from vfsdp.collectives import comm
from vfsdp.collectives.scatter import scatter_unit
from vfsdp.collectives.unit import export_full
from vfsdp.planner.spec import ShardSpec

Rename = Optional[Callable[[str], str]]


def _groups(entries: list[Entry]) -> list[tuple]:
    """``(db or None, [entries])`` in order: DBuffer-backed pieces grouped by their buffer."""
    groups: dict = {}
    for k, e in enumerate(entries):
        db = e.piece.db if e.kind == "sharded" else None
        groups.setdefault(k if db is None else ("db", id(db)), (db, []))[1].append(e)
    return list(groups.values())


def name_keys(entries: list[Entry], rename: Rename, what: str) -> dict:
    """``{entry name: key}`` under ``rename``.

    Raises:
        ValueError: ``rename`` maps two entries to one key.
    """
    named: dict = {}  # key -> entry name
    for e in entries:
        key = rename(e.name) if rename else e.name
        if key in named:
            raise ValueError(f"{what}: rename maps both {named[key]} and {e.name} to {key!r}")
        named[key] = e.name
    return {name: key for key, name in named.items()}


def entries_and_names(tree: Any, spec: ShardSpec, rename: Rename, what: str) -> tuple:
    """Collective: ``(entries, {name: key})``, with every rank raising if any rank fails or
    ``rename`` maps two entries to one key."""
    def local():
        entries = flatten(tree, spec, what)
        if (split := next((e for e in entries if e.kind == "sharded" and e.piece.within is not None),
                          None)) is not None:
            raise ValueError(f"{what}: {split.name} comes from a plan split over a model axis (TP/EP); "
                             f"full-tensor exports gather over the data axes only. Save with "
                             f"vfsdp.checkpoint.save (it reshards across TP/EP degrees), or "
                             f"export from a plan without tp= (tp=1)")
        return entries, name_keys(entries, rename, what)

    return agreed(local)


def stream_order(entries: list[Entry]) -> list[Entry]:
    """The order in which :func:`stream_full` yields entries."""
    return [e for _, group in _groups(entries) for e in group]


def _gather_pieces(entries: list[Entry], dst: int) -> dict:
    """Full tensors of pieces that are not DBuffer views (small: tile scales and the like).

    Each rank puts the bytes it writes into a zeroed buffer of them all, and one MAX
    all-reduce merges them: every byte is written by one rank (or by several, equal), and
    bytes no rank writes stay zero.
    """
    sizes = [math.prod(e.shape) * e.dtype.itemsize for e in entries]
    starts = list(itertools.accumulate(sizes, initial=0))
    buf = torch.zeros(starts[-1], dtype=torch.uint8, device=comm.device_for())  # cuda under NCCL
    for e, at in zip(entries, starts):
        if e.piece.writer and e.piece.numel:
            at += e.piece.start * e.dtype.itemsize
            mine = e.piece.local.detach().reshape(-1).view(torch.uint8)
            buf[at:at + mine.numel()].copy_(mine)
    comm.all_reduce_max_(buf)
    if dist.get_rank() != dst:
        return {}
    buf = buf.cpu()
    return {e.name: buf[at:at + n].clone().view(e.dtype).view(e.shape)  # clone: aligned
            for e, at, n in zip(entries, starts, sizes)}


def stream_full(entries: list[Entry], dst: int = 0) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, full tensor or value)`` on ``dst`` (nothing elsewhere), unit by unit.

    Collective: every rank must exhaust the iterator. A unit's full tensors are views of its
    global buffer, valid until the next item is requested; copy them to keep them.
    """
    rank = dist.get_rank()
    pieces = [e for e in entries if e.kind == "sharded" and e.piece.db is None]
    small = _gather_pieces(pieces, dst) if pieces else {}
    for db, group in _groups(entries):
        e = group[0]
        if db is not None:
            with export_full(db):
                yield from ((e.name, db.full(e.piece.index)) for e in group if rank == dst)
        elif rank == dst:
            yield e.name, (e.value if e.kind == "value" else
                           small[e.name] if e.kind == "sharded" else e.tensor.detach())


def to_state_dict(tree: Any, spec: ShardSpec, *, dst: int = 0, device: Any = "cpu",
                  rename: Rename = None) -> dict:
    """Full tensors keyed by dotted names, on rank ``dst`` (``{}`` elsewhere); collective.

    Ready for ``nn.Module.load_state_dict``, ``safetensors`` or Hugging Face (map names with
    ``rename``). Streams one unit at a time: besides the result, ``dst`` holds one gathered
    unit at a time, and so does every other rank.

    Args:
        tree: Shards (``vfsdp.shard``'s tree), optionally with optimizer states and extras.
        spec: The spec of the shards.
        dst: The rank that receives the state dict.
        device: Where the full tensors go.
        rename: ``dotted name -> key`` (e.g. to a Hugging Face naming scheme).

    Returns:
        ``{name: tensor or value}`` on ``dst``, ``{}`` on the other ranks.

    Raises:
        TypeError, ValueError: a leaf that cannot be exported (naming its path), or
            ``rename`` maps two names to one key; every rank raises.
        CheckpointError: another rank failed.

    Example:
        >>> def body():
        ...     params = {"w": torch.arange(6.0).reshape(3, 2)}
        ...     spec = vfsdp.plan(params, 2)
        ...     sd = vfsdp.checkpoint.to_state_dict(vfsdp.shard(params, spec), spec)
        ...     return {k: v.tolist() for k, v in sd.items()}
        >>> vfsdp.testing.simulate(2, body)     # rank 0 could now model.load_state_dict(sd)
        [{'w': [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]}, {}]
    """
    entries, keys = entries_and_names(tree, spec, rename, "vfsdp.checkpoint.to_state_dict")
    out, error = {}, None
    for name, value in stream_full(entries, dst):
        try:  # after a failure: keep taking part in the collectives; raised below, on every rank
            if error is None:
                out[keys[name]] = value.to(device, copy=True) if isinstance(value, torch.Tensor) else value
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory on dst
            error, out = exc, {}
    agree(error)
    return out


def from_state_dict(state_dict: Optional[dict], tree_like: Any, spec: ShardSpec, *,
                    src: int = 0, strict: bool = True, rename: Rename = None) -> Any:
    """Fill ``tree_like`` from full tensors held by rank ``src``; collective.

    The source packs one unit at a time and scatters it (equal segments), so it holds one
    unit beyond the state dict; other ranks receive only their shards.

    Args:
        state_dict: ``{dotted name: full tensor or value}`` on ``src``; ignored elsewhere
            (pass ``None``).
        tree_like: Shards (and optionally states) to fill in place.
        spec: Their spec.
        src: The rank holding ``state_dict``.
        strict: Refuse names in ``state_dict`` that ``tree_like`` lacks.
        rename: ``dotted name -> key in state_dict``.

    Returns:
        ``tree_like``, filled, with plain values taken from ``state_dict``.

    Raises:
        CheckpointError: a name missing from ``state_dict``, a shape or dtype mismatch, or
            unused names with ``strict`` (raised on every rank).

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.empty(6, device="meta")}, 2)
        ...     shards = vfsdp.shard({"w": torch.zeros(6)}, spec)
        ...     sd = {"w": torch.arange(6.0)} if dist.get_rank() == 0 else None  # e.g. torch.load
        ...     vfsdp.checkpoint.from_state_dict(sd, shards, spec)
        ...     return shards["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    """
    rank = dist.get_rank()
    entries, key = entries_and_names(tree_like, spec, rename, "vfsdp.checkpoint.from_state_dict")
    box: list = [None]
    if rank == src:
        db = next((db for db, _ in _groups(entries) if db is not None), None)
        coords = (0, 0) if db is None else (db.groups.replicate_rank, db.groups.shard_rank)
        try:
            box[0] = (None, _check_source(state_dict, entries, key, strict), coords)
        except CheckpointError as exc:
            box[0] = (str(exc), {}, coords)
        except Exception as exc:  # noqa: BLE001 - sent to every rank
            box[0] = (f"from_state_dict: checking the state dict failed: {exc}", {}, coords)
    dist.broadcast_object_list(box, group_src=src)
    err, values, coords = box[0]
    if err:
        raise CheckpointError(err)
    failed: list = []  # a source-side failure: keep the collectives going, raise at the end
    with torch.no_grad():
        for db, group in _groups(entries):
            e = group[0]
            if db is not None:
                _scatter_unit(db, group, state_dict, key, rank == src, coords, failed)
            elif e.kind != "value":  # a piece or replicated tensor: broadcast whole
                target = e.piece.local if e.kind == "sharded" else e.tensor
                full = torch.zeros(e.shape, dtype=e.dtype, device=target.device)
                if rank == src:
                    try:
                        full.copy_(state_dict[key[e.name]].detach())
                    except Exception as exc:  # noqa: BLE001 - reported on every rank below
                        failed.append(exc)
                comm.broadcast_(full, group_src=src)
                part = full.reshape(-1)[e.piece.start:e.piece.stop] if e.kind == "sharded" else full
                target.copy_(part.reshape(target.shape))
    agree(failed[0] if failed else None)
    return unflatten(tree_like, spec, values)


def _check_source(state_dict, entries, key, strict) -> dict:
    """The plain values of ``state_dict`` for ``entries``.

    Raises:
        CheckpointError: not a dict, a name missing, a shape or dtype mismatch, or (``strict``)
            unused names.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"from_state_dict: rank with src needs a dict, got {type(state_dict).__name__}")
    for e in entries:
        k = key[e.name]
        if k not in state_dict:
            raise CheckpointError(f"from_state_dict: no {k!r} in the state dict (for {e.name})")
        v = state_dict[k]
        if e.kind != "value" and (not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(e.shape)
                                  or v.dtype != e.dtype):
            got = (f"{tuple(v.shape)} {dtype_name(v.dtype)}" if isinstance(v, torch.Tensor)
                   else type(v).__name__)
            raise CheckpointError(f"from_state_dict: {k!r} is {got}, {e.name} needs {tuple(e.shape)} "
                           f"{dtype_name(e.dtype)}")
    if strict and (extra := sorted(set(state_dict) - set(key.values()))):
        raise CheckpointError(f"from_state_dict: unused names {extra[:5]}; pass strict=False to ignore them")
    return {e.name: state_dict[key[e.name]] for e in entries if e.kind == "value"}


def _scatter_unit(db, group: list, state_dict, key, is_src: bool, coords: tuple,
                  failed: list) -> None:
    """The source packs the unit and scatters it (:func:`vfsdp.collectives.scatter_unit`);
    each rank copies its pieces out of the received shard."""
    def pack(buf: torch.Tensor) -> None:
        for e in group:
            t = db.tensors[e.piece.index]
            buf[t.offset:t.offset + t.numel].copy_(state_dict[key[e.name]].reshape(-1))

    stage = torch.empty_like(db.shard)
    if (error := scatter_unit(db, pack if is_src else None, coords, out=stage)) is not None:
        failed.append(error)
    for e in group:
        lo, hi = db.tensors[e.piece.index].shard_range(db.rank)
        e.piece.local.detach().reshape(-1).copy_(stage[lo:hi])
