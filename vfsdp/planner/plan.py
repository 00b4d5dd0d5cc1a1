"""``vfsdp.plan``: a pure function from a parameter pytree and a mesh to a :class:`ShardSpec`.

No process group is needed or touched: a ``DeviceMesh`` is only read for its shape.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter, itemgetter
from typing import Any, Optional, Union

import optree
import torch

from vfsdp._gc import paused_gc
from vfsdp.planner.abstract import TENSOR_LEAVES, ShapeDtype, is_tensor_leaf
from vfsdp.planner.flatten import flatten_with_path
from vfsdp.planner.granularity import Granularity, block_elements, format_path
from vfsdp.planner.model_split import split_params
from vfsdp.planner.solver import lower_bound, pack
from vfsdp.planner.spec import (
    PASSTHROUGH,
    ShardSpec,
    SplitSuggestion,
    UnitLayout,
    refuse_non_tree,
    unit_name,
)

__all__ = ["plan", "prepare", "unit_layouts", "assemble", "Prepared", "resolve_mesh",
           "alignment_elements", "Units"]

Units = Union[None, int, Callable[[tuple], Hashable], Sequence[Union[str, tuple]]]
ROOT: tuple = ()


def resolve_mesh(mesh: Any) -> tuple[tuple[int, ...], Optional[tuple[str, ...]]]:
    """Mesh shape and dim names from an int, a tuple of ints, or a ``DeviceMesh``.

    The last dim is the shard dim; any leading dims are replicate dims (HSDP).

    Raises:
        ValueError: a dim smaller than 1.
        TypeError: anything else.
    """
    names = None
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        shape = (mesh,)
    elif isinstance(mesh, tuple) and mesh and all(isinstance(d, int) for d in mesh):
        shape = mesh
    elif (isinstance(mesh, tuple) and mesh
          and all(isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str)
                  and isinstance(a[1], int) for a in mesh)):  # (("dp", 2), ("tp", 2))
        names, shape = map(tuple, zip(*mesh))
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must differ, got {names}")
    elif hasattr(mesh, "mesh") and hasattr(mesh, "mesh_dim_names"):  # torch DeviceMesh
        shape = tuple(int(d) for d in mesh.mesh.shape)
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    else:
        raise TypeError(
            f"mesh must be an int world size, a tuple (replicate, ..., shard) of ints, "
            f"(name, size) axes, or a torch DeviceMesh; got {type(mesh).__name__}"
        )
    if any(d < 1 for d in shape):
        raise ValueError(f"world size must be >= 1 on every mesh dim, got mesh shape {shape}")
    return shape, names


def alignment_elements(
    dtype: torch.dtype, alignment_bytes: int, comm_dtypes: Sequence[torch.dtype] = ()
) -> int:
    """Elements ``S`` must be a multiple of, so that ``S`` of every dtype in ``(dtype,
    *comm_dtypes)`` is a multiple of ``alignment_bytes`` (at least 1 element).

    Example:
        >>> alignment_elements(torch.float32, 16, [torch.bfloat16])
        8
    """
    return math.lcm(*(max(1, alignment_bytes // dt.itemsize) for dt in (dtype, *comm_dtypes)))


def _logical(path: tuple) -> tuple:
    """Split dotted string entries and turn digit strings into ints: 'layers.3.w' -> layers, 3, w."""
    parts = (part for entry in path for part in (entry.split(".") if isinstance(entry, str) else (entry,)))
    return tuple(int(part) if isinstance(part, str) and part.isdigit() else part for part in parts)


def _outer_sequences(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of the outermost (non-empty) list/tuple nodes of ``node`` (at ``path``).

    Descends with ``optree.tree_flatten_one_level`` through non-sequence nodes only, so it
    touches the few nodes above the layers, not the leaves below them.
    """
    if type(node) in (list, tuple):
        return [path] if node else []
    if is_tensor_leaf(node) or optree.tree_is_leaf(node):
        return []
    level = optree.tree_flatten_one_level(node)
    return [found for entry, child in zip(level.entries, level.children)
            for found in _outer_sequences(child, path + (entry,))]


