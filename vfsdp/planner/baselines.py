"""Padding other FSDPs would need for the same shapes and blocks (for the inspector and benchmarks).

* **FSDP2** (``fully_shard``, per-parameter ``Shard(0)``): every rank stores
  ``ceil(d0 / m)`` dim-0 slices. To keep a block of rows whole, dim-0 slices per rank must be a
  multiple of ``q = lcm(slab, block) / slab`` (``slab = prod(shape[1:])``), so ``d0`` is
  padded to a multiple of ``m * q``. With element granularity ``q = 1``: FSDP2's own rule.
* **Megatron-FSDP** (LCM rule): a unit's buffer is padded to a
  multiple of ``chunk * m``, ``chunk = lcm`` over its tensors of ``lcm(slab, block)``. This
  ignores the gaps its packer may leave inside the buffer, so it is a lower estimate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["fsdp2_padding", "megatron_padding"]


def _slab(shape: tuple[int, ...]) -> tuple[int, int]:
    shape = shape or (1,)
    return shape[0], math.prod(shape[1:])


def fsdp2_padding(tensors: Iterable[tuple[tuple[int, ...], int]], world_size: int) -> int:
    """Padding elements under FSDP2's dim-0 rule for ``(shape, block)`` pairs.

    Example:
        >>> fsdp2_padding([((17, 10), 1)], 3)   # 17 rows -> 6 per rank, 18 in all
        10
    """
    pad = 0
    for shape, block in tensors:
        d0, slab = _slab(tuple(shape))
        if d0 * slab == 0:
            continue
        q = math.lcm(slab, block) // slab
        per_rank = -(-d0 // (world_size * q)) * q
        pad += (per_rank * world_size - d0) * slab
    return pad


def megatron_padding(tensors: Iterable[tuple[tuple[int, ...], int]], world_size: int) -> int:
    """Padding elements of one unit under Megatron-FSDP's LCM rule.

    Example:
        >>> megatron_padding([((5, 4), 1), ((2, 6), 1), ((3,), 1)], 2)   # chunk 12, 35 -> 48
        13
    """
    chunk, total = 1, 0
    for shape, block in tensors:
        d0, slab = _slab(tuple(shape))
        total += d0 * slab
        if d0 * slab:
            chunk = math.lcm(chunk, math.lcm(max(slab, 1), block))
    quantum = chunk * world_size
    return -(-total // quantum) * quantum - total
