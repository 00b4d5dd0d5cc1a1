"""``vfsdp.gather`` (differentiable), ``gather_async`` and ``reduce_scatter`` over pytrees.

One all-gather per unit, in place: each unit's shard is the collective's input as it is, the
unit's global buffer its output, and every full tensor a view of that buffer. No copy runs
before or after the collective.

The backward of ``gather`` is a reduce-scatter into the unit's sharded gradient DBuffer.
Gradients reach the reduce-scatter input buffer with **one contiguous copy per tensor**
(``numel * itemsize`` bytes each, never an interleaving copy like FSDP2's ``chunk_cat``): autograd
hands the backward one gradient tensor per output, which is copied into its ``[offset,
offset+numel)`` slice of the unit's gradient buffer; padding is zero-filled. When a gradient
already *is* that slice (``reduce_scatter`` on gradients produced in place), no copy happens.

Gradient semantics: ``grad_reduce="avg"`` (default) gives each rank the mean over all ranks of
their gradients (FSDP/DDP semantics: each rank's loss is a mean over its batch); ``"sum"`` gives
the sum, i.e. the exact gradient of the sum of all ranks' losses. Over an HSDP mesh the mean
or sum runs over every rank of the mesh.

The returned gradients alias the unit's persistent gradient DBuffer: the next backward
through the same unit overwrites them. Clone them to keep them.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable, Optional

import optree
import torch

from vfsdp._torch_private import functorch_active
from vfsdp.collectives import comm
from vfsdp.collectives.dbuffer import DBuffer, owner_of
from vfsdp.collectives.groups import resolve_groups
from vfsdp.collectives.handle import Handle
from vfsdp.functional.tree import group_by_unit, match_tree
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec, unit_name

__all__ = ["gather", "gather_async", "reduce_scatter", "GRAD_REDUCE_OPS"]

GRAD_REDUCE_OPS = ("avg", "sum")
_PACKING = threading.local()


class _UnitCall:
    """Arguments of one unit's gather, in an object pytree utilities leave alone."""

    __slots__ = ("spec", "key", "mesh", "idx", "what", "db")

    def __init__(self, spec, key, mesh, idx, what) -> None:
        self.spec, self.key, self.mesh, self.idx, self.what = spec, key, mesh, idx, what
        self.db = None


class _GatherUnit(torch.autograd.Function):
    """Forward: full views of one gathered unit. Backward: reduce-scatter into the grad DBuffer.

    The DBuffer is resolved inside ``forward``, where ``torch.func`` transforms hand over the
    plain (unwrapped) shard tensors, so the same code serves ``backward()``,
    ``autograd.grad`` and ``torch.func.grad``.
    """

    @staticmethod
    def forward(unit, op: str, reduce_dtype, prefetched, *local):
        db = prefetched
        if db is None:
            db = _resolve_unit(list(local), unit.spec, unit.key, unit.idx, unit.mesh, unit.what)
            db.all_gather()
        unit.db = db  # read by setup_context (torch.func may wrap the outputs there)
        return tuple(db.full_alias(i) for i in unit.idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        unit, op, reduce_dtype, _prefetched, *_local = inputs
        ctx.db, ctx.idx = unit.db, unit.idx
        ctx.op, ctx.reduce_dtype = op, reduce_dtype
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None) + tuple(
            _reduce_unit(ctx.db, ctx.idx, grads, ctx.op, ctx.reduce_dtype))


def _reduce_unit(db: DBuffer, idx, grads, op: str, reduce_dtype):
    """Reduce-scatter the gradients of tensors ``idx``; return this rank's gradient pieces.

    Normally the result lands in the unit's persistent gradient DBuffer and the pieces are its
    aliases. Inside a ``torch.func`` transform, tensors made outside it must not be mutated,
    so the buffer is built functionally (one ``cat``: still one copy per tensor) and fresh
    gradient pieces are returned.
    """
    if functorch_active():
        return _reduce_unit_functional(db, idx, grads, op, reduce_dtype)
    gdb = db.grad_buffer()
    buf = gdb.alloc_global().data
    covered = set()
    copies = []
    for i, g in zip(idx, grads):
        if g is None:
            continue
        t = gdb.tensors[i]
        dst = buf[t.offset:t.offset + t.numel]
        covered.add(i)
        if _is_slice_of(g, dst):
            continue  # produced in place: nothing to copy
        copies.append((dst, g))
    _zero_gaps(buf, gdb.tensors, covered)
    with torch.no_grad():
        for dst, g in copies:
            dst.view(g.shape).copy_(g)
    gdb.reduce_scatter(op=op, reduce_dtype=reduce_dtype)
    gdb.free_global()
    return [gdb.local(i) for i in idx]


