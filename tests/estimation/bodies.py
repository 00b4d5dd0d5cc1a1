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
from vfsdp.testing.models import GPTConfig, block, embed, head_loss, init_rule, meta_params


def step(optimizer: str, dtype, prefetch: bool = True, reshard: bool = True, layers: int = 3,
         mesh=None, steps: int = 2) -> dict:
    """``steps`` training steps (gather the embedding/head for the step, ``run_layers``,
    update, ``zero_grads``) under the buffer probe and the collective counters; what the
    estimate predicts for the same plan, beside them."""
    cfg = GPTConfig(layers=layers)
    opt = optimizer_for(optimizer, meta_params(cfg))
    mesh = mesh or dist.get_world_size()
    spec = vfsdp.plan(meta_params(cfg), mesh, granularity=opt.granularity)
    shards = vfsdp.shard(meta_params(cfg), spec, init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    toks = torch.randint(0, cfg.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
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
