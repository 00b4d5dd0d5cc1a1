"""``python -m vfsdp estimate SHAPES.json --gpus 8,64,1024 --hw h800 --tokens-per-gpu 8192``.

Plans the shape list at each GPU count (the shard group ``--shard``, default: the smallest
divisor of the count, at least one node and a power of two or the count itself, at which
the model fits; the rest replicas; ``--ep N``: the routed experts split over N GPUs) and
prints
one row per count: memory per rank by kind, the step time split, tokens/s, MFU and whether
it fits. ``--vs fsdp2,megatron`` adds the same rows under those systems' sharding rules,
padding and copies (``estimate(baseline=...)``); ``--json`` writes the records, ``--png``
draws the scaling curves and the memory stack.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from vfsdp.estimation.checks import count, shape_dims
from vfsdp.estimation.hardware import PROFILES, hardware
from vfsdp.estimation.model import GiB
from vfsdp.estimation.sweep import sweep
from vfsdp.planner.granularity import parse_granularity
from vfsdp.planner.shapes import DTYPES, load_shapes

__all__ = ["add_parser", "run", "writable"]


def add_parser(sub) -> None:
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
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient accumulation: micro-batches per step (they split the tokens)")
    p.add_argument("--no-grad-sync", action="store_true",
                   help="with --micro-batches: reduce only the last micro-batch's gradients")
    p.add_argument("--logits-dtype", default="fp32", choices=sorted(DTYPES),
                   help="the loss's softmax and gradient dtype (default fp32)")
    p.add_argument("--float8", action="store_true",
                   help="float8 weight matmuls and float8 all-gathers")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--no-reshard", action="store_true", help="keep units after forward")
    p.add_argument("--vs", default="", help="also fsdp2 and/or megatron, comma-separated")
    p.add_argument("--json", help="write one record per GPU count and system here")
    p.add_argument("--png", help="draw scaling curves and the memory stack (matplotlib)")


def run(args, out=None) -> int:
    """Run the ``estimate`` subcommand; 0 on success, 2 on bad input (one ``error:`` line on
    stderr, before anything else is printed or written)."""
    out = out or sys.stdout
    try:
        counts = [_int("--gpus", x) for x in args.gpus.split(",") if x.strip()]
        if not counts:
            raise ValueError("--gpus: give at least one GPU count, e.g. --gpus 8,64")
        systems = [s.strip() for s in args.vs.split(",") if s.strip()]
        for name in ("tokens_per_gpu", "global_tokens", "shard", "top_k", "ep", "seq",
                     "micro_batches"):
            count("estimate", "--" + name.replace("_", "-"), getattr(args, name),
                  optional=True)
        tree = _shapes(args.shapes, DTYPES[args.master_dtype])
        gran = parse_granularity(args.granularity) if args.granularity else None
        hardware(args.hw)
        if args.png:
            import matplotlib  # noqa: F401  (refused now, not after the table)
        for path in (args.json, args.png):
            writable(path)
        t0 = time.perf_counter()
        rows = sweep(tree, counts, hw=args.hw, optimizer=args.optimizer, shard=args.shard,
                     ep=args.ep,
                     granularity=gran, tokens_per_gpu=args.tokens_per_gpu,
                     global_tokens=args.global_tokens, vs=systems,
                     param_dtype=DTYPES[args.param_dtype],
                     reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                     experts_per_token=args.top_k,
                     seq=args.seq, recompute=args.recompute, micro_batches=args.micro_batches,
                     grad_sync=not args.no_grad_sync, float8=args.float8,
                     logits_dtype=DTYPES[args.logits_dtype],
                     prefetch=not args.no_prefetch,
                     reshard_after_forward=not args.no_reshard)
        secs = time.perf_counter() - t0
    except (ValueError, TypeError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=out if out is not sys.stdout else sys.stderr)
        return 2
    print(f"{args.shapes} on {args.hw}, {args.optimizer}, {args.param_dtype} compute; "
          f"planned and estimated in {secs:.2f} s", file=out)
    head = (f"{'system':<9} {'gpus':>6} {'mesh':>11} {'GiB/rank':>9} {'params':>7} {'grads':>7} "
            f"{'optim':>7} {'buffers':>8} {'acts':>7} {'step s':>8} {'compute':>8} "
            f"{'exposed':>8} {'optim s':>8} {'tokens/s':>13} {'MFU%':>6}  fits")
    print(head, file=out)
    for system, e in rows:
        g = {k: v / GiB for k, v in e.memory.items()}
        mesh = f"{e.replicas}x{e.shard}" + (f" ep{e.ep}" if e.ep > 1 else "")
        print(f"{system:<9} {e.gpus:>6} {mesh:>11} "
              f"{e.memory_per_rank / GiB:>9.2f} {g['params']:>7.2f} {g['gradients']:>7.2f} "
              f"{g['optimizer']:>7.2f} {g['buffers']:>8.2f} {g['activations']:>7.2f} "
              f"{e.step_s:>8.3f} {e.compute_s:>8.3f} {e.exposed_comm_s:>8.3f} "
              f"{e.optimizer_s:>8.3f} {e.tokens_per_s:>13,.0f} {100 * e.mfu:>6.1f}  "
              f"{'yes' if e.fits else 'NO'}", file=out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dict(e.record(), system=s) for s, e in rows], f, indent=1)
    if args.png:
        print(_draw([e for s, e in rows if s == "vfsdp"], args.png), file=out)
    return 0


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
    base = rows[0].tokens_per_s / rows[0].gpus
    a.plot(gpus, [e.tokens_per_s for e in rows], "o-", label="projected")
    a.plot(gpus, [base * g for g in gpus], "--", label="linear")
    a.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="tokens/s", title="scaling")
    a.legend()
    kinds = list(rows[0].memory)
    bottom = [0.0] * len(rows)
    for k in kinds:
        vals = [e.memory[k] / GiB for e in rows]
        b.bar([str(g) for g in gpus], vals, bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set(xlabel="GPUs", ylabel="GiB per rank", title="memory per rank")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
