"""The per-unit packing problem, on plain integers (no torch, no process group).

A unit is a list of tensors with ``numel`` e_t and indivisible block g_t (elements). Find an
order, offsets ``l_t`` in a flat buffer of ``m * S`` elements, and the per-rank size ``S`` with

1. no block crossing a rank boundary: every boundary ``k*S`` strictly inside ``(l_t, l_t+e_t)``
   has ``(k*S - l_t) % g_t == 0`` (a short last block, when ``g_t`` does not divide ``e_t``, is
   therefore never split either);
2. each tensor one contiguous interval, intervals disjoint: padding lies only between tensors;
3. every rank holding exactly ``S`` elements;
4. ``S`` a positive multiple of the alignment ``a``,

minimising ``S``. The problem is NP-hard (Partition reduces to it), so :func:`pack` is a
heuristic with a certificate: :func:`lower_bound` is the smallest ``S`` that satisfies these
necessary conditions::

    m*S >= E                   (E = sum of e_t)
    S   >= max_t min(g_t, e_t) (the largest block)
    S % a == 0, S > 0
    S % g_t == 0 for every t with e_t >= 2*S   (such a tensor contains a whole shard, whose two
                                                boundaries must both fall on block edges)

How :func:`pack` works:

* For a fixed order and ``S``, placing each tensor at its earliest feasible start is exact
  (feasible starts for a later cursor are a subset of those for an earlier one), and costs
  O(1) per tensor: a tensor either fits where the cursor is, or at the first block-aligned
  start that puts the next boundary on a block edge, or at the next shard's start (every later
  shard repeats that pattern).
* Candidate ``S`` values are only the *admissible* ones (those meeting the lower-bound
  conditions, enumerated in increasing order by ``_Bound.next_admissible``), scanned upward from
  the bound. At each candidate four strategies are tried: the given order, numel-descending,
  and block-descending. The first feasible candidate wins, so within the scan window the
  result is optimal for the given order and at least as good as every fixed order tried.
* If no candidate within the window is feasible, an exponential search (doubling increments
  above the bound) then bisection over admissible values finds a feasible ``S`` per fixed
  order, and the smallest is kept.
* Then, if that ``S`` is more than ``TOLERANCE * E / m`` above the bound, a bounded
  backtracking search over orders of tensor classes (:func:`_search`; its first descent is a
  best-fit greedy) is tried at the bound and, failing that, bisected between the bound and
  the fixed orders' ``S``.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

__all__ = ["Packing", "lower_bound", "place_in_order", "pack"]

SCAN_WINDOW = 8
"""How many admissible ``S`` values above the bound :func:`pack` scans before bisecting."""

SEARCH_PROBES = 8
"""At most this many bisection probes of the search per unit."""

SEARCH_BUDGET = 2_000
"""Placements one backtracking search probe may make (at least 4 per tensor)."""

TOLERANCE = 1e-4
"""Stop improving once padding is within this fraction of E above the lower bound's..."""

SMALL_UNIT = 64
"""...except for units of at most this many tensors, which always search when above the bound."""


@dataclass(frozen=True)
class Packing:
    """The solution for one unit.

    Attributes:
        shard_numel: ``S``, elements per rank.
        world_size: ``m``.
        offsets: Start of each tensor in the ``m*S`` buffer, in input order.
        order: Input indices in buffer order.
        lower_bound: The certified lower bound on ``S``.
        strategy: Which strategy produced the order (``"given"``, ``"numel-desc"``,
            ``"block-desc"`` or ``"search"``).

    Example:
        >>> p = pack([10, 6], [1, 1], 4, 2)          # 16 elements on 4 ranks: S = 4, no padding
        >>> p.shard_numel, p.offsets, p.lower_bound, p.strategy
        (4, (0, 10), 4, 'given')
    """

    shard_numel: int
    world_size: int
    offsets: tuple[int, ...]
    order: tuple[int, ...]
    lower_bound: int
    strategy: str


