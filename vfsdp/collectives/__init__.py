"""DBuffer and the collectives over shard specs, plus their reference semantics."""

from vfsdp.collectives.comm import counts, reset_counts
from vfsdp.collectives.dbuffer import DBuffer, owner_of
from vfsdp.collectives.groups import MeshGroups, resolve_groups
from vfsdp.collectives.handle import Handle
from vfsdp.collectives.reference import (
    all_gather_reference,
    all_reduce_reference,
    reduce_scatter_reference,
)

__all__ = [
    "DBuffer",
    "Handle",
    "MeshGroups",
    "all_gather_reference",
    "all_reduce_reference",
    "counts",
    "owner_of",
    "reduce_scatter_reference",
    "reset_counts",
    "resolve_groups",
]
