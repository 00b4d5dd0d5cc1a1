"""Low-precision all-gathers: a functional hook pair, and float8 with one scale per tensor.

``vfsdp.gather(shards, spec, all_gather=hooks)`` gathers each unit through two hooks, in the
style of FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` but functional:

* ``hooks.pre_all_gather(shard, unit) -> (payload, meta)``: this rank's ``S``-element shard
  (the master dtype) becomes what is sent: any 1-D ``payload`` and ``meta`` tensors whose
  sizes are the same on every rank (they are all-gathered as bytes, so float8 works on gloo);
* ``hooks.post_all_gather(payload, meta, unit) -> full``: every rank's payloads and metas,
  concatenated in rank order, become the unit's ``m * S`` full buffer in the compute dtype.

``unit`` (:class:`UnitInfo`) says which tensor each shard element belongs to and where every
rank's pieces sit, and lets a hook take a maximum over the ranks (``unit.all_max``), for
scales that must agree.

The backward is the straight-through one FSDP's float8 all-gather uses: the gradient of the
full buffer is reduce-scattered in ``reduce_dtype`` (float32 by default) as if the gather had
been exact, scaled for ``grad_reduce="avg"``, and returned in the shard's dtype. The gather is
functional, eager and compiled alike: functional collectives, no persistent buffers. Eagerly,
block scaling dequantizes each rank's piece of each matrix with its own few ops (a count that
grows with the tensors); compiled, those fuse.

:class:`Float8` is the ready-made pair: float8 (e4m3 by default) with one scale per tensor
(``amax / max representable``, the amax taken over every rank) or per 32x32 block of each
matrix (the tiles of :mod:`vfsdp.functional.tiles`, kept whole on ranks by the planner as for
8-bit AdamW), half the bytes of a bf16 gather plus the scales; the compute sees
``compute_dtype`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.functional.tiles import TILE, blockwise, tile_granularity, tile_view, tiled, tiles_of

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
        shapes: Each tensor's shape (by tensor index).
        pieces: Per rank, its pieces ``(tensor index, lo, hi, start, stop)``: ``[lo, hi)`` of
            that rank's shard holds ``[start, stop)`` of the tensor (flat).
        rank: This rank's index in the shard group.

    Example:
        >>> class Spy:                                   # a bf16 gather that keeps the unit
        ...     def pre_all_gather(self, shard, unit):
        ...         self.unit = unit
        ...         return shard.to(torch.bfloat16), shard.new_zeros(0)
        ...     def post_all_gather(self, payload, meta, unit):
        ...         return payload.float()
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(3), "b": torch.ones(2)}, 2)
        ...     spy = Spy()
        ...     vfsdp.gather(vfsdp.shard({"w": torch.ones(3), "b": torch.ones(2)}, spec), spec,
        ...                  all_gather=spy)
        ...     return spy.unit.segment.tolist(), spy.unit.full_segment.tolist(), spy.unit.shapes
        >>> vfsdp.testing.simulate(2, body)          # 0: b, 1: w, 2: padding
        [([0, 0, 1, 1], [0, 0, 1, 1, 1, 2, 2, 2], ((2,), (3,))),
         ([1, 2, 2, 2], [0, 0, 1, 1, 1, 2, 2, 2], ((2,), (3,)))]
    """

    segment: torch.Tensor
    full_segment: torch.Tensor
    n_tensors: int
    world: int
    group: str
    shapes: tuple = ()
    pieces: tuple = ()
    rank: int = 0

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``x`` over the shard group."""
        return tp.traced_all_reduce(x, "max", self.group)


@dataclass(frozen=True)
class Float8:
    """Gather in float8 with one scale per tensor (its amax over every rank), or per 32x32
    block of each matrix (``scaling="block"``; plan with ``granularity=hooks.granularity`` so
    blocks stay whole on ranks, as 8-bit AdamW's tiles do).

    Args:
        dtype: The float8 format sent (``torch.float8_e4m3fn``).
        compute_dtype: The dtype the compute sees (``torch.bfloat16``).
        scaling: ``"tensor"`` or ``"block"``.
        min_numel: With ``"block"``: matrices of fewer elements (and vectors) keep one scale
            per tensor.

    One NaN or inf makes its whole tensor NaN under ``"tensor"`` scaling (its amax, so its
    scale, is inf); under ``"block"`` only its 32x32 block. Use ``"block"`` where a stray
    non-finite value must stay local.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.linspace(-1, 1, 8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.linspace(-1, 1, 8)}, spec)
        ...     full = vfsdp.gather(shards, spec, all_gather=Float8())["w"]
        ...     err = (full.detach().float() - torch.linspace(-1, 1, 8)).abs().max()
        ...     return full.dtype, float(err) < 0.04
        >>> vfsdp.testing.simulate(2, body)[0]
        (torch.bfloat16, True)
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    compute_dtype: torch.dtype = torch.bfloat16
    scaling: str = "tensor"
    min_numel: int = 1024

    def __post_init__(self) -> None:
        if self.scaling not in ("tensor", "block"):
            raise ValueError(f"Float8: scaling must be 'tensor' or 'block', got {self.scaling!r}")

    @property
    def granularity(self) -> Any:
        """The planner granularity this scaling needs (``None`` for ``"tensor"``)."""
        return tile_granularity(self.min_numel) if self.scaling == "block" else None

    def _blocks(self, unit: UnitInfo, rank: int) -> list:
        """``(lo, hi, (B, R, C) view, tiles)`` of the rank's block-scaled pieces."""
        if self.scaling != "block":
            return []
        out = []
        for tid, lo, hi, start, stop in unit.pieces[rank]:
            shape = unit.shapes[tid]
            if hi > lo and blockwise(shape, self.min_numel):
                try:
                    view = tile_view(shape, start, stop)
                except ValueError as exc:
                    raise ValueError(f"Float8(scaling='block'): a tensor {shape} is split inside "
                                     f"a 32x32 block ({exc}); plan with "
                                     f"granularity=hooks.granularity") from None
                out.append((lo, hi, view, tiles_of(view)))
        return out

    def _meta_size(self, unit: UnitInfo) -> int:
        return unit.n_tensors + 1 + max([sum([block[3] for block in self._blocks(unit, r)])
                                         for r in range(unit.world)])

    def pre_all_gather(self, shard: torch.Tensor, unit: UnitInfo) -> tuple:
        """``(float8 shard, scales)``: per-tensor scales (agreed on every rank), then this
        rank's block scales (zero-padded to the largest rank's)."""
        top = torch.finfo(self.dtype).max
        x = shard.detach().float()
        amax = torch.zeros(unit.n_tensors + 1, dtype=torch.float32, device=shard.device)
        # A NaN counts as inf: scatter_reduce's amax may skip it (by the order of the
        # elements, and the device) and an all-reduce MAX may drop it, so a NaN would poison
        # its tensor only sometimes; this way one NaN or inf always does (docs: use
        # scaling="block" to keep it to its block).
        mag = x.abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
        amax = unit.all_max(amax.scatter_reduce(0, unit.segment, mag, "amax"))
        scale = _scale(amax, top)
        y = x / scale[unit.segment]  # cast once at the end (no in-place float8 writes)
        meta = [scale]
        for lo, hi, view, _n in self._blocks(unit, unit.rank):
            blocks = tiled(x[lo:hi].view(view))
            bscale = _scale(blocks.abs().amax(dim=(2, 4)), top)
            y[lo:hi] = _untiled(blocks / bscale[:, :, None, :, None], view)
            meta.append(bscale.reshape(-1))
        meta = torch.cat(meta)
        pad = self._meta_size(unit) - meta.numel()
        return y.to(self.dtype), torch.cat([meta, meta.new_zeros(pad)]) if pad else meta

    def post_all_gather(self, payload: torch.Tensor, meta: torch.Tensor,
                        unit: UnitInfo) -> torch.Tensor:
        """The full buffer: each element times its tensor's or its block's scale, in
        ``compute_dtype``."""
        scale = meta[: unit.n_tensors + 1]  # every rank sent the same per-tensor scales
        full = payload.float() * scale[unit.full_segment]
        size, s = self._meta_size(unit), payload.numel() // unit.world
        for rank in range(unit.world):  # block scales (none with "tensor")
            off = rank * size + unit.n_tensors + 1
            for lo, hi, view, n in self._blocks(unit, rank):
                blocks = tiled(payload[rank * s + lo:rank * s + hi].float().view(view))
                scales = meta[off:off + n].view(blocks.shape[0], blocks.shape[1], 1, blocks.shape[3], 1)
                full[rank * s + lo:rank * s + hi] = _untiled(blocks * scales, view)
                off += n
        return full.to(self.compute_dtype)


