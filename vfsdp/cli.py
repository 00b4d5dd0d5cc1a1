"""Command line: ``python -m vfsdp plan SHAPES.json --world-size N --granularity rows:32``, and
``python -m vfsdp estimate SHAPES.json --gpus 8,64,1024 --hw h800``, and ``python -m vfsdp
calibrate --world-size 2`` (this machine's rates on the example model's block,
:func:`vfsdp.estimation.calibrate.calibrate`).

``plan`` prints one line per distinct unit (S, padding, the certified bound, tensors per rank,
and the padding FSDP2 and Megatron-FSDP would need), a total, split options, and with
``--suggest`` a table of every ``replicate x shard`` factorisation of N with a recommendation.

``estimate`` plans the shape list at each GPU count (the shard group ``--shard``, default: the
smallest divisor of the count, at least one node and a power of two or the count itself, at
which the model fits; the rest replicas; ``--ep N``: the routed experts split over N GPUs) and
prints one row per count: memory per rank by kind, the step time split, tokens/s, MFU and
whether it fits. ``--vs fsdp2,megatron`` adds the same rows under those systems' sharding
rules, padding and copies (``estimate(baseline=...)``); ``--json`` writes the records,
``--png`` draws the scaling curves and the memory stack.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Optional

import torch

from vfsdp.estimation.checks import count, shape_dims
from vfsdp.estimation.hardware import PROFILES, hardware
from vfsdp.estimation.memory import baseline_padding, group_keys
from vfsdp.estimation.options import GiB
from vfsdp.estimation.sweep import sweep
from vfsdp.planner.check import check_spec, plan_stats
from vfsdp.planner.granularity import parse_granularity
from vfsdp.planner.plan import plan
from vfsdp.planner.shapes import DTYPES, load_shapes
from vfsdp.planner.spec import ShardSpec, unit_name


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def describe(spec: ShardSpec) -> None:
    """Print the per-distinct-unit table of a spec and its totals, with FSDP2's and
    Megatron-FSDP's padding."""
    print(f"{'unit':<32} {'count':>5} {'tensors':>7} {'S':>14} {'padding%':>10} {'bound%':>10} "
          f"{'tensors/rank':>14} {'FSDP2%':>9} {'Megatron%':>10}")
    tot_f2 = tot_mg = 0
    for keys in group_keys((u.signature, key) for key, u in spec.units.items()):
        u = spec.units[keys[0]]
        f2, mg = (baseline_padding(u, s) for s in ("fsdp2", "megatron"))
        tot_f2, tot_mg = tot_f2 + f2 * len(keys), tot_mg + mg * len(keys)
        lo, med, hi = u.tensors_per_rank_summary()
        e = max(u.total_numel, 1)
        name = unit_name(keys[0]) + (f" (+{len(keys) - 1} alike)" if len(keys) > 1 else "")
        print(f"{name:<32} {len(keys):>5} {len(u.paths):>7} {u.shard_numel:>14,} "
              f"{100 * u.padding_ratio:>10.4f} {100 * u.lower_bound_ratio:>10.4f} "
              f"{f'{lo}/{med:g}/{hi}':>14} {100 * f2 / e:>9.3f} {100 * mg / e:>10.3f}")
        if u.split is not None:
            print(f"    option: {u.split!r}")
    st = plan_stats(spec)
    e = max(st["total_numel"], 1)
    print(f"{'total':<32} {len(spec.units):>5} {st['tensors']:>7} {'':>14} "
          f"{100 * st['padding_ratio']:>10.4f} {100 * st['lower_bound_ratio']:>10.4f} {'':>14} "
          f"{100 * tot_f2 / e:>9.3f} {100 * tot_mg / e:>10.3f}")


