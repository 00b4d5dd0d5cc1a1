"""AdamW over flat DBuffers: a few fused ops per unit, bitwise equal to ``torch.optim.AdamW``.

The state (``exp_avg``, ``exp_avg_sq``) lives in DBuffers with the parameters' layout, so each
step is, per unit, the same element-wise ops as PyTorch's single-tensor AdamW applied to the
whole ``S``-element shard at once::

    p.mul_(1 - lr * wd)                       # only over tensors that decay
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.addcdiv_(m, (v.sqrt() / sqrt(1 - b2**t)).add_(eps), value=-lr / (1 - b1**t))

Padding stays zero: its gradient, moments and parameters are all zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vfsdp.collectives.dbuffer import DBuffer
from vfsdp.collectives.slot import Role
from vfsdp.functional.state import param_tree
from vfsdp.optim.base import (
    Mask,
    Optimizer,
    Schedule,
    as_schedule,
    both,
    check_hyper,
    flat_grads,
    grad_leaves,
    selected,
    state_dtype,
    unit_buffers,
)
from vfsdp.planner.spec import ShardSpec

__all__ = ["adamw", "AdamWState", "AdamWPlan", "CHUNK", "runs", "owned_views", "trainable_runs"]

CHUNK = 1 << 18
"""Elements per slice of the fused update (bounds its temporary memory)."""


def runs(db: DBuffer, mask: Mask) -> tuple[tuple[int, int], ...]:
    """Flat ranges of this rank's shard holding the tensors ``mask`` selects, merged.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"a": torch.ones(4), "b": torch.ones(4)}, 1)
        ...     shards = vfsdp.shard({"a": torch.ones(4), "b": torch.ones(4)}, spec)
        ...     db = slot_of(shards["a"]).buffer
        ...     return runs(db, None), runs(db, lambda p: p == ("b",))
        >>> vfsdp.testing.simulate(1, body)
        [(((0, 8),), ((4, 8),))]
    """
    out: list = []
    for t in db.tensors:
        if not selected(mask, t.path):
            continue
        lo, hi = t.shard_range(db.rank)
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True)
class AdamWPlan:
    """What ``init`` derives from the spec and the mask, per unit it updates: the tensors
    (``paths``), their flat ranges in this rank's shard (``update_runs``) and the ranges that
    decay (``decay_runs``). Never saved; ``init`` rebuilds it under any plan."""

    paths: Mapping[Any, frozenset] = field(default_factory=dict)
    update_runs: Mapping[Any, tuple] = field(default_factory=dict)
    decay_runs: Mapping[Any, tuple] = field(default_factory=dict)

    def owns(self, db: DBuffer, k: int) -> bool:
        """Whether the plan updates tensor ``k`` of ``db``'s unit."""
        return db.tensors[k].path in self.paths.get(db.key, ())


@dataclass
class AdamWState:
    """The step and, per unit it updates, the moment DBuffers (the parameters' layout)."""

    step: int
    exp_avg: dict
    exp_avg_sq: dict
    plan: AdamWPlan = field(default_factory=AdamWPlan, repr=False, compare=False)

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step, and the moments of the tensors it updates, shaped like the parameters."""
        keep = owned_views(self.plan)
        return {"step": self.step, "exp_avg": param_tree(self.exp_avg, spec, keep),
                "exp_avg_sq": param_tree(self.exp_avg_sq, spec, keep)}

    def restore_checkpoint(self, tree: dict) -> AdamWState:
        self.step = tree["step"]
        return self


def trainable_runs(u, plan, weight_decay_mask: Mask) -> tuple[tuple, tuple]:
    """``(update runs, decay runs)`` of unit ``u`` for the tensors the plan owns whose shards
    require grad now: a frozen tensor (``requires_grad=False``) gets no update and no decay,
    as ``torch.optim`` skips a parameter without a gradient."""
    frozen = u.frozen()
    owned = plan.paths[u.key]
    if not frozen or not any(u.db.tensors[k].path in owned for k in frozen):
        return plan.update_runs[u.key], plan.decay_runs[u.key]
    gone = {u.db.tensors[k].path for k in frozen}
    live = lambda path: path in owned and path not in gone
    return runs(u.db, live), runs(u.db, both(weight_decay_mask, live))


def owned_views(plan) -> Callable:
    """A ``param_tree`` leaf rule: tensor ``k``'s local view when ``plan.owns`` it."""
    return lambda db, k: db.local(k) if plan.owns(db, k) else None


