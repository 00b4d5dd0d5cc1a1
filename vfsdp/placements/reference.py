"""Reference semantics of a placement: a plain loop over ranks, for tests to compare against.

``split_reference(full, p)[r]`` is exactly what rank ``r`` holds under placement ``p``;
``assemble_reference(split_reference(full, p), p, full.shape)`` gives back ``full``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vfsdp.placements.ragged import Placement, flat_range, local_numel, local_shape

__all__ = ["split_reference", "assemble_reference"]


def split_reference(full: torch.Tensor, placement: Placement) -> list[torch.Tensor]:
    """Split a full tensor into its per-rank pieces (clones, one per rank).

    Args:
        full: The full tensor.
        placement: Its ``RaggedShard``.

    Returns:
        One tensor per rank, of shape ``local_shape(placement, full.shape, r)``.

    Raises:
        ValueError: the placement does not fit ``full``'s shape.

    Example:
        >>> pieces = split_reference(torch.arange(6.0), RaggedShard((0,), (1, 0, 2)))
        >>> [p.tolist() for p in pieces]
        [[0.0, 1.0], [], [2.0, 3.0, 4.0, 5.0]]
    """
    flat = full.reshape(-1)
    return [flat[slice(*flat_range(placement, full.shape, r))].clone()
            .reshape(local_shape(placement, full.shape, r)) for r in range(placement.world_size)]


def assemble_reference(
    pieces: Sequence[torch.Tensor], placement: Placement, shape: Sequence[int]
) -> torch.Tensor:
    """Reassemble per-rank pieces into the full tensor (the inverse of ``split_reference``).

    Args:
        pieces: One tensor per rank.
        placement: The placement they were split with.
        shape: The full shape.

    Returns:
        A new tensor of ``shape``.

    Raises:
        ValueError: wrong number of pieces, or a piece of the wrong size.

    Example:
        >>> p = RaggedShard((0,), (1, 0, 2))
        >>> assemble_reference(split_reference(torch.arange(6.0), p), p, (6,)).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    if len(pieces) != placement.world_size:
        raise ValueError(f"expected {placement.world_size} pieces, got {len(pieces)}")
    for rank, piece in enumerate(pieces):
        if piece.numel() != (n := local_numel(placement, shape, rank)):
            raise ValueError(f"piece {rank} has {piece.numel()} elements, placement expects {n}")
    return torch.cat([p.reshape(-1) for p in pieces]).reshape(tuple(shape))  # world size >= 1
