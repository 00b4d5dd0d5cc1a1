"""Block-wise 8-bit codes: the dynamic (tree) code maps and 32x32 tiles of matrices.

Code maps follow bitsandbytes' ``create_dynamic_map`` (as torchao copies it): seven decades
from about 1e-7 to 1, finer near 1.

* signed (for Adam's ``m``): decade ``i`` in 0..6 holds the ``2**i`` midpoints of
  ``linspace(0.1, 1, 2**i + 1)`` scaled by ``10**(i - 6)``, and their negatives; plus 0 and 1.
* unsigned (for ``v``, stored as is, never square-rooted or linear): ``2**(i+1)`` midpoints per
  decade; plus 0 and 1.

Quantization is deterministic round-to-nearest: the code is the number of midpoints between
neighbouring map entries that are ``<=`` the value (ties go up, as torchao's rule).

Tiles: a matrix ``[R, C]`` (or each matrix of a ``[E, R, C]`` stack) is cut into 32x32 tiles;
tiles at ragged edges are partial and their absmax covers their real elements only. A rank
holding whole 32-row stripes of a matrix (``rows(32)`` granularity) holds whole tiles, so it
quantizes its shard alone, bit for bit as one process would.

One implementation: :func:`step8_flat` over a **flat span**, every quantized tensor of the
rank at once (the optimizer lays its units' shards end to end), whatever their shapes and
units, a fixed number of ops. Each element's
tile comes from a small table per tensor (:func:`span_tiles`, made at ``init``):
:func:`flat_tile_ids` expands it per step, in a few ops over the span's 32-column row pieces
and one over its elements (nothing per element is stored beside the codes and one scale per
tile); a scatter-max takes each tile's absmax. The Adam arithmetic between dequantizing and
re-quantizing is AdamW's own (:func:`vfsdp.optim.base.adam_`). The per-tensor and
per-element references it is tested against are in the tests (``tests/optim/reference.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch

from vfsdp.functional.tiles import TILE
from vfsdp.optim.base import adam_


@lru_cache(maxsize=4)
def _map(signed: bool) -> tuple:
    values = [0.0, 1.0]
    for i in range(7):
        n = 2 ** i if signed else 2 ** (i + 1)
        edges = [0.1 + 0.9 * k / n for k in range(n + 1)]
        means = [(a + b) / 2 * 10.0 ** (i - 6) for a, b in itertools.pairwise(edges)]
        values += means + ([-x for x in means] if signed else [])
    return tuple(sorted(values))


def dynamic_map(signed: bool, device=None) -> torch.Tensor:
    """The 256-entry fp32 code map.

    Example:
        >>> q = dynamic_map(True); (q.numel(), float(q.min()), float(q.max()))
        (256, -0.992968738079071, 1.0)
    """
    return torch.tensor(_map(signed), dtype=torch.float32, device=device)


def midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """The 255 decision boundaries of round-to-nearest between neighbouring map entries."""
    return (qmap[1:] + qmap[:-1]) / 2


# ---------------------------------------------------------------- one pass over a flat span


@dataclass(frozen=True)
class SpanTiles:
    """Where the tiles of a flat span are: one row per piece of the span, ``(32-column row
    pieces ("chunks"), first chunk, tile columns ct, rows per matrix R, tile rows per matrix,
    first tile, length of a row's last chunk)``; a gap (elements of no quantized tensor, or of
    one not updated this step) is one chunk of tile ``n_tiles``, the spare tile.

    Attributes:
        table: That ``[pieces, 7]`` int64 table, on the span's device.
        chunks: Its number of chunks (so no op reads it back from the device).
        numel: The span's elements.
        n_tiles: Its real tiles (the scales have one more: the spare, always 0).
        keep: ``None``, or a bool per scale: the tiles whose scales stay as they are (those of
            tensors not updated this step).
    """

    table: torch.Tensor
    chunks: int
    numel: int
    n_tiles: int
    keep: Optional[torch.Tensor]


def span_tiles(pieces: list, n_tiles: int, device: Any, keep: tuple = ()) -> SpanTiles:
    """The :class:`SpanTiles` of a span made of ``pieces``, in order.

    Args:
        pieces: ``(numel, view, first tile)`` each: ``view`` the piece as ``(B, R, C)``
            matrices (:func:`~vfsdp.functional.tiles.tile_view`), its tiles numbered from
            ``first tile`` row of tiles by row of tiles; ``view=None``: a gap of ``numel`` elements.
        n_tiles: The span's tiles.
        device: The span's device.
        keep: ``(first tile, tiles)`` ranges whose scales stay (tensors not updated).

    Example:
        >>> t = span_tiles([(40 * 40, (1, 40, 40), 0), (8, None, None)], 4, "cpu")
        >>> flat_tile_ids(t).reshape(-1)[[0, 31, 32, 40 * 32, 40 * 40 - 1, 40 * 40]].tolist()
        [0, 0, 1, 2, 3, 4]
    """
    rows, first = [], 0
    for numel, view, base in (p for p in pieces if p[0]):  # empty pieces: no row
        if view is None:
            rows.append((1, first, 1, 1, 0, n_tiles, numel))
            first += 1
            continue
        b, r, c = view
        ct = -(-c // TILE)
        rows.append((b * r * ct, first, ct, r, -(-r // TILE), base, c - TILE * (ct - 1)))
        first += b * r * ct
    mask = torch.zeros(n_tiles + 1, dtype=torch.bool, device=device) if keep else None
    for lo, n in keep:
        mask[lo:lo + n] = True
    table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 7)
    return SpanTiles(table, first, sum(p[0] for p in pieces), n_tiles, mask)


def flat_tile_ids(tiles: SpanTiles) -> torch.Tensor:
    """The tile of every element of the span (``n_tiles`` for gaps): a fixed number of ops
    over its chunks and one over its elements, whatever its tensors.

    Example:
        >>> flat_tile_ids(span_tiles([(3 * 2, (3, 1, 2), 5)], 8, "cpu")).tolist()
        [5, 5, 6, 6, 7, 7]
    """
    device = tiles.table.device
    piece = torch.repeat_interleave(torch.arange(len(tiles.table), device=device),
                                    tiles.table[:, 0], output_size=tiles.chunks)
    _, first, ct, r, rt, base, last = tiles.table[piece].unbind(1)  # per chunk
    j = torch.arange(tiles.chunks, device=device) - first
    row = j // ct
    tc = j - row * ct
    b = row // r
    tile = base + (b * rt + (row - b * r) // TILE) * ct + tc
    length = torch.where(tc == ct - 1, last, TILE)
    return torch.repeat_interleave(tile, length, output_size=tiles.numel)


def step8_flat(p: torch.Tensor, g: torch.Tensor, cm: torch.Tensor, cv: torch.Tensor,
               sm: torch.Tensor, sv: torch.Tensor, tiles: SpanTiles, qm: torch.Tensor,
               qv: torch.Tensor, mids_m: torch.Tensor, mids_v: torch.Tensor, b1: float,
               b2: float, eps: float, lr: Any, bc1: Any, bc2_sqrt: Any) -> None:
    """One 8-bit AdamW step over a flat span of many tensors at once (weight decay applied
    before, by the caller): ``p``, ``g`` (fp32) and the codes ``cm``/``cv`` are the span's flat
    elements, ``sm``/``sv`` its ``n_tiles + 1`` scales (the last the spare tile's, 0) and
    ``tiles`` where each element's tile is. Dequantize ``m`` and ``v``, run Adam
    (:func:`~vfsdp.optim.base.adam_`, its scalars as it takes them), re-quantize each
    tile by its new absmax. Gap elements keep their values and codes (their gradient is taken
    as 0 and their moments dequantize to 0, so ``p`` adds ``-0.0``); the scales of
    ``tiles.keep`` stay. The one implementation the optimizer runs, eagerly, fused by
    ``torch.compile`` and traced in a compiled update.

    Example:
        >>> qm, qv = dynamic_map(True), dynamic_map(False)
        >>> p, g = torch.ones(32 * 32 + 4), torch.full((32 * 32 + 4,), 0.5)
        >>> cm, cv = (torch.zeros(p.numel(), dtype=torch.uint8) for _ in range(2))
        >>> t = span_tiles([(32 * 32, (1, 32, 32), 0), (4, None, None)], 1, "cpu")
        >>> step8_flat(p, g, cm, cv, torch.zeros(2), torch.zeros(2), t, qm, qv, midpoints(qm),
        ...            midpoints(qv), 0.9, 0.999, 1e-8, 0.1, 1 - 0.9, (1 - 0.999) ** 0.5)
        >>> round(float(p[0]), 4), float(p[-1]), int(cm[-1])   # the gap is left alone
        (0.9, 1.0, 0)
    """
    ids = flat_tile_ids(tiles)
    act = ids < tiles.n_tiles
    g = torch.where(act, g, 0.0)
    m = qm[cm.long()] * sm[ids]
    v = qv[cv.long()] * sv[ids]
    adam_([p], [g], [m], [v], b1, b2, eps, lr, bc1, bc2_sqrt, limit=max(1, p.numel()))
    _quantize_flat(m, mids_m, cm, sm, ids, act, tiles.keep)
    _quantize_flat(v, mids_v, cv, sv, ids, act, tiles.keep)


def _quantize_flat(x: torch.Tensor, mids: torch.Tensor, codes: torch.Tensor,
                   scales: torch.Tensor, ids: torch.Tensor, act: torch.Tensor,
                   keep: Optional[torch.Tensor]) -> None:
    """Quantize a flat span: each tile's absmax by a scatter-max (gaps go to
    the spare tile, whose ``x`` is 0), the codes of gap elements and the scales of ``keep``
    left as they are."""
    absmax = torch.zeros_like(scales).scatter_reduce_(0, ids, x.abs(), "amax")
    scales.copy_(absmax if keep is None else torch.where(keep, scales, absmax))
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes.copy_(torch.where(act, torch.searchsorted(mids, x / safe[ids], right=True,
                                                    out_int32=True), codes))
