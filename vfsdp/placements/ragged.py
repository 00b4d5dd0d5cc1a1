"""Placements: how one tensor's elements are distributed over the ranks of one mesh dim.

Pure data. Nothing here imports ``torch.distributed``; the helpers work on shapes and integers.

``RaggedShard(dims, local_units)`` follows veScale's semantics::

    U    = sum(local_units)
    unit = numel // U                               # elements per unit
    rank r owns flat [unit * sum(local_units[:r]), unit * sum(local_units[:r+1]))

Example: a ``[10, 4]`` tensor with ``RaggedShard((0,), (1, 2, 0, 2))`` has ``unit = 8``
elements (two rows); rank 0 owns rows 0-1, rank 1 rows 2-5, rank 2 nothing, rank 3 rows 6-9::

    rank:    0     1           2   3
    rows:  [0 1 | 2 3 4 5 |     | 6 7 8 9]

``dims`` is the prefix of dims that are flattened and split: every local piece is a whole number
of ``prod(shape[len(dims):])``-element slabs, so it can be re-viewed as
``(-1, *shape[len(dims):])``. A tensor with no elements has all-zero ``local_units``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "RaggedShard",
    "Placement",
    "flat_range",
    "local_numel",
    "local_shape",
    "validate_placement",
]


def _compact(values: Sequence[int], limit: int = 12) -> str:
    """Readable rendering of a long tuple: run-length encodes repeats, elides the middle."""
    parts = [f"{v}" if (n := len(list(run))) == 1 else f"{v}x{n}" for v, run in itertools.groupby(values)]
    if len(parts) > limit:
        parts = parts[: limit // 2] + ["..."] + parts[-limit // 2 :]
    return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class RaggedShard:
    """Uneven, block-aligned sharding of a tensor's flattened storage over one mesh dim.

    Args:
        dims: The prefix of the tensor's dims that is flattened and split, ``(0, 1, ..., k-1)``.
        local_units: Units held by each rank (zeros allowed); its length is the world size.

    Raises:
        TypeError: ``dims`` or ``local_units`` are not tuples of ints.
        ValueError: ``dims`` is not a prefix ``(0, ..., k-1)``, or a unit count is negative.

    Example:
        >>> p = RaggedShard((0,), (1, 2, 0, 2))
        >>> flat_range(p, (10, 4), 1)
        (8, 24)
    """

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("dims", "local_units"):
            value = tuple(getattr(self, name))
            object.__setattr__(self, name, value)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise TypeError(f"RaggedShard.{name} must hold ints, got {value!r}")
        if self.dims != tuple(range(len(self.dims))):
            raise ValueError(
                f"RaggedShard.dims must be a prefix (0, 1, ..., k-1) of the tensor's dims, "
                f"got {self.dims!r}"
            )
        if not self.local_units:
            raise ValueError("RaggedShard.local_units needs one entry per rank (world size >= 1)")
        if any(u < 0 for u in self.local_units):
            raise ValueError(f"RaggedShard.local_units must be >= 0, got {self.local_units!r}")

    @property
    def world_size(self) -> int:
        """Number of ranks along the sharded mesh dim."""
        return len(self.local_units)

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={_compact(self.local_units)})"


Placement = RaggedShard
"""The placements vfsdp produces. A replicated tensor needs none: HSDP's replicate dims are
described by the spec's mesh, and DTensor's own ``Replicate()`` by :func:`vfsdp.to_dtensor`."""


def validate_placement(placement: Placement, shape: Sequence[int]) -> None:
    """Check that ``placement`` can describe a tensor of ``shape``.

    Args:
        placement: A ``RaggedShard``.
        shape: The full (global) tensor shape.

    Raises:
        ValueError: ``dims`` is longer than the tensor's rank, the units do not divide the
            numel, or a unit is not a whole number of trailing slabs.

    Example:
        >>> validate_placement(RaggedShard((0,), (1, 1)), (4, 3))
    """
    if not isinstance(placement, RaggedShard):
        raise TypeError(f"expected a RaggedShard, got {type(placement).__name__}")
    shape = tuple(shape)
    if len(placement.dims) > len(shape):
        raise ValueError(f"{placement!r}: dims is longer than the tensor's rank {len(shape)}")
    numel = math.prod(shape)
    total = sum(placement.local_units)
    if total == 0:
        if numel != 0:
            raise ValueError(f"{placement!r}: all-zero local_units only fit a 0-size tensor")
        return
    if numel % total:
        raise ValueError(
            f"{placement!r}: numel {numel} of shape {shape} is not divisible by "
            f"sum(local_units) = {total}"
        )
    unit = numel // total
    slab = math.prod(shape[len(placement.dims):])
    if slab and unit % slab:
        raise ValueError(
            f"{placement!r}: a unit of {unit} elements is not a whole number of "
            f"{slab}-element slabs of dims {len(placement.dims)}.. of shape {shape}"
        )


def flat_range(placement: Placement, shape: Sequence[int], rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` range of the flattened tensor that ``rank`` holds.

    Args:
        placement: The tensor's placement.
        shape: The full tensor shape.
        rank: Rank along the sharded mesh dim.

    Returns:
        ``(start, stop)`` in elements; ``start == stop`` for a rank that holds nothing.

    Raises:
        ValueError: the placement does not fit the shape, or ``rank`` is out of range.

    Example:
        >>> flat_range(RaggedShard((0,), (1, 0, 3)), (8,), 2)
        (2, 8)
    """
    validate_placement(placement, shape)
    if not 0 <= rank < placement.world_size:
        raise ValueError(f"rank {rank} out of range for world size {placement.world_size}")
    total = sum(placement.local_units)
    unit = math.prod(shape) // total if total else 0  # all-zero units: a 0-size tensor
    start = unit * sum(placement.local_units[:rank])
    return (start, start + unit * placement.local_units[rank])


