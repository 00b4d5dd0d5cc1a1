"""References of the collectives the tests compare against (loops over ranks on plain tensors;
``reduce_scatter_reference`` is public, in :mod:`vfsdp.collectives`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vfsdp.collectives.comm import check_op
from vfsdp.collectives.reference import _check


def all_gather_reference(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global buffer every rank holds after an all-gather of equal 1-D shards: their
    concatenation in rank order."""
    _check(shards, "all_gather_reference")
    return torch.cat(list(shards))


def all_reduce_reference(values: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """What every rank holds after an all-reduce (``"sum"`` or ``"avg"``) of equal 1-D values."""
    _check(values, "all_reduce_reference")
    check_op(op)
    total = torch.stack(list(values)).sum(0)
    return total / len(values) if op == "avg" else total


def flat_redistribute_reference(sources: Sequence[Sequence[torch.Tensor]], src: Sequence,
                                dst: Sequence) -> list:
    """``out[r][i]``: rank ``r``'s destination piece of tensor ``i`` after ``flat_redistribute``,
    element by element: ``sources[r][i]`` is rank ``r``'s piece of tensor ``i``, ``src[i][r]``
    and ``dst[i][r]`` its source and destination flat ranges."""
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
            mine.append(torch.stack(vals) if vals else torch.empty(0, dtype=dtype))
        out.append(mine)
    return out