def _grouped(keys: list, unit_of: Callable[[Any], Hashable] = lambda key: key) -> dict[Hashable, list]:
    """Positions by unit, units in first-seen order; ``unit_of`` maps each run of equal
    ``keys`` to its unit's key."""
    grouped: dict[Hashable, list] = {}
    for key, run in itertools.groupby(range(len(keys)), keys.__getitem__):
        grouped.setdefault(unit_of(key), []).extend(run)
    return grouped


def _unit_groups(units: Units, paths: list[tuple], params: Any) -> dict[Hashable, list]:
    """The positions in ``paths`` of every unit's tensors, by unit key."""
    if units is None:
        seqs = sorted(_outer_sequences(params), key=repr)
        if seqs:  # a path's unit: its shallowest sequence's element, read once per run of paths
            seq_set, depths = set(seqs), sorted({len(s) for s in seqs})
            return _grouped(list(map(itemgetter(slice(0, depths[-1] + 1)), paths)),
                            lambda k: next((k[: d + 1] for d in depths if k[:d] in seq_set), ROOT))
        return _grouped([_layer_key(_logical(p)) for p in paths])
    if isinstance(units, int) and not isinstance(units, bool):
        if units < 0:
            raise ValueError(f"units depth must be >= 0, got {units}")
        return _grouped([_logical(p)[:units] for p in paths])
    if callable(units):
        keys = [units(p) for p in paths]
        for p, key in zip(paths, keys):
            try:
                hash(key)
            except TypeError:
                raise TypeError(
                    f"units callable returned an unhashable key {key!r} for {format_path(p)}; "
                    f"return a tuple, str or int"
                ) from None
        return _grouped(keys)
    if isinstance(units, (str, tuple)):
        units = [units]
    if not isinstance(units, Iterable):
        raise TypeError(f"unsupported units value {units!r}; pass None, an int depth, a callable "
                        f"or a list of prefixes")
    prefixes = [_logical((u,) if isinstance(u, str) else tuple(u)) for u in units]
    by_len = sorted(set(prefixes), key=len, reverse=True)
    keys = [next((q for q in by_len if lp[: len(q)] == q), ROOT) for lp in map(_logical, paths)]
    matched = set(keys)
    missing = [q for q in prefixes if q not in matched]
    if missing:
        raise ValueError(
            f"units prefix {format_path(missing[0])!r} matches no tensor; check the spelling "
            f"against the tree's paths (e.g. {format_path(paths[0]) if paths else 'none'!r})"
        )
    return _grouped(keys)


def _layer_key(lp: tuple) -> tuple:
    """A dotted name's layer: up to its first integer component (``ROOT`` without one)."""
    idx = next((i for i, x in enumerate(lp) if isinstance(x, int)), None)
    return ROOT if idx is None else lp[: idx + 1]


def _suggest_split(numels, blocks, m, align, shard_numel, threshold) -> Optional[tuple[int, int, tuple]]:
    """Best two-way split among simple candidates (by block size, by largest tensors), for a
    unit padded above ``threshold``.

    Returns ``(padding_now, padding_after, moved indices)`` or ``None`` when the unit is padded
    less, or no candidate at least halves the padding.
    """
    n, total = len(numels), sum(numels)
    now = m * shard_numel - total
    if n < 2 or not total or now <= threshold * total:
        return None
    candidates = [tuple(i for i in range(n) if blocks[i] == b) for b in sorted(set(blocks))]
    by_numel = sorted(range(n), key=lambda i: (-numels[i], i))
    candidates += [tuple(sorted(by_numel[:k])) for k in (1, 2, 3)]

    def padding(split, solve):
        pad = 0
        for part in split:
            ns, bs = [numels[i] for i in part], [blocks[i] for i in part]
            s = pack(ns, bs, m, align, search=False).shard_numel if solve else lower_bound(ns, bs, m, align)
            pad += m * s - sum(ns)
        return pad

    # Rank candidates by their (cheap) lower bounds; solve only the two most promising.
    splits = [(g, tuple(sorted(set(range(n)).difference(g))))
              for g in dict.fromkeys(candidates) if 0 < len(g) < n]
    splits.sort(key=lambda sp: (padding(sp, False), sp))
    best = min(((padding(sp, True), sp[0]) for sp in splits[:2]), key=lambda b: b[0], default=None)
    if best is None or best[0] * 2 > now:
        return None  # offer a split only when it at least halves the padding
    return now, best[0], best[1]


