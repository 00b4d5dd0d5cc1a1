"""vfsdp: functional, structure-aware FSDP for PyTorch (after veScale-FSDP).

The public API, re-exported from its subpackages.
"""

from vfsdp.functional import (
    dbuffers,
    dtensor_placement,
    from_dtensor,
    gather,
    gather_async,
    grads,
    reduce_scatter,
    release,
    run_layers,
    shard,
    to_dtensor,
    zero_grads,
)
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

from vfsdp import optim  # noqa: E402  (a namespace: vfsdp.optim.adamw, ...)
from vfsdp.functional import init  # noqa: E402  (a namespace: vfsdp.init.normal, ...)
from vfsdp.optim import clip_grad_norm  # noqa: E402
from vfsdp import testing  # noqa: E402  (vfsdp.testing.simulate, spawn, probes)
from vfsdp import checkpoint  # noqa: E402  (vfsdp.checkpoint.save, load, ...)

__version__ = "0.1.0"

__all__ = [
    "checkpoint",
    "clip_grad_norm",
    "dtensor_placement",
    "from_dtensor",
    "to_dtensor",
    "optim",
    "init",
    "testing",
    "dbuffers",
    "gather",
    "gather_async",
    "grads",
    "zero_grads",
    "reduce_scatter",
    "release",
    "run_layers",
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
