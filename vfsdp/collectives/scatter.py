"""Scatter one unit from a source rank: the inverse of the all-gather.

The source rank packs the unit's global ``m*S`` buffer (each tensor flattened at its
offset, zeros in the padding) and scatters equal ``S``-element segments over its shard group,
so rank ``r`` receives exactly the shard it would all-gather from. Over HSDP the other
replicas then receive their shard by broadcast from the source's replica. The source holds
one packed unit at a time, never the model twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from vfsdp.collectives import comm
from vfsdp.collectives.dbuffer import DBuffer

__all__ = ["scatter_unit"]


def scatter_unit(db: DBuffer, pack: Optional[Callable[[torch.Tensor], None]],
                 src: tuple[int, int], out: Optional[torch.Tensor] = None
                 ) -> Optional[BaseException]:
    """Collective over ``db``'s mesh: fill every rank's shard of the unit from the source.

    Args:
        db: The unit's buffer (its layout, groups, dtype and device).
        pack: On the source rank, ``pack(buf)`` writes the tensors into the zeroed global
            buffer ``buf`` at their offsets; ignored elsewhere.
        src: The source's ``(replicate_rank, shard_rank)`` (``groups.coords(global_rank)``).
        out: Where this rank's ``S`` elements land (default: ``db.shard``).

    Returns:
        The exception ``pack`` raised on the source, or ``None``. The collectives run
            either way (the buffer then holds zeros), so no rank is left waiting; raise it on
            every rank afterwards (``vfsdp.collectives.agree``).

    Raises:
        ValueError: ``src`` is not a ``(replicate_rank, shard_rank)`` pair.
        RuntimeError: from torch's collectives, e.g. an ``out`` that does not hold ``S``
            elements (raised on the source rank, while the others wait in the scatter).
            What ``pack`` raises is returned, not raised.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.empty(5)}, 2)
        ...     db = DBuffer(spec.units[()], resolve_groups(spec))
        ...     def pack(buf):
        ...         buf[:5] = torch.arange(5.0)
        ...     scatter_unit(db, pack, (0, 0))
        ...     return db.shard.tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 1.0, 2.0, 3.0], [4.0, 0.0, 0.0, 0.0]]
    """
    groups = db.groups
    out = db.shard if out is None else out
    src_replica, src_shard = src
    here = (groups.replicate_rank, groups.shard_rank) == (src_replica, src_shard)
    error: Optional[BaseException] = None
    with torch.no_grad():
        if groups.replicate_rank == src_replica:
            if here:
                buf = torch.zeros(db.layout.padded_numel, dtype=db.dtype, device=db.device)
                if pack is not None:
                    try:
                        pack(buf)
                    except Exception as exc:  # noqa: BLE001 - returned, raised on every rank
                        error = exc
                        buf.zero_()
            comm.scatter_into(out, list(buf.chunk(db.layout.world_size)) if here else None,
                              group=groups.shard, group_src=src_shard)
        if groups.replicate is not None:
            comm.broadcast_(out, group=groups.replicate, group_src=src_replica)
    return error
