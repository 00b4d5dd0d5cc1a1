"""Replication checking (JAX's ``check_vma``): which mesh axes each tensor varies over.

Under :func:`vfsdp.shard_map` (``check_vma=True``, the default) every tensor of the body
carries the set of mesh axes it **varies** over (its value may differ between the ranks of
that axis); over the others it is **invariant** (the same on every rank, its cotangent
counted once). The set comes from:

* ``shard_map``'s inputs: a piece split over an axis varies over it; a replicated input is
  invariant;
* ``vfsdp.lax.axis_index(axis)``: varies over ``axis`` (an int that carries its axes, as
  JAX's is a varying array);
* vfsdp's collectives (:mod:`vfsdp.lax`): ``psum``/``pmean`` give an invariant result,
  ``pvary`` (of an invariant value only: JAX refuses it on a varying one), ``all_gather``,
  ``psum_scatter`` and ``all_to_all`` a varying one;
* ``vfsdp.gather``/``run_layers``: the full tensors vary over the axes their plan runs on;
* every other torch op: the union of its tensor inputs' axes (``*_like`` keep their
  argument's, as JAX's ``full_like``; ``new_zeros`` & co. take a shape only: invariant), a
  write in place (``buf[i] = piece``, ``add_``, ``out=``) the union into the tensor written,
  and a gradient (``torch.autograd.grad``, ``.grad``) its primal's.

**Implicit pvary** (as JAX): where an op mixes a value invariant over an axis with values
that vary over it, that value is passed through ``vfsdp.lax.pvary`` first (in place for a
write into it), so its gradient sums every rank's; a collective of a value invariant over its
axes likewise (``psum`` of an invariant value is its size times it). ``strict=True``
(``shard_map(check_vma="strict")``) raises there instead, naming the op, the axis and the
fix, for a value that requires grad. Refused in both: ``pvary`` of a value that already
varies, and a mix in a custom ``autograd.Function``'s forward (its backward, the user's,
would hand each rank its part only: pvary the input before ``apply``).

Design: a ``TorchFunctionMode`` on the rank's thread sees every torch call; the axes live in
an attribute of the tensor (``_vfsdp_vma``: the call's token and a frozenset), so the table is
keyed by identity, costs no subclass and no cleanup, and a stale entry from another call is
ignored (its token differs). A ``torch.func`` wrapper is looked through to the tensor it
wraps, and an op's result under a transform marks the tensor under the wrapper too (what the
transform returns). Cost per op: ``benchmarks/vma_bench.py`` and docs/shard_map.md.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from vfsdp import _torch_private as tp
from vfsdp.collectives.mesh import axis_of
from vfsdp.collectives.unit import GATHER_HOOKS

_ATTR = "_vfsdp_vma"
_NONE: frozenset = frozenset()
_STATE = threading.local()  # .tracker: the Tracker of the shard_map body running here
_INPLACE = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
            "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
            "__irshift__", "__imatmul__"}
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"}
_APPLY = torch.autograd.Function.apply.__func__.__code__


class AxisIndex(int):
    """``vfsdp.lax.axis_index`` inside a ``shard_map`` body: an int that varies over
    ``axes`` (integer arithmetic keeps them; a torch op given it varies over them).

    Example:
        >>> i = AxisIndex(1, {"tp"})
        >>> j = 2 * i + 1
        >>> j, sorted(j.axes)
        (3, ['tp'])
    """

    def __new__(cls, value: int, axes: Iterable[str]) -> AxisIndex:
        out = super().__new__(cls, value)
        out.axes = frozenset(axes)
        return out


def _arith(name: str):
    op = getattr(int, name)

    def f(self, *other):
        out = op(self, *other)
        if out is NotImplemented or not isinstance(out, int):
            return out
        axes = self.axes.union(*(o.axes for o in other if isinstance(o, AxisIndex)))
        return AxisIndex(out, axes)
    f.__name__ = name
    return f


for _n in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
           "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__neg__", "__abs__"):
    setattr(AxisIndex, _n, _arith(_n))


class Tracker(TorchFunctionMode):
    """The replication tracking of one ``shard_map`` call on this rank (a torch function
    mode: enter it with ``with tracker:`` around the body).

    Args:
        axes: The mesh's axis names.
        mesh: The mesh (for the implicit ``pvary``; ``None``: the current one).
        strict: Raise where an implicit ``pvary`` would be inserted (for a value that
            requires grad), instead of inserting it.

    Example:
        >>> t = Tracker(("tp",))
        >>> x = mark(torch.ones(2), {"tp"}, t)
        >>> with t:
        ...     y = (x * 2).sum()
        >>> sorted(t.vma(y))
        ['tp']
    """

    def __init__(self, axes: tuple, mesh: Any = None, strict: bool = False) -> None:
        super().__init__()
        self.axes = tuple(axes)
        self.mesh = mesh
        self.strict = strict
        self.token = object()
        self.paused = 0
        self.ops = 0  # torch calls seen (for the cost measurement)
        self.storages: dict = {}  # what torch.func transforms wrapped: storage -> axes

    def axis(self, axes: tuple, mesh: Any = None) -> Any:
        """The :class:`~vfsdp.collectives.mesh.Axis` of ``axes`` (in the mesh's order) on
        ``mesh`` (default: the tracked one), for an implicit pvary."""
        return axis_of(axes if len(axes) > 1 else axes[0], self.mesh if mesh is None else mesh)

    def __enter__(self):
        if mark_gathered not in GATHER_HOOKS:  # gathers inside a body mark their tensors
            GATHER_HOOKS.append(mark_gathered)
        self.outer = getattr(_STATE, "tracker", None)
        _STATE.tracker = self
        return super().__enter__()

    def __exit__(self, *exc):
        _STATE.tracker = self.outer
        return super().__exit__(*exc)

    def vma(self, t: torch.Tensor) -> frozenset:
        """The axes tensor ``t`` varies over (empty: invariant, or not a tensor of this call)."""
        entry = t.__dict__.get(_ATTR)
        if entry is not None and entry[0] is self.token:
            return entry[1]
        inner = tp.functorch_unwrapped(t)  # a torch.func wrapper: what it wraps
        if inner is not None:
            return self.vma(inner)
        # A view of what a transform wrapped (vmap's result, its batch dim moved), or nothing
        # of this call (a constant, a tensor from outside the body: invariant).
        return self.storages.get(tp.storage_id(t), _NONE) if self.storages else _NONE

    def mark(self, t: torch.Tensor, axes: frozenset) -> None:
        entry = (self.token, axes)
        t.__dict__[_ATTR] = entry
        inner = tp.functorch_unwrapped(t)
        while inner is not None:  # a torch.func wrapper: what it wraps too (what it returns)
            t, inner = inner, tp.functorch_unwrapped(inner)
            t.__dict__[_ATTR] = entry
            if inner is None and axes:
                key = tp.storage_id(t)
                self.storages[key] = self.storages.get(key, _NONE) | axes

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Ops inside are not tracked (a collective's own work)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def _scan(self, a: Any, seen: list, union: frozenset) -> frozenset:
        v = _NONE  # not a tensor, an axis index or a container of them
        if isinstance(a, torch.Tensor):
            v = self.vma(a)
            seen.append((a, v))
        elif isinstance(a, AxisIndex):
            v = a.axes
        elif isinstance(a, (list, tuple, slice)):  # a list's tensors, an index's slices
            for b in (a.start, a.stop, a.step) if isinstance(a, slice) else a:
                union = self._scan(b, seen, union)
            return union
        return v if not union else (union | v if v and v is not union else union)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        self.ops += 1
        name = getattr(func, "__name__", "")
        seen: list = []  # (tensor, its axes)
        union = self._scan((args[1:] if name in _SHAPE_ONLY else args, tuple(kwargs.values())), seen, _NONE)
        if func is torch.autograd.grad:
            return self._grads(func, args, kwargs)
        inplace = name in _INPLACE or (name.endswith("_") and not name.startswith("_"))
        written = (args[0] if args else None) if inplace else kwargs.get("out")
        written = written if isinstance(written, torch.Tensor) else None
        if union and seen:
            args, kwargs = self._pvary_mixed(func, seen, union, written, args, kwargs)
        out = func(*args, **kwargs)
        if not union:
            return out
        if written is not None:
            self.mark(written, union)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.mark(o, union)
        return out

    def _pvary_mixed(self, func, seen, union, written, args, kwargs):
        """Pass each input invariant over some of ``union``'s axes through ``pvary`` (in place
        for ``written``), or raise (strict; a custom Function's forward)."""
        swap = {}
        for i, (t, v) in enumerate(seen):
            if v is union or union <= v or not t.requires_grad or id(t) in swap:
                continue  # a value without grad mixes freely (no gradient to sum)
            missing = tuple(a for a in self.axes if a in union and a not in v)
            if not torch.is_grad_enabled():
                if _in_custom_forward():
                    _mixed(func, i, t, missing, "before the custom autograd.Function's "
                           "apply (its backward would give each rank its part only)")
                continue  # no gradient is recorded here
            if self.strict:
                _mixed(func, i, t, missing, "or pass check_vma=True (which inserts it)")
            from vfsdp.spmd import lax
            with self.pause():
                if t is written:  # its old value, pvary-ed, written back (the gradient sums)
                    t.copy_(lax._PVary.apply(t.clone(), self.axis(missing)))
                else:
                    swap[id(t)] = lax._PVary.apply(t, self.axis(missing))
            self.mark(swap.get(id(t), t), union)
        return (_swapped(args, swap), {k: _swapped(v, swap) for k, v in kwargs.items()}) if swap else (
            args, kwargs)

    def check_collective(self, op: str, x: torch.Tensor, names: tuple) -> tuple:
        """Check ``op``'s input's replication over ``names``: returns ``(missing, after)``, the
        axes of ``names`` it must be ``pvary``-ed over first (JAX's implicit pvary: those it is
        invariant over) and the result's axes.

        Raises:
            ValueError: ``pvary`` of a value that already varies over an axis of ``names``; in
                strict mode, a collective of a value invariant over one of its axes (naming it
                and the fix).
        """
        have = self.vma(x)
        where = names if len(names) > 1 else names[0]
        if op == "pvary":
            already = [a for a in names if a in have]
            if already:
                raise ValueError(f"vfsdp.lax.pvary over {where!r} (check_vma): its input "
                                 f"{tuple(x.shape)} already varies over {already[0]!r}; drop the "
                                 f"pvary (JAX refuses it too)")
            return (), have | set(names)
        missing = tuple(a for a in names if a not in have)
        if missing and self.strict:
            raise ValueError(
                f"vfsdp.lax.{op} over {where!r} (check_vma='strict'): its input {tuple(x.shape)} "
                f"is invariant over {missing[0]!r} (the same on every rank): pvary it over "
                f"{missing[0]!r} first if each rank's value should count (vfsdp.lax.pvary; "
                f"check_vma=True inserts it: a psum then multiplies it by the axis size), or "
                f"drop the {op}")
        return missing, (have - set(names) if op in ("psum", "pmean") else have | set(names))

    def _grads(self, func, args, kwargs):
        """``torch.autograd.grad``: each gradient varies as its primal (JAX's rule)."""
        out = func(*args, **kwargs)
        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else ())
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        for g, x in zip(out, inputs):
            if isinstance(g, torch.Tensor):
                self.mark(g, self.vma(x))
        return out


