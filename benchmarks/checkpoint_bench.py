"""Checkpoint save and load times against the raw bytes, with gloo processes.

For the example model (``examples/train_gpt.py``'s defaults, AdamW state included) and a
larger one, on ``W`` processes (default 4), each figure is the median over ``--repeats`` runs
of the slowest rank's time:

* ``raw write`` / ``raw read``: each rank writes its own shard bytes (the same bytes the
  checkpoint holds) to one file with ``fsync``, and reads them back: the floor;
* ``save``: ``vfsdp.checkpoint.save`` (DCP write, CRCs, manifest, atomic rename);
* ``async stall``: how long ``save(async_save=True)`` blocks training (the host copy);
* ``load``: ``vfsdp.checkpoint.load`` at the same ``W`` (CRC-verified; and ``verify=False``);
* ``load W/2``: resharded onto half the ranks;
* ``to_state_dict``: full tensors streamed unit by unit to rank 0.

    python benchmarks/checkpoint_bench.py                  # W = 4, example + larger model
    python benchmarks/checkpoint_bench.py --world-size 2 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.distributed as dist

import vfsdp
from vfsdp.checkpoint.entries import flatten
from vfsdp.testing import spawn
from vfsdp.testing.models import GPTConfig, init_rule, meta_params

MODELS = {
    "example": GPTConfig(dim=96, layers=3, heads=4, kv_heads=2, ffn=256, seq=64),
    "larger": GPTConfig(dim=512, layers=8, heads=8, kv_heads=4, ffn=1376, seq=64),
}


def _setup(cfg: GPTConfig, world: int):
    spec = vfsdp.plan(meta_params(cfg), world)
    shards = vfsdp.shard(meta_params(cfg), spec, init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    opt = vfsdp.optim.adamw(lr=1e-3)
    state = opt.init(shards, spec)
    with torch.no_grad():  # non-zero moments, as after training
        for bufs in (state.exp_avg, state.exp_avg_sq):
            for db in bufs.values():
                db.shard.normal_().abs_()
    return spec, {"params": shards, "opt": state, "step": 1}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - t0)


def _raw_write(path: str, tree, spec) -> int:
    pieces = [e.piece.local for e in flatten(tree, spec) if e.kind == "sharded"]
    data = torch.cat([p.detach().reshape(-1).float() for p in pieces])  # one host copy, as DCP
    with open(path, "wb") as f:
        f.write(data.view(torch.uint8).numpy())  # a view of the fresh copy: no second copy
        f.flush()
        os.fsync(f.fileno())
    return data.numel() * 4


def _raw_read(path: str) -> None:
    with open(path, "rb") as f:
        raw = bytearray(os.path.getsize(path))
        f.readinto(raw)
        torch.frombuffer(raw, dtype=torch.float32).clone()


def _rank_body(name: str, root: str, repeats: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS[name]
    spec, tree = _setup(cfg, world)
    times: dict = {k: [] for k in ("raw_write", "raw_read", "save", "async_stall", "async_total",
                                   "load", "load_noverify", "to_state_dict")}
    nbytes = 0
    for i in range(repeats):
        raw = os.path.join(root, f"raw-{i}-{rank}.bin")
        times["raw_write"].append(_timed(lambda: _raw_write(raw, tree, spec)))
        times["raw_read"].append(_timed(lambda: _raw_read(raw)))
        path = os.path.join(root, f"ckpt-{i}")
        times["save"].append(_timed(lambda: vfsdp.checkpoint.save(path, tree, spec)))
        if rank == 0:
            nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        box = {}
        dist.barrier()
        t0 = time.perf_counter()
        box["h"] = vfsdp.checkpoint.save(path + "-async", tree, spec, async_save=True)
        times["async_stall"].append(_slowest(time.perf_counter() - t0))
        box["h"].wait()
        times["async_total"].append(_slowest(time.perf_counter() - t0))
        times["load"].append(_timed(lambda: vfsdp.checkpoint.load(path, tree, spec)))
        times["load_noverify"].append(
            _timed(lambda: vfsdp.checkpoint.load(path, tree, spec, verify=False)))
        times["to_state_dict"].append(_timed(lambda: vfsdp.checkpoint.to_state_dict(tree["params"], spec)))
    shard_bytes = sum(e.piece.numel * e.piece.local.element_size()
                      for e in flatten(tree, spec) if e.kind == "sharded")
    total = torch.tensor([shard_bytes], dtype=torch.int64)
    dist.all_reduce(total)
    params = sum(t.numel for t in spec.tensors())
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "file_bytes": nbytes,
            "tensor_bytes": int(total), "params": params}


def _reshard_body(name: str, root: str, repeats: int) -> float:
    spec, tree = _setup(MODELS[name], dist.get_world_size())
    return statistics.median(_timed(lambda: vfsdp.checkpoint.load(os.path.join(root, f"ckpt-{i}"),
                                                                  tree, spec))
                             for i in range(repeats))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", help="where to write (default: a temporary directory)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    results = {}
    for name in args.models:
        root = tempfile.mkdtemp(prefix="vfsdp-ckpt-bench-", dir=args.dir)
        try:
            r = spawn(_rank_body, args.world_size, name, root, args.repeats, timeout=1800)[0]
            half = max(1, args.world_size // 2)
            r["times"]["load_reshard"] = spawn(_reshard_body, half, name, root, args.repeats,
                                               timeout=1800)[0]
            r["reshard_world"] = half
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results[name] = r
        t, mb = r["times"], r["tensor_bytes"] / 2**20
        print(f"\n{name}: {r['params']:,} parameters, AdamW state; {mb:.1f} MiB of tensors, "
              f"{r['file_bytes'] / 2**20:.1f} MiB on disk (DCP framing "
              f"{100 * (r['file_bytes'] / r['tensor_bytes'] - 1):+.1f}%), W={args.world_size}, "
              f"median of {args.repeats}")
        print(f"  {'':<28} {'seconds':>9} {'MiB/s':>9} {'vs raw':>8}")
        rows = [("raw write (fsync)", "raw_write", None), ("raw read", "raw_read", None),
                ("save", "save", "raw_write"), ("async save: stall", "async_stall", "raw_write"),
                ("async save: total", "async_total", "raw_write"),
                ("load (CRC-verified)", "load", "raw_read"),
                ("load (verify=False)", "load_noverify", "raw_read"),
                (f"load on W={r['reshard_world']} (reshard)", "load_reshard", "raw_read"),
                ("to_state_dict (rank 0)", "to_state_dict", None)]
        for label, key, base in rows:
            ratio = f"{t[key] / t[base]:7.1f}x" if base else ""
            print(f"  {label:<28} {t[key]:9.4f} {mb / t[key]:9.1f} {ratio:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