def plan(
    params: Any,
    mesh: Any,
    *,
    granularity: Granularity = None,
    units: Units = None,
    alignment_bytes: int = 16,
    comm_dtypes: Sequence[torch.dtype] = (),
    split_threshold: float = 0.01,
    tp: Optional[Callable[[tuple], Any]] = None,
    tp_axis: str = "tp",
    tp_index: Optional[int] = None,
) -> ShardSpec:
    """Plan how every tensor of ``params`` is sharded. Pure and deterministic.

    Args:
        params: Any optree pytree. ``torch.Tensor`` leaves (real or ``meta``) and
            :class:`vfsdp.ShapeDtype` leaves are sharded; other leaves pass through.
        mesh: An int world size, a tuple ``(replicate, ..., shard)`` of ints, a tuple of
            ``(name, size)`` axes, or a torch ``DeviceMesh`` (only its shape, names and, with
            ``tp``, this rank's coordinate are read; no process group is needed). Tensors are
            sharded over the last data dim.
        granularity: The indivisible block per tensor: ``None`` (elements), an int number of
            elements, ``vfsdp.rows(k)``, ``vfsdp.whole``, or a callable ``(path, tensor) ->
            one of those``. See :mod:`vfsdp.planner.granularity`.
        units: How tensors group into communication units (one all-gather each):

            * ``None`` (default): each element of every outermost list/tuple in the tree is
              its own unit, keyed by its path (``('layers', 3)``); all other tensors form the
              root unit ``()``. A tree with no list/tuple (e.g. a flat dict from
              ``named_parameters()``) is keyed by dotted names instead: the first integer
              component marks the layer, so ``'layers.3.mlp.w'`` goes to ``('layers', 3)``.
            * an int ``d``: the first ``d`` components of the (dot-split) path.
            * a callable ``path -> hashable key``, given the optree key path.
            * a list of path prefixes (tuples or dotted strings): each is a unit, and the
              remaining tensors form the root unit. A prefix matching nothing is an error.
        alignment_bytes: ``S`` is a multiple of this many bytes (16 suits NCCL).
        comm_dtypes: Other dtypes the buffers will be communicated in (e.g. ``[torch.bfloat16]``
            for a bf16 all-gather of fp32 shards); ``S`` is kept aligned in each of them.
        split_threshold: Units padded above this ratio get a split suggestion
            (``UnitLayout.split``); nothing is split unless you ask for it.
        tp: Tensor (or expert) parallelism: a rule ``path -> Shard(dim) | Replicate()``
            (torch's placement types) splitting each **global** tensor of ``params`` over the
            mesh axis ``tp_axis`` as ``torch.tensor_split`` does. The plan is then of this
            index's pieces over the remaining (data) axes: ``spec.mesh_shape`` has no
            ``tp_axis``, each ``TensorSpec.shape`` is the piece's, and
            ``TensorSpec.strided`` (a ``StridedRaggedShard``) says where it sits in the
            global tensor, for checkpoints and ``to_dtensor``. Expert parallelism is the same
            over an ``"ep"`` axis, ``Shard(0)`` of experts stacked on dim 0.
        tp_axis: The model-parallel axis' name in ``mesh``.
        tp_index: The index along ``tp_axis`` to plan for; default: this rank's coordinate
            in the ``DeviceMesh`` (required for a mesh given as ``(name, size)`` axes).

    Returns:
        A frozen, hashable :class:`ShardSpec` mirroring ``params``.

    Raises:
        ValueError: world size < 1, a unit mixing dtypes, a bad block, an unmatched prefix.
        TypeError: an unsupported mesh, granularity or units value.

    Example:
        >>> import torch, vfsdp
        >>> params = {"embed": torch.empty(100, 8, device="meta"),
        ...           "layers": [{"w": torch.empty(8, 8, device="meta")} for _ in range(2)]}
        >>> spec = vfsdp.plan(params, 4, granularity=vfsdp.rows(2))
        >>> spec.units[("layers", 0)].shard_numel
        16
    """
    refuse_non_tree(params, "vfsdp.plan")
    if isinstance(params, ShardSpec):
        raise TypeError("vfsdp.plan: got a ShardSpec; plan takes the parameter tree "
                        "(vfsdp.plan(params, mesh))")
    mesh_shape, mesh_names = resolve_mesh(mesh)
    if not isinstance(alignment_bytes, int) or alignment_bytes < 1:
        raise ValueError(f"alignment_bytes must be an int >= 1, got {alignment_bytes!r}")
    strided = tied = None
    if tp is not None:
        paths, leaves, _ = optree.tree_flatten_with_path(params)
        tied = find_ties(leaves, paths, [i for i, x in enumerate(leaves) if is_tensor_leaf(x)],
                         params)
        params, strided, mesh_shape, mesh_names = split_params(params, mesh, mesh_shape, mesh_names,
                                                               tp, tp_axis, tp_index)
    elif tp_index is not None:
        raise ValueError("vfsdp.plan: tp_index= without tp=; give the tp rule too")
    with paused_gc():
        prepared = prepare(params, granularity, units, strided, tied)
        layouts = unit_layouts(prepared, mesh_shape[-1], alignment_bytes, tuple(comm_dtypes),
                               split_threshold)
        return assemble(prepared, layouts, mesh_shape, mesh_names)


