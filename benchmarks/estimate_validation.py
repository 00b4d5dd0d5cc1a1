"""How well ``vfsdp.estimate`` predicts what can be measured here, and what it projects.

    python benchmarks/estimate_validation.py            # all sections (about 2 minutes)
    python benchmarks/estimate_validation.py --quick    # memory, bytes and planning only
    python benchmarks/estimate_validation.py --sections 2 --runs 4   # four calibrated steps

Sections:

1. vfsdp's buffers' peak per rank (``vfsdp.testing.memory.BufferBytes``) and every
   collective's bytes (``vfsdp.collectives.comm.counts``) against the prediction, on gloo
   at W = 2 and 4, for AdamW, 8-bit AdamW and Muon, fp32 and bf16 compute, HSDP, and
   TP x FSDP (the layers' all-reduces over tp included);
2. a training step of the example model after ``calibrate`` at the same world size: the
   measured median against the predicted step time;
3. planning and estimating one model at ten GPU counts (``vfsdp.estimation.sweep``);
4. projections with the H800 profile for a DeepSeek-V3-sized MoE (the paper's scaling
   claims): weak scaling 1K -> 8K GPUs, and a 16M-token global batch from 1K to 8K, with
   the experts FSDP-sharded with the rest or split over 8, 32 or 64 GPUs;
   and a 128M-token batch of it in 4,096-token micro-batches from 1K to 8K GPUs;
5. ``--vs fsdp2`` against ``benchmarks/vs_fsdp2.py`` (its models, W = 2 and 4, fp32): the
   predicted vfsdp / FSDP2 ratios of bytes copied outside the collectives and of the peak,
   beside the measured ones where ``--measured`` names that script's ``--json`` output, and
   the predicted vfsdp / Megatron-FSDP ratios (not measured here);
6. the paper's claims beside the projection at 1,024 H800s: vfsdp against FSDP2 and
   Megatron-FSDP (throughput, peak memory), FSDP2's copy share of a step, and the two
   ablations (FSDP2's copies over vfsdp's layout; vfsdp's step over FSDP2's padding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

import vfsdp
from tests.estimation import bodies
from vfsdp.estimation import PROFILES, sweep
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


def step_time(runs: int = 1) -> None:
    print("\n2. a step of the example model after calibrate (gloo processes, medians of 15 "
          "steps; calibrate's of 21 repeats), each run a fresh calibration")
    print(f"{'W':>2} {'run':>3} {'measured s':>11} {'predicted s':>12} {'error':>7}")
    for world in (2, 4):
        for run in range(runs):
            r = spawn(bodies.calibrated_step, world, timeout=300)[0]
            err = (r["predicted"] - r["measured"]) / r["measured"]
            print(f"{world:>2} {run:>3} {r['measured']:>11.4f} {r['predicted']:>12.4f} "
                  f"{100 * err:>+6.1f}%", flush=True)


def planning() -> None:
    print("\n3. plan + estimate at ten GPU counts (8 ... 4096): vfsdp.estimation.sweep, the "
          "shard group fixed at 256 or the default's smallest that fits; beside it, "
          "estimate(plan(...)) per count")
    counts = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    for name, extra in [("llama2-7b", {}), ("llama3-70b", {}),
                        ("gpt-oss-120b", {"experts_per_token": 4}),
                        ("deepseek-v3-671b", {"experts_per_token": 8}),
                        ("deepseek-v3-671b", {"experts_per_token": 8, "ep": 8})]:
        tree = load_shapes(os.path.join(SHAPES, f"{name}.json"), torch.float32)
        label = name + (f" ep{extra['ep']}" if "ep" in extra else "")
        times = []
        for shard in (256, None):
            t0 = time.perf_counter()
            sweep(tree, counts, shard=shard, hw="h800", recompute=True, **extra)
            times.append(time.perf_counter() - t0)
        line = f"   {label:<22} sweep: shard 256 {times[0]:.2f} s, default {times[1]:.2f} s"
        if "ep" not in extra:
            gran = optimizer_for("adamw", tree).granularity
            t0 = time.perf_counter()
            for n in counts:
                mesh = n if n <= 256 else (n // 256, 256)
                vfsdp.estimate(vfsdp.plan(tree, mesh, granularity=gran), hw="h800",
                               recompute=True, **extra)
            line += f"; estimate(plan(...)) per count, shard 256: {time.perf_counter() - t0:.2f} s"
        print(line)


def paper() -> None:
    print("\n4. projected, H800 profile, DeepSeek-V3-sized MoE (671B, top-8 of 256 experts), "
          "HSDP with shard groups of 256, AdamW, bf16, activation checkpointing, seq 4096; "
          "the routed experts FSDP-sharded with the rest (ep 1) or split over ep GPUs")
    tree = load_shapes(os.path.join(SHAPES, "deepseek-v3-671b.json"), torch.float32)
    counts = [1024, 2048, 4096, 8192]
    opts = {"hw": "h800", "shard": 256, "seq": 4096, "experts_per_token": 8, "recompute": True}
    print(f"{'ep':>3} {'GPUs':>6} {'tokens/GPU':>10} {'step s':>8} {'exposed':>8} "
          f"{'tokens/s':>13} {'MFU%':>6} {'GiB/rank':>9} fits")
    for ep in (1, 8, 32, 64):
        weak = [e for _, e in sweep(tree, counts, ep=ep, tokens_per_gpu=8192, **opts)]
        strong = [e for _, e in sweep(tree, counts, ep=ep, global_tokens=16 * 2**20, **opts)]
        for e in weak + strong:
            print(f"{ep:>3} {e.gpus:>6} {e.tokens_per_rank:>10} {e.step_s:>8.2f} "
                  f"{e.exposed_comm_s:>8.2f} {e.tokens_per_s:>13,.0f} {100 * e.mfu:>6.1f} "
                  f"{e.memory_per_rank / 2**30:>9.1f} {'yes' if e.fits else 'NO'}")
        eff = weak[-1].tokens_per_s / weak[0].tokens_per_s / 8
        speed = strong[-1].tokens_per_s / strong[0].tokens_per_s
        print(f"   ep {ep}: weak scaling 1K -> 8K at 8,192 tokens/GPU {100 * eff:.1f} % "
              f"(paper: near-linear); 16M-token batch 1K -> 8K {speed:.2f}x (paper: 3.4x)")
    print("\n   a 128M-token batch in 4,096-token micro-batches (each gathers the layers again "
          "and reduces), default shard groups; DeepSeek-V3's report: 180K H800 GPU hours per "
          "trillion tokens = 1,543 tokens/s per GPU")
    print(f"{'':>3} {'layout':<22} {'GPUs':>6} {'mesh':>7} {'micro':>5} {'GiB':>5} {'step s':>7} "
          f"{'exposed':>8} {'all-to-all s':>12} {'tokens/s':>11} {'per GPU':>8}")
    for ep, layout, kw in [(8, "regather in backward", {}), (64, "regather in backward", {}),
                           (64, "no backward regather", {"reshard_after_forward": False})]:
        rows = sweep(tree, counts, ep=ep, global_tokens=2**27, micro_batch_tokens=4096,
                     **{**opts, "shard": None}, **kw)
        for _, e in rows:
            link = PROFILES["h800"].intra_bw if ep <= 8 else PROFILES["h800"].inter_bw
            a2a = e.comm_bytes["all_to_all"] / (link * PROFILES["h800"].comm_efficiency)
            print(f"{ep:>3} {layout:<22} {e.gpus:>6} {e.replicas}x{e.shard:<4} "
                  f"{e.tokens_per_rank // 4096:>5} {e.memory_per_rank / 2**30:>5.1f} "
                  f"{e.step_s:>7.1f} {e.exposed_comm_s:>8.1f} {a2a:>12.1f} "
                  f"{e.tokens_per_s:>11,.0f} {e.tokens_per_s / e.gpus:>8,.0f}"
                  f"{'' if e.fits else ' does NOT fit'}")
        print(f"    1K -> 8K: {rows[-1][1].tokens_per_s / rows[0][1].tokens_per_s:.2f}x")


def baselines(measured: str | None = None) -> None:
    from vs_fsdp2 import MODELS

    from vfsdp.testing.models import meta_params

    found = {}
    if measured:
        with open(measured) as f:
            found = {r["config"]: r for r in json.load(f)}
    print("\n5. --vs fsdp2 against benchmarks/vs_fsdp2.py (fp32, reshard after forward): "
          "vfsdp / FSDP2, predicted (measured)")
    print(f"{'config':<14} {'copied MiB vfsdp/FSDP2':>24} {'copy ratio':>18} {'peak ratio':>18}"
          f"   vfsdp / Megatron-FSDP: copies, peak")
    for world in (2, 4):
        for name, cfg in MODELS.items():
            params = meta_params(cfg)
            spec = vfsdp.plan(params, world)
            kw = {"hw": "h100", "param_dtype": None, "tokens_per_rank": 2 * cfg.seq,
                  "experts_per_token": cfg.experts or None}
            v, f, g = (vfsdp.estimate(spec, baseline=b, **kw) for b in (None, "fsdp2", "megatron"))
            peak = [e.peak_allocated for e in (v, f, g)]
            config = f"W={world} {name} fp32"
            m = found.get(config)
            copy = f" ({m['added_copied_bytes_ratio']:.3f})" if m else ""
            top = f" ({m['peak_memory_ratio']:.3f})" if m else ""
            print(f"{config:<14} {v.copy_bytes / 2**20:>11.2f}/{f.copy_bytes / 2**20:<12.2f} "
                  f"{v.copy_bytes / f.copy_bytes:>9.3f}{copy:<9} {peak[0] / peak[1]:>9.3f}{top:<9}"
                  f"   {v.copy_bytes / g.copy_bytes:.3f}, {peak[0] / peak[2]:.3f}")


def claims() -> None:
    print("\n6. the paper's claims beside the projection: 1,024 H800s, 8,192 tokens per GPU "
          "(and 2,048), seq 8192, activation checkpointing, bf16 compute, fp32 reduction, AdamW, "
          "HSDP at the default's shard group (and at 256); gains are vfsdp over the other")
    print(f"{'model':<13} {'tokens':>6} {'shard':>5} {'system':<41} {'GiB':>5} {'tokens/s':>11} "
          f"{'copy %':>6} {'throughput':>10} {'memory':>7}")
    for name, extra in [("llama3-70b", {}), ("gpt-oss-120b", {"experts_per_token": 4})]:
        tree = load_shapes(os.path.join(SHAPES, f"{name}.json"), torch.float32)
        for tokens, opt, shard in ((8192, "adamw", None), (2048, "adamw", None),
                                   (8192, "adamw8bit", None), (8192, "adamw", 256)):
            kw = {"hw": "h800", "tokens_per_gpu": tokens, "seq": 8192, "recompute": True,
                  "reduce_dtype": torch.float32, "optimizer": opt, "shard": shard, **extra}
            # Megatron-FSDP has no block-wise optimizer: 8-bit AdamW's rows are the ablations
            rows = sweep(tree, [1024], vs=["fsdp2", "megatron"] if opt == "adamw" else [], **kw)
            kw["shard"] = rows[0][1].shard
            rows += [("no DBuffer (FSDP2's copies)",
                      sweep(tree, [1024], vs=["fsdp2"], padding="vfsdp", **kw)[1][1]),
                     ("no planning (FSDP2's padding)", sweep(tree, [1024], padding="fsdp2", **kw)[0][1])]
            v = rows[0][1]
            for system, e in rows:
                label = f"{system}{', 8-bit AdamW' if opt != 'adamw' else ''}"
                print(f"{name:<13} {tokens:>6} {e.shard:>5} {label:<41} "
                      f"{e.memory_per_rank / 2**30:>5.1f} {e.tokens_per_s:>11,.0f} "
                      f"{100 * e.copy_s / e.step_s:>6.1f} "
                      f"{100 * (v.tokens_per_s / e.tokens_per_s - 1):>+9.1f}% "
                      f"{100 * (1 - v.peak_reserved / e.peak_reserved):>6.1f}%"
                      f"{'' if e.fits else '  does NOT fit'}")
    print("   paper: 5-66 % more throughput, 16-30 % less peak reserved memory; FSDP2's copy-in/"
          "copy-out up to 14 % of a step; 92.8 % of the throughput without DBuffer, 65.4 % "
          "without planning")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sections 1 and 3 only")
    ap.add_argument("--sections", default="1,2,3,4,5,6", help="which to run, e.g. 2,3")
    ap.add_argument("--runs", type=int, default=1, help="calibrated steps per world size")
    ap.add_argument("--measured", help="section 5: benchmarks/vs_fsdp2.py --json's output")
    args = ap.parse_args()
    chosen = {1, 3} if args.quick else {int(x) for x in args.sections.split(",")}
    for n, section in ((1, memory_and_bytes), (2, lambda: step_time(args.runs)),
                       (3, planning), (4, paper), (5, lambda: baselines(args.measured)),
                       (6, claims)):
        if n in chosen:
            section()


if __name__ == "__main__":
    main()
