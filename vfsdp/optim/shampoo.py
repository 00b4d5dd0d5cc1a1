"""Distributed Shampoo (Gupta, Koren and Singer, 2018), each matrix whole on one owner
(:mod:`vfsdp.optim.owners`), batched per shape there.

The published rule for a matrix ``G`` (Algorithm 1), its inverse roots refreshed every
``precondition_frequency`` steps (stale in between, as the paper's large-scale practice):

* ``L = eps I + sum G G^T``, ``R = eps I + sum G^T G`` (accumulated every step);
* at steps ``1, 1 + f, 1 + 2f, ...``: ``PL = L^(-1/4)``, ``PR = R^(-1/4)`` by ``eigh``
  (eigenvalues floored at ``eps``);
* ``p *= 1 - lr * weight_decay``; ``p -= lr * PL G PR``.

1-D tensors are refused by name: the published rule for them is a full ``n x n`` AdaGrad
matrix; give them to AdamW with :func:`vfsdp.optim.partition`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.optim.base import (
    Mask,
    Optimizer,
    Schedule,
    as_schedule,
    atomic,
    begin,
    check_hyper,
    decay_,
)
from vfsdp.optim.owners import OwnedState, init_owned, owned_step, refuse_compile
from vfsdp.planner.spec import ShardSpec

__all__ = ["shampoo", "inverse_root"]


def inverse_root(stats: torch.Tensor, p: int, floor: float) -> torch.Tensor:
    """``stats^(-1/p)`` of a stack ``[B, n, n]`` of symmetric positive semi-definite
    matrices, by ``eigh``, eigenvalues floored at ``floor``.

    Example:
        >>> inverse_root(torch.diag(torch.tensor([16.0, 1.0]))[None], 4, 1e-6)
        tensor([[[0.5000, 0.0000],
                 [0.0000, 1.0000]]])
    """
    values, q = torch.linalg.eigh(stats)
    return (q * values.clamp_min(floor).pow(-1.0 / p).unsqueeze(-2)) @ q.mT


def shampoo(
    lr: Schedule = 1e-3,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    precondition_frequency: int = 1,
    only: Optional[Callable[[tuple], bool]] = None,
    wave_size: int = 8,
) -> Optimizer:
    """Shampoo for 2-D matrices, each updated whole on one owner rank (Muon's root plan),
    which holds its statistics and inverse roots; pair it with AdamW for the rest through
    :func:`vfsdp.optim.partition`.

    Args:
        lr: A float or a schedule ``step -> lr``.
        eps: The statistics start at ``eps * I``; the floor of their eigenvalues.
        weight_decay: Decoupled weight decay (before the step).
        precondition_frequency: Steps between refreshes of the inverse roots.
        only: ``path -> bool``: the matrices it updates (default: every 2-D tensor its
            ``mask`` selects).
        wave_size: Matrices of one shape per owner in one exchange.

    Returns:
        An :class:`vfsdp.optim.Optimizer`.

    Raises:
        ValueError: a negative ``lr``, ``eps`` or ``weight_decay``, a
            ``precondition_frequency`` or ``wave_size`` below 1; from ``init``, a selected
            tensor that is not 2-D (naming it), or a matrix split over a model axis the
            shards' mesh lacks; from ``update``, under ``torch.compile`` (Muon's words) or
            with a frozen tensor.

    Example:
        >>> params = {"w": torch.randn(6, 4), "b": torch.zeros(6)}
        >>> opt = vfsdp.optim.partition({"shampoo": vfsdp.optim.shampoo(lr=0.01),
        ...                              "adamw": vfsdp.optim.adamw()},
        ...                             lambda path: "shampoo" if path == ("w",) else "adamw")
        >>> def body():
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     state = opt.init(shards, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...     state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        ...     return sorted(state["shampoo"].stacks[0])
        >>> vfsdp.testing.simulate(2, body)[1]            # rank 1 owns w
        ['L', 'PL', 'PR', 'R']
    """
    check_hyper("shampoo", lr, weight_decay, eps=eps)
    for name, value in (("precondition_frequency", precondition_frequency),
                        ("wave_size", wave_size)):
        if value < 1:
            raise ValueError(f"shampoo: {name} must be >= 1, got {value}")
    schedule = as_schedule(lr)

    def stack_state(b: int, shape: tuple, dtype: torch.dtype, device: Any) -> dict:
        eye = [torch.eye(n, dtype=dtype, device=device).mul_(eps).expand(b, n, n).clone()
               for n in shape]
        return {"L": eye[0], "R": eye[1], "PL": torch.zeros_like(eye[0]),
                "PR": torch.zeros_like(eye[1])}

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> OwnedState:
        return init_owned("shampoo", shards, spec, mask, only, wave_size, stack_state, False)

    def update(grads: Any, state: OwnedState, shards: Any, spec: ShardSpec) -> OwnedState:
        refuse_compile("shampoo")
        refresh = state.n % precondition_frequency == 0
        rates: list = []  # begin's, once owned_step has checked the inputs

        def rule(w: int, g: torch.Tensor) -> torch.Tensor:
            s = state.stacks[w]
            s["L"].add_(g @ g.mT)
            s["R"].add_(g.mT @ g)
            if refresh:
                s["PL"].copy_(inverse_root(s["L"], 4, eps))
                s["PR"].copy_(inverse_root(s["R"], 4, eps))
            return s["PL"] @ g @ s["PR"]

        with torch.no_grad():
            views, updates, _ = owned_step("shampoo", grads, state, shards, spec, rule, True,
                                           lambda: rates.append(begin(state.count, schedule)))
            state.n, rate = state.n + 1, rates[0]
            decay_(views, rate, weight_decay)
            if isinstance(rate, torch.Tensor):
                tp.foreach("add_", views, tp.foreach("mul", updates, scalar=-rate))
            else:
                tp.foreach("add_", views, updates, alpha=-rate)
        return state

    return Optimizer(init, atomic(update))
