"""The compiled path: what :func:`vfsdp.gather` does while ``torch.compile`` traces it.

The eager gather owns its buffers: it all-gathers into a persistent global buffer in place,
frees it by resizing its storage and hands out aliases with ``set_``. None of that can be
traced. While dynamo traces it (``torch.compiler.is_dynamo_compiling()``) the same call takes
a functional path instead, and the compiler owns every buffer:

* per unit, the rank's shard is assembled from its tensor pieces (zeros in the padding
  between them, exactly the eager shard's bytes), cast to ``param_dtype`` if asked, and
  all-gathered with a functional collective (``_c10d_functional.all_gather_into_tensor``),
  whose autograd backward is a reduce-scatter (sum): the sharded gradients land on the
  shards (``.grad`` or ``autograd.grad``), as with the eager default ``grads="return"``;
* ``grad_reduce="avg"`` scales that gradient by ``1 / (ranks)``; over HSDP's replicate dim a
  differentiable sum over the replicas adds theirs in the backward;
* the full tensors are views of the gathered buffer at the plan's offsets: the same layout,
  the same values, and the eager path's reference semantics;
* every shard also adds ``anchor * 0``, a one-element leaf per unit: the shard's gradient (the
  reduce-scatter) then has a user on every rank. Ranks' graphs differ (ragged pieces; a rank
  may hold nothing of a gathered tensor), and a reduce-scatter without a user would be dropped
  on one rank and waited for on the others. ``loss.backward()`` computes the anchors' (zero)
  gradients; ``torch.autograd.grad`` must be asked for them too (``vfsdp`` can't add inputs
  to it), so prefer ``backward()`` in compiled steps.

What each unit needs is plain data made eagerly, by :func:`vfsdp.shard` (:func:`prepare`),
since nothing can be computed while tracing: this rank's pieces, offsets and shapes are the
spec's own (``local_plan(spec, rank)``, a pure function of the spec, kept with it), and the
unit's runtime (its groups' names, its anchor and accumulator leaves) is the shards' unit's
(``unit.traced``, reached from a shard's slot). The spec holds nothing of any process's
runtime. Dynamo guards on the values it reads there, not on the objects: a new spec
compiles once more, and the same spec never recompiles. The shards' groups are those they
were made on.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import optree
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import SLOT
from vfsdp.functional.lowp import hooked_all_gather
from vfsdp.functional.options import Policy
from vfsdp.functional.pieces import assemble_layer
from vfsdp.planner.local import local_plan
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["traced_gather", "prepare", "traced_leaves", "traced_run_layers", "unit_context",
           "padded"]


def prepare(spec: ShardSpec, units: dict) -> None:
    """Make, eagerly, what the compiled path reads: each unit's runtime (``unit.traced``) and
    this rank's :func:`~vfsdp.planner.local.local_plan` of ``spec`` and of every sub-spec of
    its subtrees (``spec["layers"]``, ``spec["layers"][3]``, ``spec["embed"]``, ...).

    Args:
        spec: The plan.
        units: Unit key -> the :class:`~vfsdp.collectives.Unit` its shards live in.

    Returns:
        ``None``.

    Raises:
        Nothing.
    """
    rank = None
    for unit in units.values():
        rank = unit.traced_record().shard_rank
    _local(spec, rank)


def _local(spec: ShardSpec, rank: Optional[int]) -> None:
    local_plan(spec, None)
    if rank is not None:
        local_plan(spec, rank)
    tree = spec.tree
    for key, node in tree.items() if isinstance(tree, dict) else \
            enumerate(tree) if isinstance(tree, (list, tuple)) else ():
        if isinstance(node, TensorSpec) or (isinstance(node, (dict, list, tuple))
                                            and not optree.tree_is_leaf(node)):
            _local(spec[key], rank)


def _unit_of(leaf: Any, what: str) -> Any:
    """The runtime (``unit.traced``) of the unit of the shard ``leaf``, from its slot.

    Raises:
        ValueError: the leaf is not a shard made by ``vfsdp.shard`` (or ``scatter``).
    """
    slot = getattr(leaf, SLOT, None)
    found = getattr(slot.owner, "traced", None) if slot is not None else None
    if found is None:
        raise ValueError(f"{what} under torch.compile: these shards were not made for the "
                         f"compiled path; make them with vfsdp.shard before compiling (plain "
                         f"tensors are gathered eagerly only)")
    return found


def unit_context(leaves: list, spec: ShardSpec, what: str, flush: Optional[Policy] = None) -> list:
    """Per unit of ``spec``: its :func:`~vfsdp.planner.local.local_plan` entry on this rank and its
    runtime (``unit.traced``), read from the shards ``leaves`` (this rank's index in the shard
    group: from the tree's first tensor's unit). With ``flush`` (a call's policy with
    ``grad_sync``), what ``grad_sync=False`` backwards left unreduced is reduced first
    (:func:`_flush`).

    Raises:
        ValueError: shards not made by ``vfsdp.shard``.
    """
    tensors = local_plan(spec, None)[1]
    rank = _unit_of(leaves[tensors[0]], what).shard_rank if tensors else 0
    context = [(u, _unit_of(leaves[u[4][0][0]], what)) for u in local_plan(spec, rank)]
    if flush is not None and flush.grad_sync:
        _flush(leaves, context, flush.grad_reduce)
    return context


def traced_leaves(tree: Any, spec: ShardSpec, what: str) -> tuple[list, Any]:
    """``(leaves in spec order, tree structure)`` of ``tree`` while compiling (the eager call
    checks the whole structure; here only the count, which dynamo's guards then keep fixed).
    The structure is the traced tree's own (dynamo's pytree stand-in), for ``unflatten``.

    Raises:
        ValueError: a different number of leaves than the spec's tree.
    """
    if tp.compiling():
        tp.enable_compiled_backward()  # runs while tracing: lets dynamo trace the backward
    leaves, treespec = optree.tree_flatten(tree)
    n = local_plan(spec, None)[0]
    if len(leaves) != n:
        raise ValueError(f"{what}: the tree has {len(leaves)} leaves, the spec {n}; pass the "
                         f"tree the spec was planned for")
    return leaves, treespec


def _grad_times(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (exactly, infinities and NaN included), whose gradient is multiplied by
    ``scale``. Plain ops, so the compiled backward stays one region: ``x.detach() + (x -
    x.detach()) * scale`` where ``x`` is finite (there ``x - x.detach()`` is 0), ``x * scale``
    where it is not (``inf * scale`` is ``inf``; ``x - x.detach()`` would be NaN)."""
    d = x.detach()
    return torch.where(torch.isfinite(d), d + (x - d) * scale, x * scale)


