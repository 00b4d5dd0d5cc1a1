"""Redistribute tensors between two layouts that give each rank one contiguous flat range.

RaggedShard, even ``Shard(0)`` and "this rank keeps what it needs" all give every rank one
contiguous flat range of each tensor, so moving a unit's tensors from one such layout to
another is one ``all_to_all_single`` with uneven splits (which gloo supports): rank ``q``
sends rank ``r`` the intersection of its source range with ``r``'s destination range.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from vfsdp.collectives import comm

__all__ = ["flat_redistribute", "shard0_range"]

Ranges = Sequence[tuple]  # per rank: (start, stop) in the tensor's flat order


def shard0_range(shape: tuple, world: int, rank: int) -> tuple[int, int]:
    """Flat range of ``rank`` under DTensor's ``Shard(0)`` (``torch.chunk`` row sizes).

    Example:
        >>> [shard0_range((5, 2), 3, r) for r in range(3)]
        [(0, 4), (4, 8), (8, 10)]
    """
    if not shape:
        raise ValueError("Shard(0) needs at least one dim")
    rows = shape[0]
    inner = math.prod(shape[1:])
    chunk = -(-rows // world) if rows else 0
    lo = min(rank * chunk, rows)
    hi = min(lo + chunk, rows)
    return lo * inner, hi * inner


def _cut(a: tuple, b: tuple) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else (lo, lo)


def flat_redistribute(sources: Sequence[torch.Tensor], src: Sequence[Ranges],
                      dst: Sequence[Ranges], group=None,
                      device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """Move tensors from one flat-range layout to another in one ``all_to_all_single``.

    Args:
        sources: This rank's piece of each tensor (``numel`` = its source range), one dtype.
        src: ``src[i][r]``: rank ``r``'s source range of tensor ``i`` (disjoint over ranks).
        dst: ``dst[i][r]``: rank ``r``'s destination range of tensor ``i``.
        group: The process group the ranks index.
        device: Device of the outputs (default: the first source's).

    Returns:
        This rank's destination piece of each tensor, flat.

    Raises:
        ValueError: sources of different dtypes, or a destination element no rank holds.

    Example:
        >>> # ragged (7, 0, 3 elements) -> even Shard(0) rows of a (5, 2) tensor on 3 ranks
        >>> src = [[(0, 7), (7, 7), (7, 10)]]
        >>> dst = [[shard0_range((5, 2), 3, r) for r in range(3)]]
        >>> mine = flat_redistribute([piece], src, dst)   # doctest: +SKIP
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dtypes = {s.dtype for s in sources}
    if len(dtypes) > 1:
        raise ValueError(f"flat_redistribute: one dtype per call, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.float32
    device = device or (sources[0].device if sources else torch.device("cpu"))
    for i in range(len(sources)):
        lo, hi = src[i][rank]
        if sources[i].numel() != hi - lo:
            raise ValueError(f"flat_redistribute: tensor {i}: this rank's source has "
                             f"{sources[i].numel()} elements, its range [{lo}, {hi}) {hi - lo}")
        want = sum(hi - lo for lo, hi in dst[i])
        have = sum(_cut(s, d)[1] - _cut(s, d)[0] for s in src[i] for d in dst[i])
        if have != want:
            raise ValueError(f"flat_redistribute: tensor {i}: the source ranges cover {have} of "
                             f"the {want} destination elements")
    send, send_sizes, recv_sizes = [], [0] * world, [0] * world
    for q in range(world):
        for i, piece in enumerate(sources):
            lo, hi = _cut(src[i][rank], dst[i][q])
            base = src[i][rank][0]
            if hi > lo:
                send.append(piece.reshape(-1)[lo - base:hi - base])
                send_sizes[q] += hi - lo
            lo, hi = _cut(src[i][q], dst[i][rank])
            recv_sizes[q] += hi - lo
    send_buf = torch.cat(send).to(device) if send else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    if world > 1:
        comm.all_to_all_into(recv, send_buf, recv_sizes, send_sizes, group)
    else:
        recv.copy_(send_buf)
    outs = [torch.empty(dst[i][rank][1] - dst[i][rank][0], dtype=dtype, device=device)
            for i in range(len(sources))]
    off = 0
    for q in range(world):
        for i in range(len(sources)):
            lo, hi = _cut(src[i][q], dst[i][rank])
            if hi > lo:
                base = dst[i][rank][0]
                outs[i][lo - base:hi - base] = recv[off:off + hi - lo]
                off += hi - lo
    return outs
