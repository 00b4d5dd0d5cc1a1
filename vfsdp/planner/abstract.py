"""Abstract tensors for planning without allocating anything (like ``jax.ShapeDtypeStruct``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ShapeDtype", "TENSOR_LEAVES", "is_tensor_leaf", "leaf_meta"]


@dataclass(frozen=True)
class ShapeDtype:
    """A shape and a dtype: the only things the planner reads from a tensor.

    Args:
        shape: The tensor's shape.
        dtype: Its dtype (default ``torch.float32``).

    Raises:
        ValueError: a negative dim.

    Example:
        >>> ShapeDtype((4096, 1024), torch.bfloat16).numel
        4194304
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"ShapeDtype shape must be non-negative, got {shape}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"ShapeDtype dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


TENSOR_LEAVES = (ShapeDtype, torch.Tensor)
"""The leaf types the planner shards (``ShapeDtype`` first: its exact-type check is the quick one)."""


def is_tensor_leaf(x: Any) -> bool:
    """True for leaves the planner shards: ``torch.Tensor`` (real or meta) and ``ShapeDtype``."""
    return isinstance(x, TENSOR_LEAVES)


def leaf_meta(x: Any) -> tuple[tuple[int, ...], torch.dtype, int]:
    """``(shape, dtype, numel)`` of a tensor leaf."""
    shape = tuple(x.shape)
    return shape, x.dtype, math.prod(shape)
