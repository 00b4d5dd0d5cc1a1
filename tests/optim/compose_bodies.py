"""Bodies for the composition tests (module-level: they run under simulate and spawn)."""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt
from vfsdp.optim import adamw, adamw8bit, chain, clip_by_global_norm, muon, partition
from vfsdp.optim.base import both


def params():
    g = torch.Generator().manual_seed(3)
    return {"embed": torch.randn(50, 24, generator=g),
            "layers": [{"wq": torch.randn(24, 24, generator=g),
                        "w_up": torch.randn(24, 40, generator=g),
                        "w_down": torch.randn(40, 24, generator=g), "norm": torch.ones(24)}
                       for _ in range(3)]}


def is_matrix(path) -> bool:
    return path[0] == "layers" and str(path[-1]).startswith("w")


def first_layer(path) -> bool:
    return path[0] == "layers" and path[1] == 0


def label(path) -> str:
    return "m" if is_matrix(path) else "a"


def _m(path):
    return label(path) == "m"


def _a(path):
    return label(path) == "a"


def _mk_muon():
    return muon(lr=0.02, weight_decay=0.01, wave_size=2)


def _mk_adamw():
    return adamw(lr=1e-2, weight_decay=0.1)


def _mk_8bit():
    return adamw8bit(lr=1e-2, min_8bit_numel=256)


def composed(kind: str):
    """``(composed optimizer, [(member, mask), ...] applied by hand in the same order)``."""
    if kind == "partition_of_chains":
        opt = partition({"m": chain(clip_by_global_norm(0.5), _mk_muon()),
                         "a": chain(clip_by_global_norm(0.3), _mk_adamw())}, label)
        hand = [(clip_by_global_norm(0.5), _m), (_mk_muon(), _m),
                (clip_by_global_norm(0.3), _a), (_mk_adamw(), _a)]
    elif kind == "chain_of_partition":
        opt = chain(clip_by_global_norm(1.0),
                    partition({"m": _mk_8bit(), "a": _mk_adamw()}, label))
        hand = [(clip_by_global_norm(1.0), None), (_mk_8bit(), _m), (_mk_adamw(), _a)]
    elif kind == "nested_partition":
        inner = partition({"m": _mk_muon(), "a": chain(clip_by_global_norm(0.2), _mk_adamw())},
                          label)
        opt = partition({"x": inner, "y": _mk_8bit()},
                        lambda p: "x" if not first_layer(p) else "y")
        not_first = lambda p: not first_layer(p)
        hand = [(_mk_muon(), both(not_first, _m)),
                (clip_by_global_norm(0.2), both(not_first, _a)),
                (_mk_adamw(), both(not_first, _a)), (_mk_8bit(), first_layer)]
    else:
        raise ValueError(kind)
    return opt, hand


def _grads(spec, rank, step):
    g = torch.Generator().manual_seed(100 + step)
    full = optree.tree_map(lambda t: torch.randn(t.shape, generator=g), params())
    return optree.tree_map(lambda t, s: t.reshape(-1)[slice(*s.local_range(rank))].clone(),
                           full, spec.tree)


def run(kind: str, by_hand: bool, steps: int = 3, mesh=None):
    """Final full parameters after ``steps`` updates, composed or by hand."""
    opt, hand = composed(kind)
    spec = vfsdp.plan(params(), mesh or dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec)
    rank = dist.get_rank() % spec.world_size
    if by_hand:
        states = [member.init(shards, spec, mask=mask) for member, mask in hand]
    else:
        state = opt.init(shards, spec)
    for step in range(1, steps + 1):
        grads = _grads(spec, rank, step)
        if by_hand:
            states = [member.update(grads, s, shards, spec)
                      for (member, _), s in zip(hand, states)]
        else:
            state = opt.update(grads, state, shards, spec)
    full = vfsdp.gather(shards, spec)
    return [t.detach().reshape(-1).tolist() for t in optree.tree_leaves(full)]


def masked_clip(max_norm: float):
    """clip_grad_norm with a mask: the norm of the subset, only the subset scaled."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    rank = dist.get_rank()
    grads = _grads(spec, rank, 1)
    before = optree.tree_map(torch.clone, grads)
    norm = vfsdp.clip_grad_norm(grads, spec, max_norm, mask=is_matrix)
    pairs = list(zip(optree.tree_leaves(grads), optree.tree_leaves(before), spec.tensors()))
    untouched = all(torch.equal(a, b) for a, b, t in pairs if not is_matrix(t.path))
    # torch's clip_grad_norm_: scaled by max_norm / (norm + 1e-6) when that is below 1
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    scaled = all(torch.allclose(a, b * coef, rtol=1e-6, atol=0) for a, b, t in pairs
                 if is_matrix(t.path))
    return float(norm), untouched, scaled, coef


def subset_norm() -> float:
    g = torch.Generator().manual_seed(101)
    full = optree.tree_map(lambda t: torch.randn(t.shape, generator=g), params())
    paths, leaves, _ = optree.tree_flatten_with_path(full)
    return float(sum(t.double().pow(2).sum() for p, t in zip(paths, leaves) if is_matrix(p)) ** 0.5)


def save_composed(path: str, kind: str, steps: int):
    """Train ``steps`` composed updates, save params and state; return the exported state."""
    opt, _ = composed(kind)
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec)
    state = opt.init(shards, spec)
    for step in range(1, steps + 1):
        state = opt.update(_grads(spec, dist.get_rank(), step), state, shards, spec)
    tree = {"params": shards, "opt": state}
    ckpt.save(path, tree, spec)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v
            for k, v in ckpt.to_state_dict(tree, spec).items()}


def load_composed(path: str, kind: str):
    """Load into a fresh composed state on this world size; return the exported state."""
    opt, _ = composed(kind)
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec, init_fn=lambda p, local, t: local.zero_())
    tree = ckpt.load(path, {"params": shards, "opt": opt.init(shards, spec)}, spec)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v
            for k, v in ckpt.to_state_dict(tree, spec).items()}
