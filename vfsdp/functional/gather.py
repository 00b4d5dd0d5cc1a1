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
from dataclasses import dataclass
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

__all__ = ["gather", "gather_async", "reduce_scatter", "GradOptions", "GRAD_REDUCE_OPS"]

GRAD_REDUCE_OPS = ("avg", "sum")
_PACKING = threading.local()


@dataclass(frozen=True)
class GradOptions:
    """How a unit's gradients are reduced (see :func:`gather`)."""

    grad_reduce: str = "avg"
    reduce_dtype: Optional[torch.dtype] = None
    param_dtype: Optional[torch.dtype] = None
    grads: str = "return"
    accumulate: bool = False
    sync: bool = True
    free_after_backward: bool = False
    async_reduce: bool = False

    def __post_init__(self) -> None:
        if self.grad_reduce not in GRAD_REDUCE_OPS:
            raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_OPS}, got {self.grad_reduce!r}")
        if self.grads not in ("return", "buffer"):
            raise ValueError(f"grads must be 'return' or 'buffer', got {self.grads!r}")


class _UnitCall:
    """Arguments of one unit's gather, in an object pytree utilities leave alone."""

    __slots__ = ("spec", "key", "mesh", "idx", "what", "db", "opts")

    def __init__(self, spec, key, mesh, idx, what, opts: GradOptions) -> None:
        self.spec, self.key, self.mesh, self.idx, self.what = spec, key, mesh, idx, what
        self.opts = opts
        self.db = None


def gather_unit_buffer(db: DBuffer, param_dtype: Optional[torch.dtype],
                       async_op: bool = False) -> tuple[DBuffer, Handle]:
    """All-gather a unit, in ``param_dtype`` if given: one cast (a group op) into a compute
    DBuffer's shard, then the in-place all-gather of that. Returns the buffer holding the
    full tensors and the handle."""
    if param_dtype is None or param_dtype == db.dtype:
        return db, db.all_gather(async_op=async_op)
    compute = db.companion("compute", param_dtype)
    compute.copy_(db)
    return compute, compute.all_gather(async_op=async_op)


