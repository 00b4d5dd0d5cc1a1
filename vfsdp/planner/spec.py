"""The shard spec: frozen, hashable, introspectable output of ``vfsdp.plan``, in three types:

* :class:`UnitLayout`: one communication unit (one all-gather): ``world_size`` (m),
  ``shard_numel`` (S), ``dtype``, and its tensors' paths in buffer order.
* :class:`TensorSpec`: one tensor leaf: ``unit``, ``offset`` (in the unit's global ``m*S``
  buffer), ``numel``, ``shape``, ``block``, ``placement`` and ``local_range(rank)``.
* :class:`ShardSpec`: the tree of ``TensorSpec`` leaves mirroring ``params`` plus the units.

Layout of a unit's buffer, rank r owning ``[r*S, (r+1)*S)``::

    rank 0           rank 1           rank 2
    |q q q q q q|k k k k . .|v v v v v v|      . = padding, only between tensors
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import math
import statistics
import threading
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from types import MappingProxyType
from typing import Any, Optional

import optree
import torch

from vfsdp._torch_private import compiling as _compiling
from vfsdp.placements.ragged import RaggedShard, piece_shape
from vfsdp.placements.strided import StridedRaggedShard
from vfsdp.planner.flatten import Structure
from vfsdp.planner.granularity import format_path

__all__ = ["UnitLayout", "TensorSpec", "ShardSpec", "SplitSuggestion", "PASSTHROUGH", "unit_name"]


def refuse_non_tree(tree: Any, what: str) -> None:
    """Refuse, with the fix, a module or an iterator where a pytree of tensors goes.

    Raises:
        TypeError: naming what was passed and what to pass instead.
    """
    if isinstance(tree, torch.nn.Module):
        raise TypeError(f"{what}: got a {type(tree).__name__} module; vfsdp works on pytrees of "
                        f"tensors: pass dict(model.named_parameters())")
    if isinstance(tree, Iterator):
        raise TypeError(f"{what}: got an iterator ({type(tree).__name__}), which can be read only "
                        f"once and has no names; pass dict(model.named_parameters()) or a "
                        f"dict/list of tensors")



def unit_name(key: Hashable) -> str:
    """Readable name of a unit key: ``('layers', 3)`` -> ``'layers.3'``, ``()`` -> ``'<root>'``."""
    return format_path(key) if isinstance(key, tuple) else str(key)


def over(padded: int, total: int) -> float:
    """A padding ratio.

    Args:
        padded: Elements with padding (``m * S``).
        total: Elements of the tensors.

    Returns:
        ``(padded - total) / total``, or 0 when ``total`` is 0.

    Example:
        >>> over(12, 10)
        0.2
    """
    return (padded - total) / total if total else 0.0


class _Passthrough:
    """Marks a non-tensor leaf of ``params``: it is not sharded and passes through untouched."""

    def __repr__(self) -> str:
        return "PASSTHROUGH"

    __reduce__ = __repr__  # pickles (and copies) as this module's ``PASSTHROUGH``


PASSTHROUGH = _Passthrough()
"""The marker a spec tree holds where the parameter tree holds a non-tensor leaf."""


@dataclass(frozen=True)
class SplitSuggestion:
    """An offer to split a heavily padded unit in two (one more collective per step).

    Attributes:
        moved: Paths that would form the new unit.
        padding_now: Padding elements of the unit as planned.
        padding_after: Padding elements of the two units together.
        total_numel: The unit's elements, for ratios.

    Example:
        >>> SplitSuggestion((("big",),), padding_now=900, padding_after=12, total_numel=1000)
        split off [big]: padding 90.00% -> 1.20% at the cost of one more all-gather
    """

    moved: tuple[tuple, ...]
    padding_now: int
    padding_after: int
    total_numel: int

    def __repr__(self) -> str:
        e = max(self.total_numel, 1)
        names = ", ".join(format_path(p) for p in self.moved[:3])
        more = f" (+{len(self.moved) - 3} more)" if len(self.moved) > 3 else ""
        return (
            f"split off [{names}{more}]: padding {100 * self.padding_now / e:.2f}% -> "
            f"{100 * self.padding_after / e:.2f}% at the cost of one more all-gather"
        )


@dataclass(frozen=True)
class UnitLayout:
    """One communication unit: a flat buffer of ``world_size * shard_numel`` elements.

    Attributes:
        key: The unit key (e.g. ``('layers', 3)``; ``()`` is the root unit).
        world_size: ``m``, ranks in the shard group.
        shard_numel: ``S``, elements per rank.
        dtype: The single dtype of the unit's tensors.
        paths: Tensor paths in buffer order.
        offsets: Start of each tensor (same order as ``paths``), in elements.
        numels: Elements of each tensor (same order).
        blocks: Block of each tensor in elements (same order).
        shapes: Shape of each tensor (same order).
        lower_bound: Certified lower bound on ``S``.
        alignment: ``S`` is a multiple of this many elements.
        strategy: The ordering strategy the solver used.
        split: A :class:`SplitSuggestion` when the unit is heavily padded, else ``None``.
        strided: Each tensor's :class:`~vfsdp.placements.StridedRaggedShard` (same order),
            or ``()`` when no model axis splits any of them.

    Example:
        >>> u = vfsdp.plan({"a": torch.empty(5), "b": torch.empty(3, 3)}, 2).units[()]
        >>> u.shard_numel, u.paths, u.offsets, u.padded_numel - u.total_numel
        (8, (('a',), ('b',)), (0, 5), 2)
    """

    key: Hashable
    world_size: int
    shard_numel: int
    dtype: torch.dtype
    paths: tuple[tuple, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    blocks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    lower_bound: int
    alignment: int = 1
    strategy: str = "given"
    split: Optional[SplitSuggestion] = field(default=None, compare=False)
    strided: tuple = ()

    def __getstate__(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # not the caches below

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The unit's :class:`TensorSpec` s in buffer order, built from this layout alone, one
        field at a time over all of them (a unit can hold thousands)."""
        specs = tuple(map(object.__new__, itertools.repeat(TensorSpec, len(self.paths))))
        repeat = itertools.repeat
        columns = {"path": self.paths, "unit": repeat(self.key), "offset": self.offsets,
                   "numel": self.numels, "shape": map(tuple, self.shapes), "dtype": repeat(self.dtype),
                   "block": self.blocks, "layout": repeat(self), "strided": self.strided or repeat(None)}
        for f in fields(TensorSpec):  # the slots' own setters: TensorSpec is frozen
            collections.deque(map(getattr(TensorSpec, f.name).__set__, specs, columns[f.name]), maxlen=0)
        return specs

    @cached_property
    def _pieces(self) -> dict:
        return {}

    @cached_property
    def _index(self) -> dict:
        return {p: k for k, p in enumerate(self.paths)}

    def pieces(self, rank: int) -> tuple:
        """``(start in the shard, local shape)`` of each tensor's piece on ``rank``, in buffer
        order; made once per rank and kept (every buffer of the unit reads them)."""
        found = self._pieces.get(rank)
        if found is None:
            found = self._pieces[rank] = tuple((t.shard_range(rank)[0], t.local_shape(rank))
                                               for t in self.tensors)
        return found

    def index(self, path: tuple) -> int:
        """Position of a tensor path in the buffer order.

        Raises:
            KeyError: the path is not in this unit.
        """
        try:
            return self._index[tuple(path)]
        except KeyError:
            raise KeyError(f"{format_path(tuple(path))} is not in unit {unit_name(self.key)}") from None

    @property
    def total_numel(self) -> int:
        """Elements of real tensors in the unit (``E``)."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        """Size of the global buffer, ``m * S``."""
        return self.world_size * self.shard_numel

    @property
    def padding_ratio(self) -> float:
        """``(m*S - E) / E`` (0 for an empty unit)."""
        return over(self.padded_numel, self.total_numel)

    @property
    def lower_bound_ratio(self) -> float:
        """Padding ratio the lower bound would give."""
        return over(self.world_size * self.lower_bound, self.total_numel)

    @property
    def signature(self) -> tuple:
        """What makes two units identical layouts (shapes aside): numels, blocks, m, S."""
        return (self.numels, self.blocks, self.world_size, self.shard_numel, self.dtype,
                self.offsets)

    def tensors_per_rank(self) -> list[int]:
        """How many tensors each rank holds a non-empty piece of."""
        s, m = self.shard_numel, self.world_size
        diff = [0] * (m + 1)
        for off, e in zip(self.offsets, self.numels):
            if e and s:
                diff[off // s] += 1
                diff[(off + e - 1) // s + 1] -= 1
        return list(itertools.accumulate(diff[:m]))

    def tensors_per_rank_summary(self) -> tuple[int, float, int]:
        """``(min, median, max)`` of :meth:`tensors_per_rank`."""
        counts = self.tensors_per_rank()
        return min(counts), statistics.median(counts), max(counts)

    def __repr__(self) -> str:
        lo, med, hi = self.tensors_per_rank_summary()
        return (
            f"UnitLayout({unit_name(self.key)}: {len(self.paths)} tensors, {self.dtype}, "
            f"m={self.world_size}, S={self.shard_numel}, padding {100 * self.padding_ratio:.3f}% "
            f"(bound {100 * self.lower_bound_ratio:.3f}%), tensors/rank {lo}/{med:g}/{hi})"
        )


@dataclass(frozen=True, eq=False, slots=True)
class TensorSpec:
    """Where one tensor lives. Immutable; built by ``vfsdp.plan``.

    Attributes:
        path: optree key path of the tensor.
        unit: Key of its unit.
        offset: Start in the unit's global buffer, in elements.
        numel, shape, dtype: Of the full tensor.
        block: Indivisible block in elements (a short last block is allowed for ``rows``).
        layout: The :class:`UnitLayout` it belongs to.
        strided: Where this tensor (a model-parallel piece: ``shape`` is the piece's) sits in
            its global tensor, a :class:`~vfsdp.placements.StridedRaggedShard`, or ``None``
            (the tensor is the global one). Set by ``vfsdp.plan(..., tp=rule)``.

    Example:
        >>> t = vfsdp.plan({"w": torch.empty(10, 4)}, 4, granularity=vfsdp.rows(1)).tensor(("w",))
        >>> t.offset, t.block, t.placement, t.local_range(1)
        (0, 4, RaggedShard(dims=(0,), local_units=(3x3, 1)), (12, 24))
    """

    path: tuple
    unit: Hashable
    offset: int
    numel: int
    shape: tuple
    dtype: torch.dtype
    block: int
    layout: UnitLayout
    strided: Optional[StridedRaggedShard] = None

    def _key(self) -> tuple:
        return (self.path, self.unit, self.offset, self.numel, self.shape, self.dtype, self.block,
                self.layout.world_size, self.layout.shard_numel, self.strided)

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def global_shape(self) -> tuple:
        """Shape of the global tensor (``shape`` unless a model axis splits it)."""
        return tuple(self.shape) if self.strided is None else self.strided.global_shape

    def ranks(self) -> range:
        """Ranks holding a non-empty piece of this tensor."""
        if not self.numel:
            return range(0)
        s = self.layout.shard_numel
        return range(self.offset // s, (self.offset + self.numel - 1) // s + 1)

    def local_range(self, rank: int) -> tuple[int, int]:
        """Flat ``[start, stop)`` of this tensor (tensor-relative) owned by ``rank``.

        Example:
            >>> spec = vfsdp.plan({"w": torch.empty(10)}, 4)
            >>> spec.tree["w"].local_range(1)
            (4, 8)
        """
        if not 0 <= rank < self.layout.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.layout.world_size}")
        s = self.layout.shard_numel
        lo = min(max(self.offset, rank * s), self.offset + self.numel)
        hi = max(min(self.offset + self.numel, (rank + 1) * s), lo)
        return (lo - self.offset, hi - self.offset)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """``local_shape(self.placement, self.shape, rank)`` without building the placement."""
        start, stop = self.local_range(rank)
        return piece_shape(self.shape, len(self.dims), stop - start)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Where ``rank``'s piece sits in that rank's ``S``-element shard buffer."""
        start, stop = self.local_range(rank)
        base = self.offset - rank * self.layout.shard_numel
        return (max(base + start, 0), max(base + stop, 0)) if stop > start else (0, 0)

    @property
    def dims(self) -> tuple[int, ...]:
        """Prefix dims of the ``RaggedShard`` placement (whole trailing slabs per unit)."""
        unit = math.gcd(self.block, self.numel) if self.numel else 1
        return tuple(range(next(d for d in range(1 if self.shape else 0, len(self.shape) + 1)
                                if unit % max(math.prod(self.shape[d:]), 1) == 0)))  # d=ndim fits

    @property
    def placement(self) -> RaggedShard:
        """This tensor's ``RaggedShard(dims, local_units)`` over the unit's shard group.

        The unit is ``gcd(block, numel)`` elements (the block, or a divisor of it when a short
        last block exists); a 0-size tensor has all-zero ``local_units``.
        """
        unit, ranks = math.gcd(self.block, self.numel), self.ranks()  # no ranks for a 0-size tensor
        units = [0] * self.layout.world_size
        units[ranks.start:ranks.stop] = [(b - a) // unit for a, b in map(self.local_range, ranks)]
        return RaggedShard(self.dims, tuple(units))

    def __repr__(self) -> str:
        return (
            f"TensorSpec({format_path(self.path)}: shape={tuple(self.shape)}, unit="
            f"{unit_name(self.unit)}, offset={self.offset}, block={self.block}, "
            f"ranks {self.ranks().start}..{max(self.ranks().stop - 1, self.ranks().start)})"
        )


def _checked(treespec: Any, leaves: Iterable) -> tuple:
    leaves = tuple(leaves)
    if not callable(treespec) and treespec.num_leaves != len(leaves):  # a made one
        raise ValueError("ShardSpec: treespec and leaves disagree")
    return leaves


_LAZY_LOCK = threading.RLock()  # ShardSpec's leaves and treespec: made once where threads share a spec

class ShardSpec:
    """A frozen, hashable plan for a parameter pytree.

    Attributes:
        units: Read-only mapping ``unit key -> UnitLayout`` in buffer-creation order.
        mesh_shape: Shape of the device mesh; the last dim is the shard dim.
        mesh_dim_names: Names of the mesh dims, or ``None``.
        world_size: ``m``, size of the shard dim.
        treespec: The optree structure of ``params`` (``vfsdp.plan`` of a tree of plain
            dicts, lists and tuples makes it when first read).
        frozen: The paths of the frozen tensors: ``nn.Parameter`` leaves with
            ``requires_grad=False`` (a module's ``requires_grad_(False)``). Their shards do
            not require grad.

    Example:
        >>> layers = [{"w": torch.empty(8, 4)} for _ in range(2)]
        >>> spec = vfsdp.plan({"layers": layers, "b": torch.empty(3)}, 4)
        >>> list(spec.units), spec.world_size, list(spec["layers"][1].units)
        ([(), ('layers', 0), ('layers', 1)], 4, [('layers', 1)])
    """

    # The plan's own data and caches of it (fingerprint, lookups, sub-specs, local plans):
    # nothing of any process's runtime.
    __slots__ = ("units", "mesh_shape", "mesh_dim_names", "_treespec", "frozen", "_leaves",
                 "_kept", "_subs", "_local", "__weakref__")

    def __init__(self, treespec, leaves, units: Mapping, mesh_shape, mesh_dim_names=None,
                 frozen: Iterable = ()) -> None:
        set_ = object.__setattr__
        set_(self, "frozen", frozenset(frozen))
        set_(self, "_treespec", treespec)  # or a function that makes it
        set_(self, "_leaves", leaves if callable(leaves) else _checked(self.treespec, leaves))
        set_(self, "units", MappingProxyType(dict(units)))
        set_(self, "mesh_shape", tuple(mesh_shape))
        set_(self, "mesh_dim_names", None if mesh_dim_names is None else tuple(mesh_dim_names))
        set_(self, "_kept", {})  # "fingerprint", "by_path", "by_unit" -> made once
        set_(self, "_subs", {})  # key -> sub-spec, made once
        set_(self, "_local", {})  # rank (or None) -> planner.local.local_plan, made once

    def __setattr__(self, name, value):
        raise AttributeError("ShardSpec is immutable")

    def __reduce__(self):
        return (ShardSpec, (self.treespec, self.leaves(), dict(self.units), self.mesh_shape,
                            self.mesh_dim_names, self.frozen))

    @property
    def world_size(self) -> int:
        return self.mesh_shape[-1]

    @property
    def replicas(self) -> int:
        """Product of the non-shard mesh dims (1 for plain FSDP)."""
        return math.prod(self.mesh_shape[:-1])

    @property
    def model_axis(self) -> Optional[tuple[str, int, int]]:
        """``(axis, size, index)`` when ``vfsdp.plan(..., tp=rule)`` split the tensors over a
        model axis (this spec is of index ``index``'s pieces), else ``None``."""
        st = next((t.strided for t in self.tensors() if t.strided is not None), None)
        return None if st is None else (st.axis, st.size, st.index)

    @property
    def treespec(self) -> Any:
        """The optree structure of ``params`` (made when first read, where the spec was given
        a function that makes it)."""
        return self._made("_treespec")

    def _made(self, slot: str) -> Any:
        """The slot's value, made (once, where threads share the spec) where it holds a function
        that makes it."""
        if callable(value := getattr(self, slot)):
            with _LAZY_LOCK:
                if callable(value := getattr(self, slot)):
                    value = value() if slot == "_treespec" else _checked(self._treespec, value())
                    object.__setattr__(self, slot, value)
        return value

    def same_structure(self, treespec: Any, tree: Any) -> bool:
        """Whether ``treespec``, ``tree``'s optree treespec, is this spec's structure. A spec
        whose treespec is not made yet compares ``tree`` with the structure ``vfsdp.plan``
        recorded and, where they match, takes ``treespec`` as its own (``vfsdp.shard`` and
        ``gather`` check their tree so, without making the spec's treespec again).

        Example:
            >>> import optree
            >>> spec = vfsdp.plan({"w": torch.ones(4)}, 2)
            >>> spec.same_structure(optree.tree_structure({"w": 0}), {"w": 0})
            True
        """
        lazy = self._treespec
        if isinstance(lazy, Structure) and lazy.matches(tree):
            with _LAZY_LOCK:
                if self._treespec is lazy:
                    object.__setattr__(self, "_treespec", treespec)
        return treespec == self.treespec

    @property
    def tree(self) -> Any:
        """A fresh pytree mirroring ``params``: ``TensorSpec`` leaves, ``PASSTHROUGH`` elsewhere."""
        return optree.tree_unflatten(self.treespec, list(self.leaves()))

    def leaves(self) -> tuple:
        """The spec leaves in optree order (made when first read, where the spec was given a
        function that makes them: ``vfsdp.plan`` does, so a plan only read by unit is quick)."""
        return self._made("_leaves")

    def tensors(self) -> Iterator[TensorSpec]:
        """The ``TensorSpec`` s in optree order, each once (a tied tensor appears at several
        leaves but is one tensor), made as they are read: a caller that stops early (e.g.
        :attr:`model_axis`, at the first split tensor) walks no further."""
        seen: set = set()
        for x in self.leaves():
            if isinstance(x, TensorSpec) and id(x) not in seen:
                seen.add(id(x))
                yield x

    @property
    def ties(self) -> Mapping[tuple, tuple]:
        """``{leaf path: path of the tensor it is}`` for leaves that repeat another (tied
        weights: the same tensor at two places). Empty when nothing is tied.

        Example:
            >>> w = torch.empty(8, 4)
            >>> dict(vfsdp.plan({"embed": w, "head": w}, 2).ties)
            {('head',): ('embed',)}
        """
        return MappingProxyType({p: t.path for p, t in zip(self.treespec.paths(), self.leaves())
                                 if isinstance(t, TensorSpec) and tuple(p) != t.path})

    def tensor(self, path: tuple) -> TensorSpec:
        """The ``TensorSpec`` at an optree key path (a tied leaf's path gives its tensor).

        Raises:
            KeyError: no tensor at that path.
        """
        if "by_path" not in self._kept:
            at_leaves = zip(map(tuple, self.treespec.paths()), self.leaves())
            self._kept["by_path"] = {**{p: t for p, t in at_leaves if isinstance(t, TensorSpec)},
                                     **{t.path: t for t in self.tensors()}}
        try:
            return self._kept["by_path"][tuple(path)]
        except KeyError:
            raise KeyError(f"no tensor at path {format_path(tuple(path))!r}") from None

    def unit_leaves(self) -> Mapping[Hashable, tuple[tuple[int, int], ...]]:
        """``unit key -> ((leaf index, buffer index), ...)`` for the tensor leaves of this
        (sub-)spec, in leaf order. Computed once per spec and kept with it.

        Example:
            >>> spec = vfsdp.plan({"a": torch.empty(3), "b": torch.empty(5)}, 2)
            >>> dict(spec.unit_leaves())
            {(): ((0, 0), (1, 1))}
        """
        if "by_unit" not in self._kept:
            groups: dict = {}
            for i, s in enumerate(self.leaves()):
                if isinstance(s, TensorSpec):
                    groups.setdefault(s.unit, []).append((i, s.layout.index(s.path)))
            self._kept["by_unit"] = MappingProxyType({k: tuple(v) for k, v in groups.items()})
        return self._kept["by_unit"]

    def unit_tensors(self, key: Hashable) -> tuple[TensorSpec, ...]:
        """The ``TensorSpec`` s of one unit, in buffer order.

        Raises:
            KeyError: no such unit, or the unit is only partly in this (sub-)spec.
        """
        if key not in self.units:
            raise KeyError(f"no unit {unit_name(key)!r} in this spec")
        return tuple(self.tensor(p) for p in self.units[key].paths)

    def __getitem__(self, key) -> ShardSpec:
        """Sub-spec of a subtree, e.g. ``spec["layers"][3]`` for one layer's unit(s). Made
        once per key and kept (under ``torch.compile`` only kept ones are looked up: those
        :func:`vfsdp.shard` prepared, every subtree down to the leaves' containers).

        Raises:
            KeyError, IndexError: no such subtree.
            ValueError: while compiling, a sub-spec that was not prepared.
        """
        try:
            return self._subs[key]
        except (KeyError, TypeError):
            pass
        if _compiling():
            raise ValueError(f"vfsdp: spec[{key!r}] under torch.compile: only sub-specs made "
                             f"before compiling can be looked up; take it from a spec "
                             f"vfsdp.shard made shards for, or index it once before compiling")
        found = self.of_subtree(self.tree[key])
        with contextlib.suppress(TypeError):  # an unhashable key: not kept
            self._subs[key] = found
        return found

    def of_subtree(self, sub: Any) -> ShardSpec:
        """The spec of ``sub``, a subtree of :attr:`tree` (or a copy of it with some subtrees
        cut out): its tensors' units, this spec's mesh, its frozen paths.

        Args:
            sub: The subtree, its leaves this spec's ``TensorSpec`` s (and ``PASSTHROUGH``).

        Returns:
            A :class:`ShardSpec` of ``sub``.

        Example:
            >>> spec = vfsdp.plan({"a": torch.empty(4), "b": [torch.empty(2)]}, 2)
            >>> list(spec.of_subtree({"b": spec.tree["b"]}).units)
            [('b', 0)]
        """
        leaves, treespec = optree.tree_flatten(sub)
        tensors = [x for x in leaves if isinstance(x, TensorSpec)]
        keys = {x.unit for x in tensors}
        return ShardSpec(treespec, leaves, {k: v for k, v in self.units.items() if k in keys},
                         self.mesh_shape, self.mesh_dim_names, {x.path for x in tensors} & self.frozen)

    @property
    def fingerprint(self) -> str:
        """SHA-256 of a canonical description; equal on every rank and in every process."""
        if "fingerprint" not in self._kept:
            h = hashlib.sha256()
            h.update(repr((str(self.treespec), self.mesh_shape, self.mesh_dim_names)).encode())
            for u in self.units.values():
                h.update(repr((u.key, u.world_size, u.shard_numel, str(u.dtype), u.paths,
                               u.offsets, u.numels, u.blocks, u.alignment,
                               u.strided)).encode())
            for x in self.leaves():
                h.update(repr(x._key() if isinstance(x, TensorSpec) else "passthrough").encode())
            if self.frozen:
                h.update(repr(sorted(map(repr, self.frozen))).encode())
            self._kept["fingerprint"] = h.hexdigest()
        return self._kept["fingerprint"]

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardSpec) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def recipe(self) -> str:
        """The ``vfsdp.plan(...)`` call that rebuilds this spec, as Python code: each tensor's
        block and unit, the mesh and the alignment (:func:`vfsdp.planner.recipe.recipe`).
        Print it from a shrunk hypothesis example to plan the same spec again."""
        from vfsdp.planner.recipe import recipe  # it reads the spec's classes

        return recipe(self)

    def __repr__(self) -> str:
        from vfsdp.planner.table import format_spec  # the table reads the spec's classes

        return format_spec(self, max_rows=12)
