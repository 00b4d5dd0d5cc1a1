"""The runtime's backward, measured: (1) no host sync on CUDA (a whole training step's
backward under ``torch.cuda.set_sync_debug_mode("error")``, one process; elsewhere the check is
reported as unmeasured), and (2) the cost of the backward's cross-rank agreement on gloo: the
exchange's two all-reduces over the side group, started at once and waited, as the backward
does them, against one plain all-reduce of one float32 (the smallest collective), medians.

    python benchmarks/runtime_check.py            # GPU check if CUDA, gloo cost on 2 processes
    python benchmarks/runtime_check.py --cpu      # the same on the CPU (the sync check skips)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vfsdp
from vfsdp.collectives import comm
from vfsdp.collectives.comm import side_group


def sync_check(device: str) -> str:
    """One process on ``device``: plan, shard, gather, then the backward (and, separately, the
    rest of the step) under the sync debug mode."""
    if not dist.is_initialized():
        import tempfile
        init = tempfile.mktemp(prefix="vfsdp-sync-")
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"file://{init}", rank=0, world_size=1)
    torch.manual_seed(0)
    params = {"embed": torch.randn(64, 32), "layers": [
        {"w": torch.randn(32, 32) / 6, "b": torch.zeros(32)} for _ in range(4)]}
    spec = vfsdp.plan(params, 1)
    shards = vfsdp.shard(params, spec)  # on the default group's device (cuda under NCCL)
    x = torch.randn(8, 32, device=device)
    lines = []
    for step in range(3):
        full = vfsdp.gather(shards, spec)
        h = x
        for p in full["layers"]:
            h = torch.tanh(h @ p["w"] + p["b"])
        loss = (h @ full["embed"].t()).pow(2).mean()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
            ok = "no host sync"
        except RuntimeError as e:
            ok = f"SYNC: {str(e).splitlines()[0][:120]}"
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        lines.append(f"step {step}: backward on {device}: {ok}")
        vfsdp.zero_grads(shards, spec)
    dist.destroy_process_group()
    return "\n".join(lines)


def _agreement_cost(n_units: int, repeats: int) -> dict:
    group = side_group()
    times, base = [], []
    for _ in range(repeats):
        header = torch.tensor([0, 5, -5], dtype=torch.int64)
        marks = torch.zeros(n_units, dtype=torch.uint8)
        t0 = time.perf_counter()
        works = [comm.all_reduce_max_(t, group, "bench", async_op=True) for t in (header, marks)]
        for w in works:
            w.wait()
        header.tolist(), marks.tolist()
        times.append(time.perf_counter() - t0)
        one = torch.zeros(1)
        t0 = time.perf_counter()
        dist.all_reduce(one)
        base.append(time.perf_counter() - t0)
    return {"agreement_us": 1e6 * statistics.median(times),
            "one_all_reduce_us": 1e6 * statistics.median(base)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="no CUDA: skip the sync check")
    parser.add_argument("--repeats", type=int, default=201)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    cuda = torch.cuda.is_available() and not args.cpu
    print(sync_check("cuda") if cuda else
          sync_check("cpu") + "\nsync check: unmeasured (no CUDA device; the step ran on the CPU)")
    from vfsdp.testing import spawn
    for units in (8, 64, 512):
        got = spawn(_agreement_cost, 2, units, args.repeats, timeout=300)[0]
        print(f"gloo, 2 processes, {units} awaiting gathers: agreement "
              f"{got['agreement_us']:.1f} us per backward (median of {args.repeats}); one "
              f"1-float all-reduce {got['one_all_reduce_us']:.1f} us; ratio "
              f"{got['agreement_us'] / got['one_all_reduce_us']:.2f}")


if __name__ == "__main__":
    main()
