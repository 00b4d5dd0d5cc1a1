"""Rank bodies for tests/hf/test_checkpoints.py: tiny MoE models (no downloads)."""

from __future__ import annotations

import os

import optree
import torch
import torch.distributed as dist

import vfsdp


def model(kind: str, meta: bool = False):
    """A tiny Mixtral or Qwen3-MoE (4 experts, 2 layers), seeded."""
    import transformers as tf

    small = {"vocab_size": 64, "num_hidden_layers": 2, "hidden_size": 16,
             "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 8}
    if kind == "mixtral":
        cls, config = tf.MixtralForCausalLM, tf.MixtralConfig(num_local_experts=4,
                                                              num_experts_per_tok=2, **small)
    else:
        cls, config = tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, **small)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def load(kind: str, path: str) -> dict:
    """``save_pretrained``'s checkpoint read into zeroed shards of a meta-built model; the
    full state dict on rank 0."""
    params, _ = vfsdp.functionalize(model(kind, meta=True))
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec, init_fn=lambda p, local, t: local.zero_())
    vfsdp.checkpoint.load_safetensors(path, shards, spec)
    return vfsdp.checkpoint.to_state_dict(shards, spec)


def export(kind: str, state: dict, path: str, layout, max_shard_size=None) -> None:
    """The model with ``state`` (ranks are threads: one global RNG), sharded and exported with
    ``hf_layout=layout`` into directory ``path``."""
    net = model(kind)
    net.load_state_dict(state)
    params, _ = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        net.config.save_pretrained(path)
    target = path if max_shard_size else os.path.join(path, "model.safetensors")
    vfsdp.checkpoint.save_safetensors(target, shards, spec, hf_layout=layout,
                                      max_shard_size=max_shard_size)


def load_ep(kind: str, path: str) -> tuple:
    """``save_pretrained``'s checkpoint read into an expert-parallel plan (2 data x 2 ep
    ranks): ``(ep index, {name: this rank's gathered piece})``, each rank reading only the
    bytes of its experts from the per-expert tensors."""
    from torch.distributed.tensor import Replicate, Shard

    params, _ = vfsdp.functionalize(model(kind, meta=True))
    mesh = vfsdp.mesh(("dp", 2), ("ep", 2))
    rule = lambda p: Shard(0) if p[-1] in ("gate_up_proj", "down_proj") else Replicate()
    spec = vfsdp.plan(params, mesh, tp=rule, tp_axis="ep")
    shards = vfsdp.shard(params, spec, mesh=mesh, init_fn=lambda p, local, t: local.zero_())
    vfsdp.checkpoint.load_safetensors(path, shards, spec)
    with torch.no_grad():
        full = vfsdp.gather(shards, spec)
        got = {".".join(map(str, p)): t.clone() for p, t in zip(
            optree.tree_paths(full), optree.tree_leaves(full))}
        vfsdp.release(shards, spec)
    return spec.model_axis[2], got