def _untiled(blocks: torch.Tensor, view: tuple) -> torch.Tensor:
    """:func:`~vfsdp.functional.tiles.tiled`'s inverse: ``[B, R/32, 32, C/32, 32]`` tiles -> the
    ``(B, R, C)`` view's elements, flat (the padding dropped)."""
    b, r, c = view
    return blocks.reshape(b, blocks.shape[1] * TILE, blocks.shape[3] * TILE)[:, :r, :c].reshape(-1)


def _scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """``amax / top``, the scale that maps the largest value onto the format's largest; 1 for
    an all-zero tensor or block, and never below float32's smallest normal (a fixed floor such
    as 1e-12 sent tensors whose amax is far below it to zero)."""
    tiny = torch.finfo(torch.float32).tiny
    amax = amax.nan_to_num(nan=float("inf"), posinf=float("inf"))  # a NaN poisons as an inf
    return torch.where(amax > 0, (amax / top).clamp(min=tiny), torch.ones_like(amax))


class _HookedGather(torch.autograd.Function):
    """The hooked all-gather; backward: reduce-scatter of the full buffer's gradient."""

    @staticmethod
    def forward(shard, hooks, unit, reduce_dtype):
        payload, meta = hooks.pre_all_gather(shard, unit)
        return hooks.post_all_gather(_gather_bytes(payload, unit), _gather_bytes(meta, unit), unit)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = (inputs[0].dtype, *inputs[2:])  # (the shard's dtype, unit, reduce_dtype)

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
                      group: str, world: int, rank: int, reduce_dtype: Optional[torch.dtype]
                      ) -> torch.Tensor:
    """One unit's full buffer through ``hooks`` (see the module).

    Args:
        shard: This rank's ``S`` elements (differentiable).
        hooks: An object with ``pre_all_gather`` and ``post_all_gather``.
        pieces: ``(leaf index, lo, hi)`` of this rank's tensor pieces, in the unit's order.
        views: ``(leaf index, offset, numel, shape)`` of the unit's tensors.
        s: ``S``.
        group: The shard group's name (functional collectives).
        world: The shard group's size (``m``).
        rank: This rank's index in the shard group.
        reduce_dtype: The backward's reduce-scatter dtype (default float32).

    Returns:
        The ``m * S`` full buffer in the hooks' compute dtype.

    Raises:
        AttributeError: ``hooks`` lacks ``pre_all_gather`` or ``post_all_gather``. Payloads
            and metas are sent as flat bytes, whatever their shape: sizes that differ
            between ranks are not detected (the all-gather may hang or fail).

    Example:
        >>> class BF16:
        ...     def pre_all_gather(self, shard, unit):
        ...         return shard.to(torch.bfloat16), shard.new_zeros(0)
        ...     def post_all_gather(self, payload, meta, unit):
        ...         return payload.float()
        >>> def body():                                  # one tensor of 8, S = 4 per rank
        ...     r = dist.get_rank()
        ...     shard = (torch.arange(4.0) + 4 * r).requires_grad_()
        ...     full = hooked_all_gather(shard, BF16(), ((0, 0, 4),), ((0, 0, 8, (8,)),), 4,
        ...                              dist.group.WORLD.group_name, 2, r, None)
        ...     full.sum().backward()                    # reduce-scattered: summed over ranks
        ...     return full.tolist(), shard.grad.tolist()
        >>> vfsdp.testing.simulate(2, body)[1]
        ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [2.0, 2.0, 2.0, 2.0])
    """
    first: dict = {}  # offset -> (tensor id, numel, shape): a tied tensor is one tensor
    for _i, offset, numel, shape in views:  # (an empty tensor at the offset of another: one too)
        tid = first[offset][0] if offset in first else len(first)
        first[offset] = max(first.get(offset, (tid, -1, ())), (tid, numel, tuple(shape)))
    tid_of = {i: first[offset][0] for i, offset, _numel, _shape in views}
    k = len(first)
    spans = sorted((offset, tid, numel) for offset, (tid, numel, _shape) in first.items())
    segment = _segments([(tid_of[i], lo, hi) for i, lo, hi in pieces], s, k, shard.device)
    full_segment = _segments([(tid, o, o + n) for o, tid, n in spans], world * s, k, shard.device)
    shapes = tuple(shape for _tid, _numel, shape in sorted(first.values()))
    cut = [[(tid, o, max(o, r * s), min(o + n, (r + 1) * s)) for o, tid, n in spans]
           for r in range(world)]  # per rank, each tensor's overlap [lo, hi) with its shard
    pieces_by_rank = tuple(tuple((tid, lo - r * s, hi - r * s, lo - o, hi - o)
                                 for tid, o, lo, hi in cut[r] if lo < hi) for r in range(world))
    unit = UnitInfo(segment, full_segment, k, world, group, shapes, pieces_by_rank, rank)
    return _HookedGather.apply(shard, hooks, unit, reduce_dtype or torch.float32)


def _segments(spans: list, total: int, k: int, device: torch.device) -> torch.Tensor:
    """Per element of a ``total``-element range, the id of the span ``(id, lo, hi)`` holding it
    (``k`` outside every span): run lengths in Python, one ``repeat_interleave``, no op per
    tensor."""
    ids, lengths, pos = [], [], 0
    for tid, lo, hi in spans:
        ids += (k, tid)
        lengths += (max(lo - pos, 0), hi - lo)
        pos = max(pos, hi)
    ids.append(k)
    lengths.append(total - pos)
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    return torch.repeat_interleave(ids_t, torch.tensor(lengths, dtype=torch.long, device=device))
