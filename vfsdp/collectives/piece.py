"""Pieces: a rank's contiguous flat range of a global tensor, and how DCP sees it.

Every sharded thing vfsdp checkpoints (a parameter shard, a moment, 8-bit codes, tile scales)
is, on each rank, one **contiguous flat range** ``[start, start + n)`` of a global tensor in
row-major order. DCP describes data as N-D boxes (offsets and sizes per dim), so a flat range
is cut into at most ``2 * ndim - 1`` boxes (:func:`boxes`): a partial leading row, a slab of
whole rows, a partial trailing row, recursively. A range of whole rows (``rows`` granularity)
is one box. Each box is itself contiguous in the flat order, so its data is a plain slice of
the local piece: nothing is copied to describe it.

An empty range has no boxes: a rank that holds nothing of a tensor reports no chunk at all
(otherwise DCP's de-duplication by ``(fqn, offsets)`` would drop its neighbour's data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Piece", "boxes", "per_rank", "tensor_piece"]


@dataclass(frozen=True)
class Piece:
    """This rank's contiguous flat range of a global tensor.

    Attributes:
        local: The rank's data (contiguous, ``numel`` = length of the range; any shape).
        shape: Shape of the global tensor.
        start: Flat (row-major) start of the range in the global tensor.
        writer: Whether this rank writes the range at save time (``False`` on HSDP replicas
            other than the first, which hold the same data).
        db: The DBuffer ``local`` aliases, if any (lets exports gather a unit at once).
        index: The tensor's index in ``db``.
        within: For a tensor split over a model axis (TP, EP): ``(origin, shape)`` of this
            rank's box of the global tensor, and ``start`` is then flat in that box (a
            ``StridedRaggedShard``). ``None``: the range is flat in the global tensor.

    Example:
        >>> p = Piece(torch.arange(5.0), (3, 4), 6)
        >>> p.stop, p.boxes()
        (11, [((1, 2), (1, 2)), ((2, 0), (1, 3))])
    """

    local: torch.Tensor
    shape: tuple
    start: int
    writer: bool = True
    db: Any = None
    index: Optional[int] = None
    within: Optional[tuple] = None

    def __post_init__(self) -> None:
        if self.within is not None:
            origin, box = self.within
            if len(origin) != len(self.shape) or len(box) != len(self.shape) or any(
                    o < 0 or o + b > d for o, b, d in zip(origin, box, self.shape)):
                raise ValueError(f"a Piece's box at {tuple(origin)} of shape {tuple(box)} is "
                                 f"outside its tensor {tuple(self.shape)}")
        numel = math.prod(self.box_shape)
        if not self.local.is_contiguous():
            raise ValueError(f"a Piece's local tensor must be contiguous (loads write through "
                             f"it), got strides {self.local.stride()} for shape "
                             f"{tuple(self.local.shape)}")
        if self.start < 0 or self.stop > numel:
            raise ValueError(f"piece [{self.start}, {self.stop}) is outside a tensor of "
                             f"{numel} elements {tuple(self.shape)}")

    @property
    def box_shape(self) -> tuple:
        """Shape of the tensor ``start`` is flat in: the box, or the global tensor."""
        return tuple(self.shape) if self.within is None else tuple(self.within[1])

    @property
    def stop(self) -> int:
        return self.start + self.local.numel()

    @property
    def numel(self) -> int:
        return self.local.numel()

    def boxes(self) -> list:
        """``[(offsets, sizes), ...]`` covering the range, in flat order (offsets in the
        global tensor)."""
        origin = (0,) * len(self.shape) if self.within is None else self.within[0]
        return [(tuple(o + a for o, a in zip(offs, origin)), sizes)
                for offs, sizes in boxes(self.box_shape, self.start, self.stop)]

    def box_data(self, offsets: tuple, sizes: tuple, data: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The slice of ``data`` (default: ``local``) holding one of :meth:`boxes`, box-shaped."""
        if self.within is not None:
            offsets = tuple(o - a for o, a in zip(offsets, self.within[0]))
        # the box's first element, flat (row-major) in ``box_shape``
        lo = sum(o * math.prod(self.box_shape[d + 1:]) for d, o in enumerate(offsets)) - self.start
        return (self.local if data is None else data).reshape(-1)[lo:lo + math.prod(sizes)].view(sizes)


