"""Functional API over pytrees: shard, gather (differentiable), reduce_scatter, release."""

from vfsdp.functional.dtensor import dtensor_placement, from_dtensor, to_dtensor
from vfsdp.functional.gather import gather, gather_async, reduce_scatter
from vfsdp.functional.grads import grads, zero_grads
from vfsdp.functional.schedule import run_layers
from vfsdp.functional.reference import gather_reference, shard_reference, unit_buffer_reference
from vfsdp.functional.shard import dbuffers, release, shard
from vfsdp.functional.tree import match_tree

__all__ = [
    "dtensor_placement",
    "from_dtensor",
    "to_dtensor",
    "dbuffers",
    "gather",
    "gather_async",
    "gather_reference",
    "grads",
    "zero_grads",
    "match_tree",
    "reduce_scatter",
    "release",
    "run_layers",
    "shard",
    "shard_reference",
    "unit_buffer_reference",
]
