"""How well ``vfsdp.estimate`` predicts what can be measured here, and what it projects.

    python benchmarks/estimate_validation.py            # all sections (about 2 minutes)
    python benchmarks/estimate_validation.py --quick    # memory, bytes and planning only

Sections:

1. vfsdp's buffers' peak per rank (``vfsdp.testing.memory.BufferBytes``) and every
   collective's bytes (``vfsdp.collectives.comm.counts``) against the prediction, on gloo
   at W = 2 and 4, for AdamW, 8-bit AdamW and Muon, fp32 and bf16 compute, HSDP, and
   TP x FSDP (the layers' all-reduces over tp included);
2. a training step of the example model after ``calibrate`` at the same world size: the
   measured median against the predicted step time;
3. planning and estimating one model at ten GPU counts;
4. projections with the H800 profile for a DeepSeek-V3-sized MoE (the paper's scaling
   claims): weak scaling 1K -> 8K GPUs, and a 16M-token global batch from 1K to 8K.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

import vfsdp
from tests.estimation import bodies
from vfsdp.estimation.model import optimizer_for
from vfsdp.planner.shapes import load_shapes
from vfsdp.testing import simulate, spawn

SHAPES = os.path.join(os.path.dirname(__file__), "shapes")


def _row(world, mesh: str, opt: str, dtype, rs: list) -> None:
    worst = max(rs, key=lambda r: abs(r["predicted_peak"] - r["measured_peak"]))
    err = abs(worst["predicted_peak"] - worst["measured_peak"]) / worst["measured_peak"]
    same = all(r["measured_bytes"] == r["predicted_bytes"] for r in rs)
    print(f"{world:>2} {mesh:>7} {opt:<10} {str(dtype or 'fp32')[6:] or 'fp32':<8} "
          f"{worst['measured_peak']:>11,} {worst['predicted_peak']:>12,} {100 * err:>6.2f}%  "
          f"{'equal' if same else 'DIFFER'}")


def memory_and_bytes() -> None:
    print("1. vfsdp's buffers (peak per rank, worst rank) and collective bytes, gloo threads")
    print(f"{'W':>2} {'mesh':>7} {'optimizer':<10} {'compute':<8} {'measured B':>11} "
          f"{'predicted B':>12} {'error':>7}  bytes per collective")
    cases = [(w, o, d, None) for w in (2, 4) for o in ("adamw", "adamw8bit", "muon")
             for d in (None, torch.bfloat16)] + [(4, "adamw", torch.bfloat16, (2, 2))]
    for world, opt, dtype, mesh in cases:
        _row(world, str(mesh or world), opt, dtype,
             simulate(world, bodies.step, opt, dtype, True, True, 3, mesh))
    for dtype in (None, torch.bfloat16):  # TP x FSDP, the layers' all-reduces over tp included
        _row(4, "dp2xtp2", "adamw", dtype, simulate(4, bodies.tp_step, dtype))


def step_time() -> None:
    print("\n2. a step of the example model after calibrate (gloo processes, medians)")
    print(f"{'W':>2} {'measured s':>11} {'predicted s':>12} {'error':>7}")
    for world in (2, 4):
        rs = spawn(bodies.calibrated_step, world, 7, timeout=300)
        for r in rs[:1]:
            err = (r["predicted"] - r["measured"]) / r["measured"]
            print(f"{world:>2} {r['measured']:>11.4f} {r['predicted']:>12.4f} {100 * err:>+6.1f}%")


def planning() -> None:
    print("\n3. plan + estimate at ten GPU counts (8 ... 8192, shard group 64 beyond it)")
    counts = [8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192]
    for name, opt, extra in [("llama3-70b", "adamw", {}),
                             ("deepseek-v3-671b", "adamw", {"experts_per_token": 8})]:
        tree = load_shapes(os.path.join(SHAPES, f"{name}.json"), torch.float32)
        gran = optimizer_for(opt, tree).granularity
        t0 = time.perf_counter()
        for n in counts:
            mesh = n if n <= 64 else (n // 64, 64)
            vfsdp.estimate(vfsdp.plan(tree, mesh, granularity=gran), hw="h800", optimizer=opt,
                           recompute=True, **extra)
        print(f"   {name:<18} {time.perf_counter() - t0:.2f} s")


def paper() -> None:
    print("\n4. projected, H800 profile, DeepSeek-V3-sized MoE (671B, top-8 of 256 experts), "
          "HSDP with shard groups of 256, AdamW, bf16, activation checkpointing, seq 4096")
    tree = load_shapes(os.path.join(SHAPES, "deepseek-v3-671b.json"), torch.float32)
    specs = {n: vfsdp.plan(tree, (n // 256, 256)) for n in (1024, 2048, 4096, 8192)}

    def run(n, tokens):
        return vfsdp.estimate(specs[n], hw="h800", tokens_per_rank=tokens, seq=4096,
                              experts_per_token=8, recompute=True)

    print(f"{'GPUs':>6} {'tokens/GPU':>10} {'step s':>8} {'exposed':>8} {'tokens/s':>13} "
          f"{'MFU%':>6} {'GiB/rank':>9}")
    weak = {n: run(n, 8192) for n in specs}
    for n, e in weak.items():
        print(f"{n:>6} {8192:>10} {e.step_s:>8.2f} {e.exposed_comm_s:>8.2f} "
              f"{e.tokens_per_s:>13,.0f} {100 * e.mfu:>6.1f} {e.memory_per_rank / 2**30:>9.1f}")
    eff = weak[8192].tokens_per_s / weak[1024].tokens_per_s / 8
    print(f"   weak scaling efficiency 1K -> 8K: {100 * eff:.1f} % (paper: near-linear)")
    strong = {n: run(n, 16 * 2**20 // n) for n in specs}
    for n, e in strong.items():
        print(f"{n:>6} {16 * 2**20 // n:>10} {e.step_s:>8.2f} {e.exposed_comm_s:>8.2f} "
              f"{e.tokens_per_s:>13,.0f} {100 * e.mfu:>6.1f} {e.memory_per_rank / 2**30:>9.1f}")
    speed = strong[8192].tokens_per_s / strong[1024].tokens_per_s
    print(f"   16M-token batch, 1K -> 8K: {speed:.2f}x (paper: 3.4x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    memory_and_bytes()
    if not args.quick:
        step_time()
    planning()
    if not args.quick:
        paper()


if __name__ == "__main__":
    main()
