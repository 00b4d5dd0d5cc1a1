"""Distributed Muon: root load balance and bytes moved (planned), and step time (a real run).

* Planned only (no process group), on the hidden matrices of ``benchmarks/shapes/llama3-70b.json``
  at m = 8 and 64: root load max/mean for vfsdp's LPT plan and for round-robin, and bytes moved
  per step (gather to the root plus scatter back, fp32) against all-gathering every matrix on
  every rank.
* Real run: the example model on W = 4 gloo processes, seconds per step with Muon against AdamW.

    python benchmarks/muon_bench.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import vfsdp
from vfsdp.optim.muon import _cost, plan_roots
from vfsdp.planner.shapes import load_shapes

HERE = os.path.dirname(os.path.abspath(__file__))


def planned(world: int) -> dict:
    tree = load_shapes(os.path.join(HERE, "shapes", "llama3-70b.json"))
    spec = vfsdp.plan(tree, world)
    mats = [t for t in spec.tensors() if t.path[0] == "layers" and len(t.shape) == 2]
    lpt = plan_roots(mats, world)
    rr = [i % world for i in range(len(mats))]
    out = {"matrices": len(mats)}
    for name, roots in (("lpt", lpt), ("round_robin", rr)):
        load = [0] * world
        moved = 0
        for t, r in zip(mats, roots):
            load[r] += _cost(t)
            lo, hi = t.local_range(r)
            moved += 2 * (t.numel - (hi - lo)) * 4
        out[name] = {"load_max_over_mean": max(load) / (sum(load) / world), "bytes": moved}
    out["all_gather_everything_bytes"] = sum((world - 1) * t.numel * 4 for t in mats)
    return out


def step_time(optim: str, world: int = 4, steps: int = 12) -> float:
    import train_gpt

    args = train_gpt.parse(["--world-size", str(world), "--steps", str(steps), "--optim", optim,
                            "--out", ""])
    t0 = time.perf_counter()
    results = vfsdp.testing.spawn(train_gpt.train, world, args)
    del t0
    return max(r["seconds"] for r in results) / steps


def main() -> int:
    gib = 2 ** 30
    for world in (8, 64):
        r = planned(world)
        print(f"llama3-70b hidden matrices ({r['matrices']}) on m={world}: root load max/mean "
              f"LPT {r['lpt']['load_max_over_mean']:.3f} vs round-robin "
              f"{r['round_robin']['load_max_over_mean']:.3f}; bytes moved per step "
              f"{r['lpt']['bytes'] / gib:.1f} GiB (gather + scatter, fp32) vs "
              f"{r['all_gather_everything_bytes'] / gib:.1f} GiB to all-gather every matrix everywhere")
    adamw, muon = step_time("adamw"), step_time("muon")
    print(f"example model, W=4 gloo: {1e3 * adamw:.1f} ms/step with AdamW, {1e3 * muon:.1f} ms/step "
          f"with Muon (layers' matrices) + AdamW (rest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
