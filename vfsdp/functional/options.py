"""The gather and gradient options: one name each, the same on every entry point.

:func:`vfsdp.gather`, :func:`vfsdp.gather_async` and :func:`vfsdp.run_layers` take the same
keywords, and :func:`vfsdp.reduce_scatter` the reduction ones:

=======================  ======================  ===========================================
option                   default                 what it does
=======================  ======================  ===========================================
``param_dtype``          ``None``                gather in this dtype (one cast of the shard)
``free_after_backward``  ``False``               release the gathered unit once its backward
                                                 is done
``grad_reduce``          ``"avg"``               ``"avg"`` or ``"sum"`` over every rank
``reduce_dtype``         ``None`` (grad dtype)   dtype of the reduce-scatter
``grads``                ``"return"``            ``"return"``: to autograd; ``"buffer"``: only
                                                 into the gradient DBuffer
``accumulate_grads``     ``None`` (as torch)     ``None``/``True``: backwards add up until the
                                                 gradients are zeroed, as ``.grad`` does;
                                                 ``False`` (deprecated): overwrite
``grad_sync``            ``True``                ``False``: accumulate unsharded, no reduce
``async_reduce``         ``False``               reduce-scatter without waiting (``"buffer"``)
=======================  ======================  ===========================================

:meth:`GradOptions.check` refuses, naming the option and the reason, whatever a path
cannot honour: inside ``torch.func`` gradients are values returned by the transform, so
``grads="buffer"``, ``accumulate_grads``, ``grad_sync=False`` and ``async_reduce`` are
refused there; ``async_reduce`` also needs ``grads="buffer"`` everywhere (a gradient returned
to autograd must be complete when the backward returns it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from vfsdp.collectives.comm import REDUCE_OPS

__all__ = ["GatherOptions", "GradOptions", "split_options", "GRAD_MODES", "GRAD_REDUCE_OPS"]

GRAD_REDUCE_OPS = REDUCE_OPS
GRAD_MODES = ("return", "buffer")


def _check_dtype(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
        raise ValueError(f"{name} must be a floating-point torch.dtype or None, got {value!r}")


@dataclass(frozen=True)
class GatherOptions:
    """How a unit is gathered and how long it stays gathered.

    Example:
        >>> GatherOptions(param_dtype=torch.bfloat16)
        GatherOptions(param_dtype=torch.bfloat16, free_after_backward=False)
        >>> GatherOptions(param_dtype=torch.int8)
        Traceback (most recent call last):
        ...
        ValueError: param_dtype must be a floating-point torch.dtype or None, got torch.int8
    """

    param_dtype: Optional[torch.dtype] = None
    free_after_backward: bool = False

    def __post_init__(self) -> None:
        _check_dtype("param_dtype", self.param_dtype)


@dataclass(frozen=True)
class GradOptions:
    """How a unit's gradients are reduced and where they go.

    Example:
        >>> GradOptions(grads="buffer", async_reduce=True).grad_reduce
        'avg'
        >>> GradOptions(async_reduce=True)              # needs grads="buffer"
        Traceback (most recent call last):
        ...
        ValueError: async_reduce=True needs grads='buffer': ...
    """

    grad_reduce: str = "avg"
    reduce_dtype: Optional[torch.dtype] = None
    grads: str = "return"
    accumulate_grads: Optional[bool] = None
    grad_sync: bool = True
    async_reduce: bool = False

    def __post_init__(self) -> None:
        if self.grad_reduce not in GRAD_REDUCE_OPS:
            raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_OPS}, got "
                             f"{self.grad_reduce!r}")
        if self.grads not in GRAD_MODES:
            raise ValueError(f"grads must be one of {GRAD_MODES}, got {self.grads!r}")
        _check_dtype("reduce_dtype", self.reduce_dtype)
        if self.accumulate_grads is False:
            warnings.warn(
                "accumulate_grads=False is deprecated and goes in vfsdp 0.4: gradients add up "
                "across backwards until you zero them, as torch's .grad does, on every path (0.2 "
                "overwrote the gradient buffer with grads='buffer' and run_layers). Call "
                "vfsdp.zero_grads(shards, spec) before a backward that should start afresh, and "
                "drop accumulate_grads; until 0.4 it keeps 0.2's meaning (a grads='buffer' "
                "backward overwrites the gradient buffer)", FutureWarning, stacklevel=4)
        if self.async_reduce and self.grads != "buffer":
            raise ValueError("async_reduce=True needs grads='buffer': a gradient returned to "
                             "autograd must be complete when the backward returns it")

    def check(self, functorch: bool, what: str) -> None:
        """Refuse options the current path cannot honour.

        Args:
            functorch: Whether a ``torch.func`` transform is running.
            what: The entry point, for the message.

        Raises:
            ValueError: naming the option and why.
        """
        if not functorch:
            return
        why = ("inside torch.func transforms gradients are the values the transform returns, "
               "and tensors made outside it must not be mutated")
        for name, bad, hint in (
                ("grads='buffer'", self.grads == "buffer", "use grads='return'"),
                ("accumulate_grads=True", self.accumulate_grads,
                 "add the returned gradients yourself"),
                ("grad_sync=False", not self.grad_sync,
                 "sum the returned gradients, or call outside torch.func"),
                ("async_reduce=True", self.async_reduce, "drop it")):
            if bad:
                raise ValueError(f"{what}: {name} is not supported under torch.func ({why}); "
                                 f"{hint}")


_GATHER = tuple(f.name for f in fields(GatherOptions))
_GRAD = tuple(f.name for f in fields(GradOptions))
NAMES = _GATHER + _GRAD


def split_options(options: dict, what: str) -> tuple[GatherOptions, GradOptions]:
    """Keyword options of a gather entry point as ``(GatherOptions, GradOptions)``.

    Raises:
        TypeError: an unknown keyword (listing the known ones).
        ValueError: a bad value.

    Example:
        >>> g, r = split_options({"param_dtype": torch.bfloat16, "grads": "buffer"}, "gather")
        >>> g.param_dtype, r.grads
        (torch.bfloat16, 'buffer')
    """
    unknown = sorted(set(options) - set(NAMES))
    if unknown:
        raise TypeError(f"{what} got unexpected options {unknown}; it takes {list(NAMES)}")
    return (GatherOptions(**{k: v for k, v in options.items() if k in _GATHER}),
            GradOptions(**{k: v for k, v in options.items() if k in _GRAD}))
