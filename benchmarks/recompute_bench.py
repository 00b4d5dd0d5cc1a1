"""Activation checkpointing: peak memory and step time without it, with ``recompute="full"``
and with ``recompute="selective"``, next to ``vfsdp.estimate``'s prediction.

A LLaMA from a small config (no download) trains on 2 simulated ranks with
``apply.run_layers``; each rank's step (forward, backward, AdamW) is measured on rank 0:

* peak MiB: the most bytes live during the step above what was live before it
  (``vfsdp.testing.memory.LiveBytes``: activations, gathered units, gradients' staging);
* step ms: the median of ``--steps`` steps after one warm-up step;
* predicted: ``vfsdp.estimate(spec, recompute=...)``'s activations (``memory["activations"]``,
  fp32, the same tokens per rank), and its compute time relative to no checkpointing (the
  estimate models ``recompute=True`` as full checkpointing; selective has no prediction).

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

import vfsdp
from vfsdp.testing import simulate
from vfsdp.testing.memory import LiveBytes

MODES = (None, "full", "selective")


def _config(args):
    import transformers as tf

    return tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                          num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                          max_position_embeddings=args.seq, use_cache=False)


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
    for mode in MODES:
        policy = vfsdp.Policy(recompute=mode)
        times, peak = [], 0
        for step in range(args.steps + 1):
            vfsdp.zero_grads(shards, spec)
            dist.barrier()
            start = time.perf_counter()
            with LiveBytes() as live:
                loss = apply.run_layers(shards, spec, input_ids=tokens, labels=tokens,
                                        policy=policy).loss
                loss.backward()
                del loss
            opt_state = opt.update(vfsdp.grads(shards, spec), opt_state, shards, spec)
            dist.barrier()
            if step:  # the first builds what later steps reuse
                times.append(time.perf_counter() - start)
                peak = max(peak, live.peak)
        rows[mode] = (peak, statistics.median(times))
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
    rows, spec = simulate(2, _rank, args, state, timeout=1800)[0]
    tokens = args.batch * args.seq
    est = {r: vfsdp.estimate(spec, hw="h100", param_dtype=None, tokens_per_rank=tokens,
                             seq=args.seq, recompute=r) for r in (False, True)}
    base_ms = rows[None][1]
    print(f"LLaMA hidden={args.hidden} layers={args.layers} seq={args.seq} "
          f"batch={args.batch}/rank, W=2 (simulate), fp32, {args.threads} thread(s)/rank\n")
    print("| recompute | peak MiB | step ms | vs none | predicted activations MiB "
          "| predicted compute vs none |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        peak, t = rows[mode]
        pred = est[mode is not None] if mode != "selective" else None
        act = f"{pred.memory['activations'] / 2**20:.1f}" if pred else "n/a"
        ratio = f"{pred.compute_s / est[False].compute_s:.2f}" if pred else "n/a"
        print(f"| {mode or 'none'} | {peak / 2**20:.1f} | {t * 1e3:.1f} | "
              f"{t / base_ms:.2f} | {act} | {ratio} |")


if __name__ == "__main__":
    main()
