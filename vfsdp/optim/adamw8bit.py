"""Block-wise 8-bit AdamW: moments as uint8 codes in 32x32 tiles, quantized locally, no collective.

The optimizer declares its structure: ``opt.granularity`` keeps 32-row stripes of every matrix
on one rank (``rows(32)``; a ``[E, R, C]`` expert stack whose ``R`` is not a multiple of 32
keeps whole matrices), so every 32x32 tile lives on one rank and each rank quantizes its shard
alone, exactly as one process would. ``init`` refuses a spec that does not honour the tiles.

Per step and tensor, in fp32: dequantize ``m`` (signed dynamic map) and ``v`` (unsigned
dynamic map, ``v`` itself), apply AdamW exactly as :func:`vfsdp.optim.adamw`, take each tile's
new absmax and re-quantize with round-to-nearest. State: 1 byte per element per moment in
uint8 DBuffers with the parameters' layout, plus one fp32 scale per tile per moment
(2 + 8/1024 bytes per parameter).

Rules: tensors with fewer than ``min_8bit_numel`` elements (**global** numel, never the local
shard's) and 1-D tensors keep fp32 moments. Partial tiles at ragged edges take the absmax of
their real elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from vfsdp.optim.adamw import _decay_runs
from vfsdp.optim.base import Optimizer, Schedule, as_schedule, flat_grads, grad_leaves, unit_buffers
from vfsdp.optim.quant import TILE, dequantize, dynamic_map, quantize, tile_ids
from vfsdp.planner.granularity import format_path, rows
from vfsdp.planner.spec import ShardSpec

__all__ = ["adamw8bit", "AdamW8bitState", "MIN_8BIT_NUMEL"]

MIN_8BIT_NUMEL = 4096


def _quantized(shape, min_numel: int) -> bool:
    return len(shape) >= 2 and math.prod(shape) >= min_numel


def granularity_8bit(min_numel: int = MIN_8BIT_NUMEL) -> Callable:
    """The blocks 8-bit AdamW needs: 32-row stripes of matrices, whole matrices of ragged stacks."""

    def gran(path, tensor):
        shape = tuple(tensor.shape)
        if not _quantized(shape, min_numel):
            return None
        if len(shape) >= 3 and shape[-2] % TILE:
            return rows(shape[-2])  # keep each matrix of the stack whole
        return rows(TILE)

    return gran


@dataclass
class _Tensor8:
    """One quantized tensor's local state on this rank."""

    k: int           # buffer index in the unit
    lo: int          # range in the rank's shard
    hi: int
    tiles: torch.Tensor
    n_tiles: int
    scale_m: torch.Tensor
    scale_v: torch.Tensor


@dataclass
class AdamW8bitState:
    step: int
    codes_m: dict                               # unit -> uint8 DBuffer
    codes_v: dict
    quantized: dict = field(default_factory=dict)  # unit -> [_Tensor8]
    fp32: dict = field(default_factory=dict)       # unit -> [(k, lo, hi, m, v)]
    decay_runs: dict = field(default_factory=dict)

    def state_bytes(self) -> tuple[int, int]:
        """``(bytes of 8-bit state incl. scales, elements it covers)`` on this rank."""
        nbytes = elems = 0
        for tensors in self.quantized.values():
            for t in tensors:
                elems += t.hi - t.lo
                nbytes += 2 * (t.hi - t.lo) + 4 * (t.scale_m.numel() + t.scale_v.numel())
        return nbytes, elems


