"""Placements (pure data) and their reference semantics."""

from vfsdp.placements.ragged import (
    Placement,
    RaggedShard,
    flat_range,
    local_numel,
    local_shape,
    validate_placement,
)
from vfsdp.placements.reference import assemble_reference, split_reference
from vfsdp.placements.strided import StridedRaggedShard, split_lengths

__all__ = [
    "Placement",
    "RaggedShard",
    "flat_range",
    "local_numel",
    "local_shape",
    "validate_placement",
    "split_reference",
    "assemble_reference",
    "StridedRaggedShard",
    "split_lengths",
]