@dataclass(frozen=True)
class Prepared:
    """What :func:`plan` reads of a parameter tree, whatever the mesh: its structure, and per
    unit key its tensors (in tree order) with their paths, shapes, numels, blocks and dtype.
    :func:`unit_layouts` lays it out for a shard group of any size, so a sweep over GPU counts
    reads the tree once (``vfsdp.estimation.sweep``)."""

    treespec: Any              # optree's, or a function of no arguments that makes it
    num_leaves: int
    tied: dict                 # leaf index -> the leaf index it repeats
    members: dict              # unit key -> (leaf indices, paths, shapes, numels, blocks, dtype)
    strided: Optional[list]    # leaf index -> StridedRaggedShard, for a tp= plan
    frozen: frozenset = frozenset()  # paths of frozen tensors (ShardSpec.frozen)


def prepare(params: Any, granularity: Granularity = None, units: Units = None,
            strided: Optional[list] = None, tied: Optional[dict] = None,
            flat: Optional[tuple] = None) -> Prepared:
    """The mesh-independent half of :func:`plan` (see :class:`Prepared`); ``flat``: the
    tree's ``optree.tree_flatten_with_path``, where the caller has it already (else
    :func:`~vfsdp.planner.flatten.flatten_with_path`).

    Raises:
        ValueError: a complex tensor, a unit mixing dtypes, a bad block, an unmatched prefix.
    """
    paths, leaves, treespec = flat or flatten_with_path(params)
    abstract = set(map(type, leaves)) <= {ShapeDtype}  # no storage, nothing frozen
    all_idx = list(range(len(leaves))) if abstract else [
        i for i, x in enumerate(leaves) if isinstance(x, TENSOR_LEAVES)]
    if tied is None:  # leaf index -> the one it repeats
        tied = find_ties(leaves, paths, all_idx, params, storage=not abstract)
    t_idx = [i for i in all_idx if i not in tied] if tied else all_idx
    if len(t_idx) == len(leaves):  # every leaf a tensor, once
        t_paths, t_leaves = paths, leaves
    else:
        t_paths, t_leaves = _taker(t_idx)(paths), _taker(t_idx)(leaves)
    shapes = list(map(tuple, map(attrgetter("shape"), t_leaves)))
    dtypes = list(map(attrgetter("dtype"), t_leaves))
    distinct_dtypes = set(dtypes)
    if any(dt.is_complex for dt in distinct_dtypes):
        k = next(k for k, dt in enumerate(dtypes) if dt.is_complex)
        raise ValueError(f"vfsdp.plan: {format_path(t_paths[k])} is {dtypes[k]}; complex tensors "
                         f"are not supported (reductions and optimizers assume real values): "
                         f"store torch.view_as_real(t) instead")
    if callable(granularity):
        numels = list(map(math.prod, shapes))
        blocks = list(map(partial(block_elements, granularity), t_paths, shapes, numels, t_leaves))
    else:  # numel and block depend on the shape only: each distinct shape once, in tree order
        # (an error names the first tensor of that shape)
        of_shape = {sh: (n := math.prod(sh), block_elements(granularity, t_paths[shapes.index(sh)], sh, n,
                                                            None)) for sh in dict.fromkeys(shapes)}
        pairs = list(map(of_shape.__getitem__, shapes))
        numels, blocks = list(map(itemgetter(0), pairs)), list(map(itemgetter(1), pairs))
    members = {}
    for key, ks in _unit_groups(units, t_paths, params).items():
        take = _taker(ks)
        dtype, *others = dict.fromkeys(take(dtypes)) if len(distinct_dtypes) > 1 else distinct_dtypes
        if others:
            k = next(k for k in ks if dtypes[k] != dtype)
            raise ValueError(
                f"unit {unit_name(key)} mixes dtypes: {format_path(t_paths[ks[0]])} is "
                f"{dtype} but {format_path(t_paths[k])} is {dtypes[k]}. One unit is one "
                f"all-gather of one dtype: cast the tensors to one dtype, or pass units= "
                f"that puts them in separate units"
            )
        members[key] = (take(t_idx), take(t_paths), take(shapes), take(numels), take(blocks), dtype)
    frozen = frozenset() if abstract else frozenset(
        p for p, x in zip(t_paths, t_leaves) if isinstance(x, torch.nn.Parameter) and not x.requires_grad)
    return Prepared(treespec, len(leaves), tied, members, strided, frozen)


