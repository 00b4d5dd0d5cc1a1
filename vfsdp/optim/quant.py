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

Three implementations of the same arithmetic, bitwise equal:

* the one the optimizer runs, :func:`step8_flat` over a unit's **flat span**: every quantized
  tensor of the unit at once, whatever their shapes, a fixed number of ops per unit. Each
  element's tile comes from a small table per tensor (:func:`span_tiles`, made at ``init``):
  :func:`flat_tile_ids` expands it per step, in a few ops over the span's 32-column row pieces
  and one over its elements (nothing per element is stored beside the codes and one scale per
  tile); a scatter-max takes each tile's absmax;
* per tensor, :func:`step8` with :func:`quantize_tiles` and :func:`dequantize_tiles`: the local
  range seen as ``[B, R, C]`` matrices, tiles by reshaping, the reference the flat pass is
  compared with;
* the element reference, :func:`tile_ids`, :func:`quantize` and :func:`dequantize`: an
  explicit tile index per element built by a loop-free formula on the CPU.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch

from vfsdp.functional.tiles import TILE, tile_view, tiled

__all__ = ["dynamic_map", "midpoints", "tile_view", "quantize_tiles", "dequantize_tiles",
           "quantize", "dequantize", "tile_ids", "TILE", "step8", "SpanTiles", "span_tiles",
           "flat_tile_ids", "step8_flat"]


@lru_cache(maxsize=4)
def _map(signed: bool) -> tuple:
    values = [0.0, 1.0]
    for i in range(7):
        n = 2 ** i if signed else 2 ** (i + 1)
        edges = [0.1 + 0.9 * k / n for k in range(n + 1)]
        means = [(a + b) / 2 * 10.0 ** (i - 6) for a, b in itertools.pairwise(edges)]
        values += means
        if signed:
            values += [-x for x in means]
    values.sort()
    if len(values) != 256:
        raise AssertionError(f"dynamic map has {len(values)} entries")
    return tuple(values)


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


def quantize_tiles(x: torch.Tensor, mids: torch.Tensor, codes: torch.Tensor,
                   scales: torch.Tensor) -> None:
    """Quantize ``x`` (``[B, R, C]``, fp32) into ``codes`` (uint8, same shape) and ``scales``
    (fp32, ``B * ceil(R/32) * ceil(C/32)`` elements, tile order), in place.

    Args:
        x: The values.
        mids: :func:`midpoints` of the code map.
        codes, scales: Written.
    """
    b, r, c = x.shape
    tiles = tiled(x)
    absmax = tiles.abs().amax(dim=(2, 4))
    scales.copy_(absmax.reshape(-1))
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    rt, ct = tiles.shape[1], tiles.shape[3]
    y = (tiles / safe[:, :, None, :, None]).view(b, rt * TILE, ct * TILE)[:, :r, :c]
    codes.copy_(torch.searchsorted(mids, y.contiguous(), right=True))


