"""Eager vs ``torch.compile(fullgraph=True)`` vfsdp training steps, side by side in one run.

The example model (``examples/train_gpt.py``'s defaults: a LLaMA-style decoder) on gloo
processes; each rank runs the same hand-written step (gather the embedding/head unit,
``run_layers`` over the blocks, backward, clip, AdamW) eagerly on one copy of the shards and
compiled on another, alternating, and reports medians::

    python benchmarks/compile_bench.py                   # W=2, the example model
    python benchmarks/compile_bench.py --world 1 --steps 20 --dim 256 --layers 4

Columns: the first call's time (compile), the median step time after it, the peak memory a
step adds (resident memory sampled during the step, above its level before: compiled graphs
allocate outside the profiler's view), aten ops per step as the profiler sees them (a compiled
step's fused kernels are not aten ops; its matmuls and collectives are), and how many graphs
the steps compiled to (1: no recompiles).

``--cuda`` runs the GPU comparison instead: the 886M configuration, vfsdp eager, vfsdp compiled
and eager FSDP2, each under torchrun with NCCL (``benchmarks/gpu_vs_fsdp2.py --configs large
--systems vfsdp fsdp2 vfsdp_compiled``; ``--nproc`` ranks)::

    python benchmarks/compile_bench.py --cuda --nproc 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import optree
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import spawn
from vfsdp.testing.models import GPTConfig, block, embed, head_loss, init_rule, meta_params


def step_fn(spec, opt, cfg, param_dtype=None):
    """The example's training step, written so that it compiles whole (also used by
    ``gpu_vs_fsdp2.py``'s ``vfsdp_compiled`` system)."""
    layer_specs = spec["layers"]

    def step(shards, state, tokens, targets):
        vfsdp.zero_grads(shards, spec)
        io = vfsdp.gather(shards["io"], spec["io"], param_dtype=param_dtype)
        x = vfsdp.run_layers(lambda p, h: block(p, h, cfg), shards["layers"], layer_specs,
                             embed(io, tokens), param_dtype=param_dtype)
        loss = head_loss(io, x, targets)
        loss.backward()
        grads = vfsdp.grads(shards, spec)
        vfsdp.clip_grad_norm(grads, spec, 1.0)
        opt.update(grads, state, shards, spec)
        return loss.detach()

    return step


def _aten_ops(fn) -> int:
    """Aten ops the profiler sees while ``fn`` runs (a compiled graph's fused kernels are
    not aten ops; its matmuls and collectives are)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_growth(fn, repeats: int = 3) -> int:
    """Median over ``repeats`` runs of how far the process' resident memory rises above its
    level just before ``fn`` (sampled every 0.2 ms; the C heap trimmed first, so memory freed
    by earlier steps does not hide new allocations). Compiled graphs allocate outside the
    profiler's view, so both sides are measured this way."""
    import ctypes
    import threading

    libc = ctypes.CDLL("libc.so.6")
    out = []
    for _ in range(repeats):
        libc.malloc_trim(0)
        base = _rss()
        peak = [base]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.0002)

        t = threading.Thread(target=sample)
        t.start()
        fn()
        done.set()
        t.join()
        out.append(max(peak[0], _rss()) - base)
    return int(statistics.median(out))


def _run(args: argparse.Namespace) -> dict:
    from torch._dynamo.utils import counters

    cfg = GPTConfig(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                    ffn=args.ffn, seq=args.seq)
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = vfsdp.plan(meta_params(cfg), world)
    opt = vfsdp.optim.adamw(lr=1e-3, weight_decay=0.1)
    init = vfsdp.init.sharded(init_rule(cfg), 0)
    eager = vfsdp.shard(meta_params(cfg), spec, init_fn=init)
    compiled = vfsdp.shard(meta_params(cfg), spec, init_fn=init)
    se, sc = opt.init(eager, spec), opt.init(compiled, spec)
    step = step_fn(spec, opt, cfg)
    fast = torch.compile(step, fullgraph=True)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=g)
               for _ in range(args.steps)]
    times: dict = {"eager": [], "compiled": []}
    first: dict = {}
    losses: dict = {"eager": [], "compiled": []}
    for i, b in enumerate(batches):
        for name, fn, shards, state in (("eager", step, eager, se),
                                        ("compiled", fast, compiled, sc)):
            dist.barrier()
            t = time.perf_counter()
            loss = fn(shards, state, b[:, :-1], b[:, 1:])
            dt = time.perf_counter() - t
            losses[name].append(float(loss))
            if i == 0:
                first[name] = dt
            else:
                times[name].append(dt)
    b = batches[-1]
    mem = {}
    for name, fn, sh, st in (("eager", step, eager, se), ("compiled", fast, compiled, sc)):
        run = lambda fn=fn, sh=sh, st=st: fn(sh, st, b[:, :-1], b[:, 1:])
        mem[name] = (_peak_growth(run), _aten_ops(run))
    return {"first": first, "median": {k: statistics.median(v) for k, v in times.items()},
            "mem": mem, "graphs": counters["stats"]["unique_graphs"],
            "loss_gap": max(abs(a - c) for a, c in zip(losses["eager"], losses["compiled"])),
            "params": sum(t.numel() for t in optree.tree_leaves(meta_params(cfg)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--cuda", action="store_true",
                    help="the 886M configuration on GPUs, against eager FSDP2 (gpu_vs_fsdp2.py)")
    ap.add_argument("--nproc", type=int, default=1, help="with --cuda: ranks (GPUs)")
    args = ap.parse_args(argv)
    if args.cuda:
        if not torch.cuda.is_available():
            ap.error("--cuda needs CUDA GPUs (this machine has none); leave it out for the "
                     "CPU comparison")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_vs_fsdp2

        return gpu_vs_fsdp2.main(["--configs", "large", "--systems", "vfsdp", "fsdp2",
                                  "vfsdp_compiled", "--nproc", str(args.nproc),
                                  "--optimizers", "adamw"])
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the first compiles)")
    r = spawn(_run, args.world, args, timeout=1800)[0]
    e, c = r["median"]["eager"], r["median"]["compiled"]
    (me, oe), (mc, oc) = r["mem"]["eager"], r["mem"]["compiled"]
    print(f"example model, {r['params']:,} parameters, W={args.world} gloo processes, "
          f"{args.steps} steps (medians of the last {args.steps - 1})")
    print(f"{'':10} {'first call s':>12} {'step ms':>9} {'peak +MiB':>9} {'aten ops':>9}")
    print(f"{'eager':10} {r['first']['eager']:>12.2f} {1e3 * e:>9.1f} {me / 2**20:>9.2f} {oe:>9}")
    print(f"{'compiled':10} {r['first']['compiled']:>12.2f} {1e3 * c:>9.1f} {mc / 2**20:>9.2f} "
          f"{oc:>9}")
    print(f"compiled / eager: step time {c / e:.2f}x, peak memory {mc / max(me, 1):.2f}x; "
          f"graphs compiled: {r['graphs']} (1 = no recompiles); largest loss gap "
          f"{r['loss_gap']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