class _Bound:
    """Precomputed data to enumerate admissible ``S`` values quickly."""

    def __init__(self, numels: Sequence[int], blocks: Sequence[int], align: int) -> None:
        first, second = operator.itemgetter(0), operator.itemgetter(1)
        items = sorted(((e, g) for e, g in zip(numels, blocks) if e > 0), key=first, reverse=True)
        self.numels_desc = list(map(first, items))
        self.neg_numels = list(map(operator.neg, self.numels_desc))  # ascending, for bisect
        self.prefix_lcm = list(itertools.accumulate(map(second, items), math.lcm, initial=align))

    def next_admissible(self, s: int) -> int:
        s = max(s, 1)
        while True:
            # k = number of tensors with e >= 2*s (a prefix of the numel-descending list)
            k = bisect.bisect_right(self.neg_numels, -2 * s)
            step = self.prefix_lcm[k]
            cand = -(-s // step) * step
            if k == 0:
                return cand
            # The constraint set is constant on [s, drop) where the smallest member leaves it.
            drop = self.numels_desc[k - 1] // 2 + 1
            if cand < drop:
                return cand
            s = drop


def _bound(numels: Sequence[int], blocks: Sequence[int], m: int, align: int
           ) -> tuple[list[int], _Bound, int]:
    """The effective blocks (a block longer than its tensor is the tensor), their
    :class:`_Bound` and the lower bound on ``S``."""
    eff = [max(1, min(g, e)) if e > 0 else 1 for e, g in zip(numels, blocks)]
    bound = _Bound(numels, eff, align)
    return eff, bound, bound.next_admissible(max(-(-sum(numels) // m), max(eff, default=1), 1))


def lower_bound(numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int) -> int:
    """The certified lower bound on ``S`` (see the module docstring).

    Args:
        numels: Elements of each tensor.
        blocks: Block size of each tensor, in elements (``>= 1``).
        world_size: ``m``.
        align: Alignment of ``S``, in elements.

    Returns:
        The smallest admissible ``S``.

    Raises:
        ZeroDivisionError: ``world_size`` or ``align`` is 0.

    Example:
        >>> lower_bound([10, 6], [1, 1], 4, 2)
        4
    """
    return _bound(numels, blocks, world_size, align)[2]


def _earliest_start(lo: int, e: int, g: int, s: int, cap: int) -> Optional[int]:
    """Earliest start >= lo of an (e, g) tensor with shard size s in a buffer of cap elements."""
    for _ in range(2):
        boundary = (lo // s + 1) * s
        if lo + e <= boundary:
            return lo if lo + e <= cap else None
        start = lo + (boundary - lo) % g
        if start + e > cap:
            return None
        if start < boundary and (start + e <= boundary + s or s % g == 0):
            return start
        lo = boundary
    return None


def place_in_order(
    order: Sequence[int], numels: Sequence[int], blocks: Sequence[int], s: int, world_size: int
) -> Optional[list[int]]:
    """Earliest-start placement of the tensors in ``order`` for shard size ``s``.

    Args:
        order: Tensor indices in buffer order.
        numels: Elements per tensor.
        blocks: Block per tensor (``>= 1``).
        s: Shard size ``S``.
        world_size: ``m``.

    Returns:
        Offsets in input order, or ``None`` when this order does not fit in ``m * s``.

    Example:
        >>> place_in_order([0, 1], [3, 4], [1, 2], 4, 2)
        [0, 4]
    """
    cap = s * world_size
    slack = cap - sum(numels)  # padding budget: once spent, no later start can fit
    offsets = [0] * len(numels)
    cur = 0
    for i in order:  # a 0-size tensor starts at the cursor (which never passes cap)
        e = numels[i]
        start = _earliest_start(cur, e, blocks[i], s, cap)
        if start is None:
            return None
        slack -= start - cur
        if slack < 0:
            return None
        offsets[i] = start
        cur = start + e
    return offsets


def _search(
    numels: Sequence[int], blocks: Sequence[int], s: int, world_size: int, budget: int
) -> Optional[tuple[list[int], list[int]]]:
    """Bounded depth-first search over orders of tensor *classes* (equal numel and block).

    At each step every class with tensors left is placed at its earliest start; options are
    tried least-padding-first, with the most constrained class first among those that waste
    only an alignment shift (so the first descent is a best-fit greedy), and the search
    backtracks on dead ends: a class that can no longer be placed anywhere (later cursors
    only shrink its feasible starts), or padding beyond the slack ``m*S - E``. States
    ``(cursor, counts left)`` that failed are memoised. Gives up after ``budget`` placements.
    """
    cap = s * world_size
    slack = cap - sum(numels)
    if slack < 0:
        return None
    members: dict[tuple[int, int], list[int]] = {}
    for i, (e, g) in enumerate(zip(numels, blocks)):
        members.setdefault((e, g), []).append(i)
    keys = list(members)
    counts = [len(members[k]) for k in keys]
    # A class longer than S whose block does not divide S may cross only one boundary, so it
    # can start only in the first (2S - e) elements of a shard: the smaller that window, the
    # more constrained the class. Among options that waste no more than an alignment shift
    # (less than the largest block), place the most constrained class first.
    window = [(2 * s - e) / s if e > s and s % g else 1.0 for e, g in keys]
    small = max((g for _, g in keys), default=1)

    def options(cur: int, pad: int):
        opts = []
        for c, (e, g) in enumerate(keys):
            if not counts[c]:
                continue
            start = cur if e == 0 else _earliest_start(cur, e, g, s, cap)
            if start is None:
                return iter(())  # this class fits nowhere from here on: dead state
            waste = start - cur
            if pad + waste <= slack:
                opts.append((waste >= small, window[c], waste, -e, c, start))
        return iter([o[2:] for o in sorted(opts)])

    failed: set = set()
    path: list[tuple[int, int]] = []
    stack = [(0, 0, options(0, 0))]  # (cursor, padding so far, the options left to try there)
    nodes = 0
    while stack:
        cur, pad, opts = stack[-1]
        option = next(opts, None)
        if option is None:
            failed.add((cur, tuple(counts)))
            stack.pop()
            if path:
                counts[path.pop()[0]] += 1
            continue
        waste, neg_e, c, start = option
        counts[c] -= 1
        path.append((c, start))
        nodes += 1
        if len(path) == len(numels):
            break
        if nodes > budget:
            return None
        nxt = (start - neg_e, tuple(counts))
        if nxt in failed:
            path.pop()
            counts[c] += 1
            continue
        stack.append((nxt[0], pad + waste, options(nxt[0], pad + waste)))
    if len(path) < len(numels):
        return None
    offsets = [0] * len(numels)
    order = []
    pending = [iter(members[k]) for k in keys]  # each class's tensors, in input order
    for c, start in path:
        order.append(i := next(pending[c]))
        offsets[i] = start
    return offsets, order


def _fixed_orders(numels: Sequence[int], blocks: Sequence[int]) -> list[tuple[str, list]]:
    """The distinct fixed orders tried: given, numel-descending, block-descending."""
    given = list(range(len(numels)))
    orders: dict = {}
    for name, order in (("given", given),
                        ("numel-desc", sorted(given, key=lambda i: (-numels[i], i))),
                        ("block-desc", sorted(given, key=lambda i: (-blocks[i], -numels[i], i)))):
        orders.setdefault(tuple(order), (name, order))
    return list(orders.values())


def _try(order, numels, blocks, s, m):
    if order is None:
        return _search(numels, blocks, s, m, max(SEARCH_BUDGET, 4 * len(numels)))
    offsets = place_in_order(order, numels, blocks, s, m)
    return None if offsets is None else (offsets, order)


def pack(
    numels: Sequence[int],
    blocks: Sequence[int],
    world_size: int,
    align: int,
    search: bool = True,
) -> Packing:
    """Solve one unit: order, offsets and ``S``. Deterministic; results are memoised.

    Args:
        numels: Elements per tensor (``>= 0``).
        blocks: Block per tensor in elements (``>= 1``); a block larger than the tensor means
            the whole tensor.
        world_size: ``m >= 1``.
        align: Alignment of ``S`` in elements (``>= 1``).
        search: Also run the backtracking search when the fixed orders miss the bound
            (``False`` gives a quicker, possibly looser answer).

    Returns:
        A :class:`Packing`.

    Raises:
        ValueError: non-positive world size, alignment or block, or a negative numel.

    Example:
        >>> p = pack([6, 2], [3, 1], 2, 1)   # S=4 would cut the 3-element blocks
        >>> p.shard_numel, p.offsets
        (5, (2, 8))
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"alignment must be >= 1 element, got {align}")
    if any(g < 1 for g in blocks) or any(e < 0 for e in numels):
        raise ValueError("blocks must be >= 1 and numels >= 0")
    return _pack_cached(tuple(numels), tuple(blocks), world_size, align, search)


@lru_cache(maxsize=4096)
def _pack_cached(
    numels: tuple[int, ...], blocks: tuple[int, ...], m: int, align: int, search: bool
) -> Packing:
    eff, bound, lb = _bound(numels, blocks, m, align)
    fixed = _fixed_orders(numels, eff)
    candidates = [lb]
    while len(candidates) < SCAN_WINDOW:
        candidates.append(bound.next_admissible(candidates[-1] + 1))

    # the first fixed order to fit at the smallest candidate S, else the best of their bisections
    best = next(((name, found, s) for s in candidates for name, order in fixed
                 if (found := _try(order, numels, eff, s, m)) is not None), None) or min(
        (_bisect(name, order, numels, eff, m, align, bound, candidates[-1], None) for name, order in fixed),
        key=operator.itemgetter(2))

    # The search is O(budget * classes) per probe: run it only where it could help, aiming
    # first at the bound, then at "close enough", then bisecting up to the fixed orders' S.
    slack = max(align, int(TOLERANCE * sum(numels)) // m)
    worth_it = best[2] > lb + slack or (best[2] > lb and len(numels) <= SMALL_UNIT)
    if search and len(set(zip(numels, eff))) > 1 and worth_it:  # the search orders classes
        for target in (lb, bound.next_admissible(lb + 5 * slack)):
            if target >= best[2]:
                break
            found = _try(None, numels, eff, target, m)
            if found is not None:
                best = ("search", found, target)
                break
        else:
            best = _bisect("search", None, numels, eff, m, align, bound, target, best[2],
                           max_probes=SEARCH_PROBES) or best  # what it finds is below best's S
    name, (offsets, order), s = best
    return Packing(s, m, tuple(offsets), tuple(order), lb, name)


def _bisect(name, order, numels, eff, m, align, bound, lo, hi, max_probes=64):
    """Smallest feasible admissible ``S`` found by bisection in ``(lo, hi]``.

    ``lo`` is known (or assumed) infeasible. When ``hi`` is ``None``, first step up from
    ``lo`` by doubling increments until feasible. When ``hi`` is given it is assumed feasible for
    *some* strategy but not necessarily this one; returns ``None`` if bisection finds nothing
    below it.
    Feasibility is not monotone in ``S``, so this is a heuristic search.
    """
    found = None
    if hi is None:  # exponential search on the increment above lo, then bisect
        hi, step = lo, align
        while (found := _try(order, numels, eff, hi, m)) is None:
            lo, hi = hi, bound.next_admissible(hi + step)
            step *= 2
    for _ in range(max_probes):  # hi: the smallest feasible S found
        if hi - lo <= align:
            break
        cand = bound.next_admissible((lo + hi) // 2)
        if cand >= hi:
            break
        attempt = _try(order, numels, eff, cand, m)
        if attempt is None:
            lo = cand
        else:
            hi, found = cand, attempt
    return None if found is None else (name, found, hi)
