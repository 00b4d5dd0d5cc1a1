"""Reference semantics of a placement: a plain loop over ranks, for tests to compare against.

``split_reference(full, p)[r]`` is exactly what rank ``r`` holds under placement ``p``;
``assemble_reference(split_reference(full, p), p, full.shape)`` gives back ``full``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from vfsdp.placements.ragged import Placement, flat_range, local_shape

__all__ = ["split_reference", "assemble_reference", "strided_split_reference",
           "strided_assemble_reference"]


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
    pieces = []
    for rank in range(placement.world_size):
        start, stop = flat_range(placement, full.shape, rank)
        pieces.append(flat[start:stop].clone().reshape(local_shape(placement, full.shape, rank)))
    return pieces


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
        start, stop = flat_range(placement, shape, rank)
        if piece.numel() != stop - start:
            raise ValueError(
                f"piece {rank} has {piece.numel()} elements, placement expects {stop - start}"
            )
    dtype = pieces[0].dtype if pieces else torch.float32
    flat = (torch.cat([p.reshape(-1) for p in pieces]) if pieces
            else torch.empty(0, dtype=dtype))  # cpu: reference, nothing to take a device from
    return flat.reshape(tuple(shape))


def strided_split_reference(full: torch.Tensor, size: int, dim: Optional[int],
                            placements: Sequence[Placement]) -> dict:
    """Split a global tensor over a model axis then over the data ranks: ``{(index, rank):
    piece}``, a loop over both (the reference of :class:`StridedRaggedShard`).

    Args:
        full: The global tensor.
        size: The model axis' size.
        dim: The dim it is cut along (``torch.tensor_split``), or ``None`` (replicated).
        placements: Index ``i``'s ``RaggedShard`` of its piece, one per index.

    Returns:
        Every rank's flat-contiguous piece, as :func:`split_reference` gives it.

    Raises:
        ValueError: a placement does not fit its piece.

    Example:
        >>> out = strided_split_reference(torch.arange(6.0).view(2, 3), 2, 1,
        ...                               [RaggedShard((0,), (1, 1)), RaggedShard((0,), (1, 1))])
        >>> out[(0, 1)].tolist(), out[(1, 0)].tolist()
        ([[3.0, 4.0]], [[2.0]])
    """
    pieces = (full.tensor_split(size, dim) if dim is not None else [full] * size)
    return {(i, r): p for i in range(size)
            for r, p in enumerate(split_reference(pieces[i], placements[i]))}


def strided_assemble_reference(pieces: dict, size: int, dim: Optional[int],
                               placements: Sequence[Placement],
                               shape: Sequence[int]) -> torch.Tensor:
    """The global tensor back from :func:`strided_split_reference`'s pieces (index 0's copy of
    a replicated tensor).

    Args:
        pieces: ``{(index, rank): piece}``, as :func:`strided_split_reference` returns.
        size: The model axis' size.
        dim: The dim the tensor was cut along, or ``None`` (replicated).
        placements: Index ``i``'s ``RaggedShard`` of its piece, one per index.
        shape: The global shape.

    Returns:
        A new tensor of ``shape``.

    Raises:
        KeyError: a missing ``(index, rank)`` piece.
        ValueError: as :func:`assemble_reference` (a piece of the wrong size).

    Example:
        >>> ps = [RaggedShard((0,), (1, 1))] * 2
        >>> full = torch.arange(6.0).view(2, 3)
        >>> strided_assemble_reference(strided_split_reference(full, 2, 1, ps), 2, 1, ps,
        ...                            (2, 3)).equal(full)
        True
    """
    from vfsdp.placements.strided import split_lengths

    if dim is None:
        local = tuple(shape)
        return assemble_reference([pieces[(0, r)] for r in range(placements[0].world_size)],
                                  placements[0], local)
    parts = []
    for i, n in enumerate(split_lengths(shape[dim], size)):
        local = tuple(shape[:dim]) + (n,) + tuple(shape[dim + 1:])
        parts.append(assemble_reference([pieces[(i, r)] for r in range(placements[i].world_size)],
                                        placements[i], local))
    return torch.cat(parts, dim)
