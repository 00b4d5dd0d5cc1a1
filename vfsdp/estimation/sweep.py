"""``vfsdp.estimation.sweep``: one model's estimate at many GPU counts, reading the tree once.

What :func:`~vfsdp.estimation.estimate` reads of a plan splits three ways, and a sweep does each
part once:

* the tree (its structure, each unit's tensors and blocks, what the shape rules read):
  :func:`vfsdp.planner.plan.prepare` and :class:`~vfsdp.estimation.costs.Shapes`, once;
* each shard group size ``m``: the units' layouts (:func:`vfsdp.planner.plan.unit_layouts`, no
  per-tensor specs) and the optimizer's state on its first and last rank, once per ``m``;
* each GPU count: the schedule and the rings (:func:`~vfsdp.estimation.predict.predict`),
  which reads units, not tensors.

Each row equals ``estimate(plan(params, (gpus // shard, shard)), ...)`` (tested), and with
``ep`` the same with ``experts=`` the plan of one expert-parallel rank's share
(:func:`expert_share`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional, Union

import optree

from vfsdp._gc import paused_gc
from vfsdp.estimation import checks
from vfsdp.estimation.costs import EXPERT, Shapes
from vfsdp.estimation.hardware import Hardware
from vfsdp.estimation.memory import alike_members, optimizer_bytes
from vfsdp.estimation.model import optimizer_for
from vfsdp.estimation.options import Options
from vfsdp.estimation.predict import Estimate, PlanSummary, predict
from vfsdp.planner.abstract import ShapeDtype, is_tensor_leaf, leaf_meta
from vfsdp.planner.flatten import flatten_with_path
from vfsdp.planner.granularity import format_path
from vfsdp.planner.plan import prepare, unit_layouts

__all__ = ["sweep", "shard_sizes", "expert_share"]

def shard_sizes(gpus: int, gpus_per_node: int) -> list:
    """The shard group sizes a sweep tries for ``gpus`` GPUs, smallest first: the divisors of
    ``gpus`` from one node up that are one node, ``gpus`` or a power of two."""
    node = min(gpus, gpus_per_node)
    return [d for d in range(node, gpus + 1) if gpus % d == 0 and
            (d in (node, gpus) or (d & (d - 1)) == 0)] or [gpus]


def expert_share(params: Any, ep: int) -> tuple:
    """``(rest, experts)``: the tree without its routed experts, and expert-parallel rank 0's
    share of them (every tensor at its own path; what is not in a tree is ``None``).

    Routed experts are tensors on a path through ``experts.<i>`` (one expert's tensors: the
    rank keeps the first ``n / ep`` of the ``n`` experts under each ``experts``) or through
    ``experts`` with the experts stacked on dim 0 (it keeps a ``ShapeDtype`` of ``1 / ep``
    of them).

    Raises:
        ValueError: no routed experts, or a count of experts ``ep`` does not divide (naming
            the path).

    Example:
        >>> tree = {"layers": [{"attn": torch.empty(4, 4, device="meta"), "experts": [
        ...     {"w": torch.empty(4, 8, device="meta")} for _ in range(4)]}]}
        >>> rest, experts = expert_share(tree, 2)
        >>> rest["layers"][0]["experts"][0], [e["w"] is not None
        ...                                   for e in experts["layers"][0]["experts"]]
        ({'w': None}, [True, True, False, False])
    """
    checks.count("expert parallelism", "ep", ep)
    paths, leaves, treespec = optree.tree_flatten_with_path(params)
    found = [(i, name, m) for i, name in enumerate(".".join(map(str, p)) for p in paths)
             if is_tensor_leaf(leaves[i]) and (m := EXPERT.search(name))]  # (leaf, path, match)
    if not found:
        raise ValueError("expert parallelism: the tree has no routed experts (paths through "
                         "'experts.<i>' or stacked under 'experts'); pass ep=1")
    counts: dict = {}  # the path up to 'experts' -> the expert indices under it
    for _, name, m in found:
        if m.group(3):
            counts.setdefault(name[:m.start(3)], set()).add(m.group(3))
    # the same -> the first n / ep of them, by number (from 0 or from 1 alike)
    kept = {prefix: set(sorted(ids, key=int)[:len(ids) // ep]) for prefix, ids in counts.items()}
    rest, share = list(leaves), [None] * len(leaves)
    for i, name, m in found:
        rest[i] = None
        shape, dtype, _ = leaf_meta(leaves[i])
        if m.group(3):
            n = len(counts[name[:m.start(3)]])
            if n % ep:
                raise ValueError(f"expert parallelism: {format_path(paths[i])} is one of {n} "
                                 f"experts, which ep={ep} does not divide")
            share[i] = ShapeDtype(shape, dtype) if m.group(3) in kept[name[:m.start(3)]] else None
        elif not shape:
            raise ValueError(f"expert parallelism: {format_path(paths[i])} is a scalar under "
                             f"'experts', so it stacks no experts to split; move it out of "
                             f"'experts' or give it the experts on dim 0")
        elif shape[0] % ep:
            raise ValueError(f"expert parallelism: {format_path(paths[i])} stacks "
                             f"{shape[0]} experts on dim 0, which ep={ep} does not divide")
        else:
            share[i] = ShapeDtype((shape[0] // ep, *shape[1:]), dtype)
    return optree.tree_unflatten(treespec, rest), optree.tree_unflatten(treespec, share)


def sweep(params: Any, gpus: Sequence[int], *, hw: Union[str, Hardware] = "h100",
          optimizer: Any = "adamw", shard: Optional[int] = None, ep: int = 1,
          granularity: Any = None, units: Any = None, tokens_per_gpu: Optional[int] = None,
          global_tokens: Optional[int] = None, vs: Sequence[str] = (),
          micro_batch_tokens: Optional[int] = None, **options: Any) -> list:
    """Estimate one model at each GPU count, as HSDP with replicas of one shard group.

    Args:
        params: The parameter tree (real or ``meta`` tensors, or ``ShapeDtype`` leaves).
        gpus: The GPU counts.
        hw: A hardware profile or its name.
        optimizer: A vfsdp optimizer or its name; its granularity plans the units unless
            ``granularity`` is given.
        shard: The shard group's size (capped at each count, which it must divide);
            default: the smallest of :func:`shard_sizes` at which the model fits, else the
            largest.
        ep: Expert parallelism: the routed experts (:func:`expert_share`) split over ``ep``
            consecutive GPUs, each share sharded over the GPUs divided by ``ep`` (its shard
            group the largest that divides both that and the model's), the rest of the
            model over every GPU.
        granularity, units: As :func:`vfsdp.plan`'s.
        tokens_per_gpu: Tokens each GPU processes per step (weak scaling; default 4096).
        global_tokens: Tokens per step over all GPUs (strong scaling), instead.
        vs: Also ``"fsdp2"`` and/or ``"megatron"``: the same plan under their sharding rule
            and padding (``estimate(baseline=...)``).
        micro_batch_tokens: Tokens per GPU of one micro-batch, the same at every count (the
            micro-batches are the count's tokens over it), instead of ``micro_batches``.
        **options: :func:`~vfsdp.estimation.estimate`'s other arguments (``param_dtype``,
            ``experts_per_token``, ``seq``, ``recompute``, ``prefetch``, ...).

    Returns:
        ``[(system, Estimate), ...]``: per count, ``"vfsdp"`` then each of ``vs``.

    Raises:
        ValueError: no count, a count below 1 or that ``ep`` does not divide, a ``shard``,
            ``ep``, ``tokens_per_gpu``, ``global_tokens`` or ``micro_batch_tokens`` not an
            int >= 1, a ``shard`` that does not divide a count, ``micro_batch_tokens`` that
            do not divide a count's tokens or given with ``micro_batches``, both
            ``tokens_per_gpu`` and ``global_tokens``, fewer ``global_tokens`` than GPUs, a
            ``vs`` other than fsdp2/megatron, and :func:`~vfsdp.estimation.estimate`'s errors.
        TypeError: ``rank=``, ``baseline=`` or ``tokens_per_rank=`` (estimate's own).

    Example:
        >>> params = {"layers": [{"w": torch.empty(1024, 1024, device="meta")}
        ...                      for _ in range(8)]}
        >>> rows = sweep(params, [8, 64], hw="h100", tokens_per_gpu=2048)
        >>> [(system, e.gpus, e.shard) for system, e in rows]
        [('vfsdp', 8, 8), ('vfsdp', 64, 8)]
    """
    if tokens_per_gpu is not None and global_tokens is not None:
        raise ValueError("sweep: give tokens_per_gpu (weak scaling) or global_tokens (strong "
                         "scaling), not both")
    checks.count("sweep", "ep", ep)
    for name, value in (("shard", shard), ("tokens_per_gpu", tokens_per_gpu),
                        ("global_tokens", global_tokens), ("micro_batch_tokens", micro_batch_tokens)):
        checks.count("sweep", name, value, optional=True)
    if micro_batch_tokens and "micro_batches" in options:
        raise ValueError("sweep: give micro_batches (a count) or micro_batch_tokens (a size), "
                         "not both")
    if not isinstance(gpus, (list, tuple, range)):
        raise ValueError(f"sweep: gpus takes a list of GPU counts, got {gpus!r}; pass e.g. "
                         f"[8, 64]")
    gpus = list(gpus)
    if not gpus:
        raise ValueError("sweep: gpus is empty; pass at least one GPU count, e.g. [8, 64]")
    if any(isinstance(g, bool) or not isinstance(g, int) or g < 1 or g % ep for g in gpus):
        raise ValueError(f"sweep: GPU counts must be ints >= 1 that ep={ep} divides, got "
                         f"{list(gpus)}")
    if global_tokens is not None and global_tokens < max(gpus):
        raise ValueError(f"sweep: global_tokens={global_tokens} gives no token to some of "
                         f"{max(gpus)} GPUs; pass at least one token per GPU")
    unknown = [s for s in vs if s not in ("fsdp2", "megatron")]
    if unknown:
        raise ValueError(f"sweep: vs names {unknown}; pass 'fsdp2' and/or 'megatron'")
    for key in ("rank", "baseline", "tokens_per_rank"):
        if key in options:
            raise TypeError(f"sweep: {key}= is estimate()'s; a sweep takes the larger of the "
                            f"first and last rank's state, vs= for baselines and "
                            f"tokens_per_gpu= or global_tokens= for the tokens")

    def tokens(count: int) -> int:
        n = tokens_per_gpu or (global_tokens // count if global_tokens else 4096)
        if micro_batch_tokens and n % micro_batch_tokens:
            raise ValueError(f"sweep: micro_batch_tokens={micro_batch_tokens} does not divide "
                             f"the {n} tokens per GPU at {count} GPUs; pass a divisor")
        return n

    o = Options(hw=hw, muon=optimizer == "muon", tokens_per_rank=tokens(gpus[0]), **options)
    with paused_gc():  # see vfsdp._gc: a sweep builds many small objects
        return _rows(params, o, optimizer, ep, granularity, units, micro_batch_tokens, gpus, shard,
                     tokens, vs)


def _rows(params, o: Options, optimizer, ep, granularity, units, micro_tokens, gpus, shard, tokens_of,
          vs) -> list:
    """:func:`sweep`'s rows: the prepared trees once, and per shard group size the parts
    :func:`predict` reads."""
    prepared, opts, parts = [], [], []  # parts: per tree, m -> [layouts, state]
    for tree in [params] if ep == 1 else expert_share(params, ep):
        flat = flatten_with_path(tree)
        opts.append(optimizer_for(optimizer, flat))
        prepared.append(prepare(tree, opts[-1].granularity if granularity is None else granularity,
                                units, flat=flat))
        parts.append({})
    alike = [alike_members(p) for p in prepared]  # units laid out alike
    shapes = [Shapes.of_prepared(p) for p in prepared]  # read tensors: once

    def part(i: int, m: int, gpus: int, state: bool) -> PlanSummary:
        """Tree ``i``'s :class:`PlanSummary` over ``gpus`` in shard groups of ``m``; without its
        optimizer's ``state`` (0 bytes) where ``state=False``."""
        entry = parts[i].setdefault(m, [None, None])
        if entry[0] is None:
            entry[0] = unit_layouts(prepared[i], m)
        if state and entry[1] is None:
            entry[1] = max(optimizer_bytes(opts[i], entry[0], r, alike=alike[i]) for r in {0, m - 1})
        return PlanSummary(entry[0], (m,) if m == gpus else (gpus // m, m), entry[1] or 0, shapes[i])

    def one(count: int, m: int, tokens: int, baseline: Optional[str], state: bool = True) -> Estimate:
        """The estimate at ``count`` GPUs in shard groups of ``m``; ``state=False``: without
        the optimizer's state, a lower bound of the memory (what fits so does not, first)."""
        if count % m:
            raise ValueError(f"sweep: shard={m} does not divide {count} GPUs")
        model, data = part(0, m, count, state), count // ep
        experts = part(1, math.gcd(m, data), data, state) if ep > 1 else None
        mb = tokens // micro_tokens if micro_tokens else o.micro_batches
        return predict(model, experts, replace(
            o, tokens_per_rank=tokens, baseline=baseline, ep=ep if experts else None, micro_batches=mb))

    out = []
    for count in gpus:
        tokens = tokens_of(count)
        best = None  # the estimate at m, where the search made it
        if shard is not None:
            m = min(shard, count)
        else:  # the smallest that fits, else the largest
            for m in shard_sizes(count, o.hw.gpus_per_node):
                best = None
                if one(count, m, tokens, None, state=False).fits:
                    best = one(count, m, tokens, None)
                    if best.fits:
                        break
        out.append(("vfsdp", best or one(count, m, tokens, None)))
        out.extend((s, one(count, m, tokens, s)) for s in vs)
    return out
