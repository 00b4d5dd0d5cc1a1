"""The step :func:`~vfsdp.estimation.estimate` predicts, from what it reads of the plans.

:func:`predict` takes the model's :class:`PlanSummary` (and, with expert parallelism, the experts'):
each unit's buffers replayed over ``run_layers``' schedule for the memory
(:mod:`vfsdp.estimation.memory`), its collectives on the links the mesh implies and the
two-lane schedule for the time (:mod:`vfsdp.estimation.timing`), the FLOPs from the layers'
costs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import torch

from vfsdp.estimation.costs import Shapes
from vfsdp.estimation.hardware import Hardware
from vfsdp.estimation.memory import (
    alike_units,
    baseline_sizes,
    optimizer_bytes,
    peak,
    split_units,
    timeline,
    unit_bytes,
)
from vfsdp.estimation.options import GiB, Options
from vfsdp.estimation.timing import links, ring, step_schedule
from vfsdp.planner.spec import ShardSpec

__all__ = ["Estimate", "PlanSummary", "predict"]


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` predicts for one rank of one step.

    Attributes:
        gpus: Ranks in the mesh (``replicas * shard``, times the model axis of a ``tp=``
            plan, which is taken to be the innermost: consecutive ranks).
        shard: The shard group's size.
        replicas: The replicate group's size (HSDP; 1 for FSDP).
        hw: The hardware profile's name.
        memory: Bytes by kind at the peak: ``params`` (shards), ``gradients`` (shards, and
            staging shards), ``optimizer`` (its state), ``buffers`` (gathered and
            reduce-scatter buffers live at the peak), ``activations`` (saved for backward),
            ``cached`` (what the caching allocator holds beyond the peak allocation:
            ``peak_reserved - peak_allocated``), ``comm_library`` (NCCL's own buffers,
            outside torch's allocator).
        memory_per_rank: Their sum: the device memory the step needs.
        fits: Whether ``memory_per_rank`` fits the device.
        peak_at: The schedule event at which vfsdp's buffers peak.
        comm_bytes: Bytes per step and rank by collective, counted as
            :func:`vfsdp.collectives.comm.counts` counts them (an all-gather or
            reduce-scatter by its full ``m * S`` buffer, an all-reduce by its tensor;
            ``backward_marks``: the backward's agreement on which gathers it runs;
            ``all_to_all``: with experts, the tokens each rank sends to other expert-parallel
            ranks).
        step_s: Seconds per step.
        compute_s: Seconds of forward and backward compute.
        exposed_comm_s: Seconds the compute waited on collectives, or ran slowed beside them
            (``Hardware.contention``).
        optimizer_s: Seconds of the update.
        tokens_per_s: Tokens per second over all ranks.
        mfu: Model FLOPs per second over the devices' peak (recomputed forwards not
            counted).
        tokens_per_rank: The tokens each rank processes per step.
        ep: The expert-parallel group's size (1 without experts).
        copy_bytes: Bytes the system copies outside its collectives per step: vfsdp each
            gradient into its reduce-scatter buffer, and each shard cast to the compute
            dtype; FSDP2 also each all-gather's input out of the parameters (copy-in) and
            its output into them (copy-out), and the reduce-scatter's output into the
            gradients; Megatron-FSDP each gradient into its bucket, the reduce-scatter's
            output into the gradient shard, and its compute-dtype shard once per step.
        copy_s: Seconds of those copies (read and write at the memory bandwidth, on the
            compute lane): ``step_s`` is ``compute_s + copy_s + exposed_comm_s +
            optimizer_s``.
        peak_allocated: The peak of the bytes allocated (``torch.cuda.max_memory_allocated``).
        peak_reserved: The caching allocator's peak reservation
            (``torch.cuda.max_memory_reserved``): vfsdp allocates every buffer on the compute
            stream and frees it there, so it reuses what it frees and reserves its peak
            allocation; FSDP2 allocates each all-gather's output on its all-gather streams and
            each reduce-scatter's output (the sharded gradients are views of it, held to the
            step's end) on its reduce-scatter stream, and the allocator reuses a freed block
            only on the stream it was allocated on, so it reserves each stream's own peak:
            the compute stream's, the largest all-gather output, and the gradient shards.
            Fragmentation within a pool is not modelled.

    Example:
        >>> spec = vfsdp.plan({"w": torch.empty(1024, 1024, device="meta")}, 8)
        >>> est = vfsdp.estimate(spec, hw="h800")
        >>> est.memory_per_rank == sum(est.memory.values()), sorted(est.record())[:3]
        (True, ['bytes_all_gather', 'bytes_all_reduce', 'bytes_all_to_all'])
    """

    gpus: int
    shard: int
    replicas: int
    hw: str
    memory: Mapping[str, int]
    memory_per_rank: int
    fits: bool
    peak_at: str
    comm_bytes: Mapping[str, int]
    step_s: float
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    tokens_per_s: float
    mfu: float
    tokens_per_rank: int = 0
    ep: int = 1
    copy_bytes: int = 0
    copy_s: float = 0.0
    peak_allocated: int = 0
    peak_reserved: int = 0

    def record(self) -> dict:
        """One flat JSON record (``--json``)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)
                   if f.name not in ("memory", "comm_bytes")},
                **{f"memory_{k}": v for k, v in self.memory.items()},
                **{f"bytes_{k}": v for k, v in self.comm_bytes.items()}}

    def __str__(self) -> str:
        mem = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.memory.items())
        ep = f", experts over {self.ep}" if self.ep > 1 else ""
        return (f"{self.gpus} GPUs ({self.replicas} x {self.shard}{ep}) on {self.hw}: "
                f"{self.memory_per_rank / GiB:.2f} GiB per rank ({mem}; "
                f"{'fits' if self.fits else 'does NOT fit'}), step {self.step_s:.3f} s "
                f"(compute {self.compute_s:.3f}, exposed comm {self.exposed_comm_s:.3f}, "
                f"optimizer {self.optimizer_s:.3f}), {self.tokens_per_s:,.0f} tokens/s, "
                f"MFU {100 * self.mfu:.1f} %")


@dataclass(frozen=True)
class PlanSummary:
    """What :func:`predict` reads of one plan: its ``units`` (``spec.units``) and
    ``mesh_shape`` (the data axes), the optimizer's ``state`` bytes on the rank estimated
    (:func:`~vfsdp.estimation.memory.optimizer_bytes`), and its
    :class:`~vfsdp.estimation.costs.Shapes`. Each is the same at every GPU count with the
    same shard group, which is what :func:`vfsdp.estimation.sweep` reuses."""

    units: Mapping
    mesh_shape: tuple
    state: int
    shapes: Shapes

    @classmethod
    def of(cls, spec: ShardSpec, opt: Any, rank: Optional[int] = None) -> PlanSummary:
        """A plan's part, the state the larger of its first and last rank's (or ``rank``'s:
        they differ where whole tiles or matrices sit on one rank)."""
        alike = alike_units(spec.units)
        state = max(optimizer_bytes(opt, spec.units, r, spec.replicas, alike)
                    for r in ({0, spec.world_size - 1} if rank is None else {rank}))
        return cls(spec.units, spec.mesh_shape, state, Shapes.of(spec))

    @property
    def model_axis(self) -> Optional[Any]:
        """The first tensor's :class:`~vfsdp.placements.StridedRaggedShard`, for a ``tp=``
        plan, else ``None``."""
        return next((st for u in self.units.values() for st in u.strided if st is not None),
                    None)


def predict(model: PlanSummary, experts: Optional[PlanSummary], o: Options) -> Estimate:
    """:func:`~vfsdp.estimation.estimate` from the :class:`PlanSummary` s it reads: the model's (or,
    with expert parallelism, the rest's) and the experts', and its :class:`Options`."""
    steps, tokens = o.micro_batches, o.tokens_per_rank // o.micro_batches  # one micro-batch's
    prof, baseline, param_dtype = o.hw, o.baseline, o.param_dtype
    parts = [model] if experts is None else [model, experts]
    layers, rest = split_units(model.units, o.layers)
    m, r = model.mesh_shape[-1], math.prod(model.mesh_shape[:-1])
    axis = model.model_axis
    gpus = m * r * (axis.size if axis is not None else 1)
    ep, ep_link = _expert_group(model, experts, o.ep, gpus, prof)
    rate = prof.flops * prof.compute_efficiency
    mm = 2 * prof.flops * (prof.float8_rowwise_efficiency if o.float8_recipe == "rowwise"
                           else prof.float8_efficiency) if o.float8 else rate  # the weight matmuls'
    comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "all_to_all": 0,
            # the backward's agreement: 3 int64, and two bytes (runs, alive) per place of a
            # window from the oldest gather the previous pass found awaiting (in a steady
            # step, its own and the last's), rounded up to a power of two, at least 64
            "backward_marks": 24 + 2 * max(64, 1 << max(
                2 * sum(len(p.units) for p in parts) - 1, 0).bit_length()) if m * r > 1 else 0}
    per_unit = _costs(parts, tokens, o)
    by_key: dict = {}  # unit key -> its UnitBytes, the experts' added to their layer's
    times: dict = {}  # unit key -> [gather s, reduce s, host s, forward copy s, backward copy s]
    shards = state = grads = copies = slowed = once = rs_out = 0  # once: Megatron's cast
    padding = baseline if o.padding is None else o.padding if o.padding != "vfsdp" else None
    for p in parts:
        pm, pr = p.mesh_shape[-1], math.prod(p.mesh_shape[:-1])
        sizes = baseline_sizes(p.units, padding) if padding else None
        # vfsdp's staging buffer keeps no shard of its own (a slice of its global buffer);
        # float8 all-gathers (torchao's enable_fsdp_float8_all_gather, float8_all_gather: fsdp_pre_all_gather
        # casts the shard, fsdp_post_all_gather wraps the gathered bytes in a Float8Tensor,
        # torchao/float8/fsdp_utils.py at e919558) leave the layers' unsharded weights in one
        # byte an element (their norms' few with them); the head and embedding stay bf16
        ub = [dataclasses.replace(u, stage_shard=u.stage_shard * (baseline is not None),
                                  gathered=u.gathered // _itemsize(param_dtype, p)
                                  if o.float8_all_gather and u.key in layers else u.gathered)
              for u in unit_bytes(p.units, param_dtype, o.reduce_dtype, sizes)]
        # the same state per element, over the baseline's shards
        state += int(p.state * sum(sizes.values()) / max(sum(u.shard_numel for u in p.units.values()), 1)) \
            if sizes else p.state
        shards += sum(u.shard for u in ub)
        grads += sum(u.grad_shard for u in ub)
        shard_link, rep_link, _ = links(prof, pm, pr, gpus // (pm * pr))
        for u in ub:
            if u.key not in model.units:
                raise ValueError(f"estimate: the experts' unit {u.key!r} is no unit of the "
                                 f"model's plan; key the experts by the layers they belong to "
                                 f"(plan them as a tree of the same paths)")
            gathers = 2 if u.key in layers and o.reshard_after_forward and (
                u.key != layers[-1] or baseline is not None) else 1  # their hooks regather the last too
            comm["all_gather"] += u.gathered * gathers
            cast = u.gathered // pm if param_dtype not in (None, p.units[u.key].dtype) else 0
            fwd_copy, bwd_copy = cast, (gathers - 1) * cast + u.reduce_in
            if baseline == "fsdp2":  # copy-in and copy-out per gather, reduce-scatter copy-out
                fwd_copy += u.gathered // pm * (not cast) + u.gathered
                bwd_copy += (gathers - 1) * (u.gathered // pm * (not cast) + u.gathered) + \
                    u.grad_shard
            if baseline == "megatron":  # gathers in place from a kept compute-dtype shard
                # (cast once, after the update); each gradient into the main-grad bucket, the
                # reduce-scatter's output added into the gradient shard
                fwd_copy, bwd_copy, once = 0, u.reduce_in + u.reduce_in // pm, once + cast
                rs_out = max(rs_out, u.reduce_in // pm)
            copies += fwd_copy + bwd_copy
            comm["reduce_scatter"] += u.reduce_in
            # with replicas, the gradient shard's all-reduce too
            red = ring(pm, u.reduce_in / pm, shard_link) + 2 * ring(pr, u.reduce_in // pm / pr, rep_link)
            comm["all_reduce"] += u.reduce_in // pm * (pr > 1)
            gather = ring(pm, u.gathered / pm, shard_link)
            # on the compute lane: the compute slowed beside the unit's collectives, the
            # host's own work per unit and step, and the copies (read and write)
            slow = prof.contention * (gathers * gather + red)
            slowed += slow
            new = (gather, red, slow + prof.unit_overhead + prof.tensor_overhead * len(
                p.units[u.key].paths), 2 * fwd_copy / prof.memory_bw, 2 * bwd_copy / prof.memory_bw)
            times[u.key] = [a + b for a, b in zip(times.get(u.key, (0.0,) * 5), new)]
            by_key[u.key] = _plus(by_key[u.key], u) if u.key in by_key else u
    ub = [by_key[k] for k in model.units]
    # no sync: whole gradients held, in the parameters' dtype (vfsdp) or the reduce dtype,
    # each freed as its unit reduces (Megatron-FSDP's, its buffer's: to the step's end)
    acc = {} if o.grad_sync or steps == 1 else {
        u.key: u.reduce_in if baseline in ("fsdp2", "megatron") else u.accum for u in ub}
    held = sum(acc.values())
    events = timeline(ub, layers, o.prefetch, o.reshard_after_forward,
                      # and float8_saved_weights: each layer's unsharded float8 weights (their
                      # transposes), one byte an element, saved from its forward to its backward;
                      # a checkpointed layer saves none (torchao's config.py at e919558: "If using
                      # outer activation checkpointing context or SAC, you may disable this
                      # option"; torchtitan PR #833 reserves 47.32 GiB with and without it)
                      {k: c.activation_bytes + (o.float8_saved_weights and not o.recompute and k in layers)
                       * by_key[k].gathered
                       // (1 if o.float8_all_gather else _itemsize(param_dtype, model))
                       for k, c in per_unit.items()},
                      {k: c.recompute_bytes for k, c in per_unit.items()}, baseline == "fsdp2",
                      None if baseline == "megatron" else acc)
    base = shards + once + state + held  # once: Megatron's kept compute-dtype shard
    top, at, kinds = peak(base, events)
    kinds["gradients"] += held
    if baseline == "megatron" and ub:  # the main-grad bucket from the layer's backward's
        # start, and the reduce-scatter's output beside the gradient shard
        extra = max(u.reduce_in for u in ub) + rs_out
        top, kinds["buffers"] = top + extra, kinds["buffers"] + extra
    # one pool where every buffer is the compute stream's (vfsdp), else one per stream
    reserved = _stream_pools(base, events) if baseline == "fsdp2" else top
    memory = {"params": shards + once, "gradients": kinds["gradients"], "optimizer": state,
              "buffers": kinds["buffers"], "activations": kinds["activations"],
              "cached": reserved - top, "comm_library": int(o.comm_library_bytes)}
    total = sum(memory.values())
    lanes = {}
    for key, (gather, reduce, host, fwd_copy, bwd_copy) in times.items():
        c = per_unit[key]
        attn = c.attention_flops * (4 / 3 if o.recompute in (True, "full") else 1)
        # the weight matmuls at the GEMM rate (float8's: its own share of twice the peak),
        # attention at the attention kernel's, the rest at the memory bandwidth
        busy = ((c.flops + c.recompute_flops - attn) / mm + attn / (prof.flops * prof.attention_efficiency)
                + c.elementwise_bytes / prof.memory_bw + host)
        lanes[key] = (gather, busy / 3 + fwd_copy, 2 * busy / 3 + bwd_copy, reduce)
    act = tokens * model.shapes.width * _itemsize(param_dtype, model)
    exposed = 0.0  # on the compute lane: the model axis's all-reduces, the experts' all-to-alls
    if o.model_parallel is not None:
        if o.model_parallel != "tp" or axis is None:
            raise ValueError(f"estimate: model_parallel={o.model_parallel!r} needs 'tp' and a "
                             f"plan with a model axis (vfsdp.plan(..., tp=rule)); got "
                             f"{'no model axis' if axis is None else axis.axis!r}")
        n = axis.size
        one = 2 * ring(n, act / n, links(prof, m, r, n)[2])  # a ring all-reduce of the activations
        for key in layers:
            comm["all_reduce"] += 4 * act
            exposed += _add(lanes, key, 2 * one, 2 * one)
    if experts is not None and ep > 1:
        # each routed token's activation goes to its experts' ranks and back: an all-to-all
        # forward (dispatch, combine), two backward, and the forward's again if recomputed
        sent = act * (o.experts_per_token or 0) * (ep - 1) / ep
        one = (ep - 1) * ep_link.latency + sent / ep_link.bandwidth
        backward = 4 if o.recompute else 2
        for key in experts.units:
            comm["all_to_all"] += int((2 + backward) * sent)
            exposed += _add(lanes, key, 2 * one, backward * one)
    opt_s = (2 * state + 2 * shards + grads) / (prof.memory_bw * prof.compute_efficiency)
    # Muon's Newton-Schulz FLOPs per rank: 5 iterations of three matmuls per matrix, spread
    # over the ranks (each replica orthogonalises all of its own)
    opt_s += sum(sum((5 * (4 * a * a * b + 2 * a ** 3) for u in p.units.values() for a, b in (
        sorted(s) for s in u.shapes if len(s) == 2)), 0.0) / p.mesh_shape[-1] for p in parts) / rate \
        if o.muon else 0.0
    once_s = 2 * once / prof.memory_bw
    opt_s += once_s  # and Megatron-FSDP's cast, after the update
    step, compute = step_schedule([lanes[k] for k in rest], [lanes[k] for k in layers], opt_s,
                                  o.prefetch, o.reshard_after_forward)
    exposed *= steps
    if steps > 1:  # the micro-batches before the last: reduced each (grad_sync) or not at all
        mid = lanes if o.grad_sync else {k: (g, f, b, 0.0) for k, (g, f, b, _) in lanes.items()}
        step += (steps - 1) * step_schedule([mid[k] for k in rest], [mid[k] for k in layers], 0.0,
                                            o.prefetch, o.reshard_after_forward)[0]
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
            comm[kind] *= steps if o.grad_sync or kind in ("all_gather", "all_to_all") else 1
    model_flops = steps * sum(c.flops for c in per_unit.values())
    name = prof.name if baseline is None else f"{prof.name}, {baseline} sharding"
    compute *= steps
    copy_s = steps * sum(t[3] + t[4] for t in times.values()) + once_s
    exposed += steps * slowed  # the compute its collectives slowed: exposed communication
    return Estimate(gpus, m, r, name, memory, total, total <= prof.memory, at, comm,
                    step, compute - exposed - copy_s + once_s,
                    max(step - compute - opt_s + exposed, 0.0),
                    opt_s - once_s,
                    gpus * o.tokens_per_rank / step if step else 0.0,
                    model_flops / step / prof.flops if step else 0.0, o.tokens_per_rank, ep,
                    copies * steps + once, copy_s, top, reserved)


def _itemsize(dtype: Optional[torch.dtype], part: PlanSummary) -> int:
    """Bytes per element of the gathered weights: ``dtype``'s, else the shards'."""
    return (dtype or next(iter(part.units.values())).dtype).itemsize


def _expert_group(model: PlanSummary, experts: Optional[PlanSummary], ep: Optional[int], gpus: int,
                  prof: Hardware) -> tuple:
    """``(ep, the expert group's link)``, checked against the model's GPUs."""
    if experts is None:
        if ep not in (None, 1):
            raise ValueError(f"estimate: ep={ep} without experts=; pass the experts' plan")
        return 1, None
    if not any(row[2] for row in experts.shapes.units.values()):
        raise ValueError("estimate: experts= holds no routed experts (paths through "
                         "'experts.<i>' or stacked under 'experts'); plan the experts' tree "
                         "under their own names")
    axis = experts.model_axis
    size = axis.size if axis is not None else ep
    if size is None or (ep is not None and ep != size):
        raise ValueError(f"estimate: the experts' plan has {'no' if axis is None else size} "
                         f"expert-parallel axis and ep={ep}; pass ep= (the ranks the experts "
                         f"are split over) or plan them with tp=rule, tp_axis='ep'")
    em, er = experts.mesh_shape[-1], math.prod(experts.mesh_shape[:-1])
    if em * er * size != gpus:
        raise ValueError(f"estimate: the experts' plan spans {em * er} x ep {size} = "
                         f"{em * er * size} GPUs and the model's {gpus}; plan the experts over "
                         f"the GPUs divided by ep")
    return size, links(prof, em, er, size)[2]


def _stream_pools(base: int, events: list) -> int:
    """FSDP2's reservation: the sum of its streams' peaks (see ``Estimate.peak_reserved``):
    the compute stream's, from ``base`` and the events but the two below; the all-gather
    streams', the all-gather outputs; and the reduce-scatter stream's, the gradient shards
    (views of its outputs, held to the step's end)."""
    pools = [1 if e[0].startswith(("all-gather output", "copied out")) else
             2 if e[0].startswith("gradient shard") else 0 for e in events]
    return sum(peak(base if pool == 0 else 0, [e for e, p in zip(events, pools) if p == pool])[0]
               for pool in set(pools))


def _add(lanes: dict, key: Any, forward: float, backward: float) -> float:
    """Add seconds to a unit's forward and backward compute; returns their sum."""
    f, fwd, bwd, red = lanes[key]
    lanes[key] = (f, fwd + forward, bwd + backward, red)
    return forward + backward


def _costs(parts: list, tokens: int, o: Options) -> dict:
    """Per unit key of the model its cost for ``tokens`` tokens: ``o.costs`` (a key, or a
    prefix of one such as ``("layers",)``; ``()`` only names the root unit itself), else the
    shape rules' over every part (the experts' added to their layer's)."""
    out: dict = {}
    for p in parts:
        for key, c in p.shapes.costs(tokens, o).items():
            out[key] = _plus(out[key], c) if key in out else c
    costs = o.costs
    for key in parts[0].units if costs else ():
        found = next((costs[key[:n]] for n in range(len(key), 0, -1) if key[:n] in costs),
                     costs.get(()) if key == () else None)
        if found is not None:
            out[key] = found
    return out


def _plus(a: Any, b: Any) -> Any:
    """One unit's ``UnitBytes`` or ``LayerCost`` from two parts of it (the model's
    and the experts'): each number summed."""
    return replace(a, **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)
                         if f.name != "key"})
