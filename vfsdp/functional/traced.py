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

What each unit needs (its group, this rank's pieces, offsets and shapes) is plain data that
:func:`vfsdp.shard` keeps on the spec and on its sub-specs (:func:`prepare`, ``spec.traced``):
nothing about a spec is computed while tracing, a new spec compiles once more and the same spec
never recompiles. The shards' groups are those they were made on. (That slot is the one piece
of runtime state a spec still carries: dynamo reads a constant's attribute without guarding
on the object's identity, which a lookup elsewhere by spec adds, with a graph per spec object
and rank.)
"""

from __future__ import annotations

from typing import Any, Optional

import optree
import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp.functional.lowp import hooked_all_gather
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["traced_gather", "prepare", "traced_children", "group_name",
           "traced_leaves", "traced_run_layers", "traced_grads",
           "traced_zero_grads", "drop_plan_grads"]


def group_name(group: Any) -> str:
    """The name functional collectives know a process group by (``None``: the default)."""
    return (group if group is not None else dist.group.WORLD).group_name


def _unit_plan(spec: ShardSpec, groups: Any, anchors: dict) -> tuple:
    """Plain data for the traced gather of ``spec`` on this rank: ``(shard group name, shard
    size, replicate group name or None, replicas, units, shard rank)``; each unit is ``(S,
    dtype, pieces, views)``: ``pieces`` are ``(leaf index, lo, hi)`` of the rank's shard in order (empty ones
    too), ``views`` are ``(leaf index, offset, numel, shape)`` of the full tensors."""
    rank = groups.shard_rank
    tensors = spec.leaves()
    units = []
    for key, members in spec.unit_leaves().items():
        layout = spec.units[key]
        first: dict = {}  # buffer index -> its first leaf (a tie is one tensor)
        for i, k in members:
            first.setdefault(k, i)
        pieces = tuple((i, *tensors[i].shard_range(rank)) for _k, i in
                       sorted(first.items(), key=lambda kv: tensors[kv[1]].shard_range(rank)))
        views = tuple((i, tensors[i].offset, tensors[i].numel, tuple(tensors[i].shape))
                      for i, _k in members)
        # A one-element leaf every rank adds (times 0) to its shard: the shard's gradient, the
        # reduce-scatter, then always has a user on every rank, even one that holds nothing of
        # these tensors (else the compiler drops it there and the ranks deadlock).
        found = anchors.get(key)  # one per unit, shared by the spec and its sub-specs
        if found is None:
            anchor = torch.zeros(1, dtype=layout.dtype, device=groups.device, requires_grad=True)
            # grad_sync=False's unsharded accumulator: its .grad, made by the backward and
            # dropped at the sync, holds the unreduced gradients (one element until then).
            full = layout.shard_numel * groups.shard_size
            acc = torch.zeros(1, dtype=layout.dtype, device=groups.device).expand(full)
            found = anchors[key] = (anchor, acc.requires_grad_())
        units.append((layout.shard_numel, layout.dtype, pieces, views, *found))
    replicate = group_name(groups.replicate) if groups.replicate is not None else None
    return (group_name(groups.shard), groups.shard_size, replicate, groups.replicate_size,
            tuple(units), rank)


def _norm_plan(spec: ShardSpec, groups: Any, shard_name: str) -> tuple:
    """``(((leaf index, path), ...) of each tensor once, whether this rank counts each in a
    norm, shard group name, model axis group name or None)`` for the traced clipping: off
    model index 0, a tensor a ``tp=`` plan replicates is counted by index 0 only."""
    seen, tensors, counted = set(), [], []
    model = spec.model_axis
    for i, t in enumerate(spec.leaves()):
        if isinstance(t, TensorSpec) and (t.unit, t.path) not in seen:
            seen.add((t.unit, t.path))
            tensors.append((i, t.path))
            counted.append(model is None or model[2] == 0 or t.strided.dim is not None)
    model_name = None
    if model is not None and model[1] > 1:  # "": the shards were made without that axis
        model_name = group_name(groups.model) if groups.model is not None else ""
    return tuple(tensors), tuple(counted), shard_name, model_name


def prepare(spec: ShardSpec, groups: Any, anchors: Optional[dict] = None) -> None:
    """Keep on ``spec``, and on every sub-spec of its subtrees (``spec["layers"]``,
    ``spec["layers"][3]``, ``spec["embed"]``, ...), the plain data the compiled path reads
    (``spec.traced``): made eagerly, by :func:`vfsdp.shard`, since nothing about a spec can be
    computed while tracing.

    Args:
        spec: The plan.
        groups: The :class:`~vfsdp.collectives.MeshGroups` its shards live on.
        anchors: Unit key -> its anchor (see :func:`traced_gather`), shared with sub-specs.

    Returns:
        ``None``.

    Raises:
        Nothing.
    """
    tree = spec.tree
    children = len(tree) if isinstance(tree, (list, tuple)) else -1
    anchors = {} if anchors is None else anchors
    plan = _unit_plan(spec, groups, anchors)
    norms = _norm_plan(spec, groups, plan[0])
    object.__setattr__(spec, "traced", (
        spec.treespec.num_leaves,
        tuple(i for i, t in enumerate(spec.leaves()) if isinstance(t, TensorSpec)),
        children, plan, norms))
    if isinstance(tree, dict):
        keys = list(tree)
    elif isinstance(tree, (list, tuple)):
        keys = list(range(len(tree)))
    else:
        return
    for key in keys:
        node = tree[key]
        if isinstance(node, TensorSpec) or (isinstance(node, (dict, list, tuple))
                                            and not optree.tree_is_leaf(node)):
            prepare(spec[key], groups, anchors)


def _traced(spec: ShardSpec, what: str) -> tuple:
    found = spec.traced
    if found is None:
        raise ValueError(f"{what} under torch.compile: this spec was not prepared for the "
                         f"compiled path; make its shards with vfsdp.shard before compiling "
                         f"(and take sub-specs from that spec)")
    return found


def traced_children(spec: ShardSpec) -> int:
    """How many subtrees a list spec has (``-1`` for another container), while compiling.

    Raises:
        ValueError: an unprepared spec.
    """
    return _traced(spec, "vfsdp.run_layers")[2]


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
    n = _traced(spec, what)[0]
    if len(leaves) != n:
        raise ValueError(f"{what}: the tree has {len(leaves)} leaves, the spec {n}; pass the "
                         f"tree the spec was planned for")
    return leaves, treespec


def traced_grads(shards: Any, spec: ShardSpec) -> Any:
    """:func:`vfsdp.grads` while compiling: the shards' ``.grad`` (zeros where none yet).

    Raises:
        ValueError: a tree that does not match the spec.
    """
    leaves, treespec = traced_leaves(shards, spec, "vfsdp.grads")
    out = list(leaves)
    for i in _traced(spec, "vfsdp.grads")[1]:
        g = leaves[i].grad
        out[i] = g if g is not None else torch.zeros_like(leaves[i])
    return optree.tree_unflatten(treespec, out)


def traced_zero_grads(shards: Any, spec: ShardSpec, set_to_none: bool) -> None:
    """:func:`vfsdp.zero_grads` while compiling: the shards' ``.grad`` dropped (or zeroed).

    Raises:
        ValueError: a tree that does not match the spec.
    """
    leaves, _ = traced_leaves(shards, spec, "vfsdp.zero_grads")
    found = _traced(spec, "vfsdp.zero_grads")
    for i in found[1]:
        if set_to_none:  # unconditionally: asking whether it was None would be a guard
            leaves[i].grad = None
        elif leaves[i].grad is not None:
            leaves[i].grad.zero_()
    drop_plan_grads(spec)


def drop_plan_grads(spec: ShardSpec, keep: bool = False) -> None:
    """What ``zero_grads`` does, on every path, to the compiled path's own leaves:
    ``grad_sync=False``'s unreduced gradients are dropped, and the anchors' (always zero)
    gradients too, or with ``keep`` (eager ``set_to_none=False``) zeroed where they exist, so
    that a compiled step finds what it found before (one graph). While compiling ``keep`` is
    off: asking whether a gradient is ``None`` would be a guard."""
    found = spec.traced
    if found is None:
        return
    for unit in found[3][4]:
        anchor = unit[4]
        if keep and anchor.grad is not None:
            anchor.grad.zero_()
        else:
            anchor.grad = None
        unit[5].grad = None


def _grad_times(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (exactly), whose gradient is multiplied by ``scale``."""
    return x.detach() + (x - x.detach()) * scale


