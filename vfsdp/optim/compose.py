"""Composition, optax-style: ``partition`` tensors between optimizers, ``chain`` transforms."""

from __future__ import annotations

from typing import Any, Callable

from vfsdp.optim.base import Optimizer
from vfsdp.planner.spec import ShardSpec

__all__ = ["partition", "chain", "clip_by_global_norm"]


def partition(transforms: dict, labels: Callable[[tuple], str]) -> Optimizer:
    """Each tensor is updated by ``transforms[labels(path)]`` (and only by it).

    Example:
        >>> opt = vfsdp.optim.partition(                                   # doctest: +SKIP
        ...     {"muon": vfsdp.optim.muon(lr=0.02), "adamw": vfsdp.optim.adamw(lr=3e-4)},
        ...     lambda path: "muon" if path[0] == "layers" and path[-1].startswith("w")
        ...     else "adamw")

    Raises:
        ValueError (from ``init``): a label with no transform.
    """

    def init(shards: Any, spec: ShardSpec) -> dict:
        for t in spec.tensors():
            if labels(t.path) not in transforms:
                raise ValueError(f"partition: {t.path} is labelled {labels(t.path)!r}, which "
                                 f"has no transform (have {sorted(transforms)})")
        return {name: opt.init(shards, spec, mask=lambda p, n=name: labels(p) == n)
                for name, opt in transforms.items()}

    def update(grads: Any, state: dict, shards: Any, spec: ShardSpec) -> dict:
        return {name: opt.update(grads, state[name], shards, spec) for name, opt in transforms.items()}

    def granularity(path, tensor):
        opt = transforms.get(labels(path))
        g = getattr(opt, "granularity", None)
        return g(path, tensor) if callable(g) else g

    return Optimizer(init, update, granularity)


def chain(*transforms: Optimizer) -> Optimizer:
    """Apply transforms in order to the same gradients (e.g. clipping, then an optimizer)."""

    def init(shards: Any, spec: ShardSpec) -> list:
        return [t.init(shards, spec) for t in transforms]

    def update(grads: Any, state: list, shards: Any, spec: ShardSpec) -> list:
        return [t.update(grads, s, shards, spec) for t, s in zip(transforms, state)]

    grans = [t.granularity for t in transforms if t.granularity is not None]
    return Optimizer(init, update, grans[-1] if grans else None)


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """A gradient transform: clip the gradients' global norm in place (for :func:`chain`)."""
    from vfsdp.optim.clip import clip_grad_norm

    def init(shards: Any, spec: ShardSpec, mask=None) -> None:
        return None

    def update(grads: Any, state: Any, shards: Any, spec: ShardSpec) -> Any:
        clip_grad_norm(grads, spec, max_norm)
        return state

    return Optimizer(init, update)