def _grad_summed(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """``x`` (exactly, infinities and NaN included; the same on every rank of ``group``),
    whose gradient is summed over ``group``: the collective's own backward does it. The
    forward collective it costs is the price of staying one traced graph (a custom autograd
    function splits the compiled backward). The sum runs in float32 (``size * x`` could
    overflow a half-precision shard); where ``x`` is not finite the sum is the value."""
    summed = tp.traced_sum_autograd(x.float(), group, size)
    d = x.detach()
    return torch.where(torch.isfinite(d), d + (summed - summed.detach()).to(x.dtype),
                       summed.to(x.dtype))


def _scale(runtime: Any, grad_reduce: str) -> float:
    """What the reduce-scatter's sum is multiplied by: ``1 / ranks`` for ``"avg"``."""
    return 1.0 / (runtime.shard_size * runtime.replicas) if grad_reduce == "avg" else 1.0


def _flush(leaves: list, context: list, grad_reduce: str) -> None:
    """A synced gather after ``grad_sync=False`` backwards: for every unit of ``context``
    (:func:`unit_context`) whose accumulator holds gradients, reduce-scatter them (as the
    eager sync does, with this backward's own added there, here in a reduce-scatter of their
    own) into the shards' ``.grad``, and drop them."""
    for (*_k, pieces, _views), rt in context:
        acc = rt.accumulator
        if acc.grad is None:
            continue
        red = tp.traced_reduce_scatter(acc.grad, "sum", rt.shard_group, rt.shard_size)
        if rt.replicate_group is not None:
            red = tp.traced_all_reduce(red, "sum", rt.replicate_group)
        if _scale(rt, grad_reduce) != 1.0:
            red = red * _scale(rt, grad_reduce)
        with torch.no_grad():
            for i, lo, hi in pieces:
                x = leaves[i]
                if x.requires_grad:
                    piece = red[lo:hi].view(x.shape).to(x.dtype)
                    if x.grad is None:
                        x.grad = piece
                    else:
                        x.grad.add_(piece)
        acc.grad = None


def traced_gather(shards: Any, spec: ShardSpec, opts: Policy,
                  context: Optional[list] = None) -> Any:
    """The full tree, by functional collectives the compiler can trace (see the module).

    Args:
        shards: The shards (``vfsdp.shard``'s tree: their units carry their groups).
        spec: Their spec.
        opts: The call's ``vfsdp.Policy`` (:func:`vfsdp.functional.options.merge`), of which
            this path reads ``param_dtype``, ``grad_reduce``, ``reduce_dtype`` (``None`` or
            the gather's dtype: compiled, the gradients are reduce-scattered in the dtype
            they were gathered in; with ``all_gather`` hooks, any, float32 by default),
            ``all_gather`` (low-precision hooks, :mod:`vfsdp.functional.lowp`, run eagerly
            too) and ``grad_sync`` (``False``: no reduce-scatter in the backward; the
            gradients of the full tensors add up, unsharded, in the unit's accumulator, its
            ``.grad`` in the parameters' dtype, and the next synced gather reduce-scatters
            them into the shards' ``.grad`` before its own backward adds to them).
        context: :func:`unit_context` of the shards (with ``flush``), when the caller read it
            (outside a checkpointed region, where dynamo guards what it reads); ``None``: read
            here.

    Returns:
        The full tree (views of one gathered buffer per unit).

    Raises:
        ValueError: a tree that does not match the spec, an unprepared spec, or a
            ``reduce_dtype`` other than the gather's.
    """
    what = "vfsdp.gather"
    leaves, treespec = traced_leaves(shards, spec, what)
    if context is None:
        context = unit_context(leaves, spec, what, flush=opts)
    out = list(leaves)
    for (_key, s, dtype, pieces, views), rt in context:
        shard = padded([(leaves[i], lo, hi) for i, lo, hi in pieces], s, leaves[views[0][0]])
        shard = shard + rt.anchor * 0  # (see the module) exact: x + 0 == x
        if not opts.grad_sync:  # no reduce-scatter: the full gradients go to the accumulator
            shard = shard.detach()
        elif rt.replicate_group is not None:  # HSDP: the replicas' gradients are summed too
            shard = _grad_summed(shard, rt.replicate_group, rt.replicas)
        if opts.grad_sync and _scale(rt, opts.grad_reduce) != 1.0:  # "avg": the sum, times 1/ranks
            shard = _grad_times(shard, _scale(rt, opts.grad_reduce))
        gather_dtype = opts.param_dtype or dtype
        if opts.all_gather is not None:  # a low-precision gather (vfsdp.functional.lowp)
            full = hooked_all_gather(shard, opts.all_gather, pieces, views, s, rt.shard_group,
                                     rt.shard_size, rt.shard_rank, opts.reduce_dtype)
        elif opts.reduce_dtype is not None and opts.reduce_dtype != gather_dtype:
            raise ValueError(f"vfsdp.gather: reduce_dtype={opts.reduce_dtype} is not supported "
                             f"under torch.compile with a {gather_dtype} gather (the compiled "
                             f"reduce-scatter runs in the gather dtype); gather in that dtype, "
                             f"or run this step eagerly")
        else:
            full = tp.traced_all_gather(shard.to(gather_dtype), rt.shard_group, rt.shard_size)
        if not opts.grad_sync:
            full = full + (rt.accumulator - rt.accumulator.detach()).to(full.dtype)
        for i, offset, numel, shape in views:
            out[i] = full[offset:offset + numel].view(shape)
    return optree.tree_unflatten(treespec, out)


def padded(spans: list, total: int, like: torch.Tensor) -> torch.Tensor:
    """One flat tensor of ``total`` elements: each ``(tensor, lo, hi)`` of ``spans`` (in
    order) flattened at ``lo``, zeros (of ``like``'s dtype and device) between and after
    them. One ``cat``, or the tensor itself where it is the whole."""
    parts, pos = [], 0
    for x, lo, hi in spans:
        if lo > pos:
            parts.append(like.new_zeros(lo - pos))
        parts.append(x.reshape(-1))
        pos = max(pos, hi)
    if pos < total or not parts:
        parts.append(like.new_zeros(total - pos))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _regather_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective activation checkpointing: recompute (re-gather) the all-gathers and their
    waits in backward, save everything else."""
    if op in tp.traced_gather_ops() or getattr(op, "is_view", False):
        return CheckpointPolicy.MUST_RECOMPUTE  # views cost nothing to redo
    return CheckpointPolicy.PREFER_SAVE


def traced_run_layers(layer_fn: Any, layers: list, h: Any, opts: Policy) -> Any:
    """:func:`vfsdp.run_layers` while compiling: each unit gathered functionally; with
    ``reshard_after_forward`` the gathered parameters are not saved for backward but gathered
    again there (selective activation checkpointing of the all-gathers), everything else
    (activations) saved as in eager.

    Args:
        layer_fn, h: As for ``run_layers``.
        layers: Per layer, its pieces (:func:`vfsdp.functional.pieces.layer_pieces`).
        opts: The call's ``vfsdp.Policy``, as for :func:`traced_gather`
            (``reshard_after_forward`` too).

    Returns:
        The last unit's output.

    Raises:
        ValueError: as :func:`traced_gather`.
    """
    # read here, outside the checkpointed region below: dynamo guards them (traced_leaves
    # lets dynamo trace the backward)
    contexts = [unit_context(traced_leaves(piece.tree, piece.spec, piece.what)[0], piece.spec,
                             piece.what, flush=opts) for layer in layers for piece in layer]
    shards = [[piece.tree for piece in layer] for layer in layers]

    def run(shards, h):
        found = iter(contexts)
        for layer, trees in zip(layers, shards):
            h = layer_fn(assemble_layer(layer, [
                traced_gather(tree, piece.spec, opts, next(found))
                for piece, tree in zip(layer, trees)]), h)
        return h

    if opts.reshard_after_forward is False:
        return run(shards, h)
    # One region (the compiler rematerialises one per forward-loss-backward graph): every
    # all-gather is recomputed where the backward needs its unit, everything else is saved.
    return checkpoint(run, shards, h, use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, _regather_policy))
