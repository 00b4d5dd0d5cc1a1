"""``StridedRaggedShard``: a tensor split over a model-parallel mesh axis (TP, EP), whose
piece is then FSDP-sharded.

Pure data. Two levels, as veScale's ``StridedRaggedShard`` describes TP x FSDP:

1. Over the model axis (``axis``, of ``size`` ranks) the **global** tensor is cut along
   ``dim`` as ``torch.tensor_split`` cuts it (the first ``n % size`` pieces are one longer),
   or, with ``dim=None``, every index holds all of it (``Replicate``). Index ``i``'s piece is
   the box at :attr:`origin` of :attr:`local_shape`.
2. Over the data axes, that piece is flattened and split as any tensor
   (:class:`~vfsdp.placements.RaggedShard`).

A rank's FSDP range is contiguous in its piece, and so strided in the global tensor when
``dim > 0`` (hence the name). Example: a ``[4, 6]`` weight split by columns over
``tp=2`` then over ``dp=2``::

    global cols:   0 1 2 | 3 4 5           tp index 0 holds cols 0-2, index 1 cols 3-5
    tp 0, dp 0:  rows 0-1 of cols 0-2      (flat [0, 6) of its 4x3 piece)
    tp 0, dp 1:  rows 2-3 of cols 0-2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["StridedRaggedShard", "split_lengths"]


def split_lengths(n: int, parts: int) -> tuple[int, ...]:
    """The lengths ``torch.tensor_split`` gives ``n`` elements cut into ``parts``.

    Args:
        n: Elements to cut (``>= 0``).
        parts: Pieces (``>= 1``).

    Returns:
        ``parts`` lengths adding up to ``n``, the longer first.

    Raises:
        ZeroDivisionError: ``parts`` is 0. (Negative values are not checked.)

    Example:
        >>> split_lengths(10, 4)
        (3, 3, 2, 2)
    """
    q, r = divmod(n, parts)
    return tuple(q + (1 if i < r else 0) for i in range(parts))


@dataclass(frozen=True)
class StridedRaggedShard:
    """Where this rank's model-parallel piece of a tensor sits in the global tensor.

    Attributes:
        axis: The model-parallel mesh axis (``"tp"``, ``"ep"``).
        size: Its number of ranks.
        index: This rank's index along it.
        dim: The dim the global tensor is cut along, or ``None`` (replicated over ``axis``).
        global_shape: The global tensor's shape.

    Raises:
        ValueError: an index outside ``[0, size)``, or a dim outside the shape.

    Example:
        >>> s = StridedRaggedShard("tp", 2, 1, 1, (4, 6))
        >>> s.local_shape, s.origin, s.writes
        ((4, 3), (0, 3), True)
        >>> StridedRaggedShard("tp", 2, 1, None, (4, 6)).writes   # a replica's copy
        False
    """

    axis: str
    size: int
    index: int
    dim: Optional[int]
    global_shape: tuple

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"StridedRaggedShard: axis must be a mesh axis name, got {self.axis!r}")
        if self.size < 1 or not 0 <= self.index < self.size:
            raise ValueError(f"StridedRaggedShard: index {self.index} outside an axis of "
                             f"{self.size} ranks")
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        if self.dim is not None and not 0 <= self.dim < len(self.global_shape):
            raise ValueError(f"StridedRaggedShard: dim {self.dim} outside shape "
                             f"{self.global_shape} (give a non-negative dim)")

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every index's length along :attr:`dim` (``()`` when replicated)."""
        return () if self.dim is None else split_lengths(self.global_shape[self.dim], self.size)

    @property
    def start(self) -> int:
        """Where this index's piece starts along :attr:`dim` (0 when replicated)."""
        return sum(self.lengths[: self.index])

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this index's piece."""
        return tuple(self.lengths[self.index] if d == self.dim else n
                     for d, n in enumerate(self.global_shape))

    @property
    def origin(self) -> tuple[int, ...]:
        """Offsets of the piece's first element in the global tensor, per dim."""
        return tuple(self.start if d == self.dim else 0 for d in range(len(self.global_shape)))

    @property
    def writes(self) -> bool:
        """Whether this index stores its piece in a checkpoint (one copy of a replicated
        tensor: index 0's)."""
        return self.dim is not None or self.index == 0

    def describe(self) -> str:
        """``'Shard(1) over tp: 3 of 6 at 3 (index 1/2)'`` or ``'Replicate over tp'``."""
        if self.dim is None:
            return f"Replicate over {self.axis}"
        return (f"Shard({self.dim}) over {self.axis}: {self.lengths[self.index]} of "
                f"{self.global_shape[self.dim]} at {self.start} (index {self.index}/{self.size})")
