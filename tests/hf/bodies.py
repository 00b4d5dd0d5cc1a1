"""Rank bodies for the Hugging Face model tests (importable: vfsdp.testing.spawn runs them)."""

from __future__ import annotations

import os

import optree
import torch
import torch.distributed as dist

import vfsdp

STEPS, BATCH, SEQ, VOCAB = 5, 4, 8, 64
LR, WD = 1e-2, 0.1
# Adam divides by sqrt(v) + EPS: where the true gradient is zero (GPT-2's key bias, which
# softmax ignores) the gradient is rounding noise, and with eps=1e-8 that noise becomes a full
# step whose sign depends on the summation order (3e-5 apart after 5 steps). A larger EPS keeps
# such steps at rounding size; every other element is unaffected.
EPS = 1e-5


def config(kind: str):
    """A tiny config of a real architecture: GPT-2 (tied embeddings), LLaMA, Mixtral (MoE)."""
    import transformers as tf

    small = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}
    if kind == "gpt2":
        return tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=SEQ, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM", **small)
    common = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=SEQ, loss_type="ForCausalLM", **small)
    if kind == "llama":
        return tf.LlamaConfig(**common)
    if kind == "mixtral":
        return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    raise ValueError(kind)


def model(kind: str, meta: bool = False):
    import transformers as tf

    cls = {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM,
           "mixtral": tf.MixtralForCausalLM}[kind]
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return cls(config(kind))
    return cls(config(kind))


def tokens() -> torch.Tensor:
    """The global batch (every rank takes its share of the rows)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))


def train_one_process(kind: str) -> tuple[dict, torch.Tensor]:
    """Plain torch: the whole batch, ``torch.optim.AdamW``; the parameters by HF name, and the
    probe's logits."""
    net = model(kind)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    batch = tokens()
    for _ in range(STEPS):
        opt.zero_grad()
        net(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    with torch.no_grad():
        logits = net(input_ids=probe()).logits
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, logits


def train_ranks(kinds: list, out_dir: str) -> dict:
    """On each rank: functionalize, plan, shard; 5 steps with the blocks under run_layers and
    vfsdp's AdamW; export the result in Hugging Face form. Rank 0 returns, per model, the
    exported state dict and the probe's logits from the gathered parameters."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = {}
    for kind in kinds:
        net = model(kind)
        params, apply = vfsdp.functionalize(net)
        spec = vfsdp.plan(params, world, granularity=vfsdp.rows(1))
        shards = vfsdp.shard(params, spec)
        opt = vfsdp.optim.adamw(lr=LR, eps=EPS, weight_decay=WD)
        state = opt.init(shards, spec)
        batch = tokens()[mine]
        for _ in range(STEPS):
            vfsdp.zero_grads(shards, spec)
            apply.run_layers(shards, spec, input_ids=batch, labels=batch).loss.backward()
            state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        path = os.path.join(out_dir, kind)
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            net.config.save_pretrained(path)
        vfsdp.checkpoint.save_safetensors(os.path.join(path, "model.safetensors"), shards, spec)
        sd = vfsdp.checkpoint.to_state_dict(shards, spec)
        sharded = os.path.join(out_dir, f"{kind}-sharded")  # several files and an index
        if rank == 0:
            os.makedirs(sharded, exist_ok=True)
            net.config.save_pretrained(sharded)
        vfsdp.checkpoint.save_safetensors(sharded, shards, spec, max_shard_size=8192)
        meta, _ = vfsdp.functionalize(model(kind, meta=True))  # no memory until the shards
        zeros = vfsdp.init.sharded(vfsdp.init.rule(vfsdp.init.constant(0.0)))
        back = vfsdp.shard(meta, vfsdp.plan(meta, world, granularity=vfsdp.rows(1)),
                           init_fn=zeros)
        vfsdp.checkpoint.load_safetensors(sharded, back, spec)  # this rank's byte ranges
        same = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(back),
                                                     optree.tree_leaves(shards)))
        same = same and vfsdp.plan(meta, world, granularity=vfsdp.rows(1)) == spec
        with torch.no_grad():
            full = vfsdp.gather(shards, spec)
            logits = apply(full, input_ids=probe()).logits
            vfsdp.release(shards, spec)
        blocks = len(spec[apply.blocks[0]][apply.blocks[1]].units) if len(apply.blocks) == 2 \
            else None
        out[kind] = (sd, logits, apply.ties, blocks, same)
    return out if rank == 0 else {}
