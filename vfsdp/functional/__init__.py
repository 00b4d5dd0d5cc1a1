"""The FSDP runtime over pytrees: shard, scatter, gather (differentiable), reduce_scatter, release,
run_layers.

Imports ``vfsdp.collectives`` and below, never ``spmd``, ``interop``, ``optim``, ``checkpoint`` or
``testing``.
"""

from vfsdp.collectives.unit import Reductions
from vfsdp.functional.gather import gather, gather_async, grads, zero_grads
from vfsdp.functional.options import Policy
from vfsdp.functional.reduce import reduce_scatter
from vfsdp.functional.reference import (
    gather_reference,
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
    "Policy",
    "Reductions",
    "UnitLeaves",
    "dbuffers",
    "gather",
    "gather_async",
    "gather_reference",
    "grads",
    "match_tree",
    "param_tree",
    "reduce_scatter",
    "release",
    "run_layers",
    "scatter",
    "shard",
    "shard_reference",
    "unit_buffer_reference",
    "units_of",
    "zero_grads",
]
