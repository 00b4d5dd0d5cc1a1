"""Reference semantics of the collectives, as loops over ranks on plain tensors.

Each rank ``r`` of a shard group holds an ``S``-element shard, its slice ``[r*S, (r+1)*S)`` of
the unit's global ``m*S`` buffer. These functions take the per-rank values as Python lists
indexed by rank and return what every rank would hold afterwards. The fast, distributed
implementations are tested against them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["all_gather_reference", "reduce_scatter_reference", "all_reduce_reference",
           "flat_redistribute_reference"]

_OPS = ("sum", "avg")


def _check(values: Sequence[torch.Tensor], what: str) -> None:
    if not values:
        raise ValueError(f"{what}: need one tensor per rank, got none")
    first = values[0]
    for r, v in enumerate(values):
        if v.dim() != 1 or v.numel() != first.numel() or v.dtype != first.dtype:
            raise ValueError(
                f"{what}: rank {r} holds shape {tuple(v.shape)} {v.dtype}, rank 0 holds "
                f"{tuple(first.shape)} {first.dtype}; every rank needs the same 1-D size and dtype"
            )


def all_gather_reference(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global buffer every rank holds after an all-gather of equal ``S``-element shards.

    Args:
        shards: One 1-D tensor per rank, equal sizes and dtypes.

    Returns:
        Their concatenation in rank order.

    Raises:
        ValueError: no shards, or shards of different sizes or dtypes.

    Example:
        >>> all_gather_reference([torch.tensor([1., 2.]), torch.tensor([3., 4.])]).tolist()
        [1.0, 2.0, 3.0, 4.0]
    """
    _check(shards, "all_gather_reference")
    return torch.cat(list(shards))


def reduce_scatter_reference(buffers: Sequence[torch.Tensor], op: str = "sum") -> list[torch.Tensor]:
    """Per-rank shards after a reduce-scatter of equal ``m*S``-element buffers.

    Rank ``r`` receives ``op`` over all ranks of ``buffer[r*S:(r+1)*S]``.

    Args:
        buffers: One global buffer per rank (``m`` of them, each ``m*S`` elements).
        op: ``"sum"`` or ``"avg"``.

    Returns:
        ``m`` shards of ``S`` elements.

    Raises:
        ValueError: unequal buffers, a size not divisible by ``m``, or an unknown op.

    Example:
        >>> bufs = [torch.tensor([1., 2.]), torch.tensor([10., 20.])]
        >>> [s.tolist() for s in reduce_scatter_reference(bufs)]
        [[11.0], [22.0]]
    """
    _check(buffers, "reduce_scatter_reference")
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    m = len(buffers)
    if buffers[0].numel() % m:
        raise ValueError(f"buffer of {buffers[0].numel()} elements does not split over {m} ranks")
    s = buffers[0].numel() // m
    out = []
    for r in range(m):
        acc = torch.zeros(s, dtype=buffers[0].dtype, device=buffers[0].device)
        for b in buffers:
            acc = acc + b[r * s:(r + 1) * s]
        out.append(acc / m if op == "avg" else acc)
    return out


def all_reduce_reference(values: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """What every rank holds after an all-reduce (used over HSDP's replicate dim).

    Args:
        values: One 1-D tensor per rank, equal sizes and dtypes.
        op: ``"sum"`` or ``"avg"``.

    Returns:
        The reduced tensor.

    Raises:
        ValueError: unequal values or an unknown op.

    Example:
        >>> all_reduce_reference([torch.tensor([1.]), torch.tensor([3.])], "avg").tolist()
        [2.0]
    """
    _check(values, "all_reduce_reference")
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    acc = torch.zeros_like(values[0])
    for v in values:
        acc = acc + v
    return acc / len(values) if op == "avg" else acc


def flat_redistribute_reference(sources: Sequence[Sequence[torch.Tensor]], src: Sequence,
                                dst: Sequence) -> list:
    """What each rank holds after ``flat_redistribute``: element by element, over ranks.

    Args:
        sources: ``sources[r][i]``: rank ``r``'s piece of tensor ``i``.
        src: ``src[i][r]``: rank ``r``'s source flat range of tensor ``i``.
        dst: ``dst[i][r]``: rank ``r``'s destination flat range of tensor ``i``.

    Returns:
        ``out[r][i]``: rank ``r``'s destination piece of tensor ``i``.

    Raises:
        StopIteration: a destination element that no rank's source range holds.

    Example:
        >>> a = [[torch.tensor([0., 1., 2.])], [torch.tensor([3.])]]
        >>> [o[0].tolist() for o in flat_redistribute_reference(a, [[(0, 3), (3, 4)]],
        ...                                                     [[(0, 1), (1, 4)]])]
        [[0.0], [1.0, 2.0, 3.0]]
    """
    world = len(sources)
    out = []
    for r in range(world):
        mine = []
        for i in range(len(dst)):
            lo, hi = dst[i][r]
            vals = []
            for e in range(lo, hi):
                owner = next(q for q in range(world) if src[i][q][0] <= e < src[i][q][1])
                vals.append(sources[owner][i].reshape(-1)[e - src[i][owner][0]])
            dtype = sources[0][i].dtype if sources and sources[0] else torch.float32
            mine.append(torch.stack(vals) if vals else torch.empty(0, dtype=dtype))  # cpu: ref
        out.append(mine)
    return out