def adamw8bit(
    lr: Schedule = 1e-3,
    betas: tuple = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    weight_decay_mask: Optional[Callable[[tuple], bool]] = None,
    min_8bit_numel: int = MIN_8BIT_NUMEL,
) -> Optimizer:
    """AdamW with 8-bit moments in 32x32 tiles. Plan with ``granularity=opt.granularity``.

    Args:
        lr, betas, eps, weight_decay, weight_decay_mask: As :func:`vfsdp.optim.adamw`.
        min_8bit_numel: Tensors (by global numel) below this keep fp32 moments.

    Returns:
        An :class:`vfsdp.optim.Optimizer` whose ``granularity`` the planner must honour.

    Raises:
        ValueError (from ``init``): a quantized tensor's rank boundary cuts a 32-row stripe.

    Example:
        >>> opt = vfsdp.optim.adamw8bit(lr=1e-3)                          # doctest: +SKIP
        >>> spec = vfsdp.plan(params, world, granularity=opt.granularity)  # doctest: +SKIP
    """
    b1, b2 = betas
    schedule = as_schedule(lr)
    qm, qv = dynamic_map(True), dynamic_map(False)

    def init(shards: Any, spec: ShardSpec) -> AdamW8bitState:
        state = AdamW8bitState(0, {}, {})
        for u in unit_buffers(shards, spec, "adamw8bit.init"):
            db = u.db
            state.codes_m[u.key] = db.like(torch.uint8, role="exp_avg_8bit")
            state.codes_v[u.key] = db.like(torch.uint8, role="exp_avg_sq_8bit")
            state.decay_runs[u.key] = _decay_runs(db, weight_decay_mask)
            q8, f32 = [], []
            for k, t in enumerate(db.tensors):
                lo, hi = t.shard_range(db.rank)
                start, stop = t.local_range(db.rank)
                if not _quantized(tuple(t.shape), min_8bit_numel):
                    f32.append((k, lo, hi, torch.zeros(hi - lo, device=db.device),
                                torch.zeros(hi - lo, device=db.device)))
                    continue
                shape = tuple(t.shape)
                try:
                    tiles, n = tile_ids(shape, start, stop)
                except ValueError as exc:
                    raise ValueError(
                        f"adamw8bit: {format_path(t.path)} {shape} is split across ranks inside a "
                        f"32x32 tile ({exc}); plan with granularity=opt.granularity so each tile "
                        f"stays on one rank"
                    ) from None
                z = torch.zeros(n, device=db.device)
                q8.append(_Tensor8(k, lo, hi, tiles.to(db.device), n, z, z.clone()))
            state.quantized[u.key], state.fp32[u.key] = q8, f32
        return state

    def update(grads: Any, state: AdamW8bitState, shards: Any, spec: ShardSpec) -> AdamW8bitState:
        state.step += 1
        step = state.step
        rate = schedule(step)
        bc1, bc2_sqrt = 1 - b1 ** step, math.sqrt(1 - b2 ** step)
        leaves = grad_leaves(grads, spec, "adamw8bit.update")
        with torch.no_grad():
            for u in unit_buffers(shards, spec, "adamw8bit.update"):
                g = flat_grads(leaves, u, "adamw8bit.update")
                p = u.db.shard
                if weight_decay:
                    for lo, hi in state.decay_runs[u.key]:
                        p[lo:hi].mul_(1 - rate * weight_decay)
                cm, cv = state.codes_m[u.key].shard, state.codes_v[u.key].shard
                for t in state.quantized[u.key]:
                    m = dequantize(cm[t.lo:t.hi], t.scale_m, t.tiles, qm)
                    v = dequantize(cv[t.lo:t.hi], t.scale_v, t.tiles, qv)
                    gs = g[t.lo:t.hi]
                    _adam(p[t.lo:t.hi], gs, m, v, b1, b2, bc1, bc2_sqrt, eps, rate)
                    cm[t.lo:t.hi], t.scale_m = quantize(m, t.tiles, t.n_tiles, qm)
                    cv[t.lo:t.hi], t.scale_v = quantize(v, t.tiles, t.n_tiles, qv)
                for _, lo, hi, m, v in state.fp32[u.key]:
                    _adam(p[lo:hi], g[lo:hi], m, v, b1, b2, bc1, bc2_sqrt, eps, rate)
        return state

    return Optimizer(init, update, granularity_8bit(min_8bit_numel))


def _adam(p, g, m, v, b1, b2, bc1, bc2_sqrt, eps, rate) -> None:
    """The AdamW moment and parameter update in place (weight decay applied by the caller)."""
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-rate / bc1)
