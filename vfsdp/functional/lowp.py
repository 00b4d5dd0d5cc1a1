"""Low-precision all-gathers: a functional hook pair, and float8 with one scale per tensor.

``vfsdp.gather(shards, spec, all_gather=hooks)`` gathers each unit through two hooks, in the
style of FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` but functional:

* ``hooks.pre_all_gather(shard, unit) -> (payload, meta)``: this rank's ``S``-element shard
  (the master dtype) becomes what is sent: any 1-D ``payload`` and ``meta`` tensors whose
  sizes are the same on every rank (they are all-gathered as bytes, so float8 works on gloo);
* ``hooks.post_all_gather(payload, meta, unit) -> full``: every rank's payloads and metas,
  concatenated in rank order, become the unit's ``m * S`` full buffer in the compute dtype.

``unit`` (:class:`UnitInfo`) says which tensor each shard element belongs to, and lets a hook
take a maximum over the ranks (``unit.all_max``), for scales that must agree.

The backward is the straight-through one FSDP's float8 all-gather uses: the gradient of the
full buffer is reduce-scattered in ``reduce_dtype`` (float32 by default) as if the gather had
been exact, scaled for ``grad_reduce="avg"``, and returned in the shard's dtype. The gather is
functional, eager and compiled alike: functional collectives, no persistent buffers.

:class:`Float8` is the ready-made pair: float8 (e4m3 by default) with one scale per tensor
(``amax / max representable``, the amax taken over every rank), half the bytes of a bf16
gather; the compute sees ``compute_dtype`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp

__all__ = ["UnitInfo", "Float8", "hooked_all_gather"]


@dataclass(frozen=True)
class UnitInfo:
    """What a hook knows about the unit it gathers.

    Attributes:
        segment: For each of this rank's ``S`` shard elements, the index of its tensor in the
            unit (``n_tensors`` for padding), a long tensor on the shard's device.
        full_segment: The same for the ``m * S`` elements of the full buffer.
        n_tensors: Tensors in the unit.
        world: Ranks in the shard group (``m``).
        group: The shard group's name (functional collectives).
    """

    segment: torch.Tensor
    full_segment: torch.Tensor
    n_tensors: int
    world: int
    group: str

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``x`` over the shard group."""
        return tp.traced_all_reduce(x, "max", self.group)


@dataclass(frozen=True)
class Float8:
    """Gather in float8 with one scale per tensor (its amax over every rank).

    Args:
        dtype: The float8 format sent (``torch.float8_e4m3fn``).
        compute_dtype: The dtype the compute sees (``torch.bfloat16``).

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.linspace(-1, 1, 8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.linspace(-1, 1, 8)}, spec)
        ...     full = vfsdp.gather(shards, spec, all_gather=Float8())["w"]
        ...     return full.dtype, float((full.float() - torch.linspace(-1, 1, 8)).abs().max()) < 0.04
        >>> vfsdp.testing.simulate(2, body)[0]
        (torch.bfloat16, True)
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    compute_dtype: torch.dtype = torch.bfloat16

    def pre_all_gather(self, shard: torch.Tensor, unit: UnitInfo) -> tuple:
        """``(float8 shard, per-tensor scales)``; the scales agree on every rank."""
        amax = torch.zeros(unit.n_tensors + 1, dtype=torch.float32, device=shard.device)
        amax = amax.scatter_reduce(0, unit.segment, shard.detach().abs().float(), "amax")
        amax = unit.all_max(amax)
        scale = amax.clamp(min=1e-12) / torch.finfo(self.dtype).max
        payload = (shard.detach().float() / scale[unit.segment]).to(self.dtype)
        return payload, scale

    def post_all_gather(self, payload: torch.Tensor, meta: torch.Tensor,
                        unit: UnitInfo) -> torch.Tensor:
        """The full buffer: every element times its tensor's scale, in ``compute_dtype``."""
        scale = meta[: unit.n_tensors + 1]  # every rank sent the same scales
        return (payload.float() * scale[unit.full_segment]).to(self.compute_dtype)