def unit_layouts(prepared: Prepared, m: int, alignment_bytes: int = 16,
                 comm_dtypes: Sequence[torch.dtype] = (),
                 split_threshold: float = 0.01) -> dict[Hashable, UnitLayout]:
    """Every unit's :class:`UnitLayout` over a shard group of ``m`` ranks, in unit order;
    units with the same numels, blocks and dtype are solved once."""
    layouts: dict[Hashable, UnitLayout] = {}
    solved: dict[tuple, tuple] = {}
    strided = prepared.strided
    for key, (idx, paths, shapes, numels, blocks, dtype) in prepared.members.items():
        signature = (numels, blocks, dtype)
        if signature not in solved:
            align = alignment_elements(dtype, alignment_bytes, comm_dtypes)
            packing = pack(numels, blocks, m, align)
            split = _suggest_split(numels, blocks, m, align, packing.shard_numel, split_threshold)
            solved[signature] = (packing, align, split)
        packing, align, split = solved[signature]
        take = _taker(packing.order)
        layouts[key] = UnitLayout(
            key=key,
            world_size=m,
            shard_numel=packing.shard_numel,
            dtype=dtype,
            paths=take(paths),
            offsets=take(packing.offsets),
            numels=take(numels),
            blocks=take(blocks),
            shapes=take(shapes),
            lower_bound=packing.lower_bound,
            alignment=align,
            strategy=packing.strategy,
            split=None if split is None else SplitSuggestion(
                tuple(paths[k] for k in split[2]), split[0], split[1], sum(numels)
            ),
            strided=() if strided is None else tuple(strided[idx[k]] for k in packing.order),
        )
    return layouts


def _taker(order: Sequence[int]) -> Callable[[Sequence], tuple]:
    """``seq -> tuple(seq[k] for k in order)``, in C (a unit can hold thousands of tensors):
    one slice where ``order`` is a run of consecutive indices."""
    start = order[0] if order else 0
    stop = start + len(order)
    if tuple(order) == tuple(range(start, stop)):
        return lambda seq: tuple(seq[start:stop])
    return itemgetter(*order)  # two or more: one index is a run


