"""The sharded gradients of a shards tree: ``vfsdp.grads`` and ``vfsdp.zero_grads``."""

from __future__ import annotations

from typing import Any

import optree
import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import slot_of
from vfsdp.collectives.unit import drop_traced_grads
from vfsdp.functional.traced import traced_grads, traced_zero_grads
from vfsdp.functional.tree import match_tree, units_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["grads", "zero_grads"]


def grads(shards: Any, spec: ShardSpec) -> Any:
    """This rank's sharded gradients: a tree of views into each unit's gradient DBuffer.

    For units reduced with ``grads="buffer"`` (and ``run_layers``) these are views of the
    unit's gradient DBuffer, which ``backward()`` also makes the shards' ``.grad``; for units
    whose gradients went to autograd (``grads="return"``, the default of
    :func:`vfsdp.gather`, or a compiled backward) they are the shards' ``.grad`` (zeros where
    ``None``).
    Units that had no backward yet read zeros. Reductions still in flight
    (``async_reduce``) into these units are waited for first.

    Args:
        shards: The shards tree (``vfsdp.shard``'s), or a subtree with its sub-spec.
        spec: The (sub-)spec.

    Returns:
        A tree like ``shards`` of this rank's gradient pieces (views into the gradient
            DBuffers; a unit with no backward yet reads zeros).

    Raises:
        ValueError: the tree does not match the spec, or a unit's leaves are not shards
            (pass the tree returned by :func:`vfsdp.shard`).

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     full = vfsdp.gather(shards, spec, grads="buffer")
        ...     (full["w"] * 2).sum().backward()
        ...     g = vfsdp.grads(shards, spec)["w"]
        ...     return g.tolist(), shards["w"].grad is g     # .grad: the buffer's view
        >>> vfsdp.testing.simulate(2, body)
        [([2.0, 2.0, 2.0, 2.0], True), ([2.0, 2.0, 2.0, 2.0], True)]
    """
    what = "vfsdp.grads"
    if tp.compiling():  # torch.compile: the gradients are the shards' .grad
        return traced_grads(shards, spec)
    leaves = match_tree(shards, spec, what)
    out = list(leaves)
    for u in units_of(leaves, spec, what):
        if _in_dot_grad(u.unit, leaves, u.leaves):
            for i, _ in u.leaves:
                g = leaves[i].grad
                out[i] = g if g is not None else torch.zeros_like(leaves[i])
            continue
        gdb = u.unit.grads()
        gdb.ensure_shard()
        for i, k in u.leaves:
            out[i] = u.unit.grad_view(k)  # the same tensor each step: no op to make it
    return optree.tree_unflatten(spec.treespec, out)


def _in_dot_grad(unit: Any, leaves: list, members: tuple) -> bool:
    """Whether a unit's gradients are its shards' ``.grad`` rather than its gradient buffer:
    they went to autograd (``grads="return"``), a compiled backward put them there, or
    something replaced the ``.grad`` that were the buffer's views (a compiled
    ``zero_grads``)."""
    if unit.grads_mode == "return":
        return True
    if unit.grad_linked:
        return not all(leaves[i].grad is unit.grad_view(k) for i, k in members
                       if leaves[i].requires_grad)
    return unit.grads_mode is None and any(leaves[i].grad is not None for i, _ in members)


def zero_grads(shards: Any, spec: ShardSpec, *, set_to_none: bool = True) -> None:
    """Zero every unit's gradients (its gradient buffer and the shards' ``.grad``) and drop
    any unreduced accumulator.

    Args:
        shards: The shards tree.
        spec: The plan.
        set_to_none: Release the gradient shards' memory until the next backward writes them
            (like ``optimizer.zero_grad(set_to_none=True)``; reading them through
            :func:`grads` before then gives zeros). ``False`` zero-fills them in place.

    Returns:
        ``None``.

    Raises:
        ValueError: as :func:`grads`.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(5.0)
        ...     vfsdp.zero_grads(shards, spec)
        ...     return vfsdp.grads(shards, spec)["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    what = "vfsdp.zero_grads"
    if tp.compiling():  # torch.compile: the gradients are the shards' .grad
        return traced_zero_grads(shards, spec, set_to_none)
    leaves = match_tree(shards, spec, what)
    zero = []  # the .grad autograd accumulated (grads="return"), zeroed in one op
    units = units_of(leaves, spec, what)
    for u in units:
        for i, _ in u.leaves:
            if leaves[i].grad is not None:
                if set_to_none:
                    leaves[i].grad = None
                else:
                    zero.append(leaves[i].grad)
        u.unit.drop_accumulators()
        u.unit.grads_mode = None  # no reduction since: .grad or the buffer, whichever comes
        u.unit.grad_linked = False
        if not u.unit.has_grads:
            continue  # no gradient buffer yet: nothing to zero
        gdb = u.unit.grads()
        if set_to_none:
            gdb.release_shard()
        else:
            with torch.no_grad():
                gdb.ensure_shard().zero_()
    with torch.no_grad():
        tp.zero_many(zero)
    # the compiled path's anchors and accumulators
    for u in units:
        drop_traced_grads(u.unit.traced, keep=not set_to_none)


def gradient_leaves(grads: Any, spec: ShardSpec, what: str) -> list:
    """The leaves of a gradient tree in spec order, refusing the parameter shards in its place.

    ``clip_grad_norm(shards, spec, ...)``, the habit of ``torch.nn.utils.clip_grad_norm_(
    params)``, would otherwise scale the parameters, and ``opt.update(shards, ...)`` read them
    as gradients, silently: every shard names its buffer, so such a tree is refused.

    Args:
        grads: A tree shaped like the spec: ``vfsdp.grads(shards, spec)`` or the shards'
            ``.grad`` s.
        spec: The (sub-)spec.
        what: The entry point, for messages.

    Returns:
        The leaves, one per leaf of ``spec``.

    Raises:
        ValueError: a leaf is a parameter shard (naming its path), or the tree does not match
            the spec.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        ...     try:
        ...         vfsdp.clip_grad_norm(shards, spec, 1.0)
        ...     except ValueError as e:
        ...         return str(e).split(": pass")[0]
        >>> vfsdp.testing.simulate(2, body)[0]
        'vfsdp.clip_grad_norm: w is a parameter shard, not a gradient'
    """
    leaves = match_tree(grads, spec, what)
    for leaf, t in zip(leaves, spec.leaves()):
        slot = slot_of(leaf)
        if slot is not None and slot.buffer.role.holds_params and isinstance(t, TensorSpec):
            raise ValueError(
                f"{what}: {format_path(t.path)} is a parameter shard, not a gradient: pass "
                f"vfsdp.grads(shards, spec) (the gradients), not the shards; taking the "
                f"shards as gradients would change or read the parameters")
    return leaves
