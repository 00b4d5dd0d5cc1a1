"""The AdamW arithmetic over lists of flat slices: a constant number of ops per step.

Optimizers hand this module one list per operand (parameter, gradient and moment slices of
every unit they update) and it runs the update as multi-tensor ops, so the number of ops
(kernel launches on a GPU) does not grow with the number of parameters, tensors or units.

Two kernels, chosen by :func:`use_fused`:

* **foreach** (default off CUDA): ``torch._foreach_*`` ops, the same element-wise ops in the
  same order as ``torch.optim.AdamW``'s single-tensor and foreach paths, so the result is
  **bitwise equal** to ``torch.optim.AdamW()``. Its one temporary (the denominator) is bounded:
  the slices are taken in batches of at most :data:`TEMP_ELEMS` elements, so a step runs
  3 ops on the moments, 4 per batch and 1 for the weight decay (8 for up to 32M elements per
  rank).
* **fused** (default on CUDA, where the parameters, gradients and moments share a dtype):
  torch's fused AdamW kernel (``torch._fused_adamw_``), one pass over the memory and no
  temporary; **bitwise equal to** ``torch.optim.AdamW(fused=True)``, whose rounding differs
  from the foreach path's in the last bits (it computes the bias corrections in the kernel's
  float arithmetic).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from vfsdp import _torch_private as tp

__all__ = ["TEMP_ELEMS", "adamw_step", "use_fused", "batches", "scale_"]

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


def adamw_step(ps: list, gs: list, ms: list, vs: list, decay: list, *, step: int, lr: float,
               betas: tuple, eps: float, weight_decay: float, fused: bool,
               step_tensor: Optional[torch.Tensor] = None,
               limit: Optional[int] = None) -> None:
    """One AdamW step in place over parallel lists of flat slices.

    Args:
        ps, gs, ms, vs: Parameters, gradients, first and second moments (matching slices).
        decay: For the foreach path, the parameter slices that take weight decay (a subset
            of ``ps``); for the fused path, one bool per slice of ``ps``.
        step: The 1-based step. The compiled update passes a one-element float64 tensor
            (and ``lr`` as a tensor): the same ops then take their scalars from the graph.
        lr, betas, eps, weight_decay: The hyperparameters.
        fused: Run torch's fused kernel (see :func:`use_fused`).
        step_tensor: For the fused path: a 0-d float32 tensor on the parameters' device that
            holds ``step`` (the kernel reads it there).
        limit: Largest temporary of the foreach path, in elements (default
            :data:`TEMP_ELEMS`).
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
            tp.fused_adamw(ps_, gs_, ms_, vs_, [step_tensor] * len(idx), lr=lr, beta1=b1,
                           beta2=b2, weight_decay=wd, eps=eps)
        return
    traced = isinstance(step, torch.Tensor)
    if traced:  # the scalars in the graph: 0-d tensors in the moments' dtype, as a list of
        dt = ms[0].dtype  # that dtype rounds a Python scalar
        step = step.reshape(())
        lr = torch.as_tensor(lr, dtype=step.dtype, device=step.device).reshape(())
        bc1, bc2_sqrt = 1 - b1 ** step, (1 - b2 ** step).sqrt().to(dt)
        decayed, size = (1 - lr * weight_decay).to(dt), (-bc1 / lr).to(dt)
    else:
        bc1, bc2_sqrt = 1 - b1 ** step, math.sqrt(1 - b2 ** step)
        decayed, size = 1 - lr * weight_decay, -lr / bc1
    if weight_decay and decay:
        scale_(decay, decayed)
    tp.foreach("lerp_", ms, gs, scalar=1 - b1)
    tp.foreach("mul_", vs, scalar=b2)
    tp.foreach("addcmul_", vs, gs, gs, scalar=1 - b2)
    for bp, bm, bv in batches((ps, ms, vs), limit or TEMP_ELEMS):
        denom = tp.foreach("sqrt", bv)
        tp.foreach("div_", denom, scalar=bc2_sqrt)
        tp.foreach("add_", denom, scalar=eps)
        if traced:  # dynamo takes no tensor `value` in addcdiv_: the step size goes in denom
            tp.foreach("mul_", denom, scalar=size)
            tp.foreach("addcdiv_", bp, bm, denom)
        else:
            tp.foreach("addcdiv_", bp, bm, denom, scalar=size)
