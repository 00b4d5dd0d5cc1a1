"""The compiled path: what :func:`vfsdp.gather` does while ``torch.compile`` traces it.

The eager gather owns its buffers: it all-gathers into a persistent global buffer in place,
frees it by resizing its storage and hands out aliases with ``set_``. None of that can be
traced. Under ``torch.compile`` (``torch.compiler.is_compiling()``) the same call takes a
functional path instead, and the compiler owns every buffer:

* per unit, the rank's shard is assembled from its tensor pieces (zeros in the padding
  between them, exactly the eager shard's bytes), cast to ``param_dtype`` if asked, and
  all-gathered with a functional collective (``_c10d_functional.all_gather_into_tensor``),
  whose autograd backward is a reduce-scatter (sum): the sharded gradients land on the
  shards (``.grad`` or ``autograd.grad``), as with the eager default ``grads="return"``;
* ``grad_reduce="avg"`` scales that gradient by ``1 / (ranks)``; over HSDP's replicate dim a
  second functional all-reduce sums it in the backward;
* the full tensors are views of the gathered buffer at the plan's offsets: the same layout,
  the same values, and the eager path's reference semantics.

What each unit needs (its group, this rank's pieces, offsets and shapes) is plain data,
computed once per spec while tracing (:func:`unit_plan`), so a new spec compiles once more and
the same spec never recompiles.
"""

from __future__ import annotations

from typing import Any, Optional

import optree
import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp.collectives.groups import resolve_groups
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["traced_gather", "unit_plan", "group_name", "check_traced_options", "traced_leaves"]


def group_name(group: Any) -> str:
    """The name functional collectives know a process group by (``None``: the default)."""
    return (group if group is not None else dist.group.WORLD).group_name


@tp.constant_result
def unit_plan(spec: ShardSpec, mesh: Any) -> tuple:
    """Plain data for the traced gather of ``spec`` on this rank (computed once, eagerly).

    Returns:
        ``(shard group name, shard size, replicate group name or None, replicas, units)``;
        each unit is ``(S, dtype, pieces, views)``: ``pieces`` are ``(leaf index, lo, hi)`` of the
        rank's shard in order, ``views`` are ``(leaf index, offset, numel, shape)`` of the
        full tensors.
    """
    groups = resolve_groups(spec, mesh)
    rank = groups.shard_rank
    tensors = spec.leaves()
    units = []
    for key, members in spec.unit_leaves().items():
        layout = spec.units[key]
        first: dict = {}  # buffer index -> its first leaf (a tie is one tensor)
        for i, k in members:
            first.setdefault(k, i)
        pieces, views = [], []
        for _k, i in sorted(first.items(), key=lambda kv: tensors[kv[1]].shard_range(rank)):
            t: TensorSpec = tensors[i]
            lo, hi = t.shard_range(rank)
            pieces.append((i, lo, hi))  # empty ones too: their gradient is an empty tensor
        for i, _k in members:
            t = tensors[i]
            views.append((i, t.offset, t.numel, tuple(t.shape)))
        units.append((layout.shard_numel, layout.dtype, tuple(pieces), tuple(views)))
    replicate = group_name(groups.replicate) if groups.replicate is not None else None
    return (group_name(groups.shard), groups.shard_size, replicate, groups.replicate_size,
            tuple(units))


@tp.constant_result
def _num_leaves(spec: ShardSpec) -> int:
    return spec.treespec.num_leaves


def traced_leaves(tree: Any, spec: ShardSpec, what: str) -> tuple[list, Any]:
    """``(leaves in spec order, tree structure)`` of ``tree`` while compiling (the eager call
    checks the whole structure; here only the count, which dynamo's guards then keep fixed).
    The structure is the traced tree's own (dynamo's pytree stand-in), for ``unflatten``.

    Raises:
        ValueError: a different number of leaves than the spec's tree.
    """
    leaves, treespec = optree.tree_flatten(tree)
    if len(leaves) != _num_leaves(spec):
        raise ValueError(f"{what}: the tree has {len(leaves)} leaves, the spec "
                         f"{_num_leaves(spec)}; pass the tree the spec was planned for")
    return leaves, treespec


