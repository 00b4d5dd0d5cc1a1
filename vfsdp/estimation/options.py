"""The options of one estimated step: one frozen :class:`Options`, checked once where
:func:`~vfsdp.estimation.estimate` or :func:`~vfsdp.estimation.sweep` takes its keywords."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Union

import torch

from vfsdp.estimation.checks import count, rate
from vfsdp.estimation.hardware import Hardware, hardware

__all__ = ["Options", "GiB"]

GiB = 2**30


@dataclass(frozen=True)
class Options:
    """:func:`~vfsdp.estimation.estimate`'s keywords (see there), with ``hw`` resolved to its
    :class:`~vfsdp.estimation.hardware.Hardware`, ``muon``: whether the optimizer is Muon
    (its Newton-Schulz FLOPs), and ``fused_loss`` ``None`` resolved to ``compiled``.

    Raises:
        ValueError: a value no step can have, naming the argument.

    Example:
        >>> Options(hw="h800", tokens_per_rank=8192).hw.name
        'h800'
    """

    hw: Union[str, Hardware] = "h100"
    muon: bool = False
    param_dtype: Optional[torch.dtype] = torch.bfloat16
    reduce_dtype: Optional[torch.dtype] = None
    prefetch: bool = True
    reshard_after_forward: bool = True
    tokens_per_rank: int = 4096
    costs: Optional[Mapping] = None
    experts_per_token: Optional[int] = None
    seq: Optional[int] = None
    recompute: Union[bool, str] = False
    comm_library_bytes: int = 2 * GiB
    baseline: Optional[str] = None
    padding: Optional[str] = None
    model_parallel: Optional[str] = None
    layers: Optional[list] = None
    ep: Optional[int] = None
    micro_batches: int = 1
    grad_sync: bool = True
    float8: bool = False
    compiled: bool = False
    float8_saved_weights: bool = False
    float8_all_gather: Optional[bool] = None
    float8_fused_casts: Optional[bool] = None
    float8_recipe: Optional[str] = None
    logits_dtype: torch.dtype = torch.float32
    fused_loss: Optional[bool] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hw", hardware(self.hw))
        for name in ("tokens_per_rank", "experts_per_token", "seq", "ep", "micro_batches"):
            count("estimate", name, getattr(self, name), optional=name in ("experts_per_token",
                                                                          "seq", "ep"))
        rate("estimate", "comm_library_bytes", self.comm_library_bytes, zero=True)
        for name in ("param_dtype", "reduce_dtype", "logits_dtype"):
            dtype = getattr(self, name)
            if not isinstance(dtype, torch.dtype) and (dtype is not None or name == "logits_dtype"):
                raise ValueError(f"estimate: {name} must be a torch.dtype (None too, but for "
                                 f"logits_dtype), got {dtype!r}")
        if not (isinstance(self.recompute, bool) or self.recompute in ("full", "selective")):
            raise ValueError(f"estimate: recompute must be False, True, 'full' or 'selective', "
                             f"got {self.recompute!r}")
        if self.baseline not in (None, "fsdp2", "megatron"):
            raise ValueError(f"estimate: unknown baseline {self.baseline!r}; pass 'fsdp2' or "
                             f"'megatron'")
        if self.padding not in (None, "vfsdp", "fsdp2", "megatron"):
            raise ValueError(f"estimate: unknown padding {self.padding!r}; pass 'vfsdp', 'fsdp2' "
                             f"or 'megatron' (None: the system's own)")
        if self.tokens_per_rank % self.micro_batches:
            raise ValueError(f"estimate: micro_batches={self.micro_batches} does not divide "
                             f"tokens_per_rank={self.tokens_per_rank}; pass the step's tokens, "
                             f"a multiple")
        if self.fused_loss is None:  # a compiled step's loss is compiled too
            object.__setattr__(self, "fused_loss", self.compiled)
        for name, what in (("float8_all_gather", "how float8's weights are gathered"),
                           ("float8_fused_casts", "how float8's casts run"),
                           ("float8_recipe", "how float8's casts are scaled")):
            if getattr(self, name) is not None and self.float8 is not True:
                raise ValueError(f"estimate: {name}={getattr(self, name)!r} needs float8=True (it "
                                 f"says {what}); pass both, or drop it")
        if self.float8 is True:  # torchao's recipes: tensorwise, float8 gathers (not rowwise's),
            rowwise = self.float8_recipe == "rowwise"  # its casts fused when compiled (None: no float8)
            for name, value in (("float8_recipe", "tensorwise"), ("float8_all_gather", not rowwise),
                                ("float8_fused_casts", self.compiled)):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)
            if self.float8_recipe not in ("tensorwise", "rowwise"):
                raise ValueError(f"estimate: unknown float8_recipe {self.float8_recipe!r}; pass "
                                 f"'tensorwise' or 'rowwise'")
            if rowwise and self.float8_all_gather is True:  # torchao/float8/config.py at f5b5567
                raise ValueError("estimate: float8_all_gather=True needs float8_recipe='tensorwise' "
                                 "(torchao gathers rowwise weights in bf16); drop one")
        for name in ("grad_sync", "float8", "compiled", "fused_loss", "float8_saved_weights",
                     "float8_all_gather", "float8_fused_casts"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name.startswith("float8_")):
                raise ValueError(f"estimate: {name} must be True or False, got {value!r}")
        if self.float8_saved_weights and not (self.float8 and self.compiled):
            raise ValueError("estimate: float8_saved_weights=True needs float8=True and "
                             "compiled=True (torch.compile saves them); pass both, or drop it")
