"""Rank bodies for export/import and DTensor interop tests."""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt
from tests.checkpoint import bodies
from tests.testing.models import TorchGPT
from vfsdp.testing import GatheredProbe
from vfsdp.testing.models import GPTConfig, init_rule, loss_fn, meta_params

CFG = GPTConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=48, seq=16)


def export_into_module():
    """to_state_dict -> plain nn.Module: same loss, bitwise; one unit gathered at a time."""
    spec = vfsdp.plan(meta_params(CFG), dist.get_world_size())
    shards = vfsdp.shard(meta_params(CFG), spec, init_fn=vfsdp.init.sharded(init_rule(CFG), 0))
    probe = GatheredProbe()
    with probe:
        sd = ckpt.to_state_dict(shards, spec)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq), generator=g)
    targets = torch.randint(0, CFG.vocab, (2, CFG.seq), generator=g)
    full = vfsdp.gather(shards, spec)
    want = loss_fn(full, tokens, targets, CFG).detach()
    vfsdp.release(shards, spec)
    if dist.get_rank() != 0:
        return sd, probe.peak_units
    model = TorchGPT(CFG)
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        got = model(tokens, targets)
    return (sorted(sd), torch.equal(got, want), float(got), float(want)), probe.peak_units


def state_dict_roundtrip(src_world_sd):
    """from_state_dict (rank 0 holds a full state dict of every entry) into this world size."""
    like = {"step": 0, "note": "", "lr_scale": 0.0, "rng": torch.zeros(5, dtype=torch.long)}
    spec = None
    for name in ("adamw", "adamw8bit", "muon"):
        spec, shards, states = bodies.blank(dist.get_world_size(), (name,))
        like[name] = {"params": shards, "opt": states[name]}
    sd = src_world_sd if dist.get_rank() == 0 else None
    tree = ckpt.from_state_dict(sd, like, spec)
    assert tree["note"] == "hello" and tree["adamw"]["opt"].step == 3
    return bodies.full_dict(tree, spec)


def from_state_dict_errors():
    spec, shards, _ = bodies.blank(dist.get_world_size(), ())
    paths, leaves, _ = optree.tree_flatten_with_path(bodies.params())
    sd = ({".".join(map(str, p)): v for p, v in zip(paths, leaves)}
          if dist.get_rank() == 0 else None)
    out = []
    for mutate in ("missing", "shape", "unused"):
        bad = None
        if sd is not None:
            bad = dict(sd)
            if mutate == "missing":
                del bad["head"]
            elif mutate == "shape":
                bad["head"] = torch.zeros(3, 3)
            else:
                bad["extra"] = torch.zeros(1)
        try:
            ckpt.from_state_dict(bad, shards, spec)
            out.append("loaded")
        except ckpt.CheckpointError as exc:
            out.append(str(exc))
    ckpt.from_state_dict(sd, shards, spec)
    return out, bodies.full_dict(shards, spec)


def write_safetensors(path: str):
    tree = {"params": vfsdp.shard(bodies.params(), bodies.make_spec(dist.get_world_size())),
            "step": 7}
    spec = bodies.make_spec(dist.get_world_size())
    probe = GatheredProbe()
    with probe:
        ckpt.save_safetensors(path, tree, spec, metadata={"model": "test"})
    return bodies.full_dict(tree, spec), probe.peak_units


def read_safetensors(path: str):
    spec, shards, _ = bodies.blank(dist.get_world_size(), ())
    tree = ckpt.load_safetensors(path, {"params": shards, "step": 0}, spec)
    return tree["step"], bodies.full_dict(shards, spec)


def read_safetensors_error(path: str):
    spec, shards, _ = bodies.blank(dist.get_world_size(), ())
    try:
        ckpt.load_safetensors(path, {"params": shards, "step": 0}, spec)
    except ckpt.CheckpointError as exc:
        return str(exc)
    return "loaded"
