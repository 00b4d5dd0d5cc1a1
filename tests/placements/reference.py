"""The reference of :class:`vfsdp.placements.StridedRaggedShard`: a global tensor split over a
model axis, then each index's piece over the data ranks, as a loop over both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from vfsdp.placements import Placement, assemble_reference, split_lengths, split_reference


def strided_split_reference(full: torch.Tensor, size: int, dim: Optional[int],
                            placements: Sequence[Placement]) -> dict:
    """``{(index, rank): piece}``: ``full`` cut over a model axis of ``size`` along ``dim``
    (``torch.tensor_split``; ``None``: replicated), index ``i``'s piece split by
    ``placements[i]`` as :func:`split_reference` splits it."""
    pieces = (full.tensor_split(size, dim) if dim is not None else [full] * size)
    return {(i, r): p for i in range(size)
            for r, p in enumerate(split_reference(pieces[i], placements[i]))}


def strided_assemble_reference(pieces: dict, size: int, dim: Optional[int],
                               placements: Sequence[Placement],
                               shape: Sequence[int]) -> torch.Tensor:
    """The global tensor of ``shape`` back from :func:`strided_split_reference`'s pieces
    (index 0's copy of a replicated tensor)."""
    if dim is None:
        return assemble_reference([pieces[(0, r)] for r in range(placements[0].world_size)],
                                  placements[0], tuple(shape))
    parts = []
    for i, n in enumerate(split_lengths(shape[dim], size)):
        local = tuple(shape[:dim]) + (n,) + tuple(shape[dim + 1:])
        parts.append(assemble_reference([pieces[(i, r)] for r in range(placements[i].world_size)],
                                        placements[i], local))
    return torch.cat(parts, dim)