def _reduce_unit_functional(db: DBuffer, idx, grads, op: str, reduce_dtype):
    layout, rank = db.layout, db.rank
    by_index = dict(zip(idx, grads))
    rdt = reduce_dtype or next((g.dtype for g in grads if g is not None), db.dtype)
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
    out = torch.empty(layout.shard_numel, dtype=rdt, device=db.device)
    comm.reduce_scatter_into(out, full, op, db.groups.shard)
    if db.groups.replicate is not None:
        comm.all_reduce_(out, op, db.groups.replicate)
    out = out.to(db.dtype)
    result = []
    for i in idx:
        t = db.tensors[i]
        lo, hi = t.shard_range(rank)
        result.append(out[lo:hi].view(db.local(i).shape))
    return result


def _is_slice_of(g: torch.Tensor, dst: torch.Tensor) -> bool:
    try:
        return (g.is_contiguous() and g.numel() == dst.numel() and g.dtype == dst.dtype
                and g.data_ptr() == dst.data_ptr())
    except RuntimeError:
        return False


def _zero_gaps(buf: torch.Tensor, tensors, covered: set) -> None:
    """Zero everything but the tensors about to be written: padding and missing gradients."""
    end = 0
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if i in covered:
                if t.offset > end:
                    buf[end:t.offset].zero_()
                end = max(end, t.offset + t.numel)
        if end < buf.numel():
            buf[end:].zero_()


def _packing_dbuffer(spec: ShardSpec, key: Hashable, groups) -> DBuffer:
    """A per-rank DBuffer for shards that are not views into one (created once per unit)."""
    cache = getattr(_PACKING, "cache", None)
    if cache is None:
        cache = _PACKING.cache = {}
    ck = (spec.fingerprint, key, id(groups.shard), groups.shard_rank)
    db = cache.get(ck)
    if db is None:
        db = cache[ck] = DBuffer(spec, key, groups, role="param (packed)")
    return db


def _resolve_unit(local: list, spec: ShardSpec, key: Hashable, idx: tuple, mesh, what: str) -> DBuffer:
    """The parameter DBuffer the unit's shards alias, or a packing one they are copied into."""
    layout = spec.units[key]
    db = None
    for x in local:
        cand = owner_of(x) if isinstance(x, torch.Tensor) else None
        if cand is not None and cand.key == key and cand.role.startswith("param"):
            db = cand
            break
    if db is not None and db.layout != layout:
        raise ValueError(
            f"{what}: the shards of unit {unit_name(key)} were made for another plan "
            f"(m={db.layout.world_size}, S={db.layout.shard_numel}) than this spec "
            f"(m={layout.world_size}, S={layout.shard_numel}); use the spec they were sharded with"
        )
    if db is not None and all(db.is_local_view(k, x) for k, x in zip(idx, local)):
        return db
    if db is not None:
        for k, x in zip(idx, local):
            if owner_of(x) is db and not db.is_local_view(k, x):
                raise ValueError(f"{what}: {format_path(layout.paths[k])} is a view of unit "
                                 f"{unit_name(key)}'s shard at the wrong place; pass the shards "
                                 f"tree returned by vfsdp.shard")
    db = _packing_dbuffer(spec, key, resolve_groups(spec, mesh))
    with torch.no_grad():
        for k, x in zip(idx, local):
            _pack_local(db, k, x, layout.paths[k], what)
    return db


def _units(leaves, spec: ShardSpec):
    """For each unit: its key, the leaf indices present, and their buffer positions."""
    out = []
    for key, members in group_by_unit(spec).items():
        paths = spec.units[key].paths
        out.append((key, tuple(i for i, _ in members), tuple(paths.index(t.path) for _, t in members)))
    return out


def _pack_local(db: DBuffer, k: int, x, path, what: str) -> None:
    ref = db.local(k)
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(ref.shape) or x.dtype != ref.dtype:
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: {format_path(path)} should be this rank's shard of shape "
                         f"{tuple(ref.shape)} {ref.dtype}, got {got}")
    ref.copy_(x.detach())


def _check_op(grad_reduce: str) -> None:
    if grad_reduce not in GRAD_REDUCE_OPS:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_OPS}, got {grad_reduce!r}")


def _assemble(leaves, spec, mesh, grad_reduce, reduce_dtype, prefetched: dict, what: str) -> Any:
    out = list(leaves)
    for key, leaf_idx, idx in _units(leaves, spec):
        unit = _UnitCall(spec, key, mesh, idx, what)
        fulls = _GatherUnit.apply(unit, grad_reduce, reduce_dtype, prefetched.get(key),
                                  *(leaves[i] for i in leaf_idx))
        for i, f in zip(leaf_idx, fulls):
            out[i] = f
    return optree.tree_unflatten(spec.treespec, out)


