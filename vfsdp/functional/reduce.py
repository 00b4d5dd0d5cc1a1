"""Gradient reduction: full gradients of a unit's tensors into its sharded gradient DBuffer.

This is the backward of :func:`vfsdp.gather` and the body of :func:`vfsdp.reduce_scatter`.
Gradients reach the reduce-scatter input with **one contiguous copy per tensor** (``numel *
itemsize`` bytes each, never an interleaving copy like FSDP2's ``chunk_cat``): each gradient is
copied into its ``[offset, offset+numel)`` slice of the unit's staging buffer, padding is
zero-filled, and one reduce-scatter per unit lands the result in the gradient DBuffer. When a
gradient already *is* that slice, no copy happens.

Semantics: ``grad_reduce="avg"`` (default) gives each rank the mean over all ranks of their
gradients (FSDP/DDP semantics: each rank's loss is a mean over its batch); ``"sum"`` gives
the sum, the exact gradient of the sum of all ranks' losses. Over an HSDP mesh the mean or
sum runs over every rank of the mesh. Options: :mod:`vfsdp.functional.options`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Optional

import optree
import torch

from vfsdp import _torch_private as tp
from vfsdp._torch_private import functorch_active
from vfsdp.collectives.groups import resolve_groups
from vfsdp.collectives.unit import Unit
from vfsdp.functional.backward import pending
from vfsdp.functional.options import GradOptions
from vfsdp.functional.tree import match_tree
from vfsdp.functional.units import UnitLeaves, own_mesh, units_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec

__all__ = ["reduce_unit", "reduce_scatter"]


def reduce_unit(unit: Unit, index: Sequence[int], grads: Sequence[Optional[torch.Tensor]],
                opts: GradOptions, views: bool = True,
                overwrite: bool = False) -> Optional[list[Optional[torch.Tensor]]]:
    """Reduce-scatter the gradients of tensors ``index`` of ``unit``.

    Args:
        unit: The unit.
        index: Buffer indices of the tensors whose gradients are given (a tied tensor may
            appear more than once: its gradients are summed).
        grads: Their full gradients (``None``: zero, e.g. a frozen tensor).
        opts: The gradient options. ``grads="buffer"``: into the unit's gradient DBuffer,
            adding to what it holds, as torch's ``.grad`` does (overwriting only a released
            or new buffer: ``vfsdp.zero_grads`` releases it; or with the deprecated
            ``accumulate_grads=False``, on the unit's first reduction in a pass).
            ``grads="return"``: into a fresh tensor, nothing of vfsdp's is written.
        views: For ``"buffer"``, return the gradient DBuffer's views (``False``: the caller
            does not read them, return ``None`` and make none).
        overwrite: For ``"buffer"``: replace what the gradient buffer holds
            (:func:`reduce_scatter`'s default, a collective into the buffer).

    Returns:
        This rank's gradient pieces in the order of ``index`` (``None`` at repeats of an
            index), or ``None`` when ``opts.grad_sync`` is off (the gradients were only
            accumulated, unsharded). Views of the gradient DBuffer for ``"buffer"``; fresh
            tensors for ``"return"`` and inside ``torch.func``.
    """
    index, grads, first = _merge(index, grads)
    fresh = not unit.has_grads  # a new gradient buffer holds zeros: nothing to add to
    if functorch_active():
        return _expand(_reduce_functional(unit, index, grads, opts), first)
    db = unit.params
    rdt = opts.reduce_dtype or next((g.dtype for g in grads if g is not None), db.dtype)
    to_buffer = opts.grads == "buffer"
    accum = unit.accumulator(rdt, create=False)
    if not opts.grad_sync or (accum is not None and accum.is_allocated):
        # Accumulating unsharded (no reduce until the last micro-batch): a persistent buffer.
        accum = unit.accumulator(rdt)
        if not accum.is_allocated:
            accum.alloc_global().data.zero_()
        buf = accum.global_buffer.data
        dsts = accum.internal_views()
        pairs = [(i, g) for i, g in zip(index, grads) if g is not None]
        with torch.no_grad():  # one op for the unit
            tp.add_many([dsts[i] for i, _ in pairs], [g for _, g in pairs])
        if not opts.grad_sync:
            return None
        stage = accum
    else:
        stage = unit.stage(rdt, share_grads=to_buffer)
        buf = stage.alloc_global().data
        dsts = stage.internal_views()  # made once: no view op per tensor per step
        covered, copies = set(), []
        for i, g in zip(index, grads):
            if g is None:
                continue
            dst = dsts[i]
            covered.add(i)
            if not _is_slice_of(g, dst):  # produced in place: nothing to copy
                copies.append((dst, g))
        _zero_gaps(buf, db.tensors, covered)
        with torch.no_grad():  # one op for all the unit's pieces, not one per tensor
            tp.copy_many([dst if dst.shape == g.shape else dst.view(g.shape) for dst, g in copies],
                         [g for _, g in copies])
    if not to_buffer:  # to autograd: a fresh tensor, nothing of vfsdp's is aliased
        out = unit.reduce_new(buf, opts.grad_reduce, rdt)
        stage.free_global()
        unit.grads_mode = "return"
        return _expand([out[slice(*db.tensors[i].shard_range(unit.rank))].view(
            db.local_shape(i)) for i in index], first)
    gdb = unit.grads()
    task = tp.graph_task_id()
    same_pass = task != -1 and unit.grad_task == task
    if overwrite:
        accumulate = False
    elif opts.accumulate_grads is False:  # deprecated: 0.2's overwrite
        accumulate = same_pass
    else:  # as torch's .grad: add to what the buffer holds (a new or released one: nothing)
        accumulate = gdb.holds_shard and not fresh
        if accumulate and not same_pass and opts.accumulate_grads is None:
            warn_changed_default()
    unit.grad_task, unit.grads_mode = task, "buffer"
    if opts.async_reduce and stage is not accum:
        # Overlaps the next unit's backward; the staging buffer is freed once it is done.
        handle = unit.reduce(buf, opts.grad_reduce, rdt, accumulate=accumulate,
                             async_op=True, release=stage)
        pending().inflight.add(handle)  # at most one in flight on this rank
    else:
        unit.reduce(buf, opts.grad_reduce, rdt, accumulate=accumulate)
        stage.free_global()
    return _expand([gdb.local(i) for i in index], first) if views else None


def warn_changed_default() -> None:
    """A ``grads="buffer"`` backward added to an earlier backward's gradients, where 0.2
    overwrote them (shown once, as Python shows a warning)."""
    warnings.warn(
        "vfsdp 0.3: this backward adds its gradients to those an earlier backward left in the "
        "gradient buffer, as torch's .grad does (0.2 overwrote them with grads='buffer' and "
        "run_layers). To start afresh, call vfsdp.zero_grads(shards, spec) before the "
        "backward; to accumulate micro-batches, pass accumulate_grads=True, which also "
        "silences this warning", FutureWarning, stacklevel=2)


def _merge(index, grads) -> tuple[list, list, list]:
    """Sum the gradients of repeated indices (a tied tensor used at two paths).

    Returns the unique indices, their summed gradients, and for each original position the
    position of its index among the unique ones (or ``None`` for a repeat)."""
    if len(set(index)) == len(index):
        return list(index), list(grads), list(range(len(index)))
    unique: dict = {}
    first: list = []
    for i, g in zip(index, grads):
        if i in unique:
            first.append(None)
            if g is not None:
                prev = unique[i]
                unique[i] = g if prev is None else prev + g
        else:
            first.append(len(unique))
            unique[i] = g
    return list(unique), list(unique.values()), first


def _expand(pieces: Optional[list], first: list) -> Optional[list]:
    if pieces is None:
        return None
    return [pieces[k] if k is not None else None for k in first]


def _reduce_functional(unit: Unit, index, grads, opts: GradOptions) -> list[torch.Tensor]:
    """Inside ``torch.func``: build the buffer with one ``cat`` (still one copy per tensor)
    and return fresh pieces; nothing made outside the transform is mutated."""
    db, layout, rank = unit.params, unit.layout, unit.rank
    by_index = dict(zip(index, grads))
    rdt = opts.reduce_dtype or next((g.dtype for g in grads if g is not None), db.dtype)
    pieces, end = [], 0
    for i, t in enumerate(db.tensors):
        g = by_index.get(i)
        if g is None:
            continue
        if t.offset > end:
            pieces.append(torch.zeros(t.offset - end, dtype=rdt, device=db.device))
        pieces.append(g.reshape(-1).to(rdt))
        end = t.offset + t.numel
    if end < layout.padded_numel:
        pieces.append(torch.zeros(layout.padded_numel - end, dtype=rdt, device=db.device))
    full = torch.cat(pieces)
    with tp.functorch_paused():  # gloo writes into its output; functorch would refuse that
        out = unit.reduce_new(full, opts.grad_reduce, rdt)
    return [out[slice(*db.tensors[i].shard_range(rank))].view(db.local_shape(i)) for i in index]


def _is_slice_of(g: torch.Tensor, dst: torch.Tensor) -> bool:
    try:
        return (g.is_contiguous() and g.numel() == dst.numel() and g.dtype == dst.dtype
                and g.data_ptr() == dst.data_ptr())
    except RuntimeError:
        return False


def _zero_gaps(buf: torch.Tensor, tensors, covered: set) -> None:
    """Zero everything but the tensors about to be written: padding and missing gradients
    (one op for all the gaps)."""
    end, gaps = 0, []
    for i, t in enumerate(tensors):
        if i in covered:
            if t.offset > end:
                gaps.append(buf[end:t.offset])
            end = max(end, t.offset + t.numel)
    if end < buf.numel():
        gaps.append(buf[end:])
    with torch.no_grad():
        tp.zero_many(gaps)


def reduce_scatter(full_grads: Any, spec: ShardSpec, *, shards: Any = None, mesh: Any = None,
                   grad_reduce: str = "avg", reduce_dtype: Optional[torch.dtype] = None,
                   accumulate_grads: bool = False) -> Any:
    """Reduce-scatter full gradients into the sharded gradient DBuffers (explicit form).

    Args:
        full_grads: A tree of full-shape gradients (``None`` leaves count as zero).
        spec: The plan.
        shards: The shards tree whose gradient buffers receive the result (default: fresh
            buffers for this call).
        mesh: A ``DeviceMesh`` matching the spec, for fresh buffers; default: the default
            group. Shards from ``vfsdp.shard`` carry the mesh they were made on: passing one
            with ``shards`` is deprecated (a ``FutureWarning``; it goes in 0.4).
        grad_reduce: ``"avg"`` or ``"sum"`` over every rank of the mesh.
        reduce_dtype: Dtype to reduce in.
        accumulate_grads: Add into the gradient buffers instead of overwriting them.

    Returns:
        A tree of this rank's gradient shards (views into the gradient DBuffers).

    Raises:
        ValueError: structure, shape or dtype mismatch, naming the path; a bad option.

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     g = {"w": torch.full((8,), dist.get_rank() + 1.0)}
        ...     return vfsdp.reduce_scatter(g, spec, grad_reduce="sum")["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    """
    if functorch_active():
        raise ValueError("vfsdp.reduce_scatter cannot run inside torch.func transforms (it "
                         "writes gradient buffers); differentiate through vfsdp.gather instead, "
                         "whose backward reduce-scatters")
    if accumulate_grads and shards is None:
        raise ValueError("vfsdp.reduce_scatter(accumulate_grads=True) needs shards=: without "
                         "them the result goes to fresh buffers, so there is nothing to add to")
    opts = GradOptions(grad_reduce=grad_reduce, reduce_dtype=reduce_dtype, grads="buffer",
                       accumulate_grads=True if accumulate_grads else None)
    what = "vfsdp.reduce_scatter"
    grads = optree.tree_leaves(full_grads, none_is_leaf=True)
    treespec = optree.tree_structure(full_grads, none_is_leaf=True)
    if treespec.num_leaves != spec.treespec.num_leaves:
        match_tree(full_grads, spec, what)  # raises with the differing path
    if shards is not None:
        own_mesh(shards, mesh, what)  # the shards' units carry their mesh
        units = units_of(match_tree(shards, spec, what), spec, what)
    else:  # fresh units: only their gradient buffers are used
        groups = resolve_groups(spec, mesh)
        units = [UnitLeaves(key, Unit(spec.units[key], groups), tuple(members))
                 for key, members in spec.unit_leaves().items()]
    out: list = list(grads)
    leaves = spec.leaves()
    for u in units:
        unit_grads = []
        for i, _k in u.leaves:
            g, t = grads[i], leaves[i]
            if g is not None and tuple(g.shape) != tuple(t.shape):
                raise ValueError(f"{what}: gradient of {format_path(t.path)} has shape "
                                 f"{tuple(g.shape)}, expected {tuple(t.shape)}")
            unit_grads.append(g)
        pieces = reduce_unit(u.unit, u.index, unit_grads, opts, overwrite=not accumulate_grads)
        for (i, _), piece in zip(u.leaves, pieces):
            out[i] = piece
    return optree.tree_unflatten(spec.treespec, out)

