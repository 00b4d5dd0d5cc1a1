"""Activation checkpointing: peak memory and step time without it, with
``Policy(recompute="full" | "selective")``, with Hugging Face's own switch and with a
``torch.utils.checkpoint`` written into the model's forward, next to ``vfsdp.estimate``'s
prediction.

A LLaMA from a small config (no download) trains on 2 simulated ranks, under
``apply.run_layers`` and under ``apply(vfsdp.gather(...))``; each rank's step (forward,
backward, AdamW) is measured on rank 0:

* peak MiB: the most bytes live during the step above what was live before it
  (``vfsdp.testing.memory.LiveBytes``: activations, gathered units, gradients' staging);
* held MiB: the bytes live between the forward and the backward (what the graph keeps);
* step ms: the median of ``--steps`` steps after one warm-up step; "vs none": over the same
  path's step without checkpointing;
* predicted: ``vfsdp.estimate(spec, recompute=...)``'s activations (``memory["activations"]``,
  fp32, the same tokens per rank) and its compute time over no checkpointing's, for the mode
  it models (Hugging Face's switch checkpoints each block: ``"full"``).

Rows: ``hf`` is ``model.activation_checkpointing_enable()`` (transformers 5's name for
``gradient_checkpointing_enable()``: a non-reentrant ``torch.utils.checkpoint`` around each
decoder layer's call); ``stack`` replaces the decoder's
forward by ``checkpoint(decoder.forward, ...)``: one checkpoint around the embedding, every
block and the final norm.

    python benchmarks/recompute_bench.py
    python benchmarks/recompute_bench.py --hidden 512 --layers 8 --seq 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import vfsdp
from vfsdp.testing import simulate
from vfsdp.testing.memory import LiveBytes

# (path, how): how is a Policy(recompute=) value, "hf" or "stack"
MODES = (("run_layers", None), ("run_layers", "full"), ("run_layers", "selective"),
         ("run_layers", "hf"), ("run_layers", "stack"),
         ("gather", None), ("gather", "hf"), ("gather", "stack"))
PREDICTED = {None: False, "full": "full", "selective": "selective", "hf": "full"}


def _config(args):
    import transformers as tf

    return tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                          num_attention_heads=max(args.hidden // 64, 1),
                          num_key_value_heads=max(args.hidden // 64, 1),
                          max_position_embeddings=args.seq, use_cache=False)


def _switch(net, how) -> None:
    """Hugging Face's checkpointing on for ``"hf"``; the decoder checkpointed whole for
    ``"stack"``; neither otherwise."""
    if how == "hf":
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        net.activation_checkpointing_disable()
    decoder = net.model
    decoder.__dict__.pop("forward", None)
    if how == "stack":
        whole = decoder.forward
        decoder.forward = lambda *a, **k: checkpoint(whole, *a, use_reentrant=False, **k)


def _rank(args, state):
    import transformers as tf

    torch.set_num_threads(args.threads)
    net = tf.LlamaForCausalLM(_config(args))
    net.load_state_dict(state)
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.adamw(lr=1e-3)
    opt_state = opt.init(shards, spec)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    rows = {}
    for path, how in MODES:
        _switch(net, how)
        policy = vfsdp.Policy(recompute=how if how in ("full", "selective") else None)
        times, peak, held = [], 0, 0
        for step in range(args.steps + 1):
            vfsdp.zero_grads(shards, spec)
            dist.barrier()
            start = time.perf_counter()
            with LiveBytes() as live:
                if path == "run_layers":
                    loss = apply.run_layers(shards, spec, input_ids=tokens, labels=tokens,
                                            policy=policy).loss
                else:
                    loss = apply(vfsdp.gather(shards, spec), input_ids=tokens,
                                 labels=tokens).loss
                kept = live.current
                loss.backward()
                del loss
            opt_state = opt.update(vfsdp.grads(shards, spec), opt_state, shards, spec)
            dist.barrier()
            if step:  # the first builds what later steps reuse
                times.append(time.perf_counter() - start)
                peak, held = max(peak, live.peak), max(held, kept)
        rows[path, how] = (peak, held, statistics.median(times))
    return rows, spec


def main() -> None:
    import transformers as tf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    state = tf.LlamaForCausalLM(_config(args)).state_dict()
    rows, spec = simulate(2, _rank, args, state, timeout=3600)[0]
    est = {r: vfsdp.estimate(spec, hw="h100", param_dtype=None, tokens_per_rank=args.batch *
                             args.seq, seq=args.seq, recompute=r) for r in set(PREDICTED.values())}
    print(f"LLaMA hidden={args.hidden} layers={args.layers} seq={args.seq} "
          f"batch={args.batch}/rank, W=2 (simulate), fp32, {args.threads} thread(s)/rank\n")
    print("| path | checkpointing | peak MiB | held MiB | step ms | vs none "
          "| predicted activations MiB | predicted compute vs none |")
    print("|---|---|---|---|---|---|---|---|")
    for path, how in MODES:
        peak, held, t = rows[path, how]
        pred = est[PREDICTED[how]] if how in PREDICTED else None
        act = f"{pred.memory['activations'] / 2**20:.1f}" if pred else "n/a"
        ratio = f"{pred.compute_s / est[False].compute_s:.2f}" if pred else "n/a"
        label = {None: "none", "hf": "HF activation_checkpointing_enable()",
                 "stack": "checkpoint(decoder)"}.get(how, f"Policy(recompute={how!r})")
        where = "apply.run_layers" if path == "run_layers" else "apply(vfsdp.gather(...))"
        print(f"| {where} | {label} | {peak / 2**20:.1f} | {held / 2**20:.1f} | "
              f"{t * 1e3:.1f} | {t / rows[path, None][2]:.2f} | {act} | {ratio} |")


if __name__ == "__main__":
    main()