def boxes(shape: tuple, start: int, stop: int) -> list:
    """Cut the flat range ``[start, stop)`` of a row-major tensor of ``shape`` into N-D boxes.

    Args:
        shape: The global tensor's shape.
        start: First flat index of the range.
        stop: One past its last flat index.

    Returns:
        ``[(offsets, sizes), ...]`` in flat order; each box is contiguous in the flat order
            and the boxes tile the range exactly. ``[]`` for an empty range.

    Raises:
        TypeError: ``start`` or ``stop`` is not a number. Any range inside the tensor is
            cut (at most ``2 * ndim - 1`` boxes); one reaching outside it is not checked.

    Example:
        >>> boxes((4, 3), 3, 9)            # whole rows: one box
        [((1, 0), (2, 3))]
        >>> boxes((4, 3), 2, 8)
        [((0, 2), (1, 1)), ((1, 0), (1, 3)), ((2, 0), (1, 2))]
    """
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []

    def part(r: int, a: int, b: int) -> list:  # [a, b) of row r (none if empty)
        return [((r,) + o, (1,) + s) for o, s in boxes(shape[1:], a, b)]

    lead = min(-(-start // inner) * inner, stop)  # the end of a partial leading row
    trail = max(lead, stop - stop % inner)  # the start of a partial trailing row
    rows = [((lead // inner,) + (0,) * (len(shape) - 1), ((trail - lead) // inner,) + tuple(shape[1:]))]
    return (part(start // inner, start % inner, lead - start + start % inner)
            + (rows if trail > lead else []) + part(trail // inner, 0, stop - trail))


def per_rank(t: torch.Tensor, rank: int, world: int) -> Piece:
    """Checkpoint data that differs per rank (RNG or data-loader state) as a :class:`Piece`.

    Rank ``r``'s tensor is row ``r`` of a global ``(world, *t.shape)`` tensor, so it reloads
    on the same world size only (another world size is refused as a shape mismatch).

    Args:
        t: This rank's tensor (contiguous).
        rank: This rank.
        world: The number of ranks.

    Returns:
        A :class:`Piece` of the global ``(world, *t.shape)`` tensor.

    Raises:
        ValueError: ``t`` is not contiguous, or ``rank`` is outside ``[0, world)``.

    Example:
        >>> p = per_rank(torch.zeros(3), rank=1, world=4)
        >>> p.shape, p.start
        ((4, 3), 3)
    """
    return Piece(t, (world, *t.shape), rank * t.numel())


def tensor_piece(ts: Any, local: torch.Tensor, rank: int, writer: bool = True, db: Any = None,
                 index: Optional[int] = None) -> Piece:
    """Shard rank ``rank``'s range of a planned tensor as a :class:`Piece` of its **global**
    tensor: flat in it, or, for a tensor a model axis splits (``ts.strided``), flat in this
    index's box of it (a replicated tensor is written by index 0 only).

    Args:
        ts: The tensor's ``TensorSpec``.
        local: The rank's data for it (contiguous, of its range's length).
        rank: The shard rank.
        writer: Whether this rank writes at all (``False`` on HSDP replicas but the first).
        db, index: The DBuffer ``local`` aliases and the tensor's index in it, if any.

    Returns:
        The :class:`Piece`.

    Raises:
        ValueError: ``local`` does not fit the range.

    Example:
        >>> spec = vfsdp.plan({"w": torch.empty(4, 6)}, (("dp", 2), ("tp", 2)),
        ...                   tp=lambda p: Shard(1), tp_index=1, granularity=vfsdp.rows(1))
        >>> p = tensor_piece(spec.tensor(("w",)), torch.zeros(6), rank=1)
        >>> p.shape, p.boxes()
        ((4, 6), [((2, 3), (2, 3))])
    """
    st = ts.strided
    start = ts.local_range(rank)[0]
    if st is None:
        return Piece(local, tuple(ts.shape), start, writer=writer, db=db, index=index)
    return Piece(local, st.global_shape, start, writer=writer and st.writes, db=db, index=index,
                 within=(st.origin, st.local_shape))
