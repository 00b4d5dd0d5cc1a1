"""Train a Hugging Face causal LM with vfsdp on gloo processes, and export it for from_pretrained.

The model is built from a small config (nothing is downloaded): GPT-2 (tied embeddings),
LLaMA or Mixtral (MoE). Each rank functionalizes its own module, plans with the optimizer's
granularity, runs the decoder blocks under ``run_layers`` with gradient accumulation, clips,
updates with AdamW or 8-bit AdamW, and the result is written in Hugging Face's form. The same
steps in one plain-torch process (``torch.optim.AdamW``) give the same losses::

    python examples/train_hf.py --model gpt2 --world-size 2 --steps 20
    python examples/train_hf.py --model mixtral --world-size 4 --optim adamw8bit --out runs/hf
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import spawn


def config(args):
    import transformers as tf

    common = {"vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1, "loss_type": "ForCausalLM"}
    if args.model == "gpt2":
        return tf.GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=4, n_positions=args.seq,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    sizes = {"num_hidden_layers": args.layers, "hidden_size": args.dim,
             "intermediate_size": 2 * args.dim, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": args.seq, **common}
    if args.model == "llama":
        return tf.LlamaConfig(**sizes)
    return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **sizes)


def build(args):
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config(args))


def batches(args) -> torch.Tensor:
    """``[steps, micro, global batch, seq + 1]`` windows of a text that ships with Python."""
    with open(os.__file__, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, data.numel() - args.seq - 1,
                           (args.steps, args.micro, args.batch), generator=g)
    return data[starts[..., None] + torch.arange(args.seq + 1)]


def train(args) -> list:
    """One rank: its rows of every batch; returns the mean loss of each step over the ranks."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args)
    params, apply = vfsdp.functionalize(model)
    factory = {"adamw": vfsdp.optim.adamw, "adamw8bit": vfsdp.optim.adamw8bit}[args.optim]
    opt = factory(lr=args.lr, weight_decay=0.1)
    spec = vfsdp.plan(params, world, granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    state = opt.init(shards, spec)
    mine = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    losses = []
    for step_data in batches(args):
        vfsdp.zero_grads(shards, spec)
        total = torch.zeros(())
        for micro, window in enumerate(step_data):
            x, y = window[mine, :-1], window[mine, 1:]
            policy = vfsdp.Policy(grad_sync=micro == args.micro - 1)
            logits = apply.run_layers(shards, spec, input_ids=x, policy=policy).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            (loss / args.micro).backward()
            total += loss.detach() / args.micro
        grads = vfsdp.grads(shards, spec)
        vfsdp.clip_grad_norm(grads, spec, 1.0)
        state = opt.update(grads, state, shards, spec)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        model.config.save_pretrained(args.out)
    vfsdp.checkpoint.save_safetensors(args.out, shards, spec, max_shard_size=args.shard_bytes)
    with torch.no_grad():
        probe = apply(vfsdp.gather(shards, spec), input_ids=batches(args)[0, 0, :, :-1]).logits
    return [losses, probe]


def one_process(args) -> list:
    """The same steps in plain torch: the whole batch, ``torch.optim.AdamW``."""
    torch.set_num_threads(1)
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    losses = []
    for step_data in batches(args):
        opt.zero_grad()
        total = 0.0
        for window in step_data:
            logits = model(input_ids=window[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
            (loss / args.micro).backward()
            total += loss.item() / args.micro
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt2", "llama", "mixtral"], default="gpt2")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=4, help="global batch (rows per micro-batch)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optim", choices=["adamw", "adamw8bit"], default="adamw")
    ap.add_argument("--shard-bytes", type=int, default=None,
                    help="max bytes per safetensors file (sharded form with an index)")
    ap.add_argument("--out", default=None, help="export directory (default: a temporary one)")
    args = ap.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="vfsdp-hf-")
    losses, probe = spawn(train, args.world_size, args)[0]
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.4f}")
    if args.optim == "adamw":
        ref = one_process(args)
        worst = max(abs(a - b) for a, b in zip(losses, ref))
        print(f"max |loss - single-process loss| = {worst:.2e} over {len(losses)} steps")
    import transformers as tf

    loaded = tf.AutoModelForCausalLM.from_pretrained(args.out)
    torch.set_num_threads(1)
    with torch.no_grad():
        again = loaded(input_ids=batches(args)[0, 0, :, :-1]).logits
    print(f"exported to {args.out}; from_pretrained logits differ by "
          f"{(again - probe).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
