"""Functional API over pytrees: shard, scatter, gather (differentiable), reduce_scatter, release.

Imports ``vfsdp.collectives`` and below, never ``optim``, ``checkpoint`` or ``testing``.
"""

from vfsdp.collectives.unit import Reductions
from vfsdp.functional import init
from vfsdp.functional.dtensor import dtensor_placement, from_dtensor, to_dtensor
from vfsdp.functional.gather import gather, gather_async, grads, zero_grads
from vfsdp.functional.module import ModuleApply, functionalize
from vfsdp.functional.options import GatherOptions, GradOptions, Policy
from vfsdp.functional.reduce import reduce_scatter
from vfsdp.functional.reference import (
    gather_reference,
    scatter_reference,
    shard_reference,
    unit_buffer_reference,
)
from vfsdp.functional.scatter import scatter
from vfsdp.functional.schedule import run_layers
from vfsdp.functional.shard import dbuffers, release, shard
from vfsdp.functional.state import Checkpointable, param_tree
from vfsdp.functional.tree import UnitLeaves, match_tree, units_of

__all__ = [
    "Checkpointable",
    "GatherOptions",
    "GradOptions",
    "Policy",
    "ModuleApply",
    "Reductions",
    "UnitLeaves",
    "dbuffers",
    "dtensor_placement",
    "from_dtensor",
    "functionalize",
    "gather",
    "gather_async",
    "gather_reference",
    "grads",
    "init",
    "match_tree",
    "param_tree",
    "reduce_scatter",
    "release",
    "run_layers",
    "scatter",
    "scatter_reference",
    "shard",
    "shard_reference",
    "to_dtensor",
    "unit_buffer_reference",
    "units_of",
    "zero_grads",
]