class _HookedGather(torch.autograd.Function):
    """The hooked all-gather; backward: reduce-scatter of the full buffer's gradient."""

    @staticmethod
    def forward(shard, hooks, unit, reduce_dtype):
        payload, meta = hooks.pre_all_gather(shard, unit)
        full_payload = _gather_bytes(payload, unit)
        full_meta = _gather_bytes(meta, unit)
        return hooks.post_all_gather(full_payload, full_meta, unit)

    @staticmethod
    def setup_context(ctx, inputs, output):
        shard, _, unit, reduce_dtype = inputs
        ctx.args = (shard.dtype, unit, reduce_dtype)

    @staticmethod
    def backward(ctx, g):
        dtype, unit, reduce_dtype = ctx.args
        g = tp.traced_reduce_scatter(g.to(reduce_dtype), "sum", unit.group, unit.world)
        return g.to(dtype), None, None, None


def _gather_bytes(x: torch.Tensor, unit: UnitInfo) -> torch.Tensor:
    """Every rank's 1-D ``x`` (equal sizes) concatenated, sent as bytes."""
    flat = x.reshape(-1).contiguous()
    got = tp.traced_all_gather(flat.view(torch.uint8), unit.group, unit.world)
    return got.view(flat.dtype)


def hooked_all_gather(shard: torch.Tensor, hooks: Any, pieces: tuple, views: tuple, s: int,
                      group: str, world: int, reduce_dtype: Optional[torch.dtype]
                      ) -> torch.Tensor:
    """One unit's full buffer through ``hooks`` (see the module).

    Args:
        shard: This rank's ``S`` elements (differentiable).
        hooks: An object with ``pre_all_gather`` and ``post_all_gather``.
        pieces: ``(leaf index, lo, hi)`` of this rank's tensor pieces, in the unit's order.
        views: ``(leaf index, offset, numel, shape)`` of the unit's tensors.
        s: ``S``.
        group, world: The shard group's name and size.
        reduce_dtype: The backward's reduce-scatter dtype (default float32).

    Returns:
        The ``m * S`` full buffer in the hooks' compute dtype.

    Raises:
        ValueError: the hooks' payload or meta is not 1-D.
    """
    tensor_of: dict = {}  # offset -> tensor id (a tied tensor is one tensor)
    leaf_offset: dict = {}
    for i, offset, _numel, _shape in views:
        tensor_of.setdefault(offset, len(tensor_of))
        leaf_offset[i] = offset
    k = len(tensor_of)
    device = shard.device
    # Run-length lists in Python, one repeat_interleave each: no op per tensor.
    runs, pos = [], 0
    for i, lo, hi in pieces:
        if lo > pos:
            runs.append((k, lo - pos))
        if hi > lo:
            runs.append((tensor_of[leaf_offset[i]], hi - lo))
        pos = max(pos, hi)
    runs.append((k, s - pos))
    full_runs, pos = [], 0
    for offset, tid in sorted(tensor_of.items()):
        numel = next(n for _i, o, n, _s in views if o == offset)
        if offset > pos:
            full_runs.append((k, offset - pos))
        full_runs.append((tid, numel))
        pos = max(pos, offset + numel)
    full_runs.append((k, world * s - pos))
    segment, full_segment = (_segments(r, device) for r in (runs, full_runs))
    unit = UnitInfo(segment, full_segment, k, world, group)
    return _HookedGather.apply(shard, hooks, unit, reduce_dtype or torch.float32)


def _segments(runs: list, device: torch.device) -> torch.Tensor:
    ids = torch.tensor([r[0] for r in runs], dtype=torch.long, device=device)
    lengths = torch.tensor([r[1] for r in runs], dtype=torch.long, device=device)
    return torch.repeat_interleave(ids, lengths)