def suggest(tree, world_size: int, granularity, dtype: torch.dtype,
            max_padding: float = 0.01) -> None:
    """Print every ``replicate x shard`` factorisation of ``world_size``, and the pick: the
    largest shard group whose padding is at most ``max_padding``.
    Bytes per rank assume sharded parameters in ``dtype``, AdamW's two fp32 states, and two
    all-gathers of every unit per step (forward, and again in backward).
    """
    print(f"\n{'replicate x shard':>18} {'padding%':>10} {'bound%':>10} {'params/rank':>14} "
          f"{'Adam state/rank':>16} {'all-gather/rank/step':>21}")
    best = None
    for shard in (s for s in range(1, world_size + 1) if world_size % s == 0):
        rep = world_size // shard
        spec = plan(tree, (rep, shard), granularity=granularity)
        st, s_total = plan_stats(spec), sum(u.shard_numel for u in spec.units.values())
        gathered = 2 * sum((u.world_size - 1) * u.shard_numel for u in spec.units.values())
        print(f"{f'{rep} x {shard}':>18} {100 * st['padding_ratio']:>10.4f} "
              f"{100 * st['lower_bound_ratio']:>10.4f} {_gib(s_total * dtype.itemsize):>14} "
              f"{_gib(s_total * 4 * 2):>16} {_gib(gathered * dtype.itemsize):>21}")
        if st["padding_ratio"] <= max_padding:
            best = (rep, shard)
    if best is None:
        print(f"no factorisation keeps padding <= {100 * max_padding:g}%; use a coarser unit "
              f"split or a finer granularity")
    else:
        print(f"recommended: replicate {best[0]} x shard {best[1]} (the largest shard group with "
              f"padding <= {100 * max_padding:g}%)")


def _calibrate_rank(tokens: int, repeats: int):
    from vfsdp.collectives.comm import device_for
    from vfsdp.estimation.calibrate import calibrate
    from vfsdp.testing.models import example_layer

    return calibrate(example_layer(tokens, device=device_for()), repeats=repeats)


def _calibrate(args) -> int:
    """Run ``calibrate`` on the example model's block: measure, write the profile, print it."""
    import torch.distributed as dist

    with _checking():
        for name in ("world_size", "tokens", "repeats"):
            count("calibrate", "--" + name.replace("_", "-"), getattr(args, name))
        writable(args.out)
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


def _estimate_parser(sub) -> None:
    """The ``estimate`` subcommand's options."""
    p = sub.add_parser("estimate", help="memory and step time per GPU count, from a shape list")
    p.add_argument("shapes", help='JSON file {"params": [["dotted.name", [shape]], ...]}')
    p.add_argument("--gpus", required=True, help="comma-separated GPU counts, e.g. 8,64,1024")
    p.add_argument("--hw", default="h100",
                   help=f"profile ({', '.join(PROFILES)}) or a JSON file from calibrate")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--tokens-per-gpu", type=int, help="weak scaling (default 4096)")
    batch.add_argument("--global-tokens", type=int, help="strong scaling: tokens per step")
    p.add_argument("--shard", type=int, help="shard group size (default: see above)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit", "muon", "soap",
                                                               "shampoo"])
    p.add_argument("--granularity", "-g",
                   help="element, rows:K, whole or int (default: what --optimizer needs)")
    p.add_argument("--master-dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--param-dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES),
                   help="reduce-scatter dtype (default: --param-dtype)")
    p.add_argument("--top-k", type=int, help="routed experts per token (MoE shape lists)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: routed experts split over this many GPUs")
    p.add_argument("--seq", type=int, help="sequence length (adds attention FLOPs)")
    p.add_argument("--recompute", nargs="?", const="full", default=False,
                   choices=["full", "selective"],
                   help="activation checkpointing: full (the default when given) or selective "
                        "(torchtitan's op-level policy)")
    micro = p.add_mutually_exclusive_group()
    micro.add_argument("--micro-batches", type=int,
                       help="gradient accumulation: micro-batches per step (they split the tokens)")
    micro.add_argument("--micro-batch-tokens", type=int,
                       help="tokens per GPU of one micro-batch, the same at every count")
    p.add_argument("--no-grad-sync", dest="grad_sync", action="store_false",
                   help="with --micro-batches: reduce only the last micro-batch's gradients")
    p.add_argument("--logits-dtype", default="fp32", choices=sorted(DTYPES),
                   help="the loss's softmax and gradient dtype (default fp32)")
    p.add_argument("--float8", action="store_true",
                   help="float8 weight matmuls and float8 all-gathers")
    p.add_argument("--compiled", action="store_true",
                   help="under torch.compile: the kernels between the matmuls fused, the loss one, "
                        "and the activations its partitioner keeps")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false")
    p.add_argument("--no-reshard", dest="reshard_after_forward", action="store_false",
                   help="keep units after forward")
    p.add_argument("--bf16-all-gathers", dest="float8_all_gather", action="store_const",
                   const=False, help="with --float8: the weights gathered and kept in bf16 (float8 "
                                     "matmuls only)")
    p.add_argument("--float8-fused-casts", action="store_const", const=True,
                   help="with --float8: its casts in fused kernels without --compiled (Transformer "
                        "Engine's; torchao's run as separate kernels in eager mode)")
    p.add_argument("--float8-recipe", help="with --float8: torchao's scaling, tensorwise "
                                           "(default) or rowwise (per-row scales, slower GEMMs, "
                                           "bf16 all-gathers)")
    p.add_argument("--float8-saved-weights", action="store_true",
                   help="with --float8 --compiled: each layer's unsharded float8 weights saved "
                        "for its backward (torchao before 2025-06 without "
                        "force_recompute_fp8_weight_in_bwd; none in checkpointed layers)")
    p.add_argument("--eager-loss", dest="fused_loss", action="store_const", const=False,
                   help="with --compiled: the loss stays eager (its softmax and gradient held)")
    p.add_argument("--vs", default="", help="also fsdp2 and/or megatron, comma-separated")
    p.add_argument("--json", help="write one record per GPU count and system here")
    p.add_argument("--png", help="draw scaling curves and the memory stack (matplotlib)")


