"""Collectives benchmark (gloo, CPU): vfsdp's gather and reduce-scatter against the raw collective
and against FSDP2, on one LLaMA-style layer, measured side by side in one run.

For each world size it reports, per unit (one layer):

* vfsdp.gather time / raw ``all_gather_single`` time on the same bytes, as a throughput ratio
  (raw time / vfsdp time; 1.0 = no overhead);
* the same for the gradient reduce-scatter, with gradients in separate tensors (one copy each
  into the buffer) and with gradients already written into the buffer's views (no copy);
* bytes copied outside the collectives (dispatcher-level count) by vfsdp's gather and gradient
  paths, and by FSDP2's ``fully_shard`` unshard (copy-in + copy-out) and reduce-scatter
  (chunk-cat copy-in) on the same layer;
* collectives per unit.

Times are medians of ``--repeats`` runs after warm-up. Usage::

    python benchmarks/collectives_bench.py                 # W = 2 and 4
    python benchmarks/collectives_bench.py --world-sizes 2 --hidden 512 --repeats 5
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
from vfsdp.collectives import comm, counts, reset_counts, slot_of
from vfsdp.testing import CopyCounter, spawn


def layer_shapes(h: int, i: int, kv: int) -> dict:
    return {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (i, h), "up": (i, h),
            "down": (h, i), "norm1": (h,), "norm2": (h,)}


def _paired_medians(fns, repeats: int) -> list[float]:
    """Median time of each function, measured interleaved (a, b, a, b, ...) to cancel drift.

    An entry may be ``(setup, fn)``: ``setup`` runs untimed before each ``fn``.
    """
    fns = [f if isinstance(f, tuple) else (None, f) for f in fns]
    for setup, fn in fns:  # warm-up
        if setup:
            setup()
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for k, (setup, fn) in enumerate(fns):
            if setup:
                setup()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


class _Layer(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape)))

    def forward(self, x):
        return x + sum((p.sum() for p in self.parameters()), torch.zeros(()))


def bench_rank(h: int, i: int, kv: int, repeats: int) -> dict:
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = layer_shapes(h, i, kv)
    params = {"layers": [{n: torch.randn(s) for n, s in shapes.items()}]}
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    layout = spec.units[("layers", 0)]
    s, m = layout.shard_numel, layout.world_size
    out = {"S": s, "m": m, "unit_bytes": m * s * 4}

    # ---- all-gather: raw collective on the same bytes vs vfsdp.gather
    raw_in, raw_out = torch.randn(s), torch.empty(m * s)
    unit = slot_of(optree.tree_leaves(shards)[0]).unit  # the shards carry their unit
    db = unit.params
    t_raw, t_vfsdp, t_raw_fresh, t_vfsdp_fresh = _paired_medians(
        [lambda: comm.all_gather_into(raw_out, raw_in), lambda: vfsdp.gather(shards, spec),
         lambda: comm.all_gather_into(torch.empty(m * s), raw_in),
         (db.free_global, lambda: vfsdp.gather(shards, spec))], repeats)
    out.update(ag_raw_s=t_raw, ag_vfsdp_s=t_vfsdp, ag_raw_fresh_s=t_raw_fresh,
               ag_vfsdp_fresh_s=t_vfsdp_fresh)
    with CopyCounter() as c:
        reset_counts()
        full = vfsdp.gather(shards, spec)
    out["ag_copy_bytes"], out["ag_collectives"] = c.copy_bytes, counts()["all_gather"]

    # ---- reduce-scatter: raw vs vfsdp, gradients in separate tensors or in the buffer's views
    raw_rs_in, raw_rs_out = torch.randn(m * s), torch.empty(s)
    grads = optree.tree_map(torch.randn_like, params)
    gdb = unit.grads()

    views = {}

    def make_views():  # the backward would produce its gradients straight into these views
        buf = gdb.alloc_global()
        views["tree"] = {"layers": [{t.path[-1]: buf[t.offset:t.offset + t.numel].view(t.shape)
                                     for t in gdb.tensors}]}

    def in_place():
        return vfsdp.reduce_scatter(views["tree"], spec, shards=shards)

    fresh = {}

    def fresh_input():  # the raw collective under vfsdp's memory policy: its input is freed
        fresh["buf"] = torch.randn(m * s)

    def raw_release():
        comm.reduce_scatter_into(raw_rs_out, fresh["buf"], "avg")
        fresh["buf"].untyped_storage().resize_(0)

    t_rs_raw, t_rs_raw_release, t_rs_inplace, t_rs_copy = _paired_medians(
        [lambda: comm.reduce_scatter_into(raw_rs_out, raw_rs_in, "avg"), (fresh_input, raw_release),
         (make_views, in_place), lambda: vfsdp.reduce_scatter(grads, spec, shards=shards)], repeats)
    with CopyCounter() as c:
        reset_counts()
        vfsdp.reduce_scatter(grads, spec, shards=shards)
    out["rs_copy_bytes"], out["rs_collectives"] = c.copy_bytes, counts()["reduce_scatter"]
    make_views()
    with CopyCounter() as c:
        in_place()
    out["rs_inplace_copy_bytes"] = c.copy_bytes
    out.update(rs_raw_s=t_rs_raw, rs_copy_s=t_rs_copy, rs_inplace_s=t_rs_inplace,
               rs_raw_release_s=t_rs_raw_release)
    vfsdp.release(shards, spec)
    del full

    # ---- FSDP2 on the same layer: copy bytes of unshard and of the gradient reduce-scatter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = _Layer(shapes)
    fully_shard(module, mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=True)
    x = torch.zeros(())
    module(x).backward()  # warm-up: lazy init
    module.reshard()
    with CopyCounter() as c:
        module.unshard()
    out["fsdp2_ag_copy_bytes"] = c.copy_bytes
    t_f2, = _paired_medians([lambda: (module.unshard(), module.reshard())], repeats)
    out["fsdp2_ag_s"] = t_f2
    module.reshard()
    y = module(x)
    with CopyCounter() as c:
        y.backward()
    out["fsdp2_bwd_copy_bytes"] = c.copy_bytes  # regather (copy-in/out) + chunk-cat copy-in
    return out if rank == 0 else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    mib = 2 ** 20
    print(f"LLaMA-style layer: hidden {args.hidden}, intermediate {args.intermediate}, kv "
          f"{args.kv}, fp32, gloo on CPU; medians of {args.repeats}")
    for world in args.world_sizes:
        r = spawn(bench_rank, world, args.hidden, args.intermediate, args.kv, args.repeats,
                  timeout=1800)[0]
        print(f"\nW={world}: unit buffer {r['unit_bytes'] / mib:.1f} MiB (S={r['S']:,} per rank)")
        print(f"  all-gather      raw {1e3 * r['ag_raw_s']:8.2f} ms   vfsdp.gather "
              f"{1e3 * r['ag_vfsdp_s']:8.2f} ms   throughput ratio {r['ag_raw_s'] / r['ag_vfsdp_s']:.3f}"
              f"   (buffer kept allocated)")
        print(f"  all-gather      raw {1e3 * r['ag_raw_fresh_s']:8.2f} ms   vfsdp.gather "
              f"{1e3 * r['ag_vfsdp_fresh_s']:8.2f} ms   throughput ratio "
              f"{r['ag_raw_fresh_s'] / r['ag_vfsdp_fresh_s']:.3f}   (output re-allocated each time, "
              f"as after a release; FSDP2 unshard+reshard {1e3 * r['fsdp2_ag_s']:.2f} ms)")
        print(f"  reduce-scatter  raw {1e3 * r['rs_raw_s']:8.2f} ms   vfsdp (grads in place) "
              f"{1e3 * r['rs_inplace_s']:8.2f} ms   ratio {r['rs_raw_s'] / r['rs_inplace_s']:.3f}")
        print(f"                  raw + releasing its input buffer (vfsdp's memory policy) "
              f"{1e3 * r['rs_raw_release_s']:8.2f} ms   ratio "
              f"{r['rs_raw_release_s'] / r['rs_inplace_s']:.3f}")
        print(f"                  vfsdp (grads as separate tensors, one copy each) "
              f"{1e3 * r['rs_copy_s']:8.2f} ms   ratio {r['rs_raw_s'] / r['rs_copy_s']:.3f}")
        print(f"  bytes copied outside collectives per unit: vfsdp gather {r['ag_copy_bytes'] / mib:.2f}"
              f" MiB, vfsdp grads {r['rs_copy_bytes'] / mib:.2f} MiB (in place: "
              f"{r['rs_inplace_copy_bytes'] / mib:.2f} MiB); FSDP2 unshard "
              f"{r['fsdp2_ag_copy_bytes'] / mib:.2f} MiB, FSDP2 backward "
              f"{r['fsdp2_bwd_copy_bytes'] / mib:.2f} MiB")
        print(f"  collectives per unit: vfsdp {r['ag_collectives']} all-gather, "
              f"{r['rs_collectives']} reduce-scatter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