class _Gather(torch.autograd.Function):
    """All-gather a unit's shard (cast to the gather dtype); the backward reduce-scatters the
    gradient in ``reduce_dtype`` (sums it over HSDP replicas), scales it for ``"avg"`` and
    returns it in the shard's dtype."""

    @staticmethod
    def forward(shard, gather_dtype, reduce_dtype, shard_name, m, rep_name, scale):
        return tp.traced_all_gather(shard.to(gather_dtype), shard_name, m)

    @staticmethod
    def setup_context(ctx, inputs, output):
        shard, _, reduce_dtype, shard_name, m, rep_name, scale = inputs
        ctx.args = (shard.dtype, reduce_dtype, shard_name, m, rep_name, scale)

    @staticmethod
    def backward(ctx, g):
        dtype, reduce_dtype, shard_name, m, rep_name, scale = ctx.args
        g = tp.traced_reduce_scatter(g.to(reduce_dtype or g.dtype), "sum", shard_name, m)
        if rep_name is not None:
            g = tp.traced_all_reduce(g, "sum", rep_name)
        if scale != 1.0:
            g = g / (1.0 / scale)
        return g.to(dtype), None, None, None, None, None, None


def traced_gather(shards: Any, spec: ShardSpec, mesh: Any, param_dtype: Optional[torch.dtype],
                  grad_reduce: str, reduce_dtype: Optional[torch.dtype]) -> Any:
    """The full tree, by functional collectives the compiler can trace (see the module).

    Args:
        shards: The shards (``vfsdp.shard``'s tree, or plain tensors of the local shapes).
        spec: Their spec.
        mesh: The ``DeviceMesh`` the shards live on (``None``: the default group).
        param_dtype: Gather in this dtype.
        grad_reduce: ``"avg"`` or ``"sum"``.
        reduce_dtype: Reduce-scatter the gradients in this dtype (default: the gather's).

    Returns:
        The full tree (views of one gathered buffer per unit).

    Raises:
        ValueError: a tree that does not match the spec.
    """
    leaves, treespec = traced_leaves(shards, spec, "vfsdp.gather")
    shard_name, m, rep_name, replicas, units = unit_plan(spec, mesh)
    scale = 1.0 / (m * replicas) if grad_reduce == "avg" else 1.0
    out = list(leaves)
    for s, dtype, pieces, views in units:
        parts, pos = [], 0
        for i, lo, hi in pieces:
            if lo > pos:
                parts.append(leaves[i].new_zeros(lo - pos))
            parts.append(leaves[i].reshape(-1))
            pos = max(pos, hi)
        if pos < s or not parts:
            parts.append(leaves[views[0][0]].new_zeros(s - pos))
        shard = torch.cat(parts) if len(parts) > 1 else parts[0]
        full = _Gather.apply(shard, param_dtype or dtype, reduce_dtype, shard_name, m, rep_name,
                             scale)
        for i, offset, numel, shape in views:
            out[i] = full[offset:offset + numel].view(shape)
    return optree.tree_unflatten(treespec, out)



def check_traced_options(grads: str, accumulate_grads: bool, grad_sync: bool,
                         async_reduce: bool, what: str) -> None:
    """Refuse, while compiling, the gather options that need vfsdp's own gradient buffers.

    Raises:
        ValueError: ``grads="buffer"``, ``accumulate_grads``, ``grad_sync=False`` or
            ``async_reduce`` (naming the eager-only option and what to do instead).
    """
    bad = [name for name, on in (("grads='buffer'", grads == "buffer"),
                                 ("accumulate_grads=True", accumulate_grads),
                                 ("grad_sync=False", not grad_sync),
                                 ("async_reduce=True", async_reduce)) if on]
    if bad:
        raise ValueError(f"{what} under torch.compile: {bad[0]} needs vfsdp's eager gradient "
                         f"buffers; compiled, the sharded gradients go to autograd (.grad, "
                         f"autograd.grad): accumulate them by calling backward() again")