def local_numel(placement: Placement, shape: Sequence[int], rank: int) -> int:
    """Number of elements ``rank`` holds. See :func:`flat_range`.

    Args:
        placement: The tensor's placement.
        shape: The full tensor shape.
        rank: Rank along the sharded mesh dim.

    Returns:
        The size of ``rank``'s flat range (0 on a rank that holds nothing).

    Raises:
        ValueError: as :func:`flat_range`.

    Example:
        >>> local_numel(RaggedShard((0,), (1, 3)), (4, 2), 1)
        6
    """
    start, stop = flat_range(placement, shape, rank)
    return stop - start


def local_shape(placement: Placement, shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """Shape of ``rank``'s local piece: ``(n, *shape[len(dims):])``.

    Args:
        placement: The tensor's placement.
        shape: The full tensor shape.
        rank: Rank along the sharded mesh dim.

    Returns:
        The local shape. With empty ``dims`` (a 0-d tensor) it is ``shape`` on a rank that
            holds the element and ``(0,)`` elsewhere.

    Raises:
        ValueError: as :func:`flat_range`.

    Example:
        >>> local_shape(RaggedShard((0,), (1, 3)), (4, 2), 1)
        (3, 2)
    """
    return piece_shape(tuple(shape), len(placement.dims), local_numel(placement, shape, rank))


def piece_shape(shape: tuple, lead: int, n: int) -> tuple[int, ...]:
    """The shape of a piece of ``n`` elements of a tensor split over its first ``lead`` dims.

    Args:
        shape: The full tensor shape.
        lead: How many leading dims are split (``len(placement.dims)``).
        n: The piece's elements, a whole number of ``prod(shape[lead:])``-element slabs.

    Returns:
        ``(n // slab, *shape[lead:])``; with no ``lead`` dims (a 0-d tensor) ``shape``
            itself, or ``(0,)`` when ``n`` is 0.

    Example:
        >>> piece_shape((10, 4), 1, 12)
        (3, 4)
    """
    if not lead:
        return tuple(shape) if n else (0,)
    return (n // (math.prod(shape[lead:]) or 1), *shape[lead:])
