"""Functional optimizers over DBuffers (optax-style ``init`` / ``update``), schedules, clipping."""

from vfsdp.optim.adamw import AdamWState, adamw
from vfsdp.optim.adamw8bit import AdamW8bitState, adamw8bit
from vfsdp.optim.base import Optimizer, as_schedule
from vfsdp.optim.clip import clip_grad_norm, global_norm
from vfsdp.optim.compose import chain, clip_by_global_norm, partition
from vfsdp.optim.muon import MuonState, muon
from vfsdp.optim.schedules import constant, warmup_cosine

__all__ = [
    "AdamWState",
    "AdamW8bitState",
    "adamw8bit",
    "Optimizer",
    "adamw",
    "chain",
    "clip_by_global_norm",
    "muon",
    "MuonState",
    "partition",
    "as_schedule",
    "clip_grad_norm",
    "constant",
    "global_norm",
    "warmup_cosine",
]
