"""``vfsdp.shard_map``: an SPMD function over a named mesh, with input and output specs.

As JAX's ``shard_map``: every rank calls the mapped function with the same **global** inputs;
each input is split by its spec (a :class:`P`: per dim, the mesh axis, or tuple of axes, that
splits it, or ``None``), ``fn`` runs on this rank's pieces (the mesh is its ``use_mesh``, so
``vfsdp.lax`` collectives name axes alone), and the outputs are assembled by ``out_specs``:
pieces concatenated along the dims their spec splits, in axis order. Uneven splits cut as
``torch.tensor_split`` (as ``plan(tp=...)``); output pieces may have any lengths. A tuple of
axes in a spec splits one dim over them, row-major in the tuple's order (any order, as JAX).

Gradients are plain torch's: the global inputs' gradients are the ones one process computing
the global function gets (each rank ends with all of them). Under the conventions of
:mod:`vfsdp.lax`, the split's backward gathers the pieces' cotangents, the assembly's backward
hands each rank its piece of the global cotangent; a replicated (``P()``) input's gradient
counts once, so a body that uses it differently per rank marks it with ``pvary``.
``check_vma=True`` (the default) tracks which axes each tensor varies over and, as JAX's,
inserts the ``pvary`` where it was forgotten (:mod:`vfsdp.spmd.vma`); it also proves
each output's replication against its out_spec (an invariant output its spec splits is
tiled). ``check_vma="strict"`` raises where a ``pvary`` would be inserted. With
``check_vma=False`` nothing is checked: an output replicated over an axis (not in its
out_spec) is each rank's own value, taken as it is. The mapped function takes positional
arguments only, and is refused inside another's body (as JAX's).

Costs: the split is one slice and copy per split input (no communication); the assembly one
all-gather per split dim of an output (with one small exchange of the pieces' shapes), the
backward the same the other way. Each input and output is handled in a Python loop over the
tree's leaves (a spec per tensor), which fits prototyping; a training step over many tensors
belongs in ``vfsdp.gather``/``run_layers`` inside ``fn``, which compose with it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import optree
import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.mesh import Axis, axis_names, axis_of, use_mesh
from vfsdp.placements.strided import split_lengths
from vfsdp.spmd import vma
from vfsdp.spmd.lax import _gather, _PVary, _shapes

_MANUAL = threading.local()  # .axes: the mesh axes of the shard_map body running here


class P(tuple):
    """A partition spec: per dim of a tensor, the mesh axis that splits it, a tuple of axes
    (split over them as one axis, row-major in the tuple's order), or ``None`` (whole).
    Missing trailing dims are whole; axes it does not name replicate the tensor.

    Example:
        >>> P("dp", None), P(("dp", "tp")), P()
        (P('dp', None), P(('dp', 'tp')), P())
    """

    def __new__(cls, *dims: Any) -> P:
        if any(d is not None and not axis_names(d) for d in dims):
            raise ValueError(f"P{dims!r}: an empty tuple of axes; use None for a whole dim")
        return super().__new__(cls, [axis_names(d) if isinstance(d, (tuple, list)) else d
                                     for d in dims])

    def __repr__(self) -> str:
        return f"P({', '.join(repr(d) for d in self)})"

    def axes(self) -> list:
        """Every axis name it splits over, in order."""
        return [a for d in self if d is not None for a in axis_names(d)]


@dataclass(frozen=True)
class _Cut:
    """One split dim of a tensor: its axis (one or several mesh axes, as a group in the
    mesh's order), this rank's index in the spec's order (row-major over its tuple), every
    rank's length along it in the mesh's order, and ``order``: per position in the spec's
    order, the position in the mesh's (``None``: the same)."""

    dim: int
    axis: Axis
    index: int
    sizes: tuple
    order: Any = None


def _split(t: torch.Tensor, cuts: tuple) -> torch.Tensor:
    for c in cuts:
        before = (c.order or range(len(c.sizes)))[:c.index]
        t = t.narrow(c.dim, sum(c.sizes[m] for m in before), c.sizes[c.axis.index])
    return t.clone(memory_format=torch.contiguous_format)


def _join(t: torch.Tensor, cuts: tuple) -> torch.Tensor:
    t = t.detach()
    for c in cuts:
        t = _gather(t, c.axis, c.dim, [(*t.shape[:c.dim], n, *t.shape[c.dim + 1:]) for n in c.sizes])
        if c.order is not None:  # the pieces in the spec's order
            pieces = t.split(list(c.sizes), c.dim)
            t = torch.cat([pieces[m] for m in c.order], c.dim)
    return t


class _Move(torch.autograd.Function):
    """Global tensors -> this rank's pieces (``join=False``) or every rank's pieces -> the global
    tensors (``join=True``); backward: the other move of the cotangents (a joined, global
    cotangent is the same on every rank: it counts once)."""

    @staticmethod
    def forward(join, layouts, *ts):
        return tuple((_join if join else _split)(t, cuts) for t, cuts in zip(ts, layouts))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.join, ctx.layouts = inputs[:2]

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, *_Move.apply(not ctx.join, ctx.layouts, *gs))

    @staticmethod
    def jvp(ctx, _, __, *ts):
        return _Move.forward(ctx.join, ctx.layouts, *ts)


def _where(kind: str, path: tuple) -> str:
    return kind + "".join(f"[{p!r}]" for p in path)


def _check_spec(spec: Any, t: Any, where: str, names: tuple) -> list:
    """The ``(dim, names)`` pairs ``spec`` splits ``t`` along, after refusing a spec that
    does not fit, naming ``where`` and the fix."""
    if not isinstance(spec, P):
        raise TypeError(f"shard_map: the spec of {where} is {spec!r}; give a vfsdp.P(...) "
                        f"(P() replicates)")
    if not isinstance(t, torch.Tensor):
        if len(spec):
            raise ValueError(f"shard_map: {where} is a {type(t).__name__}, not a tensor: its "
                             f"spec must be P() (it is passed as it is), got {spec!r}")
        return []
    if len(spec) > t.dim():
        raise ValueError(f"shard_map: {spec!r} has {len(spec)} entries but {where} "
                         f"{tuple(t.shape)} has {t.dim()} dims; give at most one entry per "
                         f"dim (None: whole, P(): replicated)")
    axes = spec.axes()
    for i, a in enumerate(axes):
        if a not in names:
            raise ValueError(f"shard_map: {spec!r} of {where} names axis {a!r}, which the "
                             f"mesh does not have; its axes are {names}")
        if a in axes[:i]:
            raise ValueError(f"shard_map: {spec!r} of {where} uses axis {a!r} twice; a "
                             f"tensor is split over an axis once (a tuple splits one dim "
                             f"over several)")
    return [(dim, entry) for dim, entry in enumerate(spec) if entry is not None]


def _specs(specs: Any, tree: Any, kind: str) -> list:
    try:
        return optree.broadcast_prefix(specs, tree, is_leaf=lambda s: isinstance(s, P),
                                       none_is_leaf=True)
    except ValueError as exc:
        raise ValueError(f"shard_map: {kind}_specs {specs!r} do not match the {kind}puts' "
                         f"structure: give one P per {kind}put (a tuple for several), or one "
                         f"P for a whole subtree ({exc})") from None


def shard_map(fn: Callable, mesh: Any, in_specs: Any, out_specs: Any, *,
              check_vma: Union[bool, str] = True) -> Callable:
    """``fn`` as an SPMD program over ``mesh``: called on every rank with the global inputs,
    it runs ``fn`` on this rank's pieces and returns the global outputs.

    Args:
        fn: The body: this rank's pieces in, its pieces out (any pytrees). Inside it the mesh
            is current (``vfsdp.lax.psum(x, "tp")``), and ``vfsdp.gather``/``run_layers``
            work as anywhere.
        mesh: A named ``DeviceMesh`` (:func:`vfsdp.mesh`).
        in_specs: A :class:`P` per input (a tuple for the positional arguments, or a prefix
            of their pytree: one P for a whole subtree). A split dim is cut as
            ``torch.tensor_split``; an axis not named replicates the input.
        out_specs: A :class:`P` per output, as ``in_specs``: each rank's pieces are
            concatenated, in axis order, along the dims it names; ``P()`` returns an output
            replicated over every axis.
        check_vma: ``True``: track which axes each tensor varies over, as JAX's
            (:mod:`vfsdp.spmd.vma`): a missing ``pvary`` (an invariant value mixed with
            varying ones, a collective of an invariant value, an invariant output its spec
            splits) is inserted; an output that varies over an axis its out_spec replicates,
            or a ``pvary`` of a varying value, raises. ``"strict"``: the same, but a missing
            ``pvary`` of a value that requires grad raises too. ``False``: none of it (each
            rank then returns its own value of a replicated output, unchecked). Under
            ``torch.compile`` a checked call runs eagerly (a graph break).

    Returns:
        The mapped function (call it on every rank, with the same global inputs).

    Raises:
        ValueError: a spec that does not fit its input (more entries than dims, an axis the
            mesh does not have or twice), naming the input and the fix; ``check_vma`` not
            one of the three; a call inside a ``shard_map`` body; with ``check_vma``,
            replication errors (above).
        TypeError: a spec that is not a :class:`P`; keyword arguments to the mapped
            function (named).

    Example:
        >>> def body():
        ...     mesh = vfsdp.mesh(("dp", 2))
        ...     f = vfsdp.shard_map(lambda x: vfsdp.lax.psum(x.sum(0), "dp"), mesh,
        ...                         in_specs=P("dp"), out_specs=P())
        ...     return f(torch.arange(6.0).view(3, 2)).tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[6.0, 9.0], [6.0, 9.0]]
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not names:
        raise ValueError("shard_map: the mesh has no axis names; make it with "
                         "vfsdp.mesh((name, size), ...)")

    if check_vma not in (True, False, "strict"):
        raise ValueError(f"shard_map: check_vma={check_vma!r}; give True (JAX's: implicit "
                         f"pvary), 'strict' (an error instead) or False (no checking)")
    name = getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if check_vma and tp.compiling():
            # Dynamo does not trace the tracking (a torch function mode keeping state on
            # tensors): the checked call runs eagerly, a graph break (made here, where dynamo
            # is loaded already); an unchecked one is traced.
            return torch.compiler.disable(mapped, recursive=True)(*args, **kwargs)
        if kwargs:
            raise TypeError(f"shard_map({name}): keyword arguments {sorted(kwargs)} are not "
                            f"mapped (JAX refuses them too): pass them positionally, with an "
                            f"in_spec each, or bind them first with functools.partial")
        outer = getattr(_MANUAL, "axes", None)
        if outer is not None:
            raise ValueError(f"shard_map({name}) inside a shard_map body over {outer}: nesting "
                             f"is refused (as JAX refuses a shard_map over axes already "
                             f"mapped); call the inner body directly: its pieces and "
                             f"collectives are already per rank")
        paths, leaves, treespec = optree.tree_flatten_with_path(args, none_is_leaf=True)
        # A Python loop over the inputs: each has its own spec (noted in the module docstring).
        layouts = [_layout(_check_spec(s, t, _where("args", p), names), t, mesh, names, True)
                   for p, s, t in zip(paths, _specs(in_specs, args, "in"), leaves)]
        pieces = _moved(False, layouts, leaves)
        tracker = vma.Tracker(names, mesh, check_vma == "strict") if check_vma else None
        for piece, lay in zip(pieces, layouts) if tracker is not None else ():
            vma.mark(piece, [a for c in lay for a in axis_names(c.axis.name)], tracker)
        _MANUAL.axes = names
        try:
            with use_mesh(mesh), (tracker or contextlib.nullcontext()):
                result = fn(*optree.tree_unflatten(treespec, pieces))
        finally:
            _MANUAL.axes = None
        return _assemble(result, out_specs, names, mesh, tracker)

    return mapped


def _layout(pairs: list, t: Any, mesh: Any, names: tuple, split: bool) -> tuple:
    """The :class:`_Cut` of each ``(dim, names)``: lengths by ``tensor_split`` (inputs) or as
    the ranks hold them (outputs: one small exchange of shapes per cut)."""
    cuts = []
    for dim, entry in pairs:
        spec_order = axis_names(entry)
        mesh_order = tuple(sorted(spec_order, key=names.index))
        ax = axis_of(mesh_order if len(mesh_order) > 1 else mesh_order[0], mesh)
        index, order = ax.index, None
        if spec_order != mesh_order:  # row-major in the spec's order, not the mesh's
            sizes = [axis_of(a, mesh).size for a in spec_order]
            perm = [spec_order.index(a) for a in mesh_order]
            order = tuple(functools.reduce(lambda m, k: m * sizes[k] + pos[k], perm, 0)
                          for pos in itertools.product(*map(range, sizes)))
            index = order.index(ax.index)
        if split:
            by_spec = split_lengths(t.shape[dim], ax.size)
            sizes = by_spec if order is None else tuple(by_spec[order.index(m)]
                                                        for m in range(ax.size))
        else:
            sizes = tuple(s[dim] for s in _shapes(t, ax, "shard_map's output"))
        cuts.append(_Cut(dim, ax, index, sizes, order))
    return tuple(cuts)


def _moved(join: bool, layouts: list, leaves: list) -> list:
    """``leaves`` with each one that has cuts split into this rank's piece or joined."""
    cut = [i for i, lay in enumerate(layouts) if lay]
    moved = dict(zip(cut, _Move.apply(join, tuple(layouts[i] for i in cut),
                                      *(leaves[i] for i in cut)))) if cut else {}
    return [moved.get(i, t) for i, t in enumerate(leaves)]


def _assemble(result: Any, out_specs: Any, names: tuple, mesh: Any, tracker) -> Any:
    paths, leaves, treespec = optree.tree_flatten_with_path(result, none_is_leaf=True)
    layouts = []
    out = list(leaves)
    for i, (p, s, t) in enumerate(zip(paths, _specs(out_specs, result, "out"), leaves)):
        where = _where("output", p)
        pairs = _check_spec(s, t, where, names)
        if tracker is not None and isinstance(t, torch.Tensor):
            tile = _check_output(tracker.vma(t), s, where, tracker.strict, names)
            if tile:  # invariant over axes its spec splits: each rank's copy is a tile
                with tracker.pause():
                    out[i] = t = _PVary.apply(t, tracker.axis(tile))
        layouts.append(_layout(pairs, t, mesh, names, False))
    return optree.tree_unflatten(treespec, _moved(True, layouts, out))


def _check_output(have: frozenset, spec: P, where: str, strict: bool, names: tuple) -> tuple:
    """Refuse an output varying over an axis its out_spec replicates; return the axes (in the
    mesh's order) it is invariant over but its spec splits (JAX tiles it: an implicit pvary),
    which strict mode refuses."""
    named = set(spec.axes())
    for a in sorted(have - named):
        raise ValueError(f"shard_map (check_vma): {where} varies over {a!r} but its out_spec "
                         f"{spec!r} replicates it over {a!r}: psum (or pmean) it over {a!r}, "
                         f"or name {a!r} in its out_spec to concatenate the ranks' pieces")
    tile = [a for a in names if a in named and a not in have]
    if tile and strict:
        raise ValueError(f"shard_map (check_vma='strict'): {where} is invariant over "
                         f"{tile[0]!r} (the same on every rank) but its out_spec {spec!r} "
                         f"splits it over {tile[0]!r}: the result tiles its copies. pvary it "
                         f"over {tile[0]!r} first if that is meant, or drop {tile[0]!r} from "
                         f"its out_spec (check_vma=True tiles it without asking)")
    return tuple(tile)
