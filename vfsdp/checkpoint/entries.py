"""What a checkpoint holds: a tree flattened into named entries, and back.

A tree (parameter shards, optimizer states, the step, user extras) flattens with optree into
entries named by their dotted key path (``opt.exp_avg.layers.0.wq``):

* ``sharded``: a :class:`~vfsdp.checkpoint.pieces.Piece` (a parameter shard, i.e. a view
  into a DBuffer, becomes one: its global shape comes from the spec);
* ``replicated``: any other tensor, the same on every rank (checked at save time);
* ``value``: a ``bool``, ``int``, ``float`` or ``str`` (stored in the manifest).

Objects whose type is registered with :func:`register_state` (vfsdp's optimizer states are)
flatten through their adapter into such a tree, and are rebuilt after a load. Entry names
depend on tensor paths only, never on unit keys, so a checkpoint reloads under any other plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import optree
import torch

from vfsdp.checkpoint.pieces import Piece
from vfsdp.collectives.dbuffer import DBuffer, global_owner, owner_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec

__all__ = ["Entry", "flatten", "unflatten", "register_state", "VALUE_TYPES", "dtype_name",
           "parse_dtype", "tensor_bytes"]

VALUE_TYPES = (bool, int, float, str)


@dataclass
class Entry:
    """One named thing in a checkpoint.

    Attributes:
        name: Dotted key path, the DCP key.
        kind: ``"sharded"``, ``"replicated"`` or ``"value"``.
        shape, dtype: Of the global tensor (``None`` for values).
        piece: This rank's range (``sharded``).
        tensor: The tensor (``replicated``).
        value: The Python value (``value``).
    """

    name: str
    kind: str
    shape: Optional[tuple] = None
    dtype: Optional[torch.dtype] = None
    piece: Optional[Piece] = None
    tensor: Optional[torch.Tensor] = None
    value: Any = None

    def describe(self) -> str:
        if self.kind == "value":
            return f"{type(self.value).__name__} value"
        return f"{self.kind} tensor {tuple(self.shape)} {dtype_name(self.dtype)}"


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (row-major), from a private host copy.

    Never ``.numpy()`` the original: numpy pins its storage as non-resizable, and DBuffers
    release and re-allocate memory by resizing storages.
    """
    if not t.numel():
        return b""
    host = t.detach().to("cpu", copy=True).contiguous().reshape(-1)
    return host.view(torch.uint8).numpy().tobytes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint")
    return dtype


_ADAPTERS: dict = {}


def register_state(cls: type, flatten: Callable[[Any, ShardSpec], Any],
                   restore: Callable[[Any, Any], Any]) -> None:
    """Teach checkpoints an optimizer-state (or any) type.

    Args:
        cls: The type.
        flatten: ``(obj, spec) -> tree`` of what to save: tensors that are DBuffer shards,
            :class:`Piece` s, other tensors (replicated) and plain values. Tensors must alias
            ``obj``'s memory, so a load fills ``obj`` in place.
        restore: ``(obj, loaded_tree) -> obj``: put the loaded plain values (e.g. the step)
            back; tensors are already filled.

    Raises:
        TypeError: ``cls`` is not a type, or ``flatten``/``restore`` are not callable.

    Example:
        >>> vfsdp.checkpoint.register_state(                       # doctest: +SKIP
        ...     MyState, lambda s, spec: {"step": s.step, "buf": s.buf},
        ...     lambda s, tree: dataclasses.replace(s, step=tree["step"]))
    """
    if not isinstance(cls, type) or not callable(flatten) or not callable(restore):
        raise TypeError("register_state(cls, flatten, restore) takes a type and two callables")
    _ADAPTERS[cls] = (flatten, restore)


def _path_name(path: tuple) -> str:
    return format_path(tuple(path)) if path else "<root>"


