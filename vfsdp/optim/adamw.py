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
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from vfsdp.collectives.dbuffer import DBuffer
from vfsdp.optim.base import Optimizer, Schedule, as_schedule, flat_grads, grad_leaves, unit_buffers
from vfsdp.planner.spec import ShardSpec

__all__ = ["adamw", "AdamWState", "CHUNK"]

CHUNK = 1 << 18
"""Elements per slice of the fused update (bounds its temporary memory)."""


@dataclass
class AdamWState:
    """Step count and per-unit moment DBuffers (same layout as the parameters)."""

    step: int
    exp_avg: dict
    exp_avg_sq: dict
    decay_runs: dict = field(default_factory=dict)  # unit -> [(lo, hi)] ranges that decay
    update_runs: dict = field(default_factory=dict)  # unit -> [(lo, hi)] ranges it updates


def _decay_runs(db: DBuffer, mask: Optional[Callable[[tuple], bool]],
                also: Optional[Callable[[tuple], bool]] = None) -> list:
    """Flat ranges of this rank's shard whose tensors pass ``mask`` (and ``also``), merged."""
    runs: list = []
    for k, t in enumerate(db.tensors):
        if (mask is not None and not mask(t.path)) or (also is not None and not also(t.path)):
            continue
        lo, hi = t.shard_range(db.rank)
        if hi <= lo:
            continue
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))
    return runs


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
        >>> opt = vfsdp.optim.adamw(lr=3e-4, weight_decay=0.1)   # doctest: +SKIP
        >>> state = opt.init(shards, spec)                       # doctest: +SKIP
        >>> state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)  # doctest: +SKIP
    """
    b1, b2 = betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got {betas}")
    if eps < 0 or weight_decay < 0 or (not callable(lr) and lr < 0):
        raise ValueError("lr, eps and weight_decay must be >= 0")
    schedule = as_schedule(lr)

    def init(shards: Any, spec: ShardSpec, mask: Optional[Callable[[tuple], bool]] = None) -> AdamWState:
        units = unit_buffers(shards, spec, "adamw.init")
        state = AdamWState(0, {}, {})
        for u in units:
            state.exp_avg[u.key] = u.db.like(torch.float32, role="exp_avg")
            state.exp_avg_sq[u.key] = u.db.like(torch.float32, role="exp_avg_sq")
            state.decay_runs[u.key] = _decay_runs(u.db, weight_decay_mask, mask)
            state.update_runs[u.key] = ([(0, u.db.shard.numel())] if mask is None
                                        else _decay_runs(u.db, mask))
        return state

    def update(grads: Any, state: AdamWState, shards: Any, spec: ShardSpec) -> AdamWState:
        state.step += 1
        step = state.step
        rate = schedule(step)
        bc1 = 1 - b1 ** step
        bc2_sqrt = math.sqrt(1 - b2 ** step)
        leaves = grad_leaves(grads, spec, "adamw.update")
        with torch.no_grad():
            for u in unit_buffers(shards, spec, "adamw.update"):
                g = flat_grads(leaves, u, "adamw.update")
                p = u.db.shard
                m, v = state.exp_avg[u.key].shard, state.exp_avg_sq[u.key].shard
                if weight_decay:
                    for lo, hi in state.decay_runs[u.key]:
                        p[lo:hi].mul_(1 - rate * weight_decay)
                # Element-wise, so slices give the same bits; they bound the temporary
                # (the denominator) to CHUNK elements instead of a whole unit.
                for lo, hi in (c for run in state.update_runs[u.key] for c in _chunks(*run)):
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
