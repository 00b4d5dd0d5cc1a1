"""DBuffers, units and the collectives over them, plus their reference semantics.

Imports only ``vfsdp.planner`` and ``vfsdp.placements`` (and ``torch.distributed``).
"""

from vfsdp.collectives.agree import agree, agreed
from vfsdp.collectives.comm import Handle, MeshGroups, counts, host_groups, reset_counts, resolve_groups
from vfsdp.collectives.dbuffer import DBuffer, Role, Slot, View, slot_of
from vfsdp.collectives.mirror import HostMirror
from vfsdp.collectives.piece import Piece
from vfsdp.collectives.redistribute import Redistribution, flat_redistribute
from vfsdp.collectives.reference import reduce_scatter_reference
from vfsdp.collectives.scatter import scatter_unit
from vfsdp.collectives.unit import IllegalTransitionError, Unit, UnitState

__all__ = [
    "DBuffer",
    "Handle",
    "HostMirror",
    "IllegalTransitionError",
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
    "counts",
    "flat_redistribute",
    "host_groups",
    "reduce_scatter_reference",
    "reset_counts",
    "resolve_groups",
    "scatter_unit",
    "slot_of",
]
