"""The structure-aware planner: pure functions, no ``torch.distributed``."""

from vfsdp.planner.abstract import ShapeDtype
from vfsdp.planner.check import check_spec, plan_stats
from vfsdp.planner.granularity import Rows, rows, whole
from vfsdp.planner.plan import plan
from vfsdp.planner.solver import Packing, lower_bound, pack
from vfsdp.planner.spec import PASSTHROUGH, ShardSpec, SplitSuggestion, TensorSpec, UnitLayout

__all__ = [
    "ShapeDtype",
    "check_spec",
    "plan_stats",
    "Rows",
    "rows",
    "whole",
    "plan",
    "Packing",
    "lower_bound",
    "pack",
    "PASSTHROUGH",
    "ShardSpec",
    "SplitSuggestion",
    "TensorSpec",
    "UnitLayout",
]
