"""Planner benchmark: padding, the certified bound, planning time, and FSDP2 / Megatron padding.

Runs every model in ``benchmarks/shapes`` at m in {8, 64, 256, 1024, 8192} and granularity in
{element, rows:1, rows:16, rows:32, rows:128}; each plan is timed cold (solver cache cleared),
median of ``--repeats`` runs, in wall-clock and in CPU seconds (the process's own time: on a
shared, loaded machine the wall clock also counts other processes' turns). A pure-Python loop
of 2M additions, timed before and after the table, gives the machine's speed and load. Prints
one row per configuration and checks the targets:

* padding <= bound + 0.1 percentage point, or, where the bound is not attainable, <= the
  certified optimum + 0.1 pp (``--certify`` proves the optimum of small units by exhaustive
  search over every order and every shard size below the plan's);
* element granularity: padding <= 0.01 %;
* whole-model planning <= 0.3 s at m = 1024 and 8192;
* DeepSeek-V3-671B (45,395 tensors) at rows:32 and m = 1024: <= 0.1 s of CPU.

Usage::

    python benchmarks/plan_bench.py                      # the full table
    python benchmarks/plan_bench.py --models llama2-7b --world-sizes 8 64 --certify
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import vfsdp
from vfsdp.planner import solver
from vfsdp.planner.baselines import fsdp2_padding, megatron_padding
from vfsdp.planner.granularity import parse_granularity
from vfsdp.planner.shapes import load_shapes

HERE = os.path.dirname(os.path.abspath(__file__))
GRANULARITIES = ["element", "rows:1", "rows:16", "rows:32", "rows:128"]
WORLD_SIZES = [8, 64, 256, 1024, 8192]


def time_plan(tree, m, gran, repeats):
    """The spec, and the median wall-clock and CPU seconds of planning it cold."""
    times, cpu, spec = [], [], None
    for _ in range(repeats):
        solver._pack_cached.cache_clear()
        spec = None
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        spec = vfsdp.plan(tree, m, granularity=gran)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return spec, statistics.median(times), statistics.median(cpu)


def baseline_loop(n=2_000_000):
    """Wall-clock and CPU seconds of a pure-Python loop of ``n`` additions."""
    t0, c0, total = time.perf_counter(), time.process_time(), 0
    for i in range(n):
        total += i
    return time.perf_counter() - t0, time.process_time() - c0


def baseline_ratios(spec):
    f2 = mg = 0
    for u in spec.units.values():
        items = [(tuple(t.shape), t.block) for t in (spec_leaf(spec, p) for p in u.paths)]
        f2 += fsdp2_padding(items, u.world_size)
        mg += megatron_padding(items, u.world_size)
    total = vfsdp.plan_stats(spec)["total_numel"]
    return f2 / total, mg / total


_LEAF_INDEX: dict = {}


def spec_leaf(spec, path):
    index = _LEAF_INDEX.get(id(spec))
    if index is None:
        _LEAF_INDEX.clear()
        index = _LEAF_INDEX[id(spec)] = {t.path: t for t in spec.tensors()}
    return index[path]


def certify_unit(numels, blocks, world_size, align, *, upper=None, max_seconds=60.0):
    """The exact optimum of one unit: the minimal feasible ``S`` over all orders, or ``None``
    if not settled in ``max_seconds``. The solver's lower bound is cheap but not always
    attainable (block alignment at every rank boundary can force padding no order avoids);
    for every admissible ``S`` from the bound upward (up to ``upper``, a known feasible ``S``)
    this runs the backtracking search with no budget, which enumerates every order of tensor
    classes (earliest-start placement is exact for a fixed order), so the first feasible
    ``S`` is the true optimum.

    Example: ``certify_unit([6, 2], [3, 1], 2, 1)`` is 5.
    """
    eff, bound, s = solver._bound(numels, blocks, world_size, align)
    deadline = time.perf_counter() + max_seconds
    while upper is None or s < upper:
        if solver._search(numels, eff, s, world_size, budget=10**12) is not None:
            return s
        if time.perf_counter() > deadline:
            return None
        s = bound.next_admissible(s + 1)
    return upper


def certified_ratio(spec, seconds):
    """Padding ratio with each unit's bound replaced by its certified optimum where provable."""
    total = padded = 0
    proven = True
    seen = {}
    for u in spec.units.values():
        key = (u.numels, u.blocks, u.alignment)
        if key not in seen:
            seen[key] = certify_unit(u.numels, u.blocks, u.world_size, u.alignment,
                                     upper=u.shard_numel, max_seconds=seconds)
        s_opt = seen[key]
        if s_opt is None:
            proven = False
            s_opt = u.lower_bound
        total += u.total_numel
        padded += u.world_size * s_opt
    return (padded - total) / total, proven


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--world-sizes", nargs="*", type=int, default=WORLD_SIZES)
    ap.add_argument("--granularities", nargs="*", default=GRANULARITIES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--certify", action="store_true",
                    help="prove the optimum of units that miss bound + 0.1 pp (slow)")
    ap.add_argument("--certify-seconds", type=float, default=60.0)
    args = ap.parse_args(argv)

    shape_dir = os.path.join(HERE, "shapes")
    models = args.models or sorted(f[:-5] for f in os.listdir(shape_dir) if f.endswith(".json"))
    wall, cpu = baseline_loop()
    print(f"pure-Python loop of 2M additions: {wall:.3f} s wall, {cpu:.3f} s CPU")
    header = (f"{'model':<18} {'m':>5} {'granularity':<11} {'padding%':>10} {'bound%':>10} "
              f"{'gap pp':>7} {'time s':>7} {'cpu s':>7} {'FSDP2%':>9} {'Megatron%':>10}  target")
    print(header)
    print("-" * len(header))
    failures = 0
    for model in models:
        tree = load_shapes(os.path.join(shape_dir, f"{model}.json"))
        for m in args.world_sizes:
            for gname in args.granularities:
                gran = parse_granularity(gname)
                spec, secs, cpu = time_plan(tree, m, gran, args.repeats)
                vfsdp.check_spec(spec, placements=False)
                st = vfsdp.plan_stats(spec)
                pad, lb = 100 * st["padding_ratio"], 100 * st["lower_bound_ratio"]
                f2, mg = baseline_ratios(spec)
                notes = []
                ok = pad <= lb + 0.1
                if not ok and args.certify:
                    opt, proven = certified_ratio(spec, args.certify_seconds)
                    notes.append(f"certified optimum {100 * opt:.4f}%" + ("" if proven else " (partial)"))
                    ok = proven and pad <= 100 * opt + 0.1
                if gname == "element" and pad > 0.01:
                    if pad <= lb + 1e-9:  # the certified bound itself: alignment forces it
                        notes.append(f"element > 0.01% but = bound (16-byte alignment of S at m={m})")
                    else:
                        ok = False
                        notes.append("element > 0.01%")
                if m in (1024, 8192) and secs > 0.3:
                    ok = False
                    notes.append("slow")
                if (model, m, gname) == ("deepseek-v3-671b", 1024, "rows:32") and cpu > 0.1:
                    ok = False
                    notes.append("over 0.1 s of CPU")
                failures += not ok
                print(f"{model:<18} {m:>5} {gname:<11} {pad:>10.4f} {lb:>10.4f} {pad - lb:>7.3f} "
                      f"{secs:>7.3f} {cpu:>7.3f} {100 * f2:>9.3f} {100 * mg:>10.3f}  "
                      f"{'ok' if ok else 'MISS'} {'; '.join(notes)}", flush=True)
    wall, cpu = baseline_loop()
    print(f"\npure-Python loop of 2M additions: {wall:.3f} s wall, {cpu:.3f} s CPU")
    print(f"{failures} configuration(s) missed a target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
