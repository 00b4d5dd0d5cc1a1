"""Replication checking (JAX's ``check_vma``): which mesh axes each tensor varies over.

Under :func:`vfsdp.shard_map` (``check_vma=True``, the default) every tensor of the body
carries the set of mesh axes it **varies** over (its value may differ between the ranks of
that axis); over the others it is **invariant** (the same on every rank, its cotangent
counted once). The set comes from:

* ``shard_map``'s inputs: a piece split over an axis varies over it; a replicated input is
  invariant;
* vfsdp's collectives (:mod:`vfsdp.lax`), whose inputs are checked:

  ================  ==========================  ==========================
  collective        input must, over its axes   result, over its axes
  ================  ==========================  ==========================
  ``psum/pmean``    vary                        invariant
  ``pvary``         be invariant                varies
  ``all_gather``    vary                        varies (its backward sums)
  ``psum_scatter``  vary                        varies
  ``all_to_all``    vary                        varies
  ================  ==========================  ==========================

* ``vfsdp.gather``/``run_layers``: the full tensors vary over the axes their plan runs on
  (the backward reduces their cotangents over them);
* every other torch op: its result varies over the union of its tensor inputs' axes.

The mistake it catches is the one that silently corrupts gradients: an op that mixes a value
invariant over an axis, which requires grad, with values that vary over it (a column-parallel
matmul without ``pvary``): that value's gradient on each rank would be its own part only.
It raises there, naming the op, the axis and the fix (``vfsdp.lax.pvary``); a constant or a
tensor without grad may mix freely.

Design: a ``TorchFunctionMode`` on the rank's thread sees every torch call; the axes live in
an attribute of the tensor (``_vfsdp_vma``: the call's token and a frozenset), so the table is
keyed by identity, costs no subclass and no cleanup, and a stale entry from another call is
ignored (its token differs). Ints (``axis_index``) are not tracked: a tensor built from this
rank's index alone counts as invariant. Cost per op: ``benchmarks/vma_bench.py`` and docs/shard_map.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from vfsdp.collectives.unit import GATHER_HOOKS

__all__ = ["Tracker", "current", "vma_of", "mark", "check_collective", "mark_gathered"]

_ATTR = "_vfsdp_vma"
_NONE: frozenset = frozenset()
_STATE = threading.local()  # .tracker: the Tracker of the shard_map body running here


class Tracker(TorchFunctionMode):
    """The replication tracking of one ``shard_map`` call on this rank (a torch function
    mode: enter it with ``with tracker:`` around the body).

    Args:
        axes: The mesh's axis names.

    Example:
        >>> t = Tracker(("tp",))
        >>> x = mark(torch.ones(2), {"tp"}, t)
        >>> with t:
        ...     y = (x * 2).sum()
        >>> sorted(t.vma(y))
        ['tp']
    """

    def __init__(self, axes: tuple) -> None:
        super().__init__()
        self.axes = tuple(axes)
        self.token = object()
        self.paused = 0
        self.ops = 0  # torch calls seen (for the cost measurement)

    def __enter__(self):
        if mark_gathered not in GATHER_HOOKS:  # gathers inside a body mark their tensors
            GATHER_HOOKS.append(mark_gathered)
        self.outer = getattr(_STATE, "tracker", None)
        _STATE.tracker = self
        return super().__enter__()

    def __exit__(self, *exc):
        _STATE.tracker = self.outer
        return super().__exit__(*exc)

    def vma(self, t: Any) -> frozenset:
        """The axes ``t`` varies over (empty: invariant, or not a tensor of this call)."""
        entry = t.__dict__.get(_ATTR) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is self.token else _NONE

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Ops inside are not tracked (a collective's own work)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self.paused:
            return out
        self.ops += 1
        token = self.token
        union = _NONE
        seen = []  # (tensor, its axes)
        for a in (args if not kwargs else (*args, *kwargs.values())):
            for b in (a if isinstance(a, (list, tuple)) else (a,)):  # a list's tensors too
                if isinstance(b, torch.Tensor):
                    entry = b.__dict__.get(_ATTR)
                    v = entry[1] if entry is not None and entry[0] is token else _NONE
                    seen.append((b, v))
                    if v and v is not union:
                        union = v if not union else union | v
        if not union:
            return out
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)):
            outs = tuple(o for o in out if isinstance(o, torch.Tensor))
        else:
            return out
        if len(seen) > 1 and any(o.requires_grad for o in outs):
            for i, (t, v) in enumerate(seen):
                if v is not union and t.requires_grad and not union <= v:
                    _mixed(func, i, t, sorted(union - v))
        entry = (token, union)
        for o in outs:
            o.__dict__[_ATTR] = entry
        return out


def _mixed(func, i: int, t: torch.Tensor, axes: list) -> None:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    ax = axes[0] if len(axes) == 1 else tuple(axes)
    raise ValueError(
        f"vfsdp.shard_map (check_vma): {name} mixes tensor {i} {tuple(t.shape)}, which requires "
        f"grad and is invariant over {ax!r} (the same on every rank), with values that vary "
        f"over {ax!r}: its gradient on each rank would be that rank's part only (silently "
        f"wrong). Mark it varying first: vfsdp.lax.pvary(x, {ax!r}) (its backward sums the "
        f"ranks' gradients; lax.column_parallel does it), or pass check_vma=False")


def current() -> Optional[Tracker]:
    """The tracker of the ``shard_map`` body running on this thread, or ``None``.

    Example:
        >>> current() is None
        True
    """
    return getattr(_STATE, "tracker", None)


def vma_of(t: Any) -> frozenset:
    """The axes ``t`` varies over in the running ``shard_map`` body (empty outside one).

    Example:
        >>> vma_of(torch.ones(1))
        frozenset()
    """
    tracker = current()
    return _NONE if tracker is None else tracker.vma(t)


def mark(t: Any, axes: Iterable[str], tracker: Optional[Tracker] = None) -> Any:
    """Record that tensor ``t`` varies over ``axes`` (in ``tracker``, default the current one);
    returns ``t``.

    Example:
        >>> mark(torch.ones(1), {"tp"}) is not None       # no tracker: nothing recorded
        True
    """
    tracker = tracker or current()
    if tracker is not None and isinstance(t, torch.Tensor):
        t.__dict__[_ATTR] = (tracker.token, frozenset(axes))
    return t


_RULES = {"psum": ("vary", "drop"), "pmean": ("vary", "drop"), "pvary": ("invariant", "add"),
          "all_gather": ("vary", "keep"), "psum_scatter": ("vary", "keep"),
          "all_to_all": ("vary", "keep")}


def check_collective(op: str, x: torch.Tensor, names: tuple) -> Optional[frozenset]:
    """Check ``op``'s input's replication over ``names`` against the table above; returns the
    result's axes (``None`` outside a ``shard_map`` body).

    Raises:
        ValueError: the input's replication is wrong, naming the axis and the fix.

    Example:
        >>> check_collective("psum", torch.ones(1), ("tp",)) is None      # not tracking
        True
    """
    tracker = current()
    if tracker is None:
        return None
    have = tracker.vma(x)
    need, result = _RULES[op]
    if need == "vary":
        missing = [a for a in names if a not in have]
        if missing:
            ax = missing[0]
            fix = ("if each rank's value should differ, pvary it over that axis first "
                   "(vfsdp.lax.pvary); if it is already the sum, drop the psum"
                   if op in ("psum", "pmean") else
                   f"every rank would pass the same value; pvary it over {ax!r} first if that "
                   f"is meant (vfsdp.lax.pvary), or {op} over the axes it varies over")
            raise ValueError(f"vfsdp.lax.{op} over {names if len(names) > 1 else names[0]!r} "
                             f"(check_vma): its input {tuple(x.shape)} is invariant over "
                             f"{ax!r} (the same on every rank): {fix}")
    else:
        already = [a for a in names if a in have]
        if already:
            raise ValueError(f"vfsdp.lax.pvary over {names if len(names) > 1 else names[0]!r} "
                             f"(check_vma): its input {tuple(x.shape)} already varies over "
                             f"{already[0]!r}; drop the pvary (its backward would sum "
                             f"gradients that are each rank's own)")
    if result == "drop":
        return have - set(names)
    if result == "add":
        return have | set(names)
    return have


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
