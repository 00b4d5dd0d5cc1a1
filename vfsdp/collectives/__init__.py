"""Collectives over shard specs. For now: their reference semantics (loops over ranks)."""

from vfsdp.collectives.reference import (
    all_gather_reference,
    all_reduce_reference,
    reduce_scatter_reference,
)

__all__ = ["all_gather_reference", "all_reduce_reference", "reduce_scatter_reference"]
