"""Training bodies (module-level, for simulate and spawn) and their single-process references."""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import slot_of
from vfsdp.testing import GatheredProbe

D, L, B = 12, 3, 4


def init_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "root": {"inp": torch.randn(D, D, generator=g) / D ** 0.5,
                 "out": torch.randn(D, D, generator=g) / D ** 0.5},
        "layers": [{"w": torch.randn(D, D, generator=g) / D ** 0.5, "b": torch.zeros(D),
                    "norm": torch.ones(D)} for _ in range(L)],
    }


def layer(p: dict, h: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(h @ p["w"] + p["b"])
    return h * p["norm"] / (h.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()


def data(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)


def no_decay(path) -> bool:
    return path[-1] not in ("b", "norm")


def make_opt():
    return vfsdp.optim.adamw(lr=vfsdp.optim.warmup_cosine(3e-2, 2, 10), weight_decay=0.1,
                             weight_decay_mask=no_decay)


def train(steps: int, micro: int, accumulate: str, mesh_shape=None, param_dtype=None,
          reduce_dtype=None, clip=None):
    """vfsdp training; returns (losses, final full parameters as nested lists, peak units)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = init_params()
    spec = vfsdp.plan(params, mesh_shape or world, comm_dtypes=[torch.bfloat16])
    shards = vfsdp.shard(params, spec)
    opt = make_opt()
    state = opt.init(shards, spec)
    layer_specs = [spec["layers"][i] for i in range(L)]
    losses, probe = [], GatheredProbe()
    for step in range(1, steps + 1):
        vfsdp.zero_grads(shards, spec)
        total = 0.0
        for j in range(micro):
            sync = accumulate != "last" or j == micro - 1
            opts = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "grad_sync": sync,
                    "accumulate_grads": True if accumulate == "every" else None}
            x, y = data(step, rank, j)
            with probe:
                root = vfsdp.gather(shards["root"], spec["root"], grads="buffer",
                                    free_after_backward=True, **opts)
                h = x.to(param_dtype or torch.float32) @ root["inp"]
                h = vfsdp.run_layers(layer, shards["layers"], layer_specs, h, **opts)
                loss = ((h @ root["out"]).float() - y).pow(2).mean() / micro
                loss.backward()
            total += loss.item()
        grads = vfsdp.grads(shards, spec)
        if clip is not None:
            vfsdp.clip_grad_norm(grads, spec, clip)
        state = opt.update(grads, state, shards, spec)
        losses.append(total)
    full = vfsdp.gather(shards, spec)
    out = [t.detach().float().reshape(-1).tolist() for t in optree.tree_leaves(full)]
    vfsdp.release(shards, spec)
    return losses, out, probe.peak_units


def reference(steps: int, micro: int, world: int, clip=None):
    """One process, the same global batch: the mean over ranks and micro-batches."""
    params = init_params()
    leaves = optree.tree_leaves(params)
    paths = optree.tree_paths(params)
    for t in leaves:
        t.requires_grad_(True)
    decay = [p for p, path in zip(leaves, paths) if no_decay(path)]
    rest = [p for p, path in zip(leaves, paths) if not no_decay(path)]
    sched = vfsdp.optim.warmup_cosine(3e-2, 2, 10)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=sched(1), foreach=False)
    losses = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = sched(step)
        opt.zero_grad()
        total = 0.0
        for rank in range(world):
            for j in range(micro):
                x, y = data(step, rank, j)
                h = x @ params["root"]["inp"]
                for p in params["layers"]:
                    h = layer(p, h)
                loss = (h @ params["root"]["out"] - y).pow(2).mean() / micro / world
                loss.backward()
                total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(leaves, clip)
        opt.step()
        losses.append(total)
    return losses, [t.detach().reshape(-1).tolist() for t in leaves]


def clip_matches_torch(max_norm: float):
    """vfsdp.clip_grad_norm vs torch.nn.utils.clip_grad_norm_ on the unsharded gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = init_params()
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    x, y = data(1, rank, 0)
    full = vfsdp.gather(shards, spec, grads="buffer")
    h = x @ full["root"]["inp"]
    for p in full["layers"]:
        h = layer(p, h)
    (h @ full["root"]["out"] - y).pow(2).mean().backward()
    grads = vfsdp.grads(shards, spec)
    norm = vfsdp.clip_grad_norm(grads, spec, max_norm)
    clipped = [g.reshape(-1).tolist() for g in optree.tree_leaves(grads)]
    return float(norm), clipped


def layers_only_peak(reshard: bool, prefetch: bool = True):
    """Peak gathered units over forward and backward of a stack of layer units only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = {"layers": init_params()["layers"]}
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    x, y = data(1, rank, 0)
    probe = GatheredProbe()
    with probe:
        h = vfsdp.run_layers(layer, shards["layers"], [spec["layers"][i] for i in range(L)], x,
                             reshard_after_forward=reshard, prefetch=prefetch)
        (h - y).pow(2).mean().backward()
    units = {id(u): u for u in (slot_of(t).unit for t in optree.tree_leaves(shards))}
    gathered_after = sum(1 for u in units.values() if u.gathered())
    return probe.peak_units, gathered_after
