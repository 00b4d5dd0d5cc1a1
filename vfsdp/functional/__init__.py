"""Functional API over pytrees. For now: the reference semantics of shard and gather."""

from vfsdp.functional.reference import (
    gather_reference,
    match_tree,
    shard_reference,
    unit_buffer_reference,
)

__all__ = ["gather_reference", "match_tree", "shard_reference", "unit_buffer_reference"]
