"""What a checkpoint holds: a tree flattened into named entries, and back.

A tree (parameter shards, optimizer states, the step, user extras) flattens with optree into
entries named by their dotted key path (``opt.exp_avg.layers.0.wq``):

* ``sharded``: a :class:`~vfsdp.collectives.Piece` (a parameter shard, i.e. a view
  into a DBuffer, becomes one: its global shape comes from the spec);
* ``replicated``: any other tensor, the same on every rank (checked at save time);
* ``value``: a ``bool``, ``int``, ``float`` or ``str`` (stored in the manifest).

Objects that implement :class:`vfsdp.functional.Checkpointable` (vfsdp's optimizer states
do) or whose type is registered with :func:`register_state` flatten into such a tree, and are
restored after a load. Entry names depend on tensor paths only, never on unit keys, so a
checkpoint reloads under any other plan.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import optree
import torch

from vfsdp.collectives.dbuffer import DBuffer, View, slot_of
from vfsdp.collectives.piece import Piece, tensor_piece
from vfsdp.functional.state import Checkpointable
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec

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


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (row-major), from a private host copy.

    Never ``.numpy()`` the original: numpy pins its storage as non-resizable, and DBuffers
    release and re-allocate memory by resizing storages.
    """
    return t.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    if not isinstance(dtype := getattr(torch, name, None), torch.dtype):
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
        >>> import dataclasses, os, tempfile
        >>> @dataclasses.dataclass
        ... class Seen:
        ...     step: int
        ...     counts: torch.Tensor
        >>> vfsdp.checkpoint.register_state(
        ...     Seen, lambda s, spec: {"step": s.step, "counts": s.counts},
        ...     lambda s, tree: dataclasses.replace(s, step=tree["step"]))
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> def body():
        ...     spec = vfsdp.plan({}, 1)
        ...     vfsdp.checkpoint.save(path, {"seen": Seen(7, torch.arange(3.0))}, spec)
        ...     back = vfsdp.checkpoint.load(path, {"seen": Seen(0, torch.zeros(3))}, spec)
        ...     return back["seen"].step, back["seen"].counts.tolist()
        >>> vfsdp.testing.simulate(1, body)
        [(7, [0.0, 1.0, 2.0])]
    """
    if not isinstance(cls, type) or not callable(flatten) or not callable(restore):
        raise TypeError("register_state(cls, flatten, restore) takes a type and two callables")
    _ADAPTERS[cls] = (flatten, restore)


def _db_piece(t: torch.Tensor, db: DBuffer, k: int, name: str) -> Piece:
    """The Piece of a tensor that its slot says is tensor ``k``'s local view of ``db``.

    Raises:
        ValueError: ``t`` no longer sits where its slot says (e.g. a re-viewed copy).
    """
    if not db.is_local_view(k, t):
        raise ValueError(f"checkpoint: {name} claims to be {format_path(db.tensors[k].path)}'s "
                         f"piece of the {db.name} buffer of unit {db.key!r} but is not that "
                         f"memory; pass the tensors vfsdp.shard (or the optimizer) returned")
    return tensor_piece(db.tensors[k], t, db.rank, db.groups.replicate_rank == 0, db=db, index=k)


def _adapter(leaf: Any):
    """``(flatten(obj, spec), restore(obj, tree))`` for a state object, or ``None``."""
    if type(leaf) not in _ADAPTERS and isinstance(leaf, Checkpointable) and not isinstance(leaf, type):
        return (lambda obj, spec: obj.checkpoint_tree(spec),
                lambda obj, tree: obj.restore_checkpoint(tree))
    return _ADAPTERS.get(type(leaf))


def is_state_leaf(x: Any) -> bool:
    """Whether a checkpoint flattens ``x`` as a whole (a state object, a Piece, a DBuffer)."""
    return _adapter(x) is not None or isinstance(x, (Piece, DBuffer))


def flatten(tree: Any, spec: ShardSpec, what: str = "checkpoint", prefix: tuple = ()) -> list[Entry]:
    """The entries of ``tree``, in optree order (named under ``prefix``: a part's name).

    Raises:
        TypeError: a leaf that cannot be checkpointed (naming its path and what to do).
        ValueError: two leaves with the same dotted name, or a gathered full view.
    """
    out = _tie_once(_flatten_into(tree, spec, prefix, [], what))
    if (twice := next((n for n, k in collections.Counter(e.name for e in out).items() if k > 1),
                      None)) is not None:
        raise ValueError(f"{what}: two leaves are both named {twice!r}; rename one (dotted "
                         f"key paths must be unique)")
    return out


def _tie_once(entries: list[Entry]) -> list[Entry]:
    """A tie (one shard at several paths) once, under the name of the plan's path for it
    (the path registered first: ``transformer.wte.weight``, not ``lm_head.weight``)."""
    by_piece: dict = {}
    for e in entries:
        if e.kind == "sharded" and e.piece.db is not None:
            by_piece.setdefault((id(e.piece.db), e.piece.index), []).append(e)
    drop = set()
    for tied in by_piece.values():
        path = format_path(tied[0].piece.db.tensors[tied[0].piece.index].path)
        keep = next((e for e in tied if e.name == path or e.name.endswith("." + path)), tied[0])
        drop.update(id(e) for e in tied if e is not keep)
    return [e for e in entries if id(e) not in drop]


def _flatten_into(tree: Any, spec: ShardSpec, prefix: tuple, out: list, what: str) -> list[Entry]:
    for path, leaf in zip(*optree.tree_flatten_with_path(tree, is_leaf=is_state_leaf)[:2]):
        path = prefix + tuple(path)
        name = format_path(path)
        slot = slot_of(leaf)
        if slot is not None and slot.view is View.LOCAL:
            leaf = _db_piece(leaf, slot.buffer, slot.index, name)
        if (adapter := _adapter(leaf)) is not None:
            _flatten_into(adapter[0](leaf, spec), spec, path, out, what)
        elif isinstance(leaf, Piece):
            out.append(Entry(name, "sharded", tuple(leaf.shape), leaf.local.dtype, piece=leaf))
        elif isinstance(leaf, torch.Tensor):
            if slot is not None:
                raise ValueError(f"{what}: {name} is a gathered full view; pass the shards "
                                 f"(the tree vfsdp.shard returned), not vfsdp.gather's output")
            if slot_of(leaf._base) is not None:
                raise ValueError(f"{what}: {name} is a view of a vfsdp buffer (e.g. a reshaped "
                                 f"shard); pass the tensor vfsdp handed out itself")
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
    return out


def unflatten(tree: Any, spec: ShardSpec, values: dict, prefix: tuple = ()) -> Any:
    """``tree`` with its plain values replaced by ``values[name]`` and registered states
    restored (tensors were filled in place and stay the same objects)."""
    def one(path: tuple, leaf: Any) -> Any:
        path = prefix + path
        if (adapter := _adapter(leaf)) is not None:
            return adapter[1](leaf, unflatten(adapter[0](leaf, spec), spec, values, path))
        return values.get(format_path(path), leaf) if isinstance(leaf, VALUE_TYPES) else leaf

    return optree.tree_map_with_path(one, tree, is_leaf=is_state_leaf)