class _GatherUnit(torch.autograd.Function):
    """Forward: full views of one gathered unit. Backward: reduce-scatter into the grad DBuffer.

    The DBuffer is resolved inside ``forward``, where ``torch.func`` transforms hand over the
    plain (unwrapped) shard tensors, so the same code serves ``backward()``,
    ``autograd.grad`` and ``torch.func.grad``.
    """

    @staticmethod
    def forward(unit, prefetched, *local):
        full_db = prefetched
        if full_db is None:
            db = _resolve_unit(list(local), unit.spec, unit.key, unit.idx, unit.mesh, unit.what)
            full_db, _ = gather_unit_buffer(db, unit.opts.param_dtype)
        unit.db = full_db  # read by setup_context (torch.func may wrap the outputs there)
        return tuple(full_db.full_alias(i) for i in unit.idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        unit, _prefetched, *_local = inputs
        ctx.db, ctx.idx, ctx.opts = unit.db, unit.idx, unit.opts
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        opts, full_db = ctx.opts, ctx.db
        master = full_db.parent or full_db
        if opts.free_after_backward:
            # The unit's backward is done, its gathered parameters are no longer read: release
            # them before the gradient staging buffer is allocated, so the two never coexist.
            full_db.free_global()
        pieces = _reduce_unit(master, ctx.idx, grads, opts)
        if opts.grads == "buffer" or pieces is None:
            return (None, None) + (None,) * len(ctx.idx)
        return (None, None) + tuple(pieces)


def _reduce_unit(db: DBuffer, idx, grads, opts: GradOptions):
    """Reduce-scatter the gradients of tensors ``idx`` into ``db``'s gradient DBuffer.

    Returns this rank's gradient pieces (aliases of the gradient DBuffer), or ``None`` when
    ``opts.sync`` is off (the gradients were only accumulated, unsharded). Inside a
    ``torch.func`` transform, tensors made outside it must not be mutated, so the buffer is
    built functionally (one ``cat``: still one copy per tensor) and fresh pieces are returned.
    """
    if functorch_active():
        return _reduce_unit_functional(db, idx, grads, opts.grad_reduce, opts.reduce_dtype)
    gdb = db.grad_buffer()
    rdt = opts.reduce_dtype or next((g.dtype for g in grads if g is not None), gdb.dtype)
    accum = db._companions.get(("accum", rdt))
    if not opts.sync or (accum is not None and accum.is_allocated):
        # Accumulating unsharded (no reduce until the last micro-batch): a persistent buffer.
        accum = db.companion("accum", rdt)
        if not accum.is_allocated:
            accum.alloc_global().data.zero_()
        buf = accum.global_buffer.data
        with torch.no_grad():
            for i, g in zip(idx, grads):
                if g is not None:
                    t = gdb.tensors[i]
                    buf[t.offset:t.offset + t.numel].view(t.shape).add_(g)
        if not opts.sync:
            return None
        gdb.reduce_scatter(source=buf, op=opts.grad_reduce, reduce_dtype=rdt,
                           accumulate=opts.accumulate)
        accum.free_global()
        return [gdb.local(i) for i in idx]
    stage = gdb if rdt == gdb.dtype else db.companion("stage", rdt)
    buf = stage.alloc_global().data
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
    if opts.async_reduce and opts.grads == "buffer":
        # Overlap with the next unit's backward; the staging buffer is freed once it is done.
        handle = gdb.reduce_scatter(source=buf, op=opts.grad_reduce, reduce_dtype=rdt,
                                    accumulate=opts.accumulate, async_op=True)
        _pending().append((handle, stage))
        while len(_pending()) > MAX_PENDING_REDUCTIONS:
            _finish_oldest()
        return [gdb.local(i) for i in idx]
    gdb.reduce_scatter(source=buf, op=opts.grad_reduce, reduce_dtype=rdt, accumulate=opts.accumulate)
    stage.free_global()
    return [gdb.local(i) for i in idx]


MAX_PENDING_REDUCTIONS = 1
"""Async gradient reduce-scatters in flight at once (each holds one unit's staging buffer)."""


def _pending() -> list:
    if not hasattr(_PACKING, "pending"):
        _PACKING.pending = []
    return _PACKING.pending


def _finish_oldest() -> None:
    handle, stage = _pending().pop(0)
    handle.wait()
    stage._pending = None
    stage.free_global()


def wait_reductions() -> None:
    """Wait for this rank's in-flight gradient reduce-scatters (``async_reduce``)."""
    while _pending():
        _finish_oldest()


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


def _units(spec: ShardSpec):
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


def _assemble(leaves, spec, mesh, opts: GradOptions, prefetched: dict, what: str) -> Any:
    out = list(leaves)
    for key, leaf_idx, idx in _units(spec):
        unit = _UnitCall(spec, key, mesh, idx, what, opts)
        fulls = _GatherUnit.apply(unit, prefetched.get(key), *(leaves[i] for i in leaf_idx))
        for i, f in zip(leaf_idx, fulls):
            out[i] = f
    return optree.tree_unflatten(spec.treespec, out)


def gather(shards: Any, spec: ShardSpec, *, mesh: Any = None, grad_reduce: str = "avg",
           reduce_dtype: Optional[torch.dtype] = None, param_dtype: Optional[torch.dtype] = None,
           accumulate_grads: bool = False, grad_sync: bool = True, grads: str = "return",
           free_after_backward: bool = False) -> Any:
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
        param_dtype: Gather in this dtype (e.g. ``torch.bfloat16`` for fp32 master shards):
            one cast over the unit's shard (a group op) into the all-gather input.
        accumulate_grads: Add the reduced gradients into the gradient DBuffer instead of
            overwriting it (gradient accumulation, reducing every micro-batch).
        grad_sync: ``False`` accumulates this backward's gradients unsharded (in
            ``reduce_dtype``) without communicating; the next backward with ``True`` adds its
            own and reduce-scatters the sum (accumulation reducing only on the last step).
        grads: ``"return"`` hands the gradient pieces to autograd (``.grad``,
            ``autograd.grad``, ``torch.func``); ``"buffer"`` leaves them only in the gradient
            DBuffer (read them with :func:`vfsdp.grads`), so ``.grad`` costs no memory.
        free_after_backward: Release the unit's gathered buffer once its backward is done.

    Returns:
        A tree like ``shards`` with full tensors.

    Raises:
        ValueError: structure, shape or dtype mismatch (naming the path), shards made for
            another spec or world size, or a bad option value.

    Example:
        >>> full = vfsdp.gather(shards, spec)              # doctest: +SKIP
        >>> model(full, batch).backward()                  # doctest: +SKIP
    """
    opts = GradOptions(grad_reduce, reduce_dtype, param_dtype, grads, accumulate_grads,
                       grad_sync, free_after_backward)
    leaves = match_tree(shards, spec, "vfsdp.gather")
    return _assemble(leaves, spec, mesh, opts, {}, "vfsdp.gather")


def gather_async(shards: Any, spec: ShardSpec, *, mesh: Any = None, **options: Any) -> Handle:
    """Start the all-gathers now; ``handle.wait()`` returns what :func:`gather` would.

    Takes the same options as :func:`gather`. Use it to overlap the next unit's gather with
    the current unit's compute::

        nxt = vfsdp.gather_async(shards["layers"][i + 1], spec["layers"][i + 1])
        x = layer(full_i, x)
        full_next = nxt.wait()

    Returns:
        A :class:`vfsdp.collectives.Handle`.
    """
    names = ("grad_reduce", "reduce_dtype", "param_dtype", "grads", "accumulate_grads",
             "grad_sync", "free_after_backward", "async_reduce")
    unknown = set(options) - set(names)
    if unknown:
        raise TypeError(f"gather_async got unexpected options {sorted(unknown)}")
    fields = {"accumulate_grads": "accumulate", "grad_sync": "sync"}
    opts = GradOptions(**{fields.get(k, k): v for k, v in options.items()})
    what = "vfsdp.gather_async"
    leaves = match_tree(shards, spec, what)
    prefetched, handles = {}, []
    for key, leaf_idx, idx in _units(spec):
        local = [leaves[i] for i in leaf_idx]
        if all(owner_of(x) is not None for x in local):  # plain shards (not inside torch.func)
            db = _resolve_unit(local, spec, key, idx, mesh, what)
            full_db, handle = gather_unit_buffer(db, opts.param_dtype, async_op=True)
            handles.append(handle)
            prefetched[key] = full_db

    def finish():
        for h in handles:
            h.wait()
        return _assemble(leaves, spec, mesh, opts, prefetched, what)

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
    opts = GradOptions(grad_reduce=op, reduce_dtype=reduce_dtype)
    grads = optree.tree_leaves(full_grads, none_is_leaf=True)
    treespec = optree.tree_structure(full_grads, none_is_leaf=True)
    if treespec.num_leaves != spec.treespec.num_leaves:
        match_tree(full_grads, spec, "vfsdp.reduce_scatter")  # raises with the differing path
    what = "vfsdp.reduce_scatter"
    plans = []
    if shards is not None:
        leaves = match_tree(shards, spec, what)
        for key, leaf_idx, idx in _units(spec):
            db = _resolve_unit([leaves[i] for i in leaf_idx], spec, key, idx, mesh, what)
            plans.append((key, db, tuple(zip(leaf_idx, idx))))
    else:
        groups = resolve_groups(spec, mesh)
        for key, leaf_idx, idx in _units(spec):
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
        pieces = _reduce_unit(db, tuple(k for _, k in pairs), unit_grads, opts)
        for (i, _), piece in zip(pairs, pieces):
            out[i] = piece
    return optree.tree_unflatten(spec.treespec, out)
