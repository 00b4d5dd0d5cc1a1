"""vfsdp: functional, structure-aware FSDP for PyTorch (after veScale-FSDP).

What a user calls, on one screen::

    plan, rows, whole, ShapeDtype, check_spec, plan_stats     # plan (pure)
    ShardSpec, UnitLayout, TensorSpec, RaggedShard, StridedRaggedShard   # what a plan holds
    shard, scatter, gather, gather_async, release             # shards <-> full tensors
    reduce_scatter, run_layers, grads, zero_grads             # gradients
    Policy                                                    # the options, frozen
    functionalize                                             # nn.Module -> (params, apply)
    clip_grad_norm                                            # one all-reduce
    to_dtensor, from_dtensor, dtensor_placement               # DTensor interop
    mesh, lax, shard_map, P, visualize, estimate              # named axes; who holds what
    init, optim, checkpoint, testing                          # namespaces

The layers underneath (each imports only the ones below it; ``import vfsdp`` loads
``testing`` only when ``vfsdp.testing`` is first used)::

    testing                 simulate/spawn, probes, references, hypothesis strategies
    estimation              estimate, calibrate, hardware profiles
    optim    checkpoint     optimizers | save/load, state dicts  (siblings)
    functional              shard/scatter/gather/reduce over pytrees, run_layers, init
    collectives             Unit, DBuffer, collectives, groups, redistribute
    planner                 plan, spec (pure: no torch.distributed)
    placements              RaggedShard, StridedRaggedShard (pure data)
"""

from __future__ import annotations

from vfsdp import checkpoint, optim
from vfsdp.collectives.mesh import mesh
from vfsdp.estimation import estimate
from vfsdp.functional import (
    Policy,
    gather,
    gather_async,
    grads,
    reduce_scatter,
    release,
    run_layers,
    scatter,
    shard,
    zero_grads,
)
from vfsdp.interop import dtensor_placement, from_dtensor, functionalize, init, to_dtensor, visualize
from vfsdp.optim import clip_grad_norm
from vfsdp.placements import RaggedShard, StridedRaggedShard
from vfsdp.planner import (
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
from vfsdp.spmd import lax
from vfsdp.spmd.shard_map import P, shard_map

__version__ = "0.4.0.dev0"

__all__ = [
    "plan", "rows", "whole", "ShapeDtype", "check_spec", "plan_stats",
    "ShardSpec", "UnitLayout", "TensorSpec", "RaggedShard", "StridedRaggedShard",
    "shard", "scatter", "gather", "gather_async", "release",
    "reduce_scatter", "run_layers", "grads", "zero_grads", "clip_grad_norm", "Policy",
    "functionalize",
    "to_dtensor", "from_dtensor", "dtensor_placement",
    "mesh", "lax", "shard_map", "P", "visualize", "estimate",
    "init", "optim", "checkpoint", "testing",
]


def __getattr__(name: str):
    """``vfsdp.testing`` is imported on first use, so ``import vfsdp`` loads none of it."""
    if name == "testing":
        import vfsdp.testing

        return vfsdp.testing
    raise AttributeError(f"module 'vfsdp' has no attribute {name!r}")
