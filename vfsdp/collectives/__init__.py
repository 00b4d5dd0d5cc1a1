"""DBuffers, units and the collectives over them, plus their reference semantics.

Imports only ``vfsdp.planner`` and ``vfsdp.placements`` (and ``torch.distributed``).
"""

from vfsdp.collectives.agree import agree, agreed
from vfsdp.collectives.comm import counts, reset_counts
from vfsdp.collectives.dbuffer import DBuffer
from vfsdp.collectives.groups import MeshGroups, host_groups, resolve_groups
from vfsdp.collectives.handle import Handle
from vfsdp.collectives.mirror import HostMirror
from vfsdp.collectives.piece import Piece
from vfsdp.collectives.redistribute import Redistribution, flat_redistribute
from vfsdp.collectives.reference import (
    all_gather_reference,
    all_reduce_reference,
    flat_redistribute_reference,
    reduce_scatter_reference,
)
from vfsdp.collectives.scatter import scatter_unit
from vfsdp.collectives.slot import Role, Slot, View, slot_of
from vfsdp.collectives.unit import IllegalTransition, Unit, UnitState

__all__ = [
    "DBuffer",
    "Handle",
    "HostMirror",
    "IllegalTransition",
    "MeshGroups",
    "Piece",
    "Redistribution",
    "Role",
    "Slot",
    "Unit",
    "UnitState",
    "View",
    "agree",
    "agreed",
    "all_gather_reference",
    "all_reduce_reference",
    "counts",
    "flat_redistribute",
    "flat_redistribute_reference",
    "host_groups",
    "reduce_scatter_reference",
    "reset_counts",
    "resolve_groups",
    "scatter_unit",
    "slot_of",
]
