"""Exact optimum of one unit by exhaustive search, to certify plans where the bound is loose.

The lower bound of :mod:`vfsdp.planner.solver` is cheap but not always attainable: block
alignment at every rank boundary can force padding no order avoids. For units with few
distinct tensor classes, :func:`certify_unit` settles the question exactly: for every
admissible ``S`` from the bound upward it runs the backtracking search with no budget, which
enumerates every order of tensor classes (earliest-start placement is exact for a fixed
order), so the first feasible ``S`` is the true optimum.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

from vfsdp.planner import solver

__all__ = ["certify_unit"]


def certify_unit(
    numels: Sequence[int],
    blocks: Sequence[int],
    world_size: int,
    align: int,
    *,
    upper: Optional[int] = None,
    max_seconds: float = 60.0,
) -> Optional[int]:
    """The minimal feasible ``S`` over all orders, or ``None`` if not settled in time.

    Args:
        numels: Elements per tensor.
        blocks: Block per tensor, in elements.
        world_size: ``m``.
        align: Alignment of ``S`` in elements.
        upper: A known feasible ``S`` (e.g. the planner's); the scan stops there.
        max_seconds: Give up (return ``None``) after this long.

    Returns:
        The optimal ``S``, or ``None``.

    Example:
        >>> certify_unit([6, 2], [3, 1], 2, 1)
        5
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
