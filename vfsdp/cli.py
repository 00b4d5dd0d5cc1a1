"""Command line: ``python -m vfsdp plan SHAPES.json --world-size N --granularity rows:32``, and
``python -m vfsdp estimate SHAPES.json --gpus 8,64,1024 --hw h800`` (see
:mod:`vfsdp.estimation.cli`), and ``python -m vfsdp calibrate --world-size 2`` (this machine's
rates on the example model's block, :func:`vfsdp.estimation.calibrate.calibrate`).

Prints one line per distinct unit (S, padding, the certified bound, tensors per rank, and the
padding FSDP2 and Megatron-FSDP would need), a total, split options, and with ``--suggest`` a
table of every ``replicate x shard`` factorisation of N with a recommendation.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Optional

import torch

from vfsdp.estimation import cli as estimate_cli
from vfsdp.estimation.checks import count
from vfsdp.estimation.memory import baseline_padding
from vfsdp.planner.check import check_spec, plan_stats
from vfsdp.planner.granularity import parse_granularity
from vfsdp.planner.plan import _logical, plan
from vfsdp.planner.shapes import DTYPES, load_shapes
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["main", "describe", "suggest"]


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def describe(spec: ShardSpec, out=None) -> dict:
    """Print the per-distinct-unit table of a spec; return totals including baselines."""
    out = out or sys.stdout
    groups: dict = {}
    for key, u in spec.units.items():
        groups.setdefault(u.signature, []).append(key)
    print(f"{'unit':<32} {'count':>5} {'tensors':>7} {'S':>14} {'padding%':>10} {'bound%':>10} "
          f"{'tensors/rank':>14} {'FSDP2%':>9} {'Megatron%':>10}", file=out)
    tot_f2 = tot_mg = 0
    for keys in groups.values():
        u = spec.units[keys[0]]
        f2, mg = (baseline_padding(u, s) for s in ("fsdp2", "megatron"))
        tot_f2 += f2 * len(keys)
        tot_mg += mg * len(keys)
        lo, med, hi = u.tensors_per_rank_summary()
        e = max(u.total_numel, 1)
        name = unit_name(keys[0]) + (f" (+{len(keys) - 1} alike)" if len(keys) > 1 else "")
        print(f"{name:<32} {len(keys):>5} {len(u.paths):>7} {u.shard_numel:>14,} "
              f"{100 * u.padding_ratio:>10.4f} {100 * u.lower_bound_ratio:>10.4f} "
              f"{f'{lo}/{med:g}/{hi}':>14} {100 * f2 / e:>9.3f} {100 * mg / e:>10.3f}", file=out)
        if u.split is not None:
            print(f"    option: {u.split!r}", file=out)
    st = plan_stats(spec)
    e = max(st["total_numel"], 1)
    st["fsdp2_ratio"], st["megatron_ratio"] = tot_f2 / e, tot_mg / e
    print(f"{'total':<32} {len(spec.units):>5} {st['tensors']:>7} {'':>14} "
          f"{100 * st['padding_ratio']:>10.4f} {100 * st['lower_bound_ratio']:>10.4f} {'':>14} "
          f"{100 * st['fsdp2_ratio']:>9.3f} {100 * st['megatron_ratio']:>10.3f}", file=out)
    return st


def suggest(tree, world_size: int, granularity, dtype: torch.dtype, out=None,
            max_padding: float = 0.01) -> Optional[tuple[int, int]]:
    """Print every ``replicate x shard`` factorisation of ``world_size``; return the pick.

    The pick is the largest shard group whose padding is at most ``max_padding``.
    Bytes per rank assume sharded parameters in ``dtype``, AdamW's two fp32 states, and two
    all-gathers of every unit per step (forward, and again in backward).
    """
    out = out or sys.stdout
    itemsize = dtype.itemsize
    print(f"\n{'replicate x shard':>18} {'padding%':>10} {'bound%':>10} {'params/rank':>14} "
          f"{'Adam state/rank':>16} {'all-gather/rank/step':>21}", file=out)
    best = None
    for shard in (s for s in range(1, world_size + 1) if world_size % s == 0):
        rep = world_size // shard
        spec = plan(tree, (rep, shard), granularity=granularity)
        st = plan_stats(spec)
        s_total = sum(u.shard_numel for u in spec.units.values())
        params = s_total * itemsize
        state = s_total * 4 * 2
        gathered = 2 * sum((u.world_size - 1) * u.shard_numel for u in spec.units.values()) * itemsize
        print(f"{f'{rep} x {shard}':>18} {100 * st['padding_ratio']:>10.4f} "
              f"{100 * st['lower_bound_ratio']:>10.4f} {_gib(params):>14} {_gib(state):>16} "
              f"{_gib(gathered):>21}", file=out)
        if st["padding_ratio"] <= max_padding:
            best = (rep, shard)
    if best is None:
        print(f"no factorisation keeps padding <= {100 * max_padding:g}%; use a coarser unit "
              f"split or a finer granularity", file=out)
    else:
        print(f"recommended: replicate {best[0]} x shard {best[1]} (the largest shard group with "
              f"padding <= {100 * max_padding:g}%)", file=out)
    return best


def _calibrate_rank(tokens: int, repeats: int):
    from vfsdp.collectives.comm import device_for
    from vfsdp.estimation.calibrate import calibrate
    from vfsdp.testing.models import example_layer

    return calibrate(example_layer(tokens, device=device_for()), repeats=repeats)


def _calibrate(args) -> int:
    """Run ``calibrate`` on the example model's block: measure, write the profile, print it."""
    import os

    import torch.distributed as dist

    try:
        for name in ("world_size", "tokens", "repeats"):
            count("calibrate", "--" + name.replace("_", "-"), getattr(args, name))
        estimate_cli.writable(args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if dist.is_initialized() or "RANK" in os.environ:
        if not dist.is_initialized():
            dist.init_process_group()
        hw = _calibrate_rank(args.tokens, args.repeats)
        if dist.get_rank() != 0:
            return 0
    else:
        from vfsdp.testing import spawn

        hw = spawn(_calibrate_rank, args.world_size, args.tokens, args.repeats)[0]
    hw.to_json(args.out)
    print(f"wrote {args.out}: {hw.source}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vfsdp", description="vfsdp tools")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a shape list and print the layout")
    p.add_argument("shapes", help='JSON file {"params": [["dotted.name", [shape]], ...]}')
    p.add_argument("--world-size", "-m", type=int, required=True)
    p.add_argument("--granularity", "-g", default="element", help="element, rows:K, whole or int")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--alignment-bytes", type=int, default=16)
    p.add_argument("--png", help="draw one unit's buffer to this PNG (needs matplotlib)")
    p.add_argument("--unit", help="unit to draw, e.g. layers.0 or root (default: most padded)")
    p.add_argument("--max-ranks", type=int, default=64, help="ranks to draw in --png")
    p.add_argument("--suggest", action="store_true",
                   help="compare every replicate x shard factorisation of --world-size")
    estimate_cli.add_parser(sub)
    p = sub.add_parser("calibrate", help="measure this machine's rates into a profile")
    p.add_argument("--world-size", "-n", type=int, default=2,
                   help="gloo processes to start (under torchrun: its world)")
    p.add_argument("--tokens", type=int, default=256, help="tokens of the timed layer")
    p.add_argument("--repeats", type=int, default=21, help="timed repetitions per median")
    p.add_argument("--out", default="calibrated.json", help="where to write the profile")
    args = ap.parse_args(argv)
    if args.command == "estimate":
        return estimate_cli.run(args)
    if args.command == "calibrate":
        return _calibrate(args)

    try:
        gran = parse_granularity(args.granularity)
        tree = load_shapes(args.shapes, DTYPES[args.dtype])
        t0 = time.perf_counter()
        spec = plan(tree, args.world_size, granularity=gran, alignment_bytes=args.alignment_bytes)
        secs = time.perf_counter() - t0
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    check_spec(spec, placements=False)
    n = sum(1 for _ in spec.tensors())
    print(f"{args.shapes}: {n} tensors, m={args.world_size}, granularity {args.granularity}, "
          f"{args.dtype}, planned in {secs:.3f} s")
    describe(spec)
    if args.png:
        from vfsdp.interop.visualize import visualize

        if args.unit is None:  # the most padded
            unit = max(spec.units, key=lambda k: spec.units[k].padded_numel - spec.units[k].total_numel)
        else:
            unit = () if args.unit in ("root", "<root>", "") else _logical((args.unit,))
        try:
            fig = visualize(spec, unit, figure=True, max_ranks=args.max_ranks)
        except (ValueError, ImportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        fig.savefig(args.png, dpi=110)
        import matplotlib.pyplot as plt

        plt.close(fig)
        print(f"drew unit {unit_name(unit)} (at most {args.max_ranks} ranks) to {args.png}")
    if args.suggest:
        suggest(tree, args.world_size, gran, DTYPES[args.dtype])
    return 0
