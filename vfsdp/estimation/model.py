"""``vfsdp.estimate(spec, ...)``: memory per rank and step time, from the plan alone."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import optree
import torch

from vfsdp.estimation.costs import LayerCost, embedding_width, shape_costs
from vfsdp.estimation.hardware import Hardware, hardware
from vfsdp.estimation.memory import (
    baseline_sizes,
    itemsize,
    optimizer_bytes,
    peak,
    split_units,
    timeline,
    unit_bytes,
)
from vfsdp.estimation.timing import links, ring, simulate
from vfsdp.planner.spec import ShardSpec

__all__ = ["estimate", "Estimate", "optimizer_for"]

GiB = 2**30


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
            ``allowance`` (the caching allocator and the communication library).
        memory_per_rank: Their sum.
        fits: Whether ``memory_per_rank`` fits the device.
        peak_at: The schedule event at which vfsdp's buffers peak.
        comm_bytes: Bytes per step and rank by collective, counted as
            :func:`vfsdp.collectives.comm.counts` counts them (an all-gather or
            reduce-scatter by its full ``m * S`` buffer, an all-reduce by its tensor;
            ``backward_marks``: the backward's agreement on which gathers it runs).
        step_s: Seconds per step.
        compute_s: Seconds of forward and backward compute.
        exposed_comm_s: Seconds the compute waited on collectives.
        optimizer_s: Seconds of the update.
        tokens_per_s: Tokens per second over all ranks.
        mfu: Model FLOPs per second over the devices' peak (recomputed forwards not
            counted).
        tokens_per_rank: The tokens each rank processes per step.

    Example:
        >>> spec = vfsdp.plan({"w": torch.empty(1024, 1024, device="meta")}, 8)
        >>> est = vfsdp.estimate(spec, hw="h800")
        >>> est.memory_per_rank == sum(est.memory.values()), sorted(est.record())[:3]
        (True, ['bytes_all_gather', 'bytes_all_reduce', 'bytes_backward_marks'])
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
    notes: tuple = field(default=(), repr=False)

    def record(self) -> dict:
        """One flat JSON record (``--json``)."""
        out = {k: getattr(self, k) for k in (
            "gpus", "shard", "replicas", "hw", "memory_per_rank", "fits", "step_s",
            "compute_s", "exposed_comm_s", "optimizer_s", "tokens_per_s", "mfu",
            "tokens_per_rank", "peak_at")}
        out.update({f"memory_{k}": v for k, v in self.memory.items()})
        out.update({f"bytes_{k}": v for k, v in self.comm_bytes.items()})
        return out

    def __str__(self) -> str:
        mem = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.memory.items())
        return (f"{self.gpus} GPUs ({self.replicas} x {self.shard}) on {self.hw}: "
                f"{self.memory_per_rank / GiB:.2f} GiB per rank ({mem}; "
                f"{'fits' if self.fits else 'does NOT fit'}), step {self.step_s:.3f} s "
                f"(compute {self.compute_s:.3f}, exposed comm {self.exposed_comm_s:.3f}, "
                f"optimizer {self.optimizer_s:.3f}), {self.tokens_per_s:,.0f} tokens/s, "
                f"MFU {100 * self.mfu:.1f} %")


def optimizer_for(name: Union[str, Any], like: Any = None) -> Any:
    """A vfsdp optimizer from its name (``"adamw"``, ``"adamw8bit"``, ``"muon"``: Muon for
    the matrices of ``like``, a spec or a parameter tree, AdamW for the rest), or the
    optimizer itself."""
    from vfsdp import optim

    if not isinstance(name, str):
        return name
    if name == "adamw":
        return optim.adamw()
    if name == "adamw8bit":
        return optim.adamw8bit()
    if name == "muon":
        if isinstance(like, ShardSpec):
            ndim = {t.path: len(t.shape) for t in like.tensors()}
        else:
            paths, leaves, _ = optree.tree_flatten_with_path(like)
            ndim = {tuple(p): getattr(x, "ndim", 0) for p, x in zip(paths, leaves)}
        return optim.partition({"muon": optim.muon(), "adamw": optim.adamw()},
                               lambda path: "muon" if ndim.get(tuple(path)) == 2 else "adamw")
    raise ValueError(f"estimate: unknown optimizer {name!r}; pass 'adamw', 'adamw8bit', "
                     f"'muon' or a vfsdp.optim optimizer")


def estimate(spec: ShardSpec, hw: Union[str, Hardware] = "h100", optimizer: Any = "adamw",
             param_dtype: Optional[torch.dtype] = torch.bfloat16,
             reduce_dtype: Optional[torch.dtype] = None, prefetch: bool = True,
             reshard_after_forward: bool = True, tokens_per_rank: int = 4096,
             costs: Optional[Mapping[Any, LayerCost]] = None,
             experts_per_token: Optional[int] = None, seq: Optional[int] = None,
             recompute: bool = False, allocator_fraction: float = 0.05,
             comm_library_bytes: int = 2 * GiB, rank: Optional[int] = None,
             baseline: Optional[str] = None, model_parallel: Optional[str] = None,
             layers: Optional[list] = None) -> Estimate:
    """Predict one training step of ``spec`` on ``hw`` (see ``docs/estimate.md``).

    Args:
        spec: The plan (any mesh; no process group is needed).
        hw: A hardware profile or its name (``"h800"``), or a JSON file from ``calibrate``.
        optimizer: A vfsdp optimizer or its name (``"adamw"``, ``"adamw8bit"``, ``"muon"``).
        param_dtype: The compute dtype the units are gathered in (``None``: the shards').
        reduce_dtype: The reduce-scatter dtype (default: ``param_dtype``).
        prefetch: As ``run_layers``'.
        reshard_after_forward: As ``run_layers``'.
        tokens_per_rank: Tokens each rank processes per step.
        costs: Per unit key (or key prefix, such as ``("layers",)``) its
            :class:`LayerCost` for ``tokens_per_rank`` tokens (from :func:`layer_cost`);
            default: from the shapes (:func:`shape_costs`).
        experts_per_token: Routed experts per token, for the shapes' default costs of a
            model with ``experts``.
        seq: Sequence length, for the attention FLOPs of the default costs.
        recompute: The default costs keep only each layer's input (activation
            checkpointing).
        allocator_fraction: The caching allocator's allowance, a fraction of the rest.
        comm_library_bytes: The communication library's own buffers.
        rank: The shard rank whose optimizer state is counted (default: the larger of the
            first and the last rank's; they differ where whole tiles or matrices sit on
            one rank).
        baseline: ``"fsdp2"`` or ``"megatron"``: the same step with that system's sharding
            rule and padding (:func:`~vfsdp.estimation.memory.baseline_sizes`), and none of
            its copy-in/copy-out or per-parameter allocations (a bound in its favour).
        model_parallel: ``"tp"`` for a ``tp=`` plan of Megatron-style layers: each layer
            all-reduces its activations (``tokens_per_rank`` x the embedding's width, in the
            compute dtype) twice forward and twice backward over the model axis, on the
            compute lane (exposed), each after an all-gather of its shape (9 int64s a
            rank). ``None``: the model axis's own collectives are not modelled.
        layers: The unit keys ``run_layers`` runs, in order (default: the longest run of
            units keyed ``(name, i)``; the other units are gathered for the whole step).

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: an unknown profile or optimizer, a model with experts and no
            ``experts_per_token``, ``tokens_per_rank`` below 1, an unknown baseline, or
            ``model_parallel="tp"`` for a plan without a model axis, or ``layers`` naming
            a unit the plan does not have.

    Example:
        >>> params = {"layers": [{"w": torch.empty(4096, 4096, device="meta")}
        ...                      for _ in range(32)]}
        >>> est = vfsdp.estimate(vfsdp.plan(params, 64), hw="h100", tokens_per_rank=8192)
        >>> est.fits, est.gpus, est.comm_bytes["all_gather"] > 0
        (True, 64, True)
    """
    if tokens_per_rank < 1:
        raise ValueError(f"estimate: tokens_per_rank must be at least 1, got {tokens_per_rank}")
    prof = hardware(hw)
    opt = optimizer_for(optimizer, spec)
    sizes = baseline_sizes(spec, baseline) if baseline else None
    ub = unit_bytes(spec, param_dtype, reduce_dtype, sizes)
    layers, rest = split_units(spec, layers)
    ranks = sorted({0, spec.world_size - 1}) if rank is None else [rank]
    state = max(_state(optimizer, spec, r) if isinstance(optimizer, str)
                else optimizer_bytes(opt, spec, r) for r in ranks)
    if sizes:  # the same state per element, over the baseline's shards
        state = int(state * sum(sizes.values()) / max(sum(u.shard_numel for u in
                                                          spec.units.values()), 1))
    shards = sum(u.shard for u in ub)
    per_unit = _costs(spec, costs, tokens_per_rank, experts_per_token, seq, recompute)
    events = timeline(ub, layers, prefetch, reshard_after_forward,
                      {k: c.activation_bytes for k, c in per_unit.items()},
                      {k: c.recompute_bytes for k, c in per_unit.items()})
    top, at, kinds = peak(shards + state, events)
    allowance = int(allocator_fraction * top) + int(comm_library_bytes)
    memory = {"params": shards, "gradients": kinds["gradients"], "optimizer": state,
              "buffers": kinds["buffers"], "activations": kinds["activations"],
              "allowance": allowance}
    total = sum(memory.values())
    m, r = spec.world_size, spec.replicas
    model_size = spec.model_axis[1] if spec.model_axis is not None else 1
    shard_link, rep_link, model_link = links(prof, m, r, model_size)
    # the backward's agreement: 3 int64 and a byte per differentiable gather (one per unit)
    comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0,
            "backward_marks": 24 + len(ub) if m * r > 1 else 0}
    lanes: dict = {}
    rate = prof.flops * prof.compute_efficiency
    for u in ub:
        again = u.key in layers and reshard_after_forward and u.key != layers[-1]
        comm["all_gather"] += u.gathered * (2 if again else 1)
        comm["reduce_scatter"] += u.reduce_in
        rs = ring(m, u.reduce_in / m, shard_link)
        if r > 1:
            shard_grad = u.reduce_in // m
            comm["all_reduce"] += shard_grad
            rs += 2 * ring(r, shard_grad / r, rep_link)
        flops = per_unit[u.key].flops + per_unit[u.key].recompute_flops
        # the host's own work per unit and step, on the compute lane
        host = prof.unit_overhead + prof.tensor_overhead * len(spec.units[u.key].paths)
        lanes[u.key] = (ring(m, u.gathered / m, shard_link), flops / 3 / rate + host / 3,
                        2 * flops / 3 / rate + 2 * host / 3, rs)
    grads = sum(u.grad_shard for u in ub)
    tp_s = 0.0
    if model_parallel is not None:
        axis = spec.model_axis
        if model_parallel != "tp" or axis is None:
            raise ValueError(f"estimate: model_parallel={model_parallel!r} needs 'tp' and a "
                             f"plan with a model axis (vfsdp.plan(..., tp=rule)); got "
                             f"{'no model axis' if axis is None else axis[0]!r}")
        n = axis[1]
        width = embedding_width(spec)
        act_dtype = param_dtype or next(iter(spec.units.values())).dtype
        act = tokens_per_rank * width * itemsize(act_dtype)
        one = 2 * ring(n, act / n, model_link)  # a ring all-reduce of the activations
        comm["shape_exchange"] = 0
        for key in layers:
            comm["all_reduce"] += 4 * act
            # before each sum the ranks agree on its shape (vfsdp.lax: 9 int64s per rank)
            comm["shape_exchange"] += 4 * n * 9 * 8
            f, fwd, bwd, red = lanes[key]
            lanes[key] = (f, fwd + 2 * one, bwd + 2 * one, red)
            tp_s += 4 * one
    opt_s = (2 * state + 2 * shards + grads) / (prof.memory_bw * prof.compute_efficiency)
    opt_s += _muon_flops(spec, optimizer) / rate
    sched = simulate([lanes[k] for k in rest], [lanes[k] for k in layers], opt_s, prefetch,
                     reshard_after_forward)
    model_flops = sum(c.flops for c in per_unit.values())
    gpus = m * r * model_size
    name = prof.name if baseline is None else f"{prof.name}, {baseline} sharding"
    step = sched.step
    return Estimate(gpus, m, r, name, memory, total, total <= prof.memory, at, comm,
                    step, sched.compute - tp_s, max(sched.exposed + tp_s, 0.0),
                    sched.optimizer,
                    gpus * tokens_per_rank / step if step else 0.0,
                    model_flops / step / prof.flops if step else 0.0, tokens_per_rank)


@functools.lru_cache(maxsize=64)
def _state(name: str, spec: ShardSpec, rank: int) -> int:
    """The named optimizer's state bytes (a pure function of the plan: kept for sweeps)."""
    return optimizer_bytes(optimizer_for(name, spec), spec, rank)


def _costs(spec, costs, tokens, experts_per_token, seq, recompute) -> dict:
    base = shape_costs(spec, tokens, experts_per_token, seq, recompute)
    if not costs:
        return base
    out = {}
    for key in spec.units:
        # a key, or a prefix of one (("layers",)); () only names the root unit itself
        found = next((costs[key[:n]] for n in range(len(key), 0, -1) if key[:n] in costs),
                     costs.get(()) if key == () else None)
        out[key] = found if found is not None else base[key]
    return out


def _muon_flops(spec: ShardSpec, optimizer: Any) -> float:
    """Newton-Schulz FLOPs per rank for ``"muon"`` (5 iterations of three matmuls per
    matrix, spread over the ranks)."""
    if optimizer != "muon":
        return 0.0
    total = 0.0
    for t in spec.tensors():
        if len(t.shape) == 2:
            a, b = sorted(t.shape)
            total += 5 * (4 * a * a * b + 2 * a ** 3)
    return total / spec.world_size  # each replica orthogonalises all of its own
