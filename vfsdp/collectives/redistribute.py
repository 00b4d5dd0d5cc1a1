"""Redistribute tensors between two layouts that give each rank one contiguous flat range.

RaggedShard, even ``Shard(0)`` and "this rank keeps what it needs" all give every rank one
contiguous flat range of each tensor, so moving a unit's tensors from one such layout to
another is one ``all_to_all_single`` with uneven splits (which gloo supports): rank ``q``
sends rank ``r`` the intersection of its source range with ``r``'s destination range.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
import torch.distributed as dist

from vfsdp.collectives import comm
from vfsdp.collectives.comm import Handle

__all__ = ["flat_redistribute", "Redistribution", "shard0_range"]

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
    return lo * inner, min(lo + chunk, rows) * inner


def _cut(a: tuple, b: tuple) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else (lo, lo)


def _covered(src: Ranges, dst: Ranges) -> int:
    """Destination elements that some (disjoint) source range holds: a sweep, O(w log w)."""
    held = sorted((lo, hi) for lo, hi in src if hi > lo)
    total = 0
    for lo, hi in dst:  # an empty range meets none
        k = max(bisect.bisect_right(held, lo, key=lambda r: r[0]) - 1, 0)
        while k < len(held) and held[k][0] < hi:
            a, b = _cut(held[k], (lo, hi))
            total += b - a
            k += 1
    return total


def _meet(i: int, mine: tuple, others: Ranges, sizes: list) -> Iterator[tuple]:
    """``(rank, i, lo, hi)`` where ``mine`` meets each rank's range of ``others`` (relative to
    ``mine``'s start), adding each slice's size to ``sizes[rank]``."""
    if mine[1] > mine[0]:
        for q, r in enumerate(others):
            lo, hi = _cut(mine, r)
            if hi > lo:
                sizes[q] += hi - lo
                yield q, i, lo - mine[0], hi - mine[0]


class Redistribution:
    """Where each element goes in one flat redistribution, as seen from one rank (pure data).

    Built once from the ranges and reused for every call with the same layout
    (Muon plans its waves this way), so a call is one ``cat``, one ``all_to_all_single`` and
    one copy per received range.

    Args:
        src: ``src[i][r]``: rank ``r``'s source range of tensor ``i`` (disjoint over ranks).
        dst: ``dst[i][r]``: rank ``r``'s destination range of tensor ``i``.
        rank: This rank's index in the group.
        world: The group size.

    Raises:
        ValueError: a destination element that no source range holds.

    Attributes:
        rank: This rank.
        world: The group size.
        send: ``(tensor, lo, hi)`` slices of the sources to send, in destination-rank order.
        send_sizes: Elements to send to each rank.
        recv_sizes: Elements to receive from each rank.
        recv: ``(tensor, lo, hi)``: where each received range lands in the outputs, in
            source-rank order.
        out_sizes: Elements of each output.

    Example:
        >>> src, dst = [[(0, 3), (3, 4)]], [[(0, 2), (2, 4)]]      # one tensor of 4, 2 ranks
        >>> plan = Redistribution(src, dst, rank=0, world=2)
        >>> plan.send, plan.send_sizes, plan.recv, plan.recv_sizes
        ([(0, 0, 2), (0, 2, 3)], [2, 1], [(0, 0, 2)], [2, 0])
        >>> def body():
        ...     r = dist.get_rank()
        ...     lo, hi = src[0][r]
        ...     handle = Redistribution(src, dst, r, 2).run([torch.arange(4.0)[lo:hi]], async_op=True)
        ...     return [t.tolist() for t in handle.wait()]
        >>> vfsdp.testing.simulate(2, body)
        [[[0.0, 1.0]], [[2.0, 3.0]]]
    """

    __slots__ = ("rank", "world", "send", "send_sizes", "recv", "recv_sizes", "out_sizes",
                 "in_sizes")

    def __init__(self, src: Sequence[Ranges], dst: Sequence[Ranges], rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        n = len(src)
        self.in_sizes = [s[rank][1] - s[rank][0] for s in src]
        self.out_sizes = [d[rank][1] - d[rank][0] for d in dst]
        for i in range(n):
            if (have := _covered(src[i], dst[i])) != (want := sum(hi - lo for lo, hi in dst[i])):
                raise ValueError(f"flat_redistribute: tensor {i}: the source ranges cover {have} "
                                 f"of the {want} destination elements")
        # Only the ranks with a non-empty range meet (a tensor spans few ranks): the slices in
        # (rank, tensor) order, found per tensor.
        self.send_sizes, self.recv_sizes = [0] * world, [0] * world
        self.send = [x[1:] for x in sorted(
            x for i in range(n) for x in _meet(i, src[i][rank], dst[i], self.send_sizes))]
        self.recv = [x[1:] for x in sorted(
            x for i in range(n) for x in _meet(i, dst[i][rank], src[i], self.recv_sizes))]

    def run(self, sources: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
            device: Optional[torch.device] = None, async_op: bool = False
            ) -> list[torch.Tensor] | Handle:
        """Move ``sources`` (this rank's source pieces) to this rank's destination pieces.

        Args:
            sources: This rank's piece of each tensor, one dtype.
            group: The process group the ranks index (default: every rank).
            device: Device of the outputs (default: the first source's).
            async_op: Return a :class:`Handle` at once.

        Returns:
            The outputs (flat tensors), or a :class:`Handle` whose ``wait()`` returns them.

        Raises:
            ValueError: sources of different dtypes, or of the wrong sizes.
        """
        dtypes = {s.dtype for s in sources}
        if len(dtypes) > 1:
            raise ValueError(f"flat_redistribute: one dtype per call, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32  # (no sources: empty outputs)
        device = device or (sources[0].device if sources else torch.device("cpu"))
        for i, piece in enumerate(sources):
            if piece.numel() != self.in_sizes[i]:
                raise ValueError(f"flat_redistribute: tensor {i}: this rank's source has "
                                 f"{piece.numel()} elements, its range {self.in_sizes[i]}")
        send = [sources[i].reshape(-1)[lo:hi] for i, lo, hi in self.send]
        send_buf = (torch.cat(send).to(device) if send
                    else torch.empty(0, dtype=dtype, device=device))
        outs = [torch.empty(n, dtype=dtype, device=device) for n in self.out_sizes]

        def unpack(recv):
            for (i, lo, hi), got in zip(self.recv, recv.split([hi - lo for _, lo, hi in self.recv])):
                outs[i][lo:hi] = got
            return outs

        return self.exchange(send_buf, group, async_op, unpack)

    def exchange(self, send_buf: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                 async_op: bool = False, then=None) -> torch.Tensor | Handle:
        """The one ``all_to_all_single`` of :meth:`run`, for a send buffer already laid out in
        :attr:`send` order: returns the receive buffer (in :attr:`recv` order), or ``then`` of
        it; or a :class:`Handle` whose ``wait()`` does.

        Raises:
            ValueError: a send buffer of the wrong size.
        """
        if send_buf.numel() != sum(self.send_sizes):
            raise ValueError(f"flat_redistribute: the send buffer has {send_buf.numel()} "
                             f"elements, the plan sends {sum(self.send_sizes)}")
        device = send_buf.device
        recv = torch.empty(sum(self.recv_sizes), dtype=send_buf.dtype, device=device)
        keep = [send_buf]

        def done():
            del keep[:]  # the send buffer lives until the exchange is done (no record_stream)
            return then(recv) if then is not None else recv

        if self.world == 1:
            recv.copy_(send_buf)
            handle = Handle((), done)
        else:
            handle = comm.launch(device, lambda a: comm.all_to_all_into(
                recv, send_buf, self.recv_sizes, self.send_sizes, group, async_op=a), async_op, done)
        return handle if async_op else handle.wait()


def flat_redistribute(sources: Sequence[torch.Tensor], src: Sequence[Ranges],
                      dst: Sequence[Ranges], group: Optional[dist.ProcessGroup] = None,
                      device: Optional[torch.device] = None,
                      async_op: bool = False) -> list[torch.Tensor] | Handle:
    """Move tensors from one flat-range layout to another in one ``all_to_all_single``.

    Args:
        sources: This rank's piece of each tensor (``numel`` = its source range), one dtype.
        src: ``src[i][r]``: rank ``r``'s source range of tensor ``i`` (disjoint over ranks).
        dst: ``dst[i][r]``: rank ``r``'s destination range of tensor ``i``.
        group: The process group the ranks index (default: every rank).
        device: Device of the outputs (default: the first source's).
        async_op: Return a :class:`Handle` at once; its ``wait()`` returns the outputs.

    Returns:
        This rank's destination piece of each tensor, flat (or the handle).

    Raises:
        ValueError: sources of different dtypes, or a destination element no rank holds.

    Example:
        >>> # ragged (7, 0, 3 elements) -> even Shard(0) rows of a (5, 2) tensor on 3 ranks
        >>> src = [[(0, 7), (7, 7), (7, 10)]]
        >>> dst = [[shard0_range((5, 2), 3, r) for r in range(3)]]
        >>> def body():
        ...     lo, hi = src[0][dist.get_rank()]
        ...     return flat_redistribute([torch.arange(lo, hi)], src, dst)[0].tolist()
        >>> vfsdp.testing.simulate(3, body)
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """
    plan = Redistribution(src, dst, dist.get_rank(group), dist.get_world_size(group))
    return plan.run(sources, group, device, async_op=async_op)