def dequantize_tiles(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor
                     ) -> torch.Tensor:
    """``qmap[codes] * scale of its tile`` in fp32, for ``codes`` of shape ``[B, R, C]``."""
    b, r, c = codes.shape
    rt, ct = -(-r // TILE), -(-c // TILE)
    values = qmap[codes.long()]
    if (r, c) == (rt * TILE, ct * TILE):
        return (values.view(b, rt, TILE, ct, TILE) * scales.view(b, rt, 1, ct, 1)).view(b, r, c)
    s = scales.view(b, rt, ct).repeat_interleave(TILE, 1).repeat_interleave(TILE, 2)
    return values * s[:, :r, :c]


def quantize(x: torch.Tensor, tiles: torch.Tensor, n_tiles: int, qmap: torch.Tensor):
    """Reference: codes (uint8) and per-tile absmax scales (fp32) of ``x`` (any shape, fp32).

    Args:
        x: Values.
        tiles: Tile index of every element (same shape as ``x``, int64).
        n_tiles: Number of tiles.
        qmap: The code map.

    Returns:
        ``(codes, scales)``.
    """
    flat = x.reshape(-1)
    scales = torch.zeros(n_tiles, dtype=torch.float32, device=x.device)
    scales.scatter_reduce_(0, tiles.reshape(-1), flat.abs(), reduce="amax", include_self=True)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = flat / safe[tiles.reshape(-1)]
    codes = torch.searchsorted(midpoints(qmap), y, right=True).to(torch.uint8)
    return codes.reshape(x.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, tiles: torch.Tensor,
               qmap: torch.Tensor) -> torch.Tensor:
    """Reference: ``qmap[codes] * scales[tile]`` in fp32."""
    return qmap[codes.long()] * scales[tiles]


def tile_ids(shape: tuple, start: int, stop: int) -> tuple[torch.Tensor, int]:
    """Reference: the tile index of every element of the flat range ``[start, stop)`` of a
    tensor of ``shape``.

    The range must hold whole 32-row stripes of its matrices (the planner's ``rows(32)``), so
    the tiles it touches are complete; indices are local (0 = first tile in the range).

    Returns:
        ``(ids, n_tiles)`` with ``ids`` of shape ``(stop - start,)``.

    Raises:
        ValueError: the range cuts a 32-row stripe.
    """
    cols = shape[-1]
    rows = shape[-2]
    col_tiles = math.ceil(cols / TILE)
    row_tiles = math.ceil(rows / TILE)
    if (start % cols) or (stop % cols):
        raise ValueError(f"range [{start}, {stop}) cuts a row of {cols} elements")
    r0, r1 = start // cols, stop // cols
    if (r0 % rows) % TILE or ((r1 % rows) % TILE and r1 % rows != 0):
        raise ValueError(f"range of rows [{r0}, {r1}) cuts a 32-row stripe")
    g = torch.arange(r0, r1)  # cpu: reference
    stripe = (g // rows) * row_tiles + (g % rows) // TILE  # global stripe index per row
    first = int(stripe[0]) if len(stripe) else 0
    col = torch.arange(cols) // TILE  # cpu: reference
    ids = ((stripe - first)[:, None] * col_tiles + col[None, :]).reshape(-1)
    n = (int(stripe[-1]) - first + 1) * col_tiles if len(stripe) else 0
    return ids, n


def step8(p: torch.Tensor, g: torch.Tensor, cm: torch.Tensor, cv: torch.Tensor,
          sm: torch.Tensor, sv: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor,
          mids_m: torch.Tensor, mids_v: torch.Tensor, b1: float, b2: float, eps: float,
          bc2_sqrt: Any, step: Any) -> None:
    """One tensor's 8-bit AdamW step in place (weight decay applied before, by the caller):
    dequantize ``m`` and ``v`` from codes ``cm``/``cv`` (``[B, R, C]``) and tile scales
    ``sm``/``sv``, apply AdamW to ``p`` (``p + step * m / (sqrt(v) / bc2_sqrt + eps)``, with
    ``step = -rate / bias correction 1``), re-quantize. The one implementation of the 8-bit
    math: the eager update runs it, ``torch.compile`` fuses it (``compiled_step8``), and a
    compiled update traces it. A fixed number of ops whatever the tensor's size.

    ``bc2_sqrt`` and ``step`` change every step: Python floats eagerly (the last line is then
    one ``addcdiv``), or float32 tensors where a compiled graph must not specialise on them.

    Example:
        >>> qm, qv = dynamic_map(True), dynamic_map(False)
        >>> p, g = torch.ones(1, 32, 32), torch.full((1, 32, 32), 0.5)
        >>> codes = [torch.zeros(1, 32, 32, dtype=torch.uint8) for _ in range(2)]
        >>> scales = [torch.zeros(1), torch.zeros(1)]
        >>> step8(p, g, codes[0], codes[1], *scales, qm, qv, midpoints(qm), midpoints(qv),
        ...       0.9, 0.999, 1e-8, (1 - 0.999) ** 0.5, -0.1 / (1 - 0.9))
        >>> round(float(p[0, 0, 0]), 4)                  # the first step moves p by -lr
        0.9
    """
    m = dequantize_tiles(cm, sm, qm)
    v = dequantize_tiles(cv, sv, qv)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    if isinstance(step, torch.Tensor):  # the same sum, the scalar taken as a tensor
        p.addcmul_(m / denom, step)
    else:
        p.addcdiv_(m, denom, value=step)
    quantize_tiles(m, mids_m, cm, sm)
    quantize_tiles(v, mids_v, cv, sv)


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
            matrices (:func:`tile_view`), its tiles numbered from ``first tile`` in
            :func:`tile_ids`' order; ``view=None``: a gap of ``numel`` elements.
        n_tiles: The span's tiles.
        device: The span's device.
        keep: ``(first tile, tiles)`` ranges whose scales stay (tensors not updated).

    Example:
        >>> t = span_tiles([(40 * 40, (1, 40, 40), 0), (8, None, None)], 4, "cpu")
        >>> flat_tile_ids(t).reshape(-1)[[0, 31, 32, 40 * 32, 40 * 40 - 1, 40 * 40]].tolist()
        [0, 0, 1, 2, 3, 4]
    """
    rows, first = [], 0
    for numel, view, base in pieces:
        if numel == 0:
            continue
        if view is None:
            rows.append((1, first, 1, 1, 0, n_tiles, numel))
            first += 1
            continue
        b, r, c = view
        ct = -(-c // TILE)
        rows.append((b * r * ct, first, ct, r, -(-r // TILE), base, c - TILE * (ct - 1)))
        first += b * r * ct
    mask = None
    if keep:
        mask = torch.zeros(n_tiles + 1, dtype=torch.bool, device=device)
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
               b2: float, eps: float, bc2_sqrt: Any, step: Any) -> None:
    """:func:`step8` over a flat span of many tensors at once, bitwise: ``p``, ``g`` (fp32),
    the codes ``cm``/``cv`` are the span's flat elements, ``sm``/``sv`` its ``n_tiles + 1``
    scales (the last the spare tile's, 0) and ``tiles`` where each element's tile is. Gap
    elements keep their values and codes (their gradient is taken as 0 and their moments
    dequantize to 0, so ``p`` adds ``-0.0``); the scales of ``tiles.keep`` stay. The one
    implementation the optimizer runs, eagerly, fused by ``torch.compile`` and traced in a
    compiled update.

    Example:
        >>> qm, qv = dynamic_map(True), dynamic_map(False)
        >>> p, g = torch.ones(32 * 32 + 4), torch.full((32 * 32 + 4,), 0.5)
        >>> cm, cv = (torch.zeros(p.numel(), dtype=torch.uint8) for _ in range(2))
        >>> t = span_tiles([(32 * 32, (1, 32, 32), 0), (4, None, None)], 1, "cpu")
        >>> step8_flat(p, g, cm, cv, torch.zeros(2), torch.zeros(2), t, qm, qv, midpoints(qm),
        ...            midpoints(qv), 0.9, 0.999, 1e-8, (1 - 0.999) ** 0.5, -0.1 / (1 - 0.9))
        >>> round(float(p[0]), 4), float(p[-1]), int(cm[-1])   # the gap is left alone
        (0.9, 1.0, 0)
    """
    ids = flat_tile_ids(tiles)
    act = ids < tiles.n_tiles
    g = torch.where(act, g, 0.0)
    m = qm[cm.long()] * sm[ids]
    v = qv[cv.long()] * sv[ids]
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    if isinstance(step, torch.Tensor):  # as step8's
        p.addcmul_(m / denom, step)
    else:
        p.addcdiv_(m, denom, value=step)
    _quantize_flat(m, mids_m, cm, sm, ids, act, tiles.keep)
    _quantize_flat(v, mids_v, cv, sv, ids, act, tiles.keep)


def _quantize_flat(x: torch.Tensor, mids: torch.Tensor, codes: torch.Tensor,
                   scales: torch.Tensor, ids: torch.Tensor, act: torch.Tensor,
                   keep: Optional[torch.Tensor]) -> None:
    """:func:`quantize_tiles` over a flat span: each tile's absmax by a scatter-max (gaps go to
    the spare tile, whose ``x`` is 0), the codes of gap elements and the scales of ``keep``
    left as they are."""
    absmax = torch.zeros_like(scales).scatter_reduce_(0, ids, x.abs(), "amax")
    scales.copy_(absmax if keep is None else torch.where(keep, scales, absmax))
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes.copy_(torch.where(act, torch.searchsorted(mids, x / safe[ids], right=True,
                                                    out_int32=True), codes))