def _estimate(args) -> int:
    """Run the ``estimate`` subcommand; bad input is refused (:func:`_checking`) before
    anything is printed or written."""
    with _checking():
        counts = [_int("--gpus", x) for x in args.gpus.split(",") if x.strip()]
        if not counts:
            raise ValueError("--gpus: give at least one GPU count, e.g. --gpus 8,64")
        systems = [s.strip() for s in args.vs.split(",") if s.strip()]
        for name in ("tokens_per_gpu", "global_tokens", "shard", "top_k", "ep", "seq",
                     "micro_batches", "micro_batch_tokens"):
            count("estimate", "--" + name.replace("_", "-"), getattr(args, name), optional=True)
        tree = _shapes(args.shapes, DTYPES[args.master_dtype])
        gran = parse_granularity(args.granularity) if args.granularity else None
        hardware(args.hw)
        if args.png:
            import matplotlib  # noqa: F401  (refused now, not after the table)
        for path in (args.json, args.png):
            writable(path)
        options = {k: v for k, v in vars(args).items() if k not in _NOT_SWEPT}
        options.update({k: DTYPES[options[k]] for k in ("param_dtype", "reduce_dtype", "logits_dtype")
                        if options[k]})
        options["experts_per_token"] = options.pop("top_k")
        if args.micro_batches is None:  # sweep refuses micro_batches with micro_batch_tokens
            del options["micro_batches"]
        t0 = time.perf_counter()
        rows = sweep(tree, counts, granularity=gran, vs=systems, **options)
        secs = time.perf_counter() - t0
    print(f"{args.shapes} on {args.hw}, {args.optimizer}, {args.param_dtype} compute; "
          f"planned and estimated in {secs:.2f} s")
    print(f"{'system':<9} {'gpus':>6} {'mesh':>11} {'GiB/rank':>9} {'params':>7} {'grads':>7} "
          f"{'optim':>7} {'buffers':>8} {'acts':>7} {'step s':>8} {'compute':>8} "
          f"{'exposed':>8} {'optim s':>8} {'tokens/s':>13} {'MFU%':>6}  fits")
    for system, e in rows:
        g = {k: v / GiB for k, v in e.memory.items()}
        mesh = f"{e.replicas}x{e.shard}" + (f" ep{e.ep}" if e.ep > 1 else "")
        print(f"{system:<9} {e.gpus:>6} {mesh:>11} "
              f"{e.memory_per_rank / GiB:>9.2f} {g['params']:>7.2f} {g['gradients']:>7.2f} "
              f"{g['optimizer']:>7.2f} {g['buffers']:>8.2f} {g['activations']:>7.2f} "
              f"{e.step_s:>8.3f} {e.compute_s:>8.3f} {e.exposed_comm_s:>8.3f} "
              f"{e.optimizer_s:>8.3f} {e.tokens_per_s:>13,.0f} {100 * e.mfu:>6.1f}  "
              f"{'yes' if e.fits else 'NO'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dict(e.record(), system=s) for s, e in rows], f, indent=1)
    if args.png:
        print(_draw([e for s, e in rows if s == "vfsdp"], args.png))
    return 0


_NOT_SWEPT = {"command", "shapes", "gpus", "granularity", "vs", "master_dtype", "json", "png"}


def _int(option: str, text: str) -> int:
    try:
        return count("estimate", option, int(text.strip()))
    except ValueError:
        raise ValueError(f"estimate: {option} takes ints >= 1, got {text.strip()!r}") from None


def _shapes(path: str, dtype) -> object:
    """The shape list at ``path``, its structure and dimensions checked first."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    shape_dims(path, data)
    return load_shapes(data, dtype)


def writable(path: Optional[str]) -> None:
    """Make an output file's folder, or refuse a path that cannot be written: called before
    anything is computed or printed.

    Args:
        path: The file (``None``: nothing to check).

    Raises:
        ValueError: ``path`` is a folder, its folder is a file, or not writable.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     writable(os.path.join(tmp, "new", "rows.json"))
        ...     os.path.isdir(os.path.join(tmp, "new"))
        True
    """
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{path}: {folder} is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{path}: {folder} is not writable")


def _draw(rows: list, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    gpus = [e.gpus for e in rows]
    a.plot(gpus, [e.tokens_per_s for e in rows], "o-", label="projected")
    a.plot(gpus, [rows[0].tokens_per_s / rows[0].gpus * g for g in gpus], "--", label="linear")
    a.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="tokens/s", title="scaling")
    a.legend()
    bottom = [0.0] * len(rows)
    for k in rows[0].memory:
        vals = [e.memory[k] / GiB for e in rows]
        b.bar([str(g) for g in gpus], vals, bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set(xlabel="GPUs", ylabel="GiB per rank", title="memory per rank")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


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
    _estimate_parser(sub)
    p = sub.add_parser("calibrate", help="measure this machine's rates into a profile")
    p.add_argument("--world-size", "-n", type=int, default=2,
                   help="gloo processes to start (under torchrun: its world)")
    p.add_argument("--tokens", type=int, default=256, help="tokens of the timed layer")
    p.add_argument("--repeats", type=int, default=21, help="timed repetitions per median")
    p.add_argument("--out", default="calibrated.json", help="where to write the profile")
    args = ap.parse_args(argv)
    try:
        return {"plan": _plan, "estimate": _estimate, "calibrate": _calibrate}[args.command](args)
    except _Refused as exc:
        print(f"error: {exc.__cause__}", file=sys.stderr)
        return 2


class _Refused(Exception):
    """Bad input, found by :func:`_checking`: ``main`` prints one ``error:`` line, returns 2."""


@contextlib.contextmanager
def _checking() -> Iterator[None]:
    """Where a subcommand checks its input (before it prints or writes anything, or a bad
    ``--unit`` after the table): what is raised there is bad input (:class:`_Refused`); what is
    raised elsewhere is not, and shows its traceback."""
    try:
        yield
    except (ValueError, TypeError, OSError, ImportError) as exc:
        raise _Refused from exc


def _plan(args) -> int:
    """Run the ``plan`` subcommand; bad input is refused (:func:`_checking`) before anything
    is printed (a bad ``--unit``, after the table)."""
    with _checking():
        gran = parse_granularity(args.granularity)
        tree = _shapes(args.shapes, DTYPES[args.dtype])
        t0 = time.perf_counter()
        spec = plan(tree, args.world_size, granularity=gran, alignment_bytes=args.alignment_bytes)
        secs = time.perf_counter() - t0
    check_spec(spec, placements=False)
    print(f"{args.shapes}: {sum(1 for _ in spec.tensors())} tensors, m={args.world_size}, "
          f"granularity {args.granularity}, {args.dtype}, planned in {secs:.3f} s")
    describe(spec)
    if args.png:
        from vfsdp.interop.visualize import visualize

        unit = max(spec.units, key=lambda k: spec.units[k].padded_numel - spec.units[k].total_numel) \
            if args.unit is None else "<root>" if args.unit in ("root", "") else args.unit
        with _checking():
            fig = visualize(spec, unit, figure=True, max_ranks=args.max_ranks)
        fig.savefig(args.png, dpi=110)
        import matplotlib.pyplot as plt

        plt.close(fig)
        print(f"drew unit {unit_name(unit)} (at most {args.max_ranks} ranks) to {args.png}")
    if args.suggest:
        suggest(tree, args.world_size, gran, DTYPES[args.dtype])
    return 0