def _grad_summed(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """``x`` (exactly; the same on every rank of ``group``), whose gradient is summed over
    ``group``: the collective's own backward does it. The forward collective it costs is the
    price of staying one traced graph (a custom autograd function would split the backward)."""
    summed = tp.traced_sum_autograd(x, group, size)
    return x.detach() + (summed - summed.detach())


def _flush(acc: torch.Tensor, leaves: list, pieces: tuple, groups: tuple, scale: float) -> None:
    """A synced gather after ``grad_sync=False`` backwards: reduce-scatter the unreduced
    gradients the accumulator holds (as the eager sync does, with this backward's own added
    there, here in a reduce-scatter of their own) into the shards' ``.grad``, and drop them."""
    shard_name, m, rep_name, _replicas = groups
    red = tp.traced_reduce_scatter(acc.grad, "sum", shard_name, m)
    if rep_name is not None:
        red = tp.traced_all_reduce(red, "sum", rep_name)
    if scale != 1.0:
        red = red * scale
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


def _flush_tree(shards: Any, spec: ShardSpec, grad_reduce: str, what: str) -> None:
    """:func:`_flush` for every unit of a tree whose accumulator holds gradients."""
    leaves, _ = traced_leaves(shards, spec, what)
    shard_name, m, rep_name, replicas, units, _rank = _traced(spec, what)[3]
    scale = 1.0 / (m * replicas) if grad_reduce == "avg" else 1.0
    for _s, _dtype, pieces, _views, _anchor, acc in units:
        if acc.grad is not None:
            _flush(acc, leaves, pieces, (shard_name, m, rep_name, replicas), scale)


def traced_gather(shards: Any, spec: ShardSpec, mesh: Any, param_dtype: Optional[torch.dtype],
                  grad_reduce: str, reduce_dtype: Optional[torch.dtype], hooks: Any = None,
                  grad_sync: bool = True, flush: bool = True) -> Any:
    """The full tree, by functional collectives the compiler can trace (see the module).

    Args:
        shards: The shards (``vfsdp.shard``'s tree, or plain tensors of the local shapes).
        spec: Their spec.
        mesh: The ``DeviceMesh`` the shards live on (``None``: the default group).
        param_dtype: Gather in this dtype.
        grad_reduce: ``"avg"`` or ``"sum"``.
        reduce_dtype: ``None`` or the gather's dtype: compiled, the gradients are
            reduce-scattered in the dtype they were gathered in (with ``hooks``: any, float32
            by default).
        hooks: Low-precision all-gather hooks (:mod:`vfsdp.functional.lowp`); this path runs
            them eagerly too.
        grad_sync: ``False``: no reduce-scatter in the backward; the gradients of the full
            tensors add up, unsharded, in the unit's accumulator (its ``.grad``, in the
            parameters' dtype), and the next synced gather reduce-scatters them into the
            shards' ``.grad`` before its own backward adds to them.
        flush: Do that here (``False``: the caller did, outside a checkpointed region).

    Returns:
        The full tree (views of one gathered buffer per unit).

    Raises:
        ValueError: a tree that does not match the spec, an unprepared spec, or a
            ``reduce_dtype`` other than the gather's.
    """
    leaves, treespec = traced_leaves(shards, spec, "vfsdp.gather")
    shard_name, m, rep_name, replicas, units, rank = _traced(spec, "vfsdp.gather")[3]
    scale = 1.0 / (m * replicas) if grad_reduce == "avg" else 1.0
    if flush and grad_sync:  # what grad_sync=False backwards left unreduced
        _flush_tree(shards, spec, grad_reduce, "vfsdp.gather")
    out = list(leaves)
    for s, dtype, pieces, views, anchor, acc in units:
        parts, pos = [], 0
        for i, lo, hi in pieces:
            if lo > pos:
                parts.append(leaves[i].new_zeros(lo - pos))
            parts.append(leaves[i].reshape(-1))
            pos = max(pos, hi)
        if pos < s or not parts:
            parts.append(leaves[views[0][0]].new_zeros(s - pos))
        shard = torch.cat(parts) if len(parts) > 1 else parts[0]
        shard = shard + anchor * 0  # (see _unit_plan) exact: x + 0 == x
        if not grad_sync:  # no reduce-scatter: the full gradients go to the accumulator
            shard = shard.detach()
        elif rep_name is not None:  # HSDP: the replicas' gradients are summed too
            shard = _grad_summed(shard, rep_name, replicas)
        if grad_sync and scale != 1.0:  # "avg": the reduce-scatter's sum, times 1 / ranks
            shard = _grad_times(shard, scale)
        gather_dtype = param_dtype or dtype
        if hooks is not None:  # a low-precision gather (vfsdp.functional.lowp)
            full = hooked_all_gather(shard, hooks, pieces, views, s, shard_name, m, rank,
                                     reduce_dtype)
            if not grad_sync:
                full = full + (acc - acc.detach()).to(full.dtype)
            for i, offset, numel, shape in views:
                out[i] = full[offset:offset + numel].view(shape)
            continue
        if reduce_dtype is not None and reduce_dtype != gather_dtype:
            raise ValueError(f"vfsdp.gather: reduce_dtype={reduce_dtype} is not supported under "
                             f"torch.compile with a {gather_dtype} gather (the compiled "
                             f"reduce-scatter runs in the gather dtype); gather in that dtype, "
                             f"or run this step eagerly")
        full = tp.traced_all_gather(shard.to(gather_dtype), shard_name, m)
        if not grad_sync:
            full = full + (acc - acc.detach()).to(gather_dtype)
        for i, offset, numel, shape in views:
            out[i] = full[offset:offset + numel].view(shape)
    return optree.tree_unflatten(treespec, out)



def _regather_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective activation checkpointing: recompute (re-gather) the all-gathers and their
    waits in backward, save everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in tp.traced_gather_ops() or getattr(op, "is_view", False):
        return CheckpointPolicy.MUST_RECOMPUTE  # views cost nothing to redo
    return CheckpointPolicy.PREFER_SAVE


def traced_run_layers(layer_fn: Any, shards: Any, specs: list, h: Any, mesh: Any,
                      reshard_after_forward: bool, param_dtype: Optional[torch.dtype],
                      grad_reduce: str, reduce_dtype: Optional[torch.dtype],
                      grad_sync: bool = True, hooks: Any = None) -> Any:
    """:func:`vfsdp.run_layers` while compiling: each unit gathered functionally; with
    ``reshard_after_forward`` the gathered parameters are not saved for backward but gathered
    again there (selective activation checkpointing of the all-gathers), everything else
    (activations) saved as in eager.

    Args:
        layer_fn, shards, specs, h, mesh, reshard_after_forward: As for ``run_layers``.
        param_dtype, grad_reduce, reduce_dtype, grad_sync, hooks: As for
            :func:`traced_gather`.

    Returns:
        The last unit's output.

    Raises:
        ValueError: as :func:`traced_gather`.
    """
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if tp.compiling():
        tp.enable_compiled_backward()  # runs while tracing: lets dynamo trace its backward

    if grad_sync:  # what grad_sync=False backwards left unreduced: outside the region below
        for shard, spec in zip(shards, specs):
            _flush_tree(shard, spec, grad_reduce, "vfsdp.run_layers")

    def run(shards, h):
        for shard, spec in zip(shards, specs):
            h = layer_fn(traced_gather(shard, spec, mesh, param_dtype, grad_reduce,
                                       reduce_dtype, hooks, grad_sync=grad_sync, flush=False), h)
        return h

    if not reshard_after_forward:
        return run(shards, h)
    # One region (the compiler rematerialises one per forward-loss-backward graph): every
    # all-gather is recomputed where the backward needs its unit, everything else is saved.
    h = checkpoint(run, shards, h, use_reentrant=False,
                   context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                _regather_policy))
    return h
