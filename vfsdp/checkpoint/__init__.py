"""Distributed checkpoints that reshard, and export/import of full state dicts.

* :func:`save` / :func:`load`: DCP checkpoints of shards, optimizer states and extras; load
  under any world size, mesh or spec. Atomic, checksummed, optionally asynchronous.
* :func:`to_state_dict` / :func:`save_safetensors`: full tensors by dotted name, streamed one
  unit at a time. :func:`from_state_dict` / :func:`load_safetensors`: back into shards.
"""

from vfsdp.checkpoint.entries import register_state
from vfsdp.checkpoint.export import from_state_dict, to_state_dict
from vfsdp.checkpoint.io import AsyncSave, load, save
from vfsdp.checkpoint.safetensors import load_safetensors, save_safetensors
from vfsdp.checkpoint.storage import CheckpointError
from vfsdp.collectives.piece import Piece, boxes, per_rank

__all__ = ["save", "load", "AsyncSave", "CheckpointError", "register_state", "Piece", "boxes",
           "per_rank", "to_state_dict", "from_state_dict", "save_safetensors",
           "load_safetensors"]
