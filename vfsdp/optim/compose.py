"""Composition, optax-style: ``partition`` tensors between optimizers, ``chain`` transforms.

Both pass a ``mask`` down (see :mod:`vfsdp.optim.base`), so they nest in any order::

    partition({"hidden": chain(clip_by_global_norm(1.0), muon()),
               "rest": chain(clip_by_global_norm(1.0), adamw())}, labels)
    chain(clip_by_global_norm(1.0), partition({...}, labels))

Inside a ``partition``, a ``clip_by_global_norm`` clips the global norm of its own subset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from vfsdp.optim.base import (
    Mask,
    Optimizer,
    atomic,
    begin,
    both,
    grad_leaves,
    init_masked,
    member,
    same_at_ties,
    selected,
)
from vfsdp.optim.transforms import fuse
from vfsdp.planner.granularity import combine, format_path
from vfsdp.planner.spec import ShardSpec


def partition(transforms: dict, labels: Callable[[tuple], str]) -> Optimizer:
    """Each tensor is updated by ``transforms[labels(path)]`` (and only by it).

    Args:
        transforms: ``label -> optimizer`` (any optimizer, ``chain`` or ``partition``).
        labels: ``path -> label``.

    Returns:
        An :class:`Optimizer` whose state is ``{label: state}`` and whose granularity is,
            per tensor, that of its label's optimizer.

    Raises:
        ValueError: from ``init``, a selected tensor whose label has no transform.
        TypeError: from ``init``, a member whose ``init`` takes no ``mask``.

    Example:
        >>> opt = vfsdp.optim.partition(
        ...     {"8bit": vfsdp.optim.adamw8bit(), "fp32": vfsdp.optim.adamw()},
        ...     lambda path: "8bit" if path[-1] == "w" else "fp32")
        >>> opt.granularity(("w",), torch.empty(64, 64)), opt.granularity(("b",), torch.empty(64))
        (rows(32), None)
    """
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError("partition(transforms, labels) takes a non-empty dict of optimizers")

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> dict:
        same_at_ties(labels, spec, "partition", "labels")
        for t in spec.tensors():
            if selected(mask, t.path) and labels(t.path) not in transforms:
                raise ValueError(f"partition: {format_path(t.path)} is labelled "
                                 f"{labels(t.path)!r}, which has no transform (have "
                                 f"{sorted(transforms)})")
        return {name: init_masked(opt, shards, spec,
                                  both(mask, lambda p, n=name: labels(p) == n), "partition")
                for name, opt in transforms.items()}

    def update(grads: Any, state: dict, shards: Any, spec: ShardSpec) -> dict:
        # Each member writes its own label's tensors (parameters, or gradients in place).
        return {name: member(opt, grads, state[name], shards, spec)
                for name, opt in transforms.items()}

    def granularity(path, tensor):
        opt = transforms.get(labels(path))
        g = getattr(opt, "granularity", None)
        return g(path, tensor) if callable(g) else g

    return Optimizer(init, atomic(update, compose=True), granularity)


def chain(*transforms: Optimizer) -> Optimizer:
    """Apply transforms in order, each to the gradients the one before it left (e.g.
    clipping, then an optimizer), as ``optax.chain`` does: a gradient transform changes the
    gradients in place (one update form, see :mod:`vfsdp.optim.base`), and the next member
    reads the same tree.

    A run of transforms (:mod:`vfsdp.optim.transforms`: ``scale_by_adam``, ...,
    ``scale_by_learning_rate``) is one member: AdamW's own implementation for AdamW's
    sequence, else the transforms one after another over the whole rank.

    The chain's granularity keeps whole every block any member needs
    (:func:`vfsdp.planner.granularity.combine`); its ``mask`` goes to every member.

    Args:
        transforms: Optimizers (or gradient transforms), applied in order.

    Returns:
        An :class:`Optimizer` whose state is the list of the members' states.

    Raises:
        TypeError: a member that is not an :class:`Optimizer`.
        ValueError: transforms out of order (see :func:`vfsdp.optim.transforms.fuse`).

    Example:
        >>> opt = vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0),
        ...                         vfsdp.optim.adamw8bit(lr=1e-3))
        >>> opt.granularity(("w",), torch.empty(64, 64))
        rows(32)
    """
    for t in transforms:
        if not isinstance(t, Optimizer):
            raise TypeError(f"chain takes Optimizers, got {type(t).__name__}")
    transforms = fuse(transforms)  # a run of transforms: one member (vfsdp.optim.transforms)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> list:
        return [init_masked(t, shards, spec, mask, "chain") for t in transforms]

    def update(grads: Any, state: list, shards: Any, spec: ShardSpec) -> list:
        return [member(t, grads, s, shards, spec) for t, s in zip(transforms, state)]

    return Optimizer(init, atomic(update, compose=True), combine(*(t.granularity for t in transforms)))


@dataclass
class ClipState:
    """``clip_by_global_norm``'s state: nothing to save, only the mask ``init`` was given.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        ...     state = vfsdp.optim.clip_by_global_norm(1.0).init(shards, spec)
        ...     return state, state.checkpoint_tree(spec)
        >>> vfsdp.testing.simulate(2, body)
        [(ClipState(mask=None), {}), (ClipState(mask=None), {})]
    """

    mask: Optional[Callable[[tuple], bool]] = None

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        return {}

    def restore_checkpoint(self, tree: Any) -> ClipState:
        return self


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """A gradient transform: clip the gradients' global norm in place (for :func:`chain`).

    Under a ``partition`` mask, the norm and the scaling cover the selected tensors only.

    Args:
        max_norm: The largest allowed global norm.

    Returns:
        An :class:`Optimizer` whose ``update`` scales the gradients in place (no parameters
            change) and whose state is a :class:`ClipState`.

    Raises:
        ValueError: ``max_norm`` is negative or not finite.

    Example:
        >>> opt = vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0), vfsdp.optim.adamw())
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     grads = vfsdp.grads(shards, spec)
        ...     grads["w"].fill_(3.0)
        ...     opt.update(grads, opt.init(shards, spec), shards, spec)
        ...     return round(float(vfsdp.optim.global_norm(grads, spec)), 4)
        >>> vfsdp.testing.simulate(2, body)
        [1.0, 1.0]
    """
    from vfsdp.optim.clip import check_max_norm, clip_grad_norm

    check_max_norm(max_norm)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> ClipState:
        return ClipState(mask)

    def update(grads: Any, state: ClipState, shards: Any, spec: ShardSpec) -> ClipState:
        grad_leaves(grads, spec, "clip_by_global_norm")  # the checks, before the ranks agree
        begin()
        clip_grad_norm(grads, spec, max_norm, mask=state.mask)
        return state

    return Optimizer(init, atomic(update))
