"""The AdamW arithmetic over lists of flat slices: a constant number of ops per step.

Optimizers hand this module one list per operand (parameter, gradient and moment slices of
every unit they update) and it runs the update as multi-tensor ops, so the number of ops
(kernel launches on a GPU) does not grow with the number of parameters, tensors or units.

Two kernels, chosen by :func:`use_fused`:

* **foreach** (default off CUDA): ``torch._foreach_*`` ops, the same element-wise ops in the
  same order as ``torch.optim.AdamW``'s single-tensor and foreach paths, so the result is, on
  the CPU, **bitwise equal** to ``torch.optim.AdamW()`` (on a GPU and in a compiled graph the
  step size divides the denominator first, as ``capturable=True`` does: :func:`adam_`). Its
  one temporary (the denominator) is bounded: the slices are taken in batches of at most
  :data:`TEMP_ELEMS` elements, so a step runs 3 ops on the moments, 4 per batch and 1 for the
  weight decay (8 for up to 32M elements per rank), and 7 tiny ones on the step counter (the
  count, the bias corrections, the step size): the state's counter is a tensor on the device
  (:func:`new_count`), which no step reads back to the host.
* **fused** (default on CUDA, where the parameters, gradients and moments share a dtype):
  torch's fused AdamW kernel (``torch._fused_adamw_``), one pass over the memory and no
  temporary; **bitwise equal to** ``torch.optim.AdamW(fused=True)``, whose rounding differs
  from the foreach path's in the last bits (it computes the bias corrections in the kernel's
  float arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp

__all__ = ["TEMP_ELEMS", "adamw_step", "use_fused", "batches", "scale_", "new_count",
           "learning_rate", "step_scalars", "decay_", "adam_"]

TEMP_ELEMS = 1 << 25
"""Largest temporary of the foreach path, in elements (128 MiB in fp32)."""


def use_fused(fused: Optional[bool], device: torch.device, dtypes: set, what: str = "") -> bool:
    """Whether the fused kernel runs: ``fused`` if given, else on CUDA; it needs one dtype
    for parameters, gradients and moments (``dtypes``).

    Raises:
        ValueError: ``fused=True`` where the kernel cannot run (naming why).
    """
    able = len(dtypes) == 1
    if fused is None:
        return able and device.type == "cuda"
    if fused and not able:
        why = (f"parameters, gradients and moments must share one dtype, got "
               f"{sorted(map(str, dtypes))}")
        where = f": {what}" if what else ""
        raise ValueError(f"adamw(fused=True){where}: {why}; use fused=False (the foreach path), "
                         f"or fp32 master parameters (param_dtype= for the compute dtype)")
    return bool(fused)


def batches(lists: tuple, limit: int = TEMP_ELEMS) -> list[tuple]:
    """Cut parallel lists of flat slices into batches of at most ``limit`` elements each,
    splitting slices larger than that (element-wise ops give the same bits either way).

    Example:
        >>> a = torch.arange(10.0)
        >>> [[t.tolist() for t in b[0]] for b in batches(([a[:3], a[3:]],), limit=4)]
        [[[0.0, 1.0, 2.0], [3.0]], [[4.0, 5.0, 6.0, 7.0]], [[8.0, 9.0]]]
    """
    out: list = []
    cur: list = [[] for _ in lists]
    size = 0
    for parts in zip(*lists):
        n, lo = parts[0].numel(), 0
        while lo < n:
            take = min(n - lo, limit - size)
            for acc, t in zip(cur, parts):
                acc.append(t if (lo, take) == (0, n) else t[lo:lo + take])
            size, lo = size + take, lo + take
            if size == limit:
                out.append(tuple(cur))
                cur, size = [[] for _ in lists], 0
    if size:
        out.append(tuple(cur))
    return out


def scale_(tensors: list, factor: float) -> None:
    """``t.mul_(factor)`` for every tensor, one multi-tensor op per dtype, rounded as the
    single-tensor op rounds: torch's CPU multi-tensor kernel would first round a Python scalar
    to a bf16/fp16 list's dtype (0.998 -> 0.996 in bf16), so those lists get it as an fp32
    tensor, whose product is taken in fp32.

    Example:
        >>> t = torch.full((2,), 1.5, dtype=torch.bfloat16)
        >>> scale_([t], 0.998); t.tolist()
        [1.5, 1.5]
    """
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        if dtype in (torch.float32, torch.float64) or isinstance(factor, torch.Tensor):
            tp.foreach("mul_", ts, scalar=factor)  # a tensor factor: the moments' dtype
        else:
            tp.foreach("mul_", ts, scalar=torch.tensor(factor, dtype=torch.float32,
                                                       device=ts[0].device))


def new_count(device: Any) -> torch.Tensor:
    """An optimizer state's step counter: a one-element float32 tensor on the parameters'
    ``device`` (``torch.optim``'s ``state_steps``: the fused kernel reads it as it is), 0
    before the first update. An update adds one to it (an op on the device, no host sync) and
    takes every per-step scalar from it (:func:`learning_rate`, :func:`step_scalars`); a
    compiled update counts in it as the eager one does: one counter on every path. (One
    element, not 0-d: dynamo would take a 0-d CPU tensor for a constant.)

    Example:
        >>> new_count("cpu")
        tensor([0.])
    """
    return torch.zeros(1, dtype=torch.float32, device=device)


def learning_rate(schedule: Callable, count: torch.Tensor) -> Any:
    """The learning rate at the step ``count`` holds: a constant schedule's float (no op), or
    ``schedule(step)``, which then takes the step as a 0-d float64 tensor (see
    :mod:`vfsdp.optim.schedules`).

    Example:
        >>> learning_rate(lambda step: 0.1 / step, torch.full((1,), 2.0))
        tensor(0.0500, dtype=torch.float64)
    """
    value = getattr(schedule, "constant", None)
    return value if value is not None else schedule(count.double().reshape(()))


_BETAS: dict = {}  # (betas, device) -> the betas as a float64 tensor, made once


def step_scalars(count: torch.Tensor, betas: tuple) -> tuple:
    """``(1 - beta1 ** step, sqrt(1 - beta2 ** step))``, the bias corrections of the step
    ``count`` holds, as 0-d float64 tensors on its device: the double-precision scalars
    ``torch.optim.AdamW`` takes, in four ops on two elements.

    Example:
        >>> bc1, bc2_sqrt = step_scalars(torch.ones(1), (0.9, 0.99))
        >>> round(float(bc1), 4), round(float(bc2_sqrt), 4)
        (0.1, 0.1)
    """
    if tp.compiling():  # no module-level cache in a graph (a new entry would recompile)
        b1, b2 = betas
        step = count.double().reshape(())  # in double precision, as the cached betas give
        return 1 - b1 ** step, (1 - b2 ** step).sqrt()
    key = (tuple(betas), str(count.device))
    found = _BETAS.get(key)
    if found is None:
        found = _BETAS[key] = torch.tensor(betas, dtype=torch.float64, device=count.device)
    bc1, bc2 = (1 - found ** count).unbind()
    return bc1, bc2.sqrt()


def decay_(tensors: list, lr, weight_decay: float) -> None:
    """Decoupled weight decay in place, ``p.mul_(1 - lr * weight_decay)`` for every tensor: the
    one implementation every optimizer runs (:func:`scale_`: one op per dtype)."""
    if weight_decay and tensors:
        scale_(tensors, 1 - lr * weight_decay)


def adam_(ps: list, gs: list, ms: list, vs: list, b1: float, b2: float, eps: float,
          lr: Any, bc1: Any, bc2_sqrt: Any, limit: Optional[int] = None) -> None:
    """The Adam moments and the parameter step, in place over parallel lists of flat tensors:
    ``m.lerp_(g, 1 - b1)``, ``v = b2 * v + (1 - b2) * g * g``, ``p += size * m / (sqrt(v) /
    bc2_sqrt + eps)`` with ``size = -lr / bc1``. The one implementation of Adam's arithmetic:
    AdamW's foreach path runs it over every unit's slices, 8-bit AdamW over its dequantized
    span (lists of one tensor), and a compiled update traces it.

    On the CPU, outside ``torch.compile``, the step size is a per-tensor scalar list
    (``torch._foreach_addcdiv_``'s), so the ops and their rounding are ``torch.optim.AdamW``'s;
    elsewhere (a GPU, a compiled graph, where a scalar list would be read back to the host)
    the denominator is divided by the step size first, as torch's ``capturable`` path does, a
    rounding apart in the last bit.

    Args:
        ps, gs, ms, vs: Parameters, gradients and moments (matching flat tensors).
        b1, b2, eps: The hyperparameters.
        lr: The learning rate (a float or a tensor).
        bc1, bc2_sqrt: The bias correction and the square root of the second
            (:func:`step_scalars`; tensors, or floats).
        limit: Largest temporary, in elements (default :data:`TEMP_ELEMS`): the slices are
            taken in batches of at most that (the same bits either way).

    Example:
        >>> p, g, m, v = torch.ones(2), torch.full((2,), 0.5), torch.zeros(2), torch.zeros(2)
        >>> adam_([p], [g], [m], [v], 0.9, 0.999, 1e-8, 0.1, 1 - 0.9, (1 - 0.999) ** 0.5)
        >>> [round(x, 4) for x in p.tolist()]           # the first step moves p by -lr
        [0.9, 0.9]
    """
    if not ps:
        return
    tp.foreach("lerp_", ms, gs, scalar=1 - b1)
    tp.foreach("mul_", vs, scalar=b2)
    tp.foreach("addcmul_", vs, gs, gs, scalar=1 - b2)
    if not isinstance(bc1, torch.Tensor):
        size, per_tensor = -lr / bc1, False
    elif ps[0].device.type == "cpu" and not tp.compiling():
        size, per_tensor = None, True  # a scalar list per batch, read on the host
    else:  # the scalars in the moments' dtype, as torch's capturable path takes them
        dt = ms[0].dtype
        size, per_tensor = torch.div(-lr, bc1).to(dt), False
        bc2_sqrt = bc2_sqrt.to(dt)
    for bp, bm, bv in batches((ps, ms, vs), limit or TEMP_ELEMS):
        denom = tp.foreach("sqrt", bv)
        tp.foreach("div_", denom, scalar=bc2_sqrt)
        tp.foreach("add_", denom, scalar=eps)
        if per_tensor:
            tp.foreach("addcdiv_", bp, bm, denom, scalar=torch.div(-lr, bc1.expand(len(bp))))
        elif isinstance(size, torch.Tensor):  # dynamo takes no tensor `value` in addcdiv_
            tp.foreach("div_", denom, scalar=size)
            tp.foreach("addcdiv_", bp, bm, denom)
        else:
            tp.foreach("addcdiv_", bp, bm, denom, scalar=size)


def adamw_step(ps: list, gs: list, ms: list, vs: list, decay: list, *, count: torch.Tensor,
               lr: Any, betas: tuple, eps: float, weight_decay: float, fused: bool,
               scalars: Optional[tuple] = None, limit: Optional[int] = None) -> None:
    """One AdamW step in place over parallel lists of flat slices.

    Args:
        ps, gs, ms, vs: Parameters, gradients, first and second moments (matching slices).
        decay: For the foreach path, the parameter slices that take weight decay (a subset
            of ``ps``); for the fused path, one bool per slice of ``ps``.
        count: The state's step counter (:func:`new_count`), already counting this step.
        lr: The learning rate of this step (:func:`learning_rate`: a float or a tensor).
        betas, eps, weight_decay: The hyperparameters.
        fused: Run torch's fused kernel (see :func:`use_fused`).
        scalars: This step's :func:`step_scalars`, where the caller has them already.
        limit: Largest temporary of the foreach path, in elements (default
            :data:`TEMP_ELEMS`).

    Example:
        >>> p, g, m, v = torch.ones(2), torch.full((2,), 0.5), torch.zeros(2), torch.zeros(2)
        >>> adamw_step([p], [g], [m], [v], [], count=new_count("cpu").add_(1), lr=0.1,
        ...            betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=False)
        >>> [round(x, 4) for x in p.tolist()]
        [0.9, 0.9]
    """
    if not ps:
        return
    b1, b2 = betas
    if fused:
        for wd, sel in ((weight_decay, True), (0.0, False)):
            idx = [i for i, d in enumerate(decay) if bool(d) is sel]
            if not idx:
                continue
            ps_, gs_, ms_, vs_ = ([xs[i] for i in idx] for xs in (ps, gs, ms, vs))
            tp.fused_adamw(ps_, gs_, ms_, vs_, [count] * len(idx), lr=lr, beta1=b1,
                           beta2=b2, weight_decay=wd, eps=eps)
        return
    bc1, bc2_sqrt = scalars if scalars is not None else step_scalars(count, betas)
    decay_(decay, lr, weight_decay)
    adam_(ps, gs, ms, vs, b1, b2, eps, lr, bc1, bc2_sqrt, limit)