def assemble(prepared: Prepared, layouts: Mapping[Hashable, UnitLayout], mesh_shape: tuple,
             mesh_names: Optional[tuple] = None) -> ShardSpec:
    """The :class:`ShardSpec` of ``prepared`` laid out as ``layouts`` (from
    :func:`unit_layouts`) over ``mesh_shape``, whose last dim is the layouts' ``m``. Its
    :class:`TensorSpec` leaves are made when first read."""
    return ShardSpec(prepared.treespec, partial(_spec_leaves, prepared, layouts), layouts,
                     mesh_shape, mesh_names, frozen=prepared.frozen)


def _spec_leaves(prepared: Prepared, layouts: Mapping[Hashable, UnitLayout]) -> list:
    """The spec's leaves: each unit's :class:`TensorSpec` s at their leaves, a tie's at each."""
    out: list[Any] = [PASSTHROUGH] * prepared.num_leaves
    with paused_gc():
        for key, layout in layouts.items():
            idx, paths = prepared.members[key][:2]
            if layout.paths != paths:  # the layout's buffer order is not the tree's
                idx = map(dict(zip(paths, idx)).__getitem__, layout.paths)
            collections.deque(map(out.__setitem__, idx, layout.tensors), maxlen=0)
    for i, first in prepared.tied.items():
        out[i] = out[first]
    return out


def find_ties(leaves: list, paths: list, idx: list, params: Any = None, storage: bool = True) -> dict:
    """Leaves that are one tensor: ``{leaf index: index of its first occurrence}``.

    A tie is the same object twice (a tied embedding and head), or two real tensors that are
    the same view of one storage (same offset, shape, strides and dtype). Two real tensors that
    share memory but are different views of it cannot be kept as one tensor. The first
    occurrence is the first in the dicts' insertion order (``params``, where given), as a
    module registers its tensors (``{"wte": w, "io": {"lm_head": w}}``: ``wte``), not in
    optree's sorted-key order. ``storage=False``: the leaves have no storage to compare
    (``ShapeDtype`` s): only the same object is a tie.

    Raises:
        ValueError: overlapping different views of one storage (naming both paths).
    """
    tied: dict = {}
    ids = list(map(id, map(leaves.__getitem__, idx)))
    if len(set(ids)) < len(idx):  # an object at two places
        first_by_id = dict(zip(reversed(ids), reversed(idx)))
        tied = {i: first_by_id[d] for i, d in zip(idx, ids) if first_by_id[d] != i}
    by_storage: dict = {}
    for i in idx if storage else ():
        leaf = leaves[i]
        if isinstance(leaf, ShapeDtype) or i in tied or leaf.device.type == "meta" or not leaf.numel():
            continue
        try:
            key = (leaf.device, leaf.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no plain storage (DTensor, wrapper)
            continue
        view = (leaf.storage_offset(), tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype)
        span = _byte_span(leaf)
        for j, other_view, other_span in by_storage.get(key, ()):
            if other_view == view:
                tied[i] = j
                break
            if span[0] < other_span[1] and other_span[0] < span[1]:
                raise ValueError(
                    f"{format_path(paths[i])} and {format_path(paths[j])} share memory but are "
                    f"different views of it (offset/shape/strides {view[:3]} vs "
                    f"{other_view[:3]}); vfsdp keeps a tie only between identical tensors: pass "
                    f"one of them, or .clone() the other")
        else:
            by_storage.setdefault(key, []).append((i, view, span))
    if not tied or params is None:
        return tied
    groups: dict = {}
    for i, first in tied.items():
        groups.setdefault(first, [first]).append(i)
    out = {}
    for group in groups.values():
        head = min(group, key=lambda i: _insertion_key(params, paths[i]))
        out.update({i: head for i in group if i != head})
    return out


def _insertion_key(tree: Any, path: tuple) -> tuple:
    """Where ``path`` comes in ``tree`` with dicts in insertion order (a key's position in
    its dict; other entries as optree numbers them)."""
    key = []
    for entry in path:
        key.append(list(tree).index(entry) if isinstance(tree, dict)
                   else entry if isinstance(entry, int) else 0)
        tree = tree[entry] if isinstance(tree, (dict, list, tuple)) else None
    return tuple(key)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor can touch: ``[first, last + 1)``."""
    size = t.element_size()
    lo = t.storage_offset()
    hi = lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
    return lo * size, hi * size
