"""Shard a small MLP stack, gather it, take gradients, and check them against one process.

Runs as N simulated ranks in this process by default, as N gloo processes with ``--spawn``,
and under torchrun as it is (gloo on CPU, NCCL on GPUs)::

    python examples/gather_demo.py --world-size 4
    python examples/gather_demo.py --world-size 3 --spawn
    torchrun --nproc-per-node 4 examples/gather_demo.py
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import optree
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import simulate, spawn

DIM, LAYERS, BATCH = 24, 3, 8


def init_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(DIM, DIM, generator=g) / DIM ** 0.5,
        "layers": [{"w": torch.randn(DIM, DIM, generator=g) / DIM ** 0.5,
                    "b": torch.zeros(DIM)} for _ in range(LAYERS)],
    }


def model(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = x @ p["embed"]
    for layer in p["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return (h ** 2).mean()


def batch(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 + rank))


def run() -> float:
    """One SPMD step: returns the max |error| of this rank's gradient shards vs one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    params = init_params()
    spec = vfsdp.plan(params, world)
    if rank == 0:
        print(spec)
    shards = vfsdp.shard(params, spec)               # views into one DBuffer per unit
    full = vfsdp.gather(shards, spec)                # one all-gather per unit, zero copy
    loss = model(full, batch(rank).to(device))
    loss.backward()                                  # reduce-scatter (mean over ranks) per unit
    vfsdp.release(shards, spec)

    # the same gradients on one process: the mean over ranks' batches
    ref = init_params()
    leaves = [ref["embed"]] + [t for layer in ref["layers"] for t in layer.values()]
    for t in leaves:
        t.requires_grad_(True)
    sum(model(ref, batch(r)) for r in range(world)).div(world).backward()
    err = 0.0
    for mine, t_ref, tspec in zip(optree.tree_leaves(shards), optree.tree_leaves(ref), spec.leaves()):
        lo, hi = tspec.local_range(rank)
        if hi > lo:
            err = max(err, float((mine.grad.reshape(-1).cpu() - t_ref.grad.reshape(-1)[lo:hi]).abs().max()))
    return err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--spawn", action="store_true", help="gloo processes instead of threads")
    args = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        errors = [run()]
        dist.destroy_process_group()
    else:
        errors = spawn(run, args.world_size) if args.spawn else simulate(args.world_size, run)
    worst = max(errors)
    print(f"max |gradient error| vs one process: {worst:.2e} over {len(errors)} rank(s)")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
