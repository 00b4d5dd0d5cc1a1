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

import dataclasses
from typing import Any, Optional

import optree
import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.comm import resolve_groups
from vfsdp.collectives.unit import Unit, _expand, _merge
from vfsdp.functional.options import Policy, merge, resolve
from vfsdp.functional.traced import padded
from vfsdp.functional.tree import UnitLeaves, match_tree, own_mesh, refuse_structure, units_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["reduce_scatter"]


def _reduce_functional(unit: Unit, index, grads, opts: Policy) -> list:
    """Inside ``torch.func``: build the buffer with one ``cat`` (still one copy per tensor)
    and return fresh pieces; nothing made outside the transform is mutated (a tied tensor's
    repeated index gets its gradients summed, ``None`` at the repeats)."""
    index, grads, first = _merge(index, grads)
    db, rank = unit.params, unit.rank
    rdt = opts.reduce_dtype or next((g.dtype for g in grads if g is not None), db.dtype)
    spans = sorted((db.tensors[i].offset, i, g) for i, g in zip(index, grads) if g is not None)
    full = padded([(g.to(rdt), o, o + g.numel()) for o, _i, g in spans],
                  unit.layout.padded_numel, torch.empty(0, dtype=rdt, device=db.device))
    with tp.functorch_paused():  # gloo writes into its output; functorch would refuse that
        out = unit.reduce_new(full, opts.grad_reduce, rdt)
    return _expand([out[slice(*db.tensors[i].shard_range(rank))].view(db.local_shape(i))
                    for i in index], first)


def reduce_scatter(full_grads: Any, spec: ShardSpec, policy: Optional[Policy] = None, *,
                   shards: Any = None, mesh: Any = None, **options: Any) -> Any:
    """Reduce-scatter full gradients into the sharded gradient DBuffers (explicit form).

    Args:
        full_grads: A tree of full-shape gradients (``None`` leaves count as zero).
        spec: The plan.
        shards: The shards tree whose gradient buffers receive the result (default: fresh
            buffers for this call).
        mesh: A ``DeviceMesh`` matching the spec, for fresh buffers; default: the default
            group. Shards from ``vfsdp.shard`` carry the mesh they were made on: passing one
            with ``shards`` is refused.
        policy: A :class:`vfsdp.Policy`, as for :func:`vfsdp.gather`; an explicit reduction
            reads its ``grad_reduce`` (``"avg"`` or ``"sum"`` over every rank of the mesh),
            ``reduce_dtype`` and ``accumulate_grads`` (``True``: add into the gradient
            buffers; default: overwrite them). Its gather-side fields do not apply.
        **options: Those fields by keyword, overriding ``policy``'s (``accumulate_grads=False``
            is the default here: overwrite).

    Returns:
        A tree of this rank's gradient shards (views into the gradient DBuffers).

    Raises:
        ValueError: structure, shape or dtype mismatch, naming the path; a bad option, or
            ``grad_sync=False``, ``grads="return"`` or ``async_reduce=True`` (an explicit
            reduction reduces now, into the gradient buffers).
        TypeError: an unknown option.

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     g = {"w": torch.full((8,), dist.get_rank() + 1.0)}
        ...     return vfsdp.reduce_scatter(g, spec, grad_reduce="sum")["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    """
    if tp.functorch_active():
        raise ValueError("vfsdp.reduce_scatter cannot run inside torch.func transforms (it "
                         "writes gradient buffers); differentiate through vfsdp.gather instead, "
                         "whose backward reduce-scatters")
    what = "vfsdp.reduce_scatter"
    if options.get("accumulate_grads") is False:  # here the default: overwrite
        del options["accumulate_grads"]
    policy = merge(policy, options, what)
    for name, asked in (("grad_sync=False", policy.grad_sync is False),
                        ("grads='return'", policy.grads == "return"),
                        ("async_reduce=True", policy.async_reduce is True)):
        if asked:
            raise ValueError(f"{what}: {name} is not supported by an explicit reduction (it "
                             f"reduces now, into the gradient buffers); drop it")
    accumulate_grads = policy.accumulate_grads is True
    if accumulate_grads and shards is None:
        raise ValueError("vfsdp.reduce_scatter(accumulate_grads=True) needs shards=: without "
                         "them the result goes to fresh buffers, so there is nothing to add to")
    opts = resolve(dataclasses.replace(policy, grads="buffer"), layers=False)
    paths, grads, treespec = optree.tree_flatten_with_path(full_grads, none_is_leaf=True)
    if paths != spec.treespec.paths():  # a None gradient keeps its place: compare the paths
        refuse_structure(paths, treespec, spec, what)
    for g, t in zip(grads, spec.leaves()):
        if isinstance(t, TensorSpec) and g is not None and tuple(g.shape) != tuple(t.shape):
            raise ValueError(f"{what}: gradient of {format_path(t.path)} has shape "
                             f"{tuple(g.shape)}, expected {tuple(t.shape)}")
    if shards is not None:
        own_mesh(shards, mesh, what)  # the shards' units carry their mesh
        units = units_of(match_tree(shards, spec, what), spec, what)
    else:  # fresh units: only their gradient buffers are used
        groups = resolve_groups(spec, mesh)  # (once: every unit's)
        units = [UnitLeaves(key, Unit(spec.units[key], groups), tuple(members))
                 for key, members in spec.unit_leaves().items()]
    out: list = list(grads)
    for u in units:
        pieces = u.unit.reduce_grads(tuple(k for _, k in u.leaves), [grads[i] for i, _ in u.leaves], opts,
                                     overwrite=not accumulate_grads)
        for (i, _), piece in zip(u.leaves, pieces):
            out[i] = piece
    return optree.tree_unflatten(spec.treespec, out)

