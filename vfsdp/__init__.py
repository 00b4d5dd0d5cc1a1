"""vfsdp: functional, structure-aware FSDP for PyTorch (after veScale-FSDP).

The public API, re-exported from its subpackages.
"""

from vfsdp.functional import dbuffers, gather, gather_async, reduce_scatter, release, shard
from vfsdp.placements import RaggedShard, Replicate, assemble_reference, split_reference
from vfsdp.planner import (
    PASSTHROUGH,
    ShapeDtype,
    ShardSpec,
    TensorSpec,
    UnitLayout,
    check_spec,
    plan,
    plan_stats,
    rows,
    whole,
)

__version__ = "0.1.0"

__all__ = [
    "dbuffers",
    "gather",
    "gather_async",
    "reduce_scatter",
    "release",
    "shard",
    "RaggedShard",
    "Replicate",
    "assemble_reference",
    "split_reference",
    "PASSTHROUGH",
    "ShapeDtype",
    "ShardSpec",
    "TensorSpec",
    "UnitLayout",
    "check_spec",
    "plan",
    "plan_stats",
    "rows",
    "whole",
]
