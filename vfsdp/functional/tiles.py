"""32x32 tiles of matrices: the geometry block-wise scales share (8-bit AdamW's moments,
float8 all-gathers' per-block scales).

A matrix ``[R, C]`` (or each matrix of a ``[E, R, C]`` stack) is cut into 32x32 tiles from row
0, column 0; tiles at ragged edges are partial. A rank holding whole 32-row stripes of a matrix
(whole matrices of a stack whose matrices are not) holds whole tiles: :func:`tile_granularity`
is the planner rule that keeps them so, :func:`tile_view` sees such a range as ``[B, R, C]``
and :func:`tiled` cuts that into tiles by reshaping.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from vfsdp.planner.granularity import rows

__all__ = ["TILE", "tile_view", "tiled", "tiles_of", "tile_granularity", "blockwise", "tile_range"]

TILE = 32


def blockwise(shape: tuple, min_numel: int) -> bool:
    """Whether a tensor of ``shape`` gets tile scales: a matrix (or stack) of ``min_numel``
    elements or more, and of at least one (an empty one has no tiles).

    Example:
        >>> blockwise((64, 64), 4096), blockwise((4096,), 16), blockwise((0, 64), 0)
        (True, False, False)
    """
    n = math.prod(shape)
    return len(shape) >= 2 and n >= min_numel and n > 0


def tile_granularity(min_numel: int) -> Callable:
    """The planner granularity that keeps tiles whole on ranks: 32-row stripes of matrices,
    whole matrices of ragged stacks, for tensors :func:`blockwise` selects.

    Example:
        >>> g = tile_granularity(16)
        >>> g(("w",), torch.empty(64, 8, device="meta")), g(("b",), torch.empty(8, device="meta"))
        (rows(32), None)
    """

    def gran(path, tensor):
        shape = tuple(tensor.shape)
        if not blockwise(shape, min_numel):
            return None
        if len(shape) >= 3 and shape[-2] % TILE:
            return rows(shape[-2])  # keep each matrix of the stack whole
        return rows(TILE)

    return gran


def tile_view(shape: tuple, start: int, stop: int) -> tuple[int, int, int]:
    """The flat range ``[start, stop)`` of a tensor of ``shape`` as ``B`` matrices ``[R, C]``
    whose 32x32 tiles (from row 0, column 0, partial at the edges) are the tensor's tiles.

    Rows of a matrix or of a stack whose matrices have a multiple of 32 rows: ``B = 1``,
    the range's rows (whole 32-row stripes). A stack with ragged matrices: whole matrices.

    Returns:
        ``(B, R, C)``.

    Raises:
        ValueError: the range cuts a row, a 32-row stripe, or a ragged stack's matrix.

    Example:
        >>> tile_view((70, 40), 32 * 40, 70 * 40), tile_view((3, 40, 32), 40 * 32, 3 * 40 * 32)
        ((1, 38, 40), (2, 40, 32))
    """
    cols, rows = shape[-1], shape[-2]
    n = stop - start
    if len(shape) >= 3 and rows % TILE:
        per = rows * cols
        if start % per or stop % per:
            raise ValueError(f"range [{start}, {stop}) cuts a {rows}x{cols} matrix of a stack "
                             f"whose matrices are not whole 32-row stripes")
        return n // per, rows, cols
    if start % cols or stop % cols:
        raise ValueError(f"range [{start}, {stop}) cuts a row of {cols} elements")
    r0, r1 = start // cols, stop // cols
    if (r0 % rows) % TILE or ((r1 % rows) % TILE and r1 % rows != 0):
        raise ValueError(f"range of rows [{r0}, {r1}) cuts a 32-row stripe")
    return 1, r1 - r0, cols


def tiles_of(view: tuple) -> int:
    """Tiles of a ``(B, R, C)`` view.

    Example:
        >>> tiles_of((2, 40, 32))
        4
    """
    b, r, c = view
    return b * -(-r // TILE) * -(-c // TILE)


def tiled(x: torch.Tensor) -> torch.Tensor:
    """``[B, R, C]`` -> ``[B, R/32, 32, C/32, 32]``, zero-padded to whole tiles if ragged."""
    b, r, c = x.shape
    rt, ct = -(-r // TILE), -(-c // TILE)
    if (r, c) != (rt * TILE, ct * TILE):
        x = torch.nn.functional.pad(x, (0, ct * TILE - c, 0, rt * TILE - r))
    return x.view(b, rt, TILE, ct, TILE)


def tile_range(shape: tuple, start: int) -> tuple[int, int]:
    """``(first tile, total tiles)``: the global number of the tile holding flat element
    ``start`` of a tensor of ``shape`` (``start`` at the head of a 32-row stripe, or of a
    ragged stack's matrix), tiles numbered row of tiles by row of tiles, matrix by matrix, and
    the tensor's tile count.

    Example:
        >>> tile_range((70, 40), 32 * 40), tile_range((3, 40, 32), 40 * 32)
        ((2, 6), (2, 6))
    """
    rows_, cols = shape[-2], shape[-1]
    row_tiles, col_tiles = math.ceil(rows_ / TILE), math.ceil(cols / TILE)
    total = math.prod(shape[:-2]) * row_tiles * col_tiles
    g0 = start // cols
    stripe = (g0 // rows_) * row_tiles + (g0 % rows_) // TILE
    return stripe * col_tiles, total
