"""A brute-force oracle for tiny units, written independently of the planner's code.

It tries every start position of every tensor (not just earliest starts) and every order.
"""

from __future__ import annotations

import itertools


def crosses_ok(start: int, e: int, g: int, s: int, m: int) -> bool:
    """Constraint check for one tensor placed at ``start``."""
    if start < 0 or start + e > m * s:
        return False
    for k in range(1, m):
        boundary = k * s
        if start < boundary < start + e and (boundary - start) % g:
            return False
    return True


def fits_in_order(order, numels, blocks, s, m) -> bool:
    """Exhaustive DFS over start positions for this order."""
    cap = m * s

    def dfs(k, cur):
        if k == len(order):
            return True
        i = order[k]
        for start in range(cur, cap - numels[i] + 1):
            if crosses_ok(start, numels[i], blocks[i], s, m) and dfs(k + 1, start + numels[i]):
                return True
        return False

    return dfs(0, 0)


def _candidates(numels, align):
    top = max(sum(numels), 1)
    return range(align, top + align, align)


def best_for_order(order, numels, blocks, m, align) -> int:
    """Minimal S for a fixed order."""
    for s in _candidates(numels, align):
        if fits_in_order(order, numels, blocks, s, m):
            return s
    raise AssertionError("unreachable: S >= total always fits in shard 0")


def optimum(numels, blocks, m, align) -> int:
    """Minimal S over all orders and placements."""
    orders = list(dict.fromkeys(
        tuple(p) for p in itertools.permutations(range(len(numels)))
    ))
    for s in _candidates(numels, align):
        if any(fits_in_order(o, numels, blocks, s, m) for o in orders):
            return s
    raise AssertionError("unreachable")


def lower_bound_scan(numels, blocks, m, align) -> int:
    """The issue's bound by a linear scan over S (independent of the solver's jumps)."""
    total = sum(numels)
    largest = max((min(g, e) for e, g in zip(numels, blocks) if e), default=0)
    s = align
    while True:
        if (m * s >= total and s >= largest and
                all(s % g == 0 for e, g in zip(numels, blocks) if e >= 2 * s and e)):
            return s
        s += align


def padding_ok(offsets, numels, blocks, s, m) -> bool:
    """Independent validity check of a full placement."""
    spans = sorted((o, o + e) for o, e in zip(offsets, numels) if e)
    for (_a0, a1), (b0, _b1) in itertools.pairwise(spans):
        if b0 < a1:
            return False
    return s > 0 and all(crosses_ok(o, e, g, s, m) for o, e, g in zip(offsets, numels, blocks) if e)
