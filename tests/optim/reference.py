"""References the optimizers are tested against (they run in no optimizer): 8-bit AdamW per
tensor, tiles by reshaping (:func:`step8`, :func:`quantize_tiles`, :func:`dequantize_tiles`),
and per element, an explicit tile index each (:func:`tile_ids`, :func:`quantize`,
:func:`dequantize`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from vfsdp.functional.tiles import TILE, tiled
from vfsdp.optim.quant import dynamic_map, midpoints  # noqa: F401 - for the examples


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
          lr: Any, bc1: Any, bc2_sqrt: Any) -> None:
    """Reference: one tensor's 8-bit AdamW step in place (weight decay applied before):
    dequantize ``m`` and ``v`` from codes ``cm``/``cv`` (``[B, R, C]``) and tile scales
    ``sm``/``sv``, apply AdamW to ``p`` (``p + size * m / (sqrt(v) / bc2_sqrt + eps)``, with
    ``size = -lr / bc1``, floats or one-element tensors), re-quantize: the 8-bit
    math written out by hand, per tensor, tiles by reshaping, which ``step8_flat`` equals.

    Example:
        >>> qm, qv = dynamic_map(True), dynamic_map(False)
        >>> p, g = torch.ones(1, 32, 32), torch.full((1, 32, 32), 0.5)
        >>> codes = [torch.zeros(1, 32, 32, dtype=torch.uint8) for _ in range(2)]
        >>> scales = [torch.zeros(1), torch.zeros(1)]
        >>> step8(p, g, codes[0], codes[1], *scales, qm, qv, midpoints(qm), midpoints(qv),
        ...       0.9, 0.999, 1e-8, 0.1, 1 - 0.9, (1 - 0.999) ** 0.5)
        >>> round(float(p[0, 0, 0]), 4)                  # the first step moves p by -lr
        0.9
    """
    m = dequantize_tiles(cm, sm, qm)
    v = dequantize_tiles(cv, sv, qv)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = v.sqrt().div_(float(bc2_sqrt)).add_(eps)
    p.addcdiv_(m, denom, value=-float(lr) / float(bc1))
    quantize_tiles(m, mids_m, cm, sm)
    quantize_tiles(v, mids_v, cv, sv)
