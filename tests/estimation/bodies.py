"""Bodies for the estimate tests: one training step of the example model, measured."""

from __future__ import annotations

import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives.comm import counts, reset_counts
from vfsdp.estimation import LayerCost
from vfsdp.estimation.memory import state_tensors
from vfsdp.estimation.model import optimizer_for
from vfsdp.testing.memory import BufferBytes
from vfsdp.testing.models import (
    GPTConfig,
    block,
    embed,
    example_layer,
    head_loss,
    init_rule,
    meta_params,
)


def _model(cfg: GPTConfig, opt, mesh) -> tuple:
    """``(spec, shards, tokens)`` of the example model planned for ``opt`` on ``mesh``."""
    spec = vfsdp.plan(meta_params(cfg), mesh, granularity=opt.granularity)
    shards = vfsdp.shard(meta_params(cfg), spec, init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    return spec, shards, torch.randint(0, cfg.vocab, (2, 32), generator=torch.Generator().manual_seed(0))


def step(optimizer: str, dtype, prefetch: bool = True, reshard: bool = True, layers: int = 3,
         mesh=None, steps: int = 2) -> dict:
    """``steps`` training steps (gather the embedding/head for the step, ``run_layers``,
    update, ``zero_grads``) under the buffer probe and the collective counters; what the
    estimate predicts for the same plan, beside them."""
    cfg = GPTConfig(layers=layers)
    opt = optimizer_for(optimizer, meta_params(cfg))
    spec, shards, toks = _model(cfg, opt, mesh or dist.get_world_size())
    with BufferBytes().track(shards) as live:
        state = opt.init(shards, spec)
        live.track(state_tensors(state))
        for _ in range(steps):
            reset_counts()
            io = vfsdp.gather(shards["io"], spec["io"], param_dtype=dtype, grads="buffer")
            h = vfsdp.run_layers(lambda p, x: block(p, x, cfg), shards["layers"],
                                 spec["layers"], embed(io, toks), param_dtype=dtype,
                                 prefetch=prefetch, reshard_after_forward=reshard)
            head_loss(io, h, toks).backward()
            del io, h
            measured = dict(counts())
            state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
            live.track(state_tensors(state))
            vfsdp.zero_grads(shards, spec)
    est = vfsdp.estimate(spec, hw="h100", optimizer=optimizer, param_dtype=dtype,
                         prefetch=prefetch, reshard_after_forward=reshard,
                         rank=spec.units[()].world_size and _shard_rank(spec),
                         costs={(): LayerCost(0.0, 0),
                                ("layers",): LayerCost(0.0, 0)})
    buffers = est.memory["params"] + est.memory["optimizer"] + est.memory["gradients"] \
        + est.memory["buffers"]
    return {"measured_peak": live.peak, "predicted_peak": buffers,
            "measured_bytes": {k: v for k, v in measured.items() if k.endswith("_bytes")},
            "predicted_bytes": {f"{k}_bytes": v for k, v in est.comm_bytes.items() if v}}


def _shard_rank(spec) -> int:
    return dist.get_rank() % spec.world_size


def calibrated_step(steps: int = 15, batch: int = 4, repeats: int = 21) -> dict:
    """Calibrate this machine at this world size (``repeats`` per median), then time
    ``steps`` training steps of the example model (median, after a warm-up) beside what the
    estimate predicts from the calibrated profile and the layers' traced costs."""
    import statistics
    import time

    from vfsdp.estimation import layer_cost
    from vfsdp.estimation.calibrate import calibrate

    cfg = GPTConfig()
    tokens = batch * cfg.seq
    hw = calibrate(example_layer(tokens), repeats=repeats)
    opt = vfsdp.optim.adamw()
    params = meta_params(cfg)
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params, spec, init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    state = opt.init(shards, spec)
    g = torch.Generator().manual_seed(dist.get_rank())
    toks = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        io = vfsdp.gather(shards["io"], spec["io"], grads="buffer")
        h = vfsdp.run_layers(lambda p, x: block(p, x, cfg), shards["layers"], spec["layers"],
                             embed(io, toks))
        head_loss(io, h, toks).backward()
        del io, h
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        vfsdp.zero_grads(shards, spec)
        if i:
            times.append(time.perf_counter() - t0)
    full = {k: torch.empty(v.shape) for k, v in params["io"].items()}
    x = torch.empty(batch, cfg.seq, cfg.dim)
    costs = {("layers",): layer_cost(lambda p, h: block(p, h, cfg), params["layers"][0], x),
             (): layer_cost(lambda p, t: head_loss(p, embed(p, t), t), full, toks)}
    est = vfsdp.estimate(spec, hw=hw, optimizer="adamw", param_dtype=None,
                         tokens_per_rank=tokens, costs=costs)
    return {"measured": statistics.median(times), "predicted": est.step_s,
            "compute": est.compute_s, "exposed": est.exposed_comm_s, "opt": est.optimizer_s}


def tp_step(dtype=None) -> dict:
    """A steady TP x FSDP step (the second; dp=2 x tp=2, Megatron's placements): vfsdp's buffers and every
    collective measured beside the estimate of this tp index's plan, the layers' own
    all-reduces over ``tp`` included (``model_parallel="tp"``)."""
    from vfsdp.testing.models_tp import block_tp, tp_rule

    cfg = GPTConfig(layers=2)
    mesh = vfsdp.mesh(("dp", 2), ("tp", 2))
    opt = vfsdp.optim.adamw()
    spec = vfsdp.plan(meta_params(cfg), mesh, tp=tp_rule(cfg), tp_axis="tp",
                      granularity=opt.granularity)
    shards = vfsdp.shard(meta_params(cfg), spec, mesh=mesh,
                         init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    dp_rank = dist.get_rank() // 2
    toks = torch.randint(0, cfg.vocab, (2, 32), generator=torch.Generator().manual_seed(dp_rank))
    layer_specs = [spec["layers"][i] for i in range(cfg.layers)]
    with BufferBytes().track(shards) as live:
        state = opt.init(shards, spec)
        live.track(state_tensors(state))
        for _ in range(2):  # the second step is a steady one
            reset_counts()
            io = vfsdp.gather(shards["io"], spec["io"], param_dtype=dtype, grads="buffer")
            h = vfsdp.run_layers(lambda p, x: block_tp(p, x, cfg, mesh), shards["layers"],
                                 layer_specs, embed(io, toks), param_dtype=dtype)
            head_loss(io, h, toks).backward()
            del io, h
            measured = dict(counts())
            state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
            live.track(state_tensors(state))
            vfsdp.zero_grads(shards, spec)
    est = vfsdp.estimate(spec, hw="h100", optimizer="adamw", param_dtype=dtype,
                         rank=_shard_rank(spec), tokens_per_rank=toks.numel(),
                         model_parallel="tp",
                         costs={(): LayerCost(0.0, 0), ("layers",): LayerCost(0.0, 0)})
    # lax's sums agree on their shape first off CUDA only (on a GPU it would be a host sync
    # per sum): the estimate, of a GPU step, does not count that agreement
    return {"measured_peak": live.peak,
            "predicted_peak": sum(est.memory[k] for k in
                                  ("params", "optimizer", "gradients", "buffers")),
            "measured_bytes": {k: v for k, v in measured.items()
                               if k.endswith("_bytes") and k != "shape_exchange_bytes"},
            "predicted_bytes": {f"{k}_bytes": v for k, v in est.comm_bytes.items() if v}}


def accum_step(micro: int, dtype, reduce_dtype, layers: int = 3) -> dict:
    """One step of ``micro`` micro-batches, each but the last without a reduce
    (``grad_sync=False``), under the buffer probe; the estimate of the same step beside it."""
    cfg = GPTConfig(layers=layers)
    opt = vfsdp.optim.adamw()
    spec, shards, toks = _model(cfg, opt, dist.get_world_size())
    with BufferBytes().track(shards) as live:
        state = opt.init(shards, spec)
        live.track(state_tensors(state))
        for i in range(micro):
            kw = {"param_dtype": dtype, "reduce_dtype": reduce_dtype, "grad_sync": i == micro - 1}
            io = vfsdp.gather(shards["io"], spec["io"], grads="buffer", **kw)
            h = vfsdp.run_layers(lambda p, x: block(p, x, cfg), shards["layers"],
                                 spec["layers"], embed(io, toks), **kw)
            head_loss(io, h, toks).backward()
            del io, h
    est = vfsdp.estimate(spec, hw="h100", optimizer="adamw", param_dtype=dtype,
                         reduce_dtype=reduce_dtype, micro_batches=micro, grad_sync=False,
                         tokens_per_rank=64 * micro, rank=dist.get_rank(),
                         costs={(): LayerCost(0.0, 0), ("layers",): LayerCost(0.0, 0)})
    return {"measured_peak": live.peak, "predicted_peak": est.memory_per_rank
            - est.memory["activations"] - est.memory["cached"] - est.memory["comm_library"],
            "at": est.peak_at}
