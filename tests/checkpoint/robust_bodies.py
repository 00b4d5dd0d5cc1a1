"""Rank bodies where only some ranks go wrong: every rank must raise, none may hang."""

from __future__ import annotations

import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt

P = {"a": torch.arange(3.0), "b": torch.arange(8.0)}   # on 2 ranks, rank 1 holds none of a


def _outcome(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def renamed_tree(path: str, save: bool):
    """A tree whose paths are not the spec's: shards matched exactly, empty pieces included."""
    spec = vfsdp.plan(P, dist.get_world_size())
    if save:
        sh = vfsdp.shard(P, spec)
        ckpt.save(path, {"A": sh["a"], "B": sh["b"]}, spec)
        return None
    sh = vfsdp.shard(P, spec, init_fn=lambda p, local, t: local.zero_())
    ckpt.load(path, {"A": sh["a"], "B": sh["b"]}, spec)
    full = vfsdp.gather(sh, spec)
    return torch.equal(full["a"], P["a"]) and torch.equal(full["b"], P["b"])


def one_rank_bad_leaf(path: str):
    spec = vfsdp.plan(P, dist.get_world_size())
    tree = {"p": vfsdp.shard(P, spec), "x": object() if dist.get_rank() == 1 else 1}
    return _outcome(ckpt.save, path, tree, spec)


def rename_collision(path: str):
    spec = vfsdp.plan(P, dist.get_world_size())
    sh = vfsdp.shard(P, spec)
    same = lambda name: "w"
    return (_outcome(ckpt.to_state_dict, sh, spec, rename=same),
            _outcome(ckpt.save_safetensors, path, sh, spec, rename=same))


def safetensors_unwritable(path: str):
    spec = vfsdp.plan(P, dist.get_world_size())
    return _outcome(ckpt.save_safetensors, path, vfsdp.shard(P, spec), spec)


def save_to(path: str, overwrite: bool = False):
    spec = vfsdp.plan(P, dist.get_world_size())
    return _outcome(ckpt.save, path, {"p": vfsdp.shard(P, spec)}, spec, overwrite=overwrite)


def load_from(path: str):
    spec = vfsdp.plan(P, dist.get_world_size())
    sh = vfsdp.shard(P, spec, init_fn=lambda p, local, t: local.zero_())
    out = _outcome(ckpt.load, path, {"p": sh}, spec)
    return out, vfsdp.checkpoint.to_state_dict(sh, spec)


def values(path: str, save: bool, like_step):
    spec = vfsdp.plan(P, dist.get_world_size())
    sh = vfsdp.shard(P, spec)
    if save:
        ckpt.save(path, {"p": sh, "step": 3}, spec)
        return None
    try:
        return ckpt.load(path, {"p": sh, "step": like_step}, spec)["step"]
    except ckpt.CheckpointError as exc:
        return str(exc)


def per_rank_state(path: str, save: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = vfsdp.plan(P, world)
    rng = torch.full((4,), float(rank)) if save else torch.zeros(4)
    tree = {"rng": ckpt.per_rank(rng, rank, world)}
    if save:
        ckpt.save(path, tree, spec)
        return None
    out = _outcome(ckpt.load, path, tree, spec)
    return out, rng.tolist()


def source_copy_fails():
    """The source's tensors pass the checks but cannot be read (meta): no rank hangs."""
    spec = vfsdp.plan(P, dist.get_world_size())
    sh = vfsdp.shard(P, spec)
    sd = {k: torch.empty_like(v, device="meta") for k, v in P.items()}
    return _outcome(ckpt.from_state_dict, sd if dist.get_rank() == 0 else None, sh, spec)