def _swapped(a: Any, swap: dict) -> Any:
    if isinstance(a, torch.Tensor):
        return swap.get(id(a), a)
    if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        return type(a)(_swapped(b, swap) for b in a)
    return a


def _in_custom_forward() -> bool:
    """Whether a custom ``autograd.Function``'s forward is on this thread's stack."""
    return any(f.f_code is _APPLY for f, _ in traceback.walk_stack(sys._getframe(2)))


def _mixed(func, i: int, t: torch.Tensor, axes: tuple, fix: str) -> None:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    ax = axes[0] if len(axes) == 1 else axes
    raise ValueError(
        f"vfsdp.shard_map (check_vma): {name} mixes tensor {i} {tuple(t.shape)}, which requires "
        f"grad and is invariant over {ax!r} (the same on every rank), with values that vary "
        f"over {ax!r}: its gradient must sum every rank's. Mark it varying first: "
        f"vfsdp.lax.pvary(x, {ax!r}) {fix}")


def current() -> Optional[Tracker]:
    """The tracker of the ``shard_map`` body running on this thread, or ``None``.

    Example:
        >>> current() is None
        True
    """
    return getattr(_STATE, "tracker", None)


def mark(t: Any, axes: Iterable[str], tracker: Optional[Tracker] = None) -> Any:
    """Record that tensor ``t`` varies over ``axes`` (in ``tracker``, default the current one);
    returns ``t``.

    Example:
        >>> mark(torch.ones(1), {"tp"}) is not None       # no tracker: nothing recorded
        True
    """
    tracker = tracker or current()
    if tracker is not None and isinstance(t, torch.Tensor):
        tracker.mark(t, frozenset(axes))
    return t


def mark_gathered(fulls: Iterable, spec: Any, members: tuple = ()) -> None:
    """Mark ``vfsdp.gather``'s full tensors (the spec's leaves ``members``: ``(index, key)``
    pairs) as varying over the data axes ``spec`` runs on (every axis of the mesh for a plan
    of the default group), whose backward reduces their cotangents, and a model-parallel
    piece (``plan(tp=...)``'s ``Shard``) over its model axis. Nothing outside a
    ``shard_map`` body.

    Example:
        >>> mark_gathered([torch.ones(1)], None)          # no tracker: nothing to do
    """
    tracker = current()
    if tracker is None:
        return
    names = getattr(spec, "mesh_dim_names", None)
    data = set(tracker.axes) if names is None else set(names) & set(tracker.axes)
    leaves = spec.leaves() if members else ()
    for n, f in enumerate(fulls):
        strided = getattr(leaves[members[n][0]], "strided", None) if members else None
        split = strided is not None and strided.dim is not None  # dim None: replicated
        mark(f, data | ({strided.axis} & set(tracker.axes) if split else set()), tracker)