def adamw(
    lr: Schedule = 1e-3,
    betas: tuple = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    weight_decay_mask: Optional[Callable[[tuple], bool]] = None,
) -> Optimizer:
    """AdamW (decoupled weight decay), fused over each unit's flat shard.

    Args:
        lr: A float or a schedule ``step -> lr`` (steps count from 1).
        betas: ``(beta1, beta2)``.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay.
        weight_decay_mask: ``path -> bool``; tensors for which it is false (e.g. norms and
            biases) take no weight decay. Default: every tensor decays.

    Returns:
        An :class:`vfsdp.optim.Optimizer`.

    Raises:
        ValueError: a negative learning rate, ``eps`` or weight decay, or betas outside [0, 1).

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     opt = vfsdp.optim.adamw(lr=0.1, weight_decay=0.0)
        ...     state = opt.init(shards, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...     state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        ...     return [round(x, 4) for x in shards["w"].tolist()], state.step
        >>> vfsdp.testing.simulate(2, body)
        [([0.9, 0.9, 0.9, 0.9], 1), ([0.9, 0.9, 0.9, 0.9], 1)]
    """
    check_hyper("adamw", lr, weight_decay, betas=betas, eps=eps)
    b1, b2 = betas
    schedule = as_schedule(lr)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> AdamWState:
        state = AdamWState(0, {}, {})
        update_runs, decay_runs, paths = {}, {}, {}
        for u in unit_buffers(shards, spec, "adamw.init"):
            chosen = tuple(t.path for t in u.db.tensors if selected(mask, t.path))
            if not chosen:
                continue  # nothing of this unit is ours: no state for it
            sdt = state_dtype(u.db.dtype)  # float32, or float64 for float64 parameters
            state.exp_avg[u.key] = u.db.like(sdt, Role.STATE, "exp_avg")
            state.exp_avg_sq[u.key] = u.db.like(sdt, Role.STATE, "exp_avg_sq")
            update_runs[u.key] = runs(u.db, mask)
            decay_runs[u.key] = runs(u.db, both(weight_decay_mask, mask))
            paths[u.key] = frozenset(chosen)
        state.plan = AdamWPlan(paths, update_runs, decay_runs)
        return state

    def update(grads: Any, state: AdamWState, shards: Any, spec: ShardSpec) -> AdamWState:
        state.step += 1
        step = state.step
        rate = schedule(step)
        bc1 = 1 - b1 ** step
        bc2_sqrt = math.sqrt(1 - b2 ** step)
        leaves = grad_leaves(grads, spec, "adamw.update")
        plan = state.plan
        with torch.no_grad():
            for u in unit_buffers(shards, spec, "adamw.update"):
                if u.key not in state.exp_avg:
                    continue
                update_runs, decay_runs = trainable_runs(u, plan, weight_decay_mask)
                if not update_runs:
                    continue  # every tensor of ours here is frozen
                p = u.db.shard
                m, v = state.exp_avg[u.key].shard, state.exp_avg_sq[u.key].shard
                g = flat_grads(leaves, u, "adamw.update", m.dtype)
                if weight_decay:
                    for lo, hi in decay_runs:
                        p[lo:hi].mul_(1 - rate * weight_decay)
                # Element-wise, so slices give the same bits; they bound the temporary
                # (the denominator) to CHUNK elements instead of a whole unit.
                for lo, hi in (c for run in update_runs for c in _chunks(*run)):
                    gs, ms, vs = g[lo:hi], m[lo:hi], v[lo:hi]
                    ms.lerp_(gs, 1 - b1)
                    vs.mul_(b2).addcmul_(gs, gs, value=1 - b2)
                    denom = vs.sqrt().div_(bc2_sqrt).add_(eps)
                    p[lo:hi].addcdiv_(ms, denom, value=-rate / bc1)
        return state

    return Optimizer(init, update)


def _chunks(lo: int, hi: int):
    for start in range(lo, hi, CHUNK):
        yield start, min(start + CHUNK, hi)
