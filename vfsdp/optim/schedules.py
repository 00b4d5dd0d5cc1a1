"""Learning-rate schedules: plain callables of the (1-based) step.

The optimizers count steps in a tensor on the parameters' device (part of their state: no
host sync per step, and no new graph per step under ``torch.compile``), so a schedule is
called with the step as a 0-d float64 tensor, and these return a tensor then, computed without
Python branches on it. Your own schedule should do the same: one that turns the step into a
Python number (``int(step)``, ``if step < n``) still works, but reads the step back from the
device every update (a host sync on a GPU), and cannot be compiled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def constant(lr: float) -> Callable[[int], float]:
    """``step -> lr``.

    Args:
        lr: The constant learning rate.

    Returns:
        A callable ``step -> lr``.

    Raises:
        TypeError: not from ``constant`` itself (it checks nothing); from the returned
            schedule, a call without a step.

    Example:
        >>> constant(0.1)(7)
        0.1
    """
    def schedule(step: Any) -> float:
        return lr

    schedule.constant = lr  # read by the optimizers: no op per step
    return schedule


def warmup_cosine(peak: float, warmup: int, total: int, floor: float = 0.0) -> Callable[[int], float]:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``floor`` at ``total``.

    Args:
        peak: The learning rate at the end of the warm-up.
        warmup: Warm-up steps (``0``: none).
        total: The step at which the decay reaches ``floor`` (and stays).
        floor: The final learning rate.

    Returns:
        A callable ``step -> lr`` (steps count from 1).

    Raises:
        ValueError: ``warmup`` or ``total`` negative, or ``warmup > total``.

    Example:
        >>> f = warmup_cosine(1.0, 10, 110)
        >>> f(5), f(10), round(f(110), 6)
        (0.5, 1.0, 0.0)
    """
    if warmup < 0 or total < 0 or warmup > total:
        raise ValueError(f"need 0 <= warmup <= total, got warmup={warmup}, total={total}")

    def schedule(step: Any) -> Any:
        # One formula, on tensors (no Python branch on the step: it compiles and syncs
        # nothing); a Python step gets a Python float back.
        t = step if isinstance(step, torch.Tensor) else \
            torch.tensor(float(step), dtype=torch.float64)  # cpu: a Python step, on the host
        progress = ((t - warmup) / max(1, total - warmup)).clamp(0, 1)
        out = floor + 0.5 * (peak - floor) * (1 + torch.cos(math.pi * progress))
        out = torch.where(t >= total, torch.full_like(out, floor), out)
        if warmup:
            out = torch.where(t <= warmup, peak * t / warmup, out)
        return out if t is step else float(out)

    return schedule
