"""Reference semantics of the reduce-scatter, as a loop over ranks on plain tensors.

Each rank ``r`` of a shard group holds an ``S``-element shard, its slice ``[r*S, (r+1)*S)`` of
the unit's global ``m*S`` buffer. These functions take the per-rank values as Python lists
indexed by rank and return what every rank would hold afterwards. The fast, distributed
implementations are tested against them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vfsdp.collectives.comm import check_op

__all__ = ["reduce_scatter_reference"]


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
    check_op(op)
    m = len(buffers)
    if buffers[0].numel() % m:
        raise ValueError(f"buffer of {buffers[0].numel()} elements does not split over {m} ranks")
    total = sum(b.view(m, b.numel() // m) for b in buffers)  # rank r's shard: row r
    return list((total / m if op == "avg" else total).unbind(0))
