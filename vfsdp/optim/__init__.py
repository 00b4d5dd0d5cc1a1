"""Functional optimizers over DBuffers (optax-style ``init`` / ``update``), schedules, clipping.

Imports ``vfsdp.functional`` and below; ``vfsdp.checkpoint`` does not import it (states
checkpoint themselves through :class:`vfsdp.functional.Checkpointable`).
"""

from vfsdp.optim.adamw import AdamWPlan, AdamWState, adamw
from vfsdp.optim.adamw8bit import AdamW8bitPlan, AdamW8bitState, adamw8bit
from vfsdp.optim.base import Optimizer, PartialUpdateError, as_schedule, gradient_transform
from vfsdp.optim.clip import GradTree, clip_grad_norm, clip_grad_norm_of, global_norm, global_norm_of
from vfsdp.optim.muon import MuonPlan, MuonState, muon
from vfsdp.optim.offload import OffloadState, offload
from vfsdp.optim.schedules import constant, warmup_cosine
from vfsdp.optim.shampoo import shampoo
from vfsdp.optim.soap import soap
from vfsdp.optim.transforms import (
    ClipState,
    TransformsState,
    add_decayed_weights,
    chain,
    clip_by_global_norm,
    partition,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_muon,
    scale_by_shampoo,
    scale_by_soap,
    transform,
)

__all__ = [
    "AdamW8bitPlan",
    "AdamW8bitState",
    "AdamWPlan",
    "AdamWState",
    "ClipState",
    "GradTree",
    "MuonPlan",
    "MuonState",
    "OffloadState",
    "TransformsState",
    "Optimizer",
    "PartialUpdateError",
    "adamw",
    "add_decayed_weights",
    "adamw8bit",
    "as_schedule",
    "chain",
    "clip_by_global_norm",
    "clip_grad_norm",
    "clip_grad_norm_of",
    "constant",
    "global_norm",
    "global_norm_of",
    "gradient_transform",
    "muon",
    "offload",
    "partition",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_muon",
    "scale_by_shampoo",
    "scale_by_soap",
    "shampoo",
    "soap",
    "transform",
    "warmup_cosine",
]