def gather(shards: Any, spec: ShardSpec, *, mesh: Any = None, grad_reduce: str = "avg",
           reduce_dtype: Optional[torch.dtype] = None) -> Any:
    """Full tensors from this rank's shards: one in-place all-gather per unit. Differentiable.

    Works on the whole tree or any subtree with its sub-spec (``spec["layers"][3]``). The
    result's tensors are views into each unit's global buffer; they stay valid until
    :func:`vfsdp.release` (or a later gather refreshes them: gathering a gathered unit again
    is allowed and re-runs its all-gather). Non-tensor leaves pass through.

    Args:
        shards: The tree returned by :func:`vfsdp.shard` (or shards of the right local shapes;
            those are packed into a DBuffer with one copy per tensor).
        spec: The plan (or the sub-spec of the subtree).
        mesh: A ``DeviceMesh`` matching the spec; default: the default group.
        grad_reduce: ``"avg"`` or ``"sum"``: how the backward reduces across ranks.
        reduce_dtype: Dtype of the backward's reduce-scatter (default: the gradient dtype).

    Returns:
        A tree like ``shards`` with full tensors.

    Raises:
        ValueError: structure, shape or dtype mismatch (naming the path), or shards made for
            another spec or world size.

    Example:
        >>> full = vfsdp.gather(shards, spec)              # doctest: +SKIP
        >>> model(full, batch).backward()                  # doctest: +SKIP
    """
    _check_op(grad_reduce)
    leaves = match_tree(shards, spec, "vfsdp.gather")
    return _assemble(leaves, spec, mesh, grad_reduce, reduce_dtype, {}, "vfsdp.gather")


def gather_async(shards: Any, spec: ShardSpec, *, mesh: Any = None, grad_reduce: str = "avg",
                 reduce_dtype: Optional[torch.dtype] = None) -> Handle:
    """Start the all-gathers now; ``handle.wait()`` returns what :func:`gather` would.

    Use it to overlap the next unit's gather with the current unit's compute::

        nxt = vfsdp.gather_async(shards["layers"][i + 1], spec["layers"][i + 1])
        x = layer(full_i, x)
        full_next = nxt.wait()

    Returns:
        A :class:`vfsdp.collectives.Handle`.
    """
    _check_op(grad_reduce)
    what = "vfsdp.gather_async"
    leaves = match_tree(shards, spec, what)
    prefetched, handles = {}, []
    for key, leaf_idx, idx in _units(leaves, spec):
        local = [leaves[i] for i in leaf_idx]
        if all(owner_of(x) is not None for x in local):  # plain shards (not inside torch.func)
            db = _resolve_unit(local, spec, key, idx, mesh, what)
            handles.append(db.all_gather(async_op=True))
            prefetched[key] = db

    def finish():
        for h in handles:
            h.wait()
        return _assemble(leaves, spec, mesh, grad_reduce, reduce_dtype, prefetched, what)

    return Handle((), finish)


def reduce_scatter(full_grads: Any, spec: ShardSpec, *, shards: Any = None, mesh: Any = None,
                   op: str = "avg", reduce_dtype: Optional[torch.dtype] = None) -> Any:
    """Reduce-scatter full gradients into the sharded gradient DBuffers (explicit form).

    Args:
        full_grads: A tree of full-shape gradients (``None`` leaves count as zero).
        spec: The plan.
        shards: The shards tree whose DBuffers receive the result (default: per-rank buffers
            vfsdp keeps for the spec).
        mesh: A ``DeviceMesh`` matching the spec; default: the default group.
        op: ``"avg"`` or ``"sum"``.
        reduce_dtype: Dtype to reduce in.

    Returns:
        A tree of this rank's gradient shards (views into the gradient DBuffers).

    Raises:
        ValueError: structure, shape or dtype mismatch, naming the path.
    """
    _check_op(op)
    grads = optree.tree_leaves(full_grads, none_is_leaf=True)
    treespec = optree.tree_structure(full_grads, none_is_leaf=True)
    if treespec.num_leaves != spec.treespec.num_leaves:
        match_tree(full_grads, spec, "vfsdp.reduce_scatter")  # raises with the differing path
    what = "vfsdp.reduce_scatter"
    plans = []
    if shards is not None:
        leaves = match_tree(shards, spec, what)
        for key, leaf_idx, idx in _units(leaves, spec):
            db = _resolve_unit([leaves[i] for i in leaf_idx], spec, key, idx, mesh, what)
            plans.append((key, db, tuple(zip(leaf_idx, idx))))
    else:
        groups = resolve_groups(spec, mesh)
        for key, leaf_idx, idx in _units(spec.leaves(), spec):
            plans.append((key, _packing_dbuffer(spec, key, groups), tuple(zip(leaf_idx, idx))))
    out: list = list(grads)
    for key, db, pairs in plans:
        unit_grads = []
        for i, k in pairs:
            g = grads[i]
            t: TensorSpec = spec.leaves()[i]
            if g is not None and (tuple(g.shape) != tuple(t.shape)):
                raise ValueError(f"vfsdp.reduce_scatter: gradient of {format_path(t.path)} has "
                                 f"shape {tuple(g.shape)}, expected {tuple(t.shape)}")
            unit_grads.append(g)
        pieces = _reduce_unit(db, tuple(k for _, k in pairs), unit_grads, op, reduce_dtype)
        for (i, _), piece in zip(pairs, pieces):
            out[i] = piece
    return optree.tree_unflatten(spec.treespec, out)
