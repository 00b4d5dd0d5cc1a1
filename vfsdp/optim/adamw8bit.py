"""Block-wise 8-bit AdamW: moments as uint8 codes in 32x32 tiles, quantized locally.

No collective on the data: the one exchange of an update is the ranks' agreement that their
checks passed (:func:`~vfsdp.optim.base.atomic`, a flag on the host).

The optimizer declares its structure: ``opt.granularity`` keeps 32-row stripes of every matrix
on one rank (``rows(32)``; a ``[E, R, C]`` expert stack whose ``R`` is not a multiple of 32
keeps whole matrices), so every 32x32 tile lives on one rank and each rank quantizes its shard
alone, exactly as one process would. ``init`` refuses a spec that does not honour the tiles.

Per step, in one flat pass over every unit's quantized tensors on the rank (their shards laid
end to end; in fp32): dequantize ``m``
(signed dynamic map) and ``v`` (unsigned dynamic map, ``v`` itself), apply AdamW exactly as
:func:`vfsdp.optim.adamw`, take each tile's new absmax and re-quantize with round-to-nearest.
State: 1 byte per element per moment in uint8 DBuffers with the parameters' layout, plus one
fp32 scale per tile per moment (2 + 8/1024 bytes per parameter).

Rules: tensors with fewer than ``min_8bit_numel`` elements (**global** numel, never the local
shard's) and 1-D tensors keep fp32 moments. Partial tiles at ragged edges take the absmax of
their real elements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp._warnings import warn_user
from vfsdp.collectives.dbuffer import Role
from vfsdp.collectives.piece import Piece, tensor_piece
from vfsdp.functional.state import param_tree
from vfsdp.functional.tiles import blockwise, tile_granularity, tile_range, tile_view, tiles_of
from vfsdp.optim.base import (
    CountedState,
    Mask,
    Optimizer,
    OwnedPlan,
    Schedule,
    adamw_step,
    as_schedule,
    atomic,
    begin,
    check_hyper,
    cuts_of,
    decay_,
    flat_grads,
    grad_leaves,
    init_units,
    pieces_of,
    runs,
    selected,
    step_scalars,
    trained,
)
from vfsdp.optim.quant import SpanTiles, dynamic_map, midpoints, span_tiles, step8_flat
from vfsdp.optim.traced import TracedAdam8, first_leaves, traced_adamw8bit
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec

MIN_8BIT_NUMEL = 4096


@dataclass(frozen=True)
class Quantized:
    """One quantized tensor's place on this rank: buffer index ``k``, range ``[lo, hi)`` in
    the shard, that range seen as ``B`` matrices ``[R, C]`` (``view``, see
    :func:`~vfsdp.optim.quant.tile_view`), its number of tiles and the first of them in the
    rank's scales (``t0``: every unit's tiles in order, then a spare one)."""

    k: int
    lo: int
    hi: int
    view: tuple
    n_tiles: int
    t0: int = 0


@dataclass(frozen=True)
class AdamW8bitPlan(OwnedPlan):
    """What ``init`` derives from the spec and the mask, per unit: the tensors it updates
    (``paths``), the quantized ones (``quantized``, by shard offset), those with fp32 moments
    (``fp32``: ``(k, lo, hi)``), the buffer indices that decay (``decays``) and the rank's
    number of tiles (``n_tiles``). Never saved; rebuilt by ``init``.

    Example:
        >>> opt = vfsdp.optim.adamw8bit(min_8bit_numel=1024)
        >>> params = {"w": torch.ones(64, 32), "norm": torch.ones(32)}
        >>> spec = vfsdp.plan(params, 2, granularity=opt.granularity)
        >>> def body():
        ...     plan = opt.init(vfsdp.shard(params, spec), spec).plan
        ...     return [(q.k, q.lo, q.hi) for q in plan.quantized[()]], plan.fp32[()]
        >>> vfsdp.testing.simulate(2, body)      # w: 8-bit, half a rank each; norm: fp32
        [([(1, 32, 1056)], ((0, 0, 32),)), ([(1, 0, 1024)], ((0, 0, 0),))]
    """

    quantized: Mapping[Any, tuple] = field(default_factory=dict)
    fp32: Mapping[Any, tuple] = field(default_factory=dict)
    decays: Mapping[Any, frozenset] = field(default_factory=dict)
    n_tiles: int = 0


@dataclass(frozen=True)
class RankPass:
    """The operands of one update over every unit it trains on this rank, made once per set
    of units and frozen tensors and kept (the parameter, code and moment buffers are fixed
    tensors, so their views are too): the units' whole shards laid end to end for the one
    8-bit pass, the span's tiles over them, the slices that decay, and the fp32-moment
    tensors with where their gradients are in the concatenated gradient."""

    ps: tuple        # parameter shards (another tree's: made again), code shards (m, v)
    cms: tuple
    cvs: tuple
    tiles: Optional[SpanTiles]  # None: no quantized tensor is trained
    decay: tuple     # parameter slices that decay
    small: tuple     # (parameter slices, m, v) of the fp32-moment tensors trained
    cuts: tuple      # cuts_of's (sizes, index): those slices of the concatenated gradient


@dataclass
class AdamW8bitState(CountedState):
    """The step counter (``count``); uint8 codes per unit (DBuffers with the parameters'
    layout); per quantized tensor ``(unit, k)`` its tile scales (views of the rank's scales,
    ``rank_scales_m``/``_v``: every unit's tiles in shard order, then a spare one); per small
    tensor its fp32 moments.

    Example:
        >>> opt = vfsdp.optim.adamw8bit(min_8bit_numel=1024)
        >>> params = {"w": torch.ones(64, 32), "norm": torch.ones(32)}
        >>> spec = vfsdp.plan(params, 2, granularity=opt.granularity)
        >>> def body():
        ...     state = opt.init(vfsdp.shard(params, spec), spec)
        ...     return state.step, state.codes_m[()].dtype, state.state_bytes()
        >>> vfsdp.testing.simulate(2, body)      # (bytes, elements) of 8-bit state per rank
        [(0, torch.uint8, (2056, 1024)), (0, torch.uint8, (2056, 1024))]
    """

    codes_m: dict
    codes_v: dict
    scales_m: dict = field(default_factory=dict)
    scales_v: dict = field(default_factory=dict)
    fp32_m: dict = field(default_factory=dict)
    fp32_v: dict = field(default_factory=dict)
    rank_scales_m: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    rank_scales_v: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    traced: Optional[TracedAdam8] = field(default=None, repr=False, compare=False)
    saved: ClassVar[tuple] = ("codes_m", "codes_v")

    def state_bytes(self) -> tuple[int, int]:
        """``(bytes of 8-bit state incl. scales, elements it covers)`` on this rank."""
        tensors = [t for q8 in self.plan.quantized.values() for t in q8]
        elems = sum(t.hi - t.lo for t in tensors)
        return 2 * elems + 8 * sum(t.n_tiles for t in tensors), elems  # codes; m and v scales

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step; the codes per element and the tile scales indexed by global tile (so
        another block placement reloads them bit for bit); the small tensors' fp32 moments."""
        tree = super().checkpoint_tree(spec)
        for attr, scales, small in (("m", self.scales_m, self.fp32_m), ("v", self.scales_v, self.fp32_v)):

            def scale_piece(db, k, scales=scales):
                if (found := scales.get((db.key, k))) is None:
                    return None
                ts = db.tensors[k]
                first, total = tile_range(tuple(ts.shape), ts.local_range(db.rank)[0])
                first = first if found.numel() else 0
                writer = db.groups.replicate_rank == 0
                st = ts.strided
                if st is None or st.dim is None:
                    return Piece(found, (total,), first, writer=writer and
                                 (st is None or st.writes))
                # Tiles of this index's piece: row ``index`` of (model axis, most tiles); it
                # reloads at the same model-axis degree only (tiles of other pieces differ).
                most = max(tile_range(replace(st, index=i).local_shape, 0)[1]
                           for i in range(st.size))
                return Piece(found, (st.size, most), first, writer=writer,
                             within=((st.index, 0), (1, most)))

            def small_piece(db, k, small=small):
                return None if (found := small.get((db.key, k))) is None else tensor_piece(
                    db.tensors[k], found, db.rank, db.groups.replicate_rank == 0)

            tree[f"scales_{attr}"] = param_tree(self.codes_m, spec, scale_piece)
            tree[f"fp32_{attr}"] = param_tree(self.codes_m, spec, small_piece)
        return tree


def _rank_pass(state: AdamW8bitState, units: list) -> RankPass:
    """The :class:`RankPass` of ``units`` (``(unit, frozen buffer indices)`` in order)."""
    plan, pieces, live, decay, small, ranges, base = state.plan, [], set(), [], [], [], 0
    for u, frozen in units:
        p, at = u.db.shard, 0
        for t in plan.quantized[u.key]:
            if t.hi > t.lo and t.k not in frozen:
                pieces += [(t.lo - at, None, None), (t.hi - t.lo, t.view, t.t0)]
                live.add((u.key, t.k))
                at = t.hi
        pieces.append((p.numel() - at, None, None))
        decaying = {u.db.tensors[k].path for k in plan.decays[u.key] - frozen}
        decay += [p[lo:hi] for lo, hi in runs(u.db, decaying.__contains__)]
        for k, lo, hi in plan.fp32[u.key]:
            if k not in frozen and hi > lo:
                ranges.append((base + lo, base + hi))
                small.append((p[lo:hi], state.fp32_m[(u.key, k)], state.fp32_v[(u.key, k)]))
        base += p.numel()
    # the scales of the tiles not trained now stay (other units', frozen tensors')
    still = tuple((t.t0, t.n_tiles) for key, ts in plan.quantized.items() for t in ts
                  if (key, t.k) not in live and t.n_tiles)
    tiles = span_tiles(pieces, plan.n_tiles, units[0][0].db.device, still) if live else None
    return RankPass(tuple(u.db.shard for u, _ in units),
                    tuple(state.codes_m[u.key].shard for u, _ in units),
                    tuple(state.codes_v[u.key].shard for u, _ in units),
                    tiles, tuple(decay), tuple(zip(*small)) or ((), (), ()), cuts_of(ranges, base))


def adamw8bit(
    lr: Schedule = 1e-3,
    betas: tuple = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    weight_decay_mask: Optional[Callable[[tuple], bool]] = None,
    min_8bit_numel: int = MIN_8BIT_NUMEL,
    compile: Optional[bool] = None,
) -> Optimizer:
    """AdamW with 8-bit moments in 32x32 tiles. Plan with ``granularity=opt.granularity``.

    A step is one flat pass over every quantized tensor of the rank, the units' shards laid
    end to end (:func:`~vfsdp.optim.quant.step8_flat`: tile indices from a small table per
    tensor, dequantize, update, new absmax by one scatter-max, re-quantize; a fixed number of
    ops whatever the units and tensors, no per-element index kept) and one multi-tensor AdamW
    over every fp32-moment tensor of every unit.

    Args:
        lr: As :func:`vfsdp.optim.adamw`.
        betas: As :func:`vfsdp.optim.adamw`.
        eps: As :func:`vfsdp.optim.adamw`.
        weight_decay: As :func:`vfsdp.optim.adamw`.
        weight_decay_mask: As :func:`vfsdp.optim.adamw`.
        min_8bit_numel: Tensors (by global numel) below this keep fp32 moments.
        compile: Run the per-unit pass through ``torch.compile`` (one graph for every unit
            and step), which fuses it into a few kernels. ``None`` (default): on CUDA; if compiling fails
            there, a warning says why and the eager ops run. Compiled kernels may round
            differently in the last bit than the eager ops.

    Returns:
        An :class:`vfsdp.optim.Optimizer` whose ``granularity`` the planner must honour.

    Raises:
        ValueError: as :func:`vfsdp.optim.adamw` for the hyperparameters; from ``init``, a
            quantized tensor's rank boundary cuts a 32-row stripe.

    Example:
        >>> opt = vfsdp.optim.adamw8bit(lr=1e-3)
        >>> params = {"w": torch.randn(128, 64), "norm": torch.ones(64)}
        >>> spec = vfsdp.plan(params, 3, granularity=opt.granularity)
        >>> def body():
        ...     shards = vfsdp.shard(params, spec)
        ...     state = opt.init(shards, spec)         # refuses a spec that cuts a tile
        ...     grads = vfsdp.grads(shards, spec)
        ...     state = opt.update(grads, state, shards, spec)
        ...     return state.state_bytes()[1]          # elements with 8-bit moments here
        >>> sum(vfsdp.testing.simulate(3, body))
        8192
    """
    check_hyper("adamw8bit", lr, weight_decay, betas=betas, eps=eps)
    b1, b2 = betas
    schedule = as_schedule(lr)

    @functools.cache
    def qmaps(device) -> tuple:
        """Code maps and their midpoints, made once per device (on the parameters')."""
        qm, qv = dynamic_map(True, device), dynamic_map(False, device)
        return qm, qv, midpoints(qm), midpoints(qv)

    @functools.cache
    def kernel(device_type: str) -> Callable:
        return compiled_step8() if (device_type == "cuda" if compile is None else compile) else step8_flat

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> AdamW8bitState:
        units, count = init_units(shards, spec, "adamw8bit.init", mask=mask,
                                  weight_decay_mask=weight_decay_mask)
        state = AdamW8bitState(count, {}, {})
        paths, quantized, fp32, decay, t0 = {}, {}, {}, {}, 0
        traced, small = [], []
        for u in units:
            db = u.db
            chosen = frozenset(t.path for t in db.tensors if selected(mask, t.path))
            if not chosen:
                continue
            cm = state.codes_m[u.key] = db.like(torch.uint8, Role.STATE, "codes_m")
            cv = state.codes_v[u.key] = db.like(torch.uint8, Role.STATE, "codes_v")
            decays = decay[u.key] = frozenset(
                k for k, t in enumerate(db.tensors)
                if t.path in chosen and selected(weight_decay_mask, t.path))
            q8, f32 = [], []
            # in shard order: every unit's tiles, in that order, then the spare
            for k, t in sorted(((k, t) for k, t in enumerate(db.tensors) if t.path in chosen),
                               key=lambda kt: kt[1].shard_range(db.rank)[0]):
                lo, hi = t.shard_range(db.rank)
                shape = tuple(t.shape)
                if not blockwise(shape, min_8bit_numel):
                    f32.append((k, lo, hi))
                    state.fp32_m[(u.key, k)], state.fp32_v[(u.key, k)] = (
                        torch.zeros(hi - lo, dtype=torch.float32, device=db.device) for _ in "mv")
                    continue
                try:
                    view = tile_view(shape, *t.local_range(db.rank))
                except ValueError as exc:
                    raise ValueError(
                        f"adamw8bit: {format_path(t.path)} {shape} is split across ranks inside a "
                        f"32x32 tile ({exc}); plan with granularity=opt.granularity so each tile "
                        f"stays on one rank"
                    ) from None
                q8.append(Quantized(k, lo, hi, view, n := tiles_of(view), t0))
                t0 += n
            paths[u.key], quantized[u.key], fp32[u.key] = chosen, tuple(q8), tuple(f32)
            first = first_leaves(u)  # what a compiled update reads (vfsdp.optim.traced)
            traced += [(first[t.k], t, t.k in decays, cm.local(t.k).view(-1), cv.local(t.k).view(-1))
                       for t in q8 if t.hi > t.lo]
            small += [(first[k], k in decays, state.fp32_m[(u.key, k)], state.fp32_v[(u.key, k)])
                      for k, lo, hi in f32 if hi > lo]
        for attr in ("m", "v"):
            whole = torch.zeros(t0 + 1, dtype=torch.float32, device=count.device)
            setattr(state, f"rank_scales_{attr}", whole)
            getattr(state, f"scales_{attr}").update({(key, t.k): whole[t.t0:t.t0 + t.n_tiles]
                                                     for key, q8 in quantized.items() for t in q8})
        state.plan = AdamW8bitPlan(paths, quantized, fp32, decay, t0)
        state.traced = TracedAdam8(traced, state.rank_scales_m, state.rank_scales_v, small,
                                   qmaps(count.device))
        return state

    def update(grads: Any, state: AdamW8bitState, shards: Any, spec: ShardSpec) -> AdamW8bitState:
        if tp.compiling():
            rate = begin(state.count, schedule)
            traced_adamw8bit(grads, state, shards, spec, rate, betas, eps, weight_decay)
            return state
        leaves = grad_leaves(grads, spec, "adamw8bit.update")
        with torch.no_grad():
            units = trained(shards, spec, state.plan, "adamw8bit.update")  # frozen: no update, no decay
            gs = [flat_grads(leaves, u, "adamw8bit.update") for u, _ in units]
            rate = begin(state.count, schedule)  # the checks are done: nothing written yet
            scalars = step_scalars(state.count, betas)
            if not units:
                return state
            run = state.cached(tuple((u.key, frozen) for u, frozen in units),
                               tuple(u.db.shard for u, _ in units), lambda: _rank_pass(state, units))
            decay_(list(run.decay), rate, weight_decay)
            g = _cat(gs).float()  # its arithmetic: fp32
            if run.tiles is not None:  # one 8-bit pass over every unit of the rank
                p, cm, cv = _cat(run.ps), _cat(run.cms), _cat(run.cvs)
                qm, qv, mm, mv = qmaps(p.device)
                kernel(p.device.type)(p, g, cm, cv, state.rank_scales_m, state.rank_scales_v,
                                 run.tiles, qm, qv, mm, mv, b1, b2, eps, rate, *scalars)
                if len(run.ps) > 1:  # back into the units' buffers
                    for dst, src in ((run.ps, p), (run.cms, cm), (run.cvs, cv)):
                        tp.foreach("copy_", list(dst), list(src.split([x.numel() for x in run.ps])))
            if run.small[0]:  # one multi-tensor AdamW over the fp32-moment tensors
                ps, ms, vs = run.small
                adamw_step(list(ps), pieces_of(g, run.cuts), list(ms), list(vs), [],
                           count=state.count, lr=rate, betas=betas, eps=eps, weight_decay=0.0,
                           fused=False, scalars=scalars)
        return state

    return Optimizer(init, atomic(update), tile_granularity(min_8bit_numel), local_state=True)


def compiled_step8() -> Callable:
    """:func:`~vfsdp.optim.quant.step8_flat` through ``torch.compile``: one graph for every
    step (the span's table and sizes go in as arguments, the step's three scalars as one
    float32 tensor); where compiling fails, a warning says why and the eager pass runs
    instead."""
    fn = torch.compile(_unpacked, dynamic=True)
    failed: list = []

    def run(*args) -> None:
        if not failed:
            scalars = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=args[0].device)
                                   for x in args[-3:]]).float()
            try:  # the span's tiles unpacked, in SpanTiles' field order
                return fn(*args[:6], *vars(args[6]).values(), *args[7:-3], scalars)
            except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back
                failed.append(exc)
                warn_user(f"adamw8bit: torch.compile of the 8-bit step failed "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); running "
                          f"the eager ops (same result, more kernels). Pass compile=False to "
                          f"skip compiling.")
        return step8_flat(*args)

    return run


def _unpacked(p, g, cm, cv, sm, sv, table, chunks, numel, n_tiles, keep, *args) -> None:
    """:func:`~vfsdp.optim.quant.step8_flat` with its span's tiles unpacked (sizes as
    arguments, not attributes a graph would specialise on) and its three per-step scalars
    (learning rate, bias corrections) in one tensor."""
    lr, bc1, bc2_sqrt = args[-1].unbind()
    step8_flat(p, g, cm, cv, sm, sv, SpanTiles(table, chunks, numel, n_tiles, keep),
               *args[:-1], lr, bc1, bc2_sqrt)


def _cat(xs: Any) -> torch.Tensor:
    """``torch.cat(xs)``, or the one tensor itself (no copy)."""
    return xs[0] if len(xs) == 1 else torch.cat(list(xs))
