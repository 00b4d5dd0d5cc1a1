"""Rank bodies for tests/hf/test_matrix.py: 16 architectures from tiny configs (no downloads),
trained on 2 ranks under ``apply(vfsdp.gather(...))`` and ``apply.run_layers``, with and
without gradient checkpointing, exported and read back."""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

import vfsdp

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 64
LR, WD, EPS = 1e-2, 0.1, 1e-5  # EPS: see tests/hf/bodies.py
MODES = [(how, ckpt) for how in ("gather", "run_layers") for ckpt in (False, True)]

_DECODER = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": SEQ,
                "head_dim": 8, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}


def _configs() -> dict:
    import transformers as tf

    d = _DECODER
    moe = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}
    window = {"sliding_window": 4}
    return {  # kind: (model class, config)
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**d)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**d, **window)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(
            **d, use_sliding_window=True, max_window_layers=1, **window)),
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config(**d)),
        "qwen3_moe": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **d, num_experts=4, moe_intermediate_size=8, **moe)),
        "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig(**d, num_local_experts=4, **moe)),
        "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig(**d)),
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(**d, **window)),
        "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **d, **window, sliding_window_pattern=2)),
        "phi3": (tf.Phi3ForCausalLM, tf.Phi3Config(**{**d, "pad_token_id": 0})),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=VOCAB, n_layer=2, n_embd=16, n_head=2, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)),
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=SEQ, bos_token_id=0,
            eos_token_id=1)),
        "olmo": (tf.OlmoForCausalLM, tf.OlmoConfig(**{**d, "pad_token_id": 0})),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            image_size=8, patch_size=4, num_channels=3, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)),
    }


KINDS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma2",
         "gemma3", "phi3", "gpt2", "gpt_neox", "olmo", "bert", "t5", "vit"]


_INITIAL: dict = {}
# transformers swaps torch.nn.init's functions for guarded ones while it builds a model and
# puts back what it found: two rank threads building at once can leave the guarded ones in
# place for the process (simulate's per-rank seeding of later tests then breaks)
_BUILD = threading.Lock()


#: State-dict names a tie leaves out of vfsdp's export (written once, under the other name)
TIED = {kind: set() for kind in KINDS} | {
    "gpt2": {"lm_head.weight"}, "gemma": {"lm_head.weight"}, "gemma2": {"lm_head.weight"},
    "gemma3": {"lm_head.weight"}, "bert": {"cls.predictions.decoder.weight",
                                           "cls.predictions.decoder.bias"},
    "t5": {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}}


def model(kind: str, meta: bool = False):
    """The kind's model with its seeded initial values. Ranks that are threads share one
    RNG, so those values are made once and loaded (persistent buffers included)."""
    cls, config = _configs()[kind]
    with _BUILD:
        if meta:
            with torch.device("meta"):
                return cls(config)
        if kind not in _INITIAL:
            torch.manual_seed(0)
            _INITIAL[kind] = cls(config).state_dict()
        net = cls(config)
    net.load_state_dict(_INITIAL[kind])
    return net


def batch(kind: str, rows: slice = slice(None)) -> dict:
    """The global batch's ``rows`` as the model's keyword inputs (labels included)."""
    g = torch.Generator().manual_seed(1)
    if kind == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, 8, 8, generator=g)[rows],
                "labels": torch.randint(0, 3, (BATCH,), generator=g)[rows]}
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)[rows]
    if kind == "t5":
        return {"input_ids": ids, "labels": ids.flip(1)}
    return {"input_ids": ids, "labels": ids}


def loss_of(out) -> torch.Tensor:
    """The loss (with the MoE's auxiliary loss: the routers' outputs captured by hooks)."""
    return out.loss


def train_one_process(kind: str, world: int = 2) -> dict:
    """Plain torch, ``torch.optim.AdamW``: each step's loss the mean of the ``world`` ranks'
    (a MoE's load-balancing loss is not one of the whole batch's); the state dict after
    STEPS."""
    net = model(kind)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    parts = [batch(kind, slice(r * BATCH // world, (r + 1) * BATCH // world))
             for r in range(world)]
    for _ in range(STEPS):
        opt.zero_grad()
        (sum(loss_of(net(**inputs)) for inputs in parts) / world).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def train_ranks(kind: str, out_dir: str) -> dict:
    """On each rank, for each mode: STEPS of vfsdp's AdamW on this rank's rows; rank 0
    returns ``{mode: state dict}``. The last mode's result is exported (one file and a
    sharded directory) for ``from_pretrained`` and the 3-rank read-back."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = {}
    for how, ckpt in MODES:
        net = model(kind)
        if ckpt:  # reentrant, as transformers 4 did by default: run non-reentrant by vfsdp
            net.activation_checkpointing_enable({"use_reentrant": True})
        net.train()
        params, apply = vfsdp.functionalize(net)
        spec = vfsdp.plan(params, world, granularity=vfsdp.rows(1))
        shards = vfsdp.shard(params, spec)
        opt = vfsdp.optim.adamw(lr=LR, eps=EPS, weight_decay=WD)
        state = opt.init(shards, spec)
        inputs = batch(kind, rows)
        for _ in range(STEPS):
            vfsdp.zero_grads(shards, spec)
            if how == "gather":
                loss_of(apply(vfsdp.gather(shards, spec), **inputs)).backward()
                vfsdp.release(shards, spec)
            else:
                loss_of(apply.run_layers(shards, spec, **inputs)).backward()
            state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        out[(how, ckpt)] = vfsdp.checkpoint.to_state_dict(apply.state_tree(shards), spec)
    path, sharded = os.path.join(out_dir, kind), os.path.join(out_dir, f"{kind}-sharded")
    if rank == 0:
        for p in (path, sharded):
            os.makedirs(p, exist_ok=True)
            net.config.save_pretrained(p)
    tree = apply.state_tree(shards)
    vfsdp.checkpoint.save_safetensors(os.path.join(path, "model.safetensors"), tree, spec)
    vfsdp.checkpoint.save_safetensors(sharded, tree, spec, max_shard_size=4096)
    return out if rank == 0 else {}


def read_back(kinds: list, out_dir: str, source: str) -> dict:
    """At this world size: each kind's checkpoint in ``out_dir/<kind><source>`` read into
    zeroed shards of a meta-built model; rank 0 returns ``{kind: state dict}``."""
    out = {}
    for kind in kinds:
        meta = model(kind, meta=True)
        params, apply = vfsdp.functionalize(meta)
        apply.buffers = {k: torch.zeros(b.shape, dtype=b.dtype) for k, b in apply.buffers.items()}
        spec = vfsdp.plan(params, dist.get_world_size(), granularity=vfsdp.rows(1))
        zeros = vfsdp.init.sharded(vfsdp.init.rule(vfsdp.init.constant(0.0)))
        shards = vfsdp.shard(params, spec, init_fn=zeros)
        tree = apply.state_tree(shards)
        rename = apply.saved_names() if source == "" else None  # save_pretrained's names
        vfsdp.checkpoint.load_safetensors(os.path.join(out_dir, kind + source), tree, spec,
                                          rename=rename)
        out[kind] = vfsdp.checkpoint.to_state_dict(tree, spec)
    return out if dist.get_rank() == 0 else {}