def _db_piece(t: torch.Tensor, db: DBuffer, path: tuple, name: str) -> Piece:
    """The Piece of a tensor that is one of ``db``'s local views.

    Matched exactly when ``t`` came from ``DBuffer.local`` (``vfsdp.shard``'s leaves), else by
    its key path ending in the tensor's path, else by memory (a unique non-empty view).
    """
    k = db.view_index(t)
    if k is None:
        cands = [k for k in range(len(db.tensors)) if db.is_local_view(k, t)]
        by_path = [k for k in cands if tuple(path[-len(db.tensors[k].path):]) == db.tensors[k].path]
        pick = by_path or [k for k in cands if db.tensors[k].numel and t.numel()]
        if len(pick) != 1:
            raise ValueError(f"checkpoint: {name} is a view into the {db.role} buffer of unit "
                             f"{db.key!r} but not exactly one tensor's shard (candidates: "
                             f"{[format_path(db.tensors[k].path) for k in cands]}); pass the "
                             f"tensors vfsdp.shard returned (or keep their key paths)")
        k = pick[0]
    ts = db.tensors[k]
    return Piece(t, tuple(ts.shape), ts.local_range(db.rank)[0],
                 writer=db.groups.replicate_rank == 0, db=db, index=k)


def flatten(tree: Any, spec: ShardSpec, what: str = "checkpoint") -> list[Entry]:
    """The entries of ``tree``, in optree order.

    Raises:
        TypeError: a leaf that cannot be checkpointed (naming its path and what to do).
        ValueError: two leaves with the same dotted name, or a gathered full view.
    """
    out: list[Entry] = []
    _flatten_into(tree, spec, (), out, what)
    seen: dict = {}
    for e in out:
        if e.name in seen:
            raise ValueError(f"{what}: two leaves are both named {e.name!r}; rename one (dotted "
                             f"key paths must be unique)")
        seen[e.name] = e
    return out


def _flatten_into(tree: Any, spec: ShardSpec, prefix: tuple, out: list, what: str) -> None:
    paths, leaves, _ = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: type(x) in _ADAPTERS or isinstance(x, (Piece, DBuffer)))
    for path, leaf in zip(paths, leaves):
        path = prefix + tuple(path)
        name = _path_name(path)
        adapter = _ADAPTERS.get(type(leaf))
        if adapter is not None:
            _flatten_into(adapter[0](leaf, spec), spec, path, out, what)
        elif isinstance(leaf, Piece):
            out.append(Entry(name, "sharded", tuple(leaf.shape), leaf.local.dtype, piece=leaf))
        elif isinstance(leaf, torch.Tensor):
            db = owner_of(leaf)
            if db is not None and leaf.untyped_storage()._cdata == db.shard.untyped_storage()._cdata:
                p = _db_piece(leaf, db, path, name)
                out.append(Entry(name, "sharded", tuple(p.shape), leaf.dtype, piece=p))
            elif global_owner(leaf) is not None:
                raise ValueError(f"{what}: {name} is a gathered full view; pass the shards "
                                 f"(the tree vfsdp.shard returned), not vfsdp.gather's output")
            else:
                out.append(Entry(name, "replicated", tuple(leaf.shape), leaf.dtype, tensor=leaf))
        elif isinstance(leaf, VALUE_TYPES):
            out.append(Entry(name, "value", value=leaf))
        elif isinstance(leaf, DBuffer):
            raise TypeError(f"{what}: {name} is a DBuffer; checkpoint its tensors instead "
                            f"(the optimizer state object, or vfsdp.shard's tree)")
        else:
            raise TypeError(f"{what}: {name} is a {type(leaf).__name__}, which checkpoints "
                            f"cannot store; use a tensor or a bool/int/float/str, or register "
                            f"the type with vfsdp.checkpoint.register_state")


def unflatten(tree: Any, spec: ShardSpec, values: dict) -> Any:
    """``tree`` with its plain values replaced by ``values[name]`` and registered states
    restored (tensors were filled in place and stay the same objects)."""
    return _unflatten(tree, spec, (), values)


def _unflatten(tree: Any, spec: ShardSpec, prefix: tuple, values: dict) -> Any:
    paths, leaves, treespec = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: type(x) in _ADAPTERS or isinstance(x, (Piece, DBuffer)))
    new = []
    for path, leaf in zip(paths, leaves):
        path = prefix + tuple(path)
        adapter = _ADAPTERS.get(type(leaf))
        if adapter is not None:
            sub = _unflatten(adapter[0](leaf, spec), spec, path, values)
            new.append(adapter[1](leaf, sub))
        elif isinstance(leaf, VALUE_TYPES) and _path_name(path) in values:
            new.append(values[_path_name(path)])
        else:
            new.append(leaf)
    return optree.tree_unflatten(treespec, new)
