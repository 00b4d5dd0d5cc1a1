"""Several plans in one checkpoint: named ``(tree, spec)`` parts saved and loaded together.

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

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Optional

import optree
import torch

from vfsdp.checkpoint.entries import Entry, flatten, is_state_leaf, unflatten
from vfsdp.checkpoint.manifest import single_layout
from vfsdp.checkpoint.storage import CheckpointError
from vfsdp.collectives.dbuffer import slot_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["Part", "normalize", "flatten_parts", "parts_layout", "check_parts",
           "unflatten_parts"]

_FORM = ("pass parts as {name: (tree, spec)} or {name: (tree, spec, mesh)}, or a list of such "
         "tuples; for one tree pass save(path, tree, spec)")


class Part(NamedTuple):
    """One named part: its tree, the spec it was sharded with, and its mesh (or ``None``)."""

    name: str
    tree: Any
    spec: ShardSpec
    mesh: Any = None


def normalize(parts: Any, what: str) -> list[Part]:
    """The parts of a dict or list form, checked.

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
            raise TypeError(f"{what}: part {name!r}'s mesh must be the DeviceMesh its shards "
                            f"were made on (vfsdp.mesh(...)) or None, got "
                            f"{type(mesh).__name__}")
        if mesh is not None:
            _check_mesh(name, spec, mesh, what)
        out.append(Part(name, tree, spec, mesh))
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


def _check_owner(name: str, layout: Any, part: Part, what: str) -> None:
    """A shard of a vfsdp buffer (of unit ``layout``) belongs to a unit of its part's spec."""
    own = part.spec.units.get(layout.key)
    if own is layout or own == layout:
        return
    raise ValueError(f"{what}: part {part.name!r}: {name} is a shard of unit "
                     f"{unit_name(layout.key)} of another plan than the part's spec; pair each "
                     f"tree with the spec it was sharded with ({{name: (shards, spec)}})")


def _flatten_part(part: Part, what: str) -> list[Entry]:
    # Shards first, before optimizer states read their buffers through the spec.
    paths, leaves, _ = optree.tree_flatten_with_path(part.tree, is_leaf=is_state_leaf)
    for path, leaf in zip(paths, leaves):
        slot = slot_of(leaf) if isinstance(leaf, torch.Tensor) else None
        if slot is not None:
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


def flatten_parts(parts: list[Part], what: str) -> list[Entry]:
    """The entries of every part (:func:`normalize`'s), each named ``<part>.<path>``, in the
    parts' order.

    Raises:
        TypeError, ValueError: a leaf that cannot be checkpointed, or a shard paired with
            another plan's spec (naming the part, the tensor path and the fix).
    """
    out: list[Entry] = []
    for part in parts:  # names hold no ".": entries of two parts never clash
        out += _flatten_part(part, what)
    return out


def _mesh_record(mesh: Any) -> Optional[list]:
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return [[str(n), int(s)] for n, s in zip(names, mesh.shape)]


def parts_layout(parts: list[Part]) -> dict:
    """What the manifest records of the parts: ``{"parts": {name: {mesh, plan}}}``."""
    return {"parts": {p.name: {"mesh": _mesh_record(p.mesh), **single_layout(p.spec)}
                      for p in parts}}


def check_parts(manifest: dict, parts: Optional[list[Part]], strict: bool, path: str) -> None:
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
    saved = list(manifest["parts"])
    names = [p.name for p in parts]
    for n in names:
        if n not in manifest["parts"]:
            raise CheckpointError(f"{path} has no part {n!r} (it holds parts {saved}); name the "
                                  f"parts as they were saved")
    extra = [n for n in saved if n not in names]
    if strict and extra:
        raise CheckpointError(f"{path} holds part(s) {extra} that the load does not name (it "
                              f"names {names}); add them, or pass strict=False to load a subset")


def unflatten_parts(form: Any, parts: list[Part], values: dict) -> Any:
    """``form`` (the parts as given: dict or list) with each part's loaded tree in place of
    its tuple."""
    loaded = [unflatten(p.tree, p.spec, values, (p.name,)) for p in parts]
    return dict(zip(form, loaded)) if isinstance(form, Mapping) else loaded
