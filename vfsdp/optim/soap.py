"""Distributed SOAP (Vyas et al., 2024): Adam in the eigenbases of Shampoo's preconditioners,
each matrix whole on one owner (:mod:`vfsdp.optim.muon`'s owners), batched per shape there.

The rule is pytorch-optimizer's ``SOAP`` (a port of the authors' code), for a matrix ``G``
with statistics ``L``, ``R`` and eigenbases ``QL``, ``QR`` (``x -> QL^T x QR`` projects):

* the first update only accumulates ``L = lerp(L, G G^T, 1 - shampoo_beta)`` (and ``R`` with
  ``G^T G``) and sets ``QL``, ``QR`` by ``eigh`` (eigenvalues descending); nothing moves;
* then, at step ``t`` (counting from that first update's successor): ``m = lerp(m, G,
  1 - beta1)`` (kept in the original basis), ``v = lerp(v, project(G)^2, 1 - beta2)``,
  ``p -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * unproject(project(m) / (sqrt(v) + eps))``,
  ``p *= 1 - lr * weight_decay``; then ``L``, ``R`` accumulate ``G``, and every
  ``precondition_frequency`` steps ``QL``, ``QR`` are refreshed by one power iteration and a
  QR decomposition (in float32), ``v`` permuted to the new order of the eigenvalues;
* a side longer than ``max_precondition_dim`` is not rotated (identity);
* 1-D tensors take Adam with the same step size (no side rotated), owned as the matrices are.

Under TP the owner of a matrix split over the model axis gathers its pieces (as Muon's root
does), runs the rule on the global matrix and keeps its piece of the update: each index of
the model axis holds the same state (index 0 writes it to checkpoints).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from vfsdp.optim.base import Optimizer, Schedule, check_hyper
from vfsdp.optim.muon import apply_, branch_, owned


def eigenbasis(stats: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of a stack ``[B, n, n]`` of symmetric matrices, by descending
    eigenvalue (``eigh`` of ``stats + 1e-30 I``, as SOAP's authors take them).

    Example:
        >>> eigenbasis(torch.diag(torch.tensor([1.0, 3.0]))[None])
        tensor([[[0., 1.],
                 [1., 0.]]])
    """
    eye = torch.eye(stats.shape[-1], dtype=stats.dtype, device=stats.device)
    return torch.linalg.eigh(stats + 1e-30 * eye)[1].flip(-1)


def _rotate(x: torch.Tensor, ql: Optional[torch.Tensor], qr: Optional[torch.Tensor],
            back: bool = False) -> torch.Tensor:
    """``ql^T x qr`` (``back``: ``ql x qr^T``), a ``None`` side left as it is."""
    if ql is not None:
        x = (ql if back else ql.mT) @ x
    if qr is not None:
        x = x @ (qr.mT if back else qr)
    return x


def _refresh(stats: torch.Tensor, q: torch.Tensor, v: torch.Tensor, side: int) -> tuple:
    """One power iteration and a QR (float32) of ``q`` against ``stats``, the columns sorted
    by the estimated eigenvalues (descending); ``v`` permuted along ``side`` to match."""
    mq = stats @ q
    order = (q * mq).sum(-2).argsort(-1, descending=True)
    at = order[:, :, None] if side == 0 else order[:, None, :]
    v = v.gather(side + 1, at.expand_as(v))
    q = torch.linalg.qr(mq.gather(2, order[:, None, :].expand_as(mq)).float())[0]
    return q.to(stats.dtype), v


def _sizes(t: Any, rate: Any, b1: float, b2: float, correct_bias: bool) -> tuple:
    """``(step size, weight-decay rate)`` of step ``t > 0``: ``rate``, times Adam's bias
    corrections; compiled, both 0 at ``t = 0`` (nothing moves: ``p * 1 - 0 * u``)."""
    if not isinstance(t, torch.Tensor):
        return (rate * (math.sqrt(1 - b2 ** t) / (1 - b1 ** t)) if correct_bias else rate), rate
    t = t.double()
    moving = t > 0
    corr = torch.where(moving, (1 - b2 ** t).sqrt() / (1 - b1 ** t), 0.0) if correct_bias \
        else moving.double()
    return rate * corr, rate * moving.double()


def soap(
    lr: Schedule = 3e-3,
    betas: tuple = (0.95, 0.95),
    shampoo_beta: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    precondition_frequency: int = 10,
    max_precondition_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    only: Optional[Callable[[tuple], bool]] = None,
    wave_size: int = 8,
    weight_decay_first: bool = False,
) -> Optimizer:
    """SOAP: every 2-D matrix updated whole on one owner rank (Muon's root plan), which holds
    its moments, statistics and eigenbases; 1-D tensors take Adam on an owner too.

    Args:
        lr: A float or a schedule ``step -> lr``.
        betas: ``(beta1, beta2)`` of the Adam moments.
        shampoo_beta: The statistics' decay (default ``beta2``).
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay (after the step, as the reference).
        precondition_frequency: Steps between refreshes of the eigenbases.
        max_precondition_dim: Sides longer than this are not rotated.
        merge_dims: Only ``False`` (refused otherwise), as the next two.
        precondition_1d: Only ``False``: 1-D tensors take Adam.
        normalize_grads: Only ``False``.
        correct_bias: Adam's bias corrections in the step size.
        only: ``path -> bool``: the tensors it updates (default: every 1-D and 2-D tensor its
            ``mask`` selects).
        wave_size: Matrices of one shape per owner in one exchange (a bound on the full
            gradients an owner holds at once).
        weight_decay_first: Decay the parameters before the step (AdamW's order, what
            ``chain(scale_by_soap(), add_decayed_weights(wd), ...)`` says) rather than after
            it (the reference's); they differ by ``lr * weight_decay * step``.

    Returns:
        An :class:`vfsdp.optim.Optimizer`.

    Raises:
        ValueError: a negative ``lr``, ``eps`` or ``weight_decay``, betas outside [0, 1), a
            ``precondition_frequency``, ``max_precondition_dim`` or ``wave_size`` below 1,
            an option vfsdp does not implement; from ``init``, a selected tensor of 3 or
            more dimensions, or a matrix split over a model axis the shards' mesh lacks; from
            ``update``, a frozen tensor, or under ``torch.compile`` a matrix split over a
            model axis (Muon's words).

    Example:
        >>> params = {"w": torch.randn(6, 4), "b": torch.zeros(6)}
        >>> def body():
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     opt = vfsdp.optim.soap(lr=0.01, precondition_frequency=5)
        ...     state = opt.init(shards, spec)
        ...     for _ in range(3):     # the first update only sets the eigenbases
        ...         vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...         state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        ...     return state.step, [m.root for m in state.plan.matrices]   # b's and w's owners
        >>> vfsdp.testing.simulate(2, body)
        [(3, [0, 1]), (3, [0, 1])]
    """
    check_hyper("soap", lr, weight_decay, betas=betas, eps=eps,
                precondition_frequency=precondition_frequency,
                max_precondition_dim=max_precondition_dim, wave_size=wave_size)
    for name, on in (("merge_dims", merge_dims), ("precondition_1d", precondition_1d),
                     ("normalize_grads", normalize_grads)):
        if on:
            raise ValueError(f"soap: {name}=True is not implemented by vfsdp's SOAP; leave it "
                             f"False (the reference's default)")
    b1, b2 = betas
    decay = 1 - (b2 if shampoo_beta is None else shampoo_beta)

    def stack_state(b: int, shape: tuple, dtype: torch.dtype, device: Any) -> dict:
        out = {name: torch.zeros(b, *shape, dtype=dtype, device=device)
               for name in ("exp_avg", "exp_avg_sq")}  # a vector's sides are not rotated
        for name, n in zip(("L", "R", "QL", "QR"), shape * 2 if len(shape) == 2 else ()):
            if n <= max_precondition_dim:
                out[name] = torch.zeros(b, n, n, dtype=dtype, device=device)
        return out

    def rule(s: dict, t: Any, g: torch.Tensor) -> Optional[torch.Tensor]:
        # t: the reference's step (the first only initialises, and sends nothing back)
        ql, qr = s.get("QL"), s.get("QR")
        # Whether step t moves anything (the first only sets the eigenbases): eagerly None (no)
        # or 1.0; compiled, t > 0 as a 0-d tensor the moments' weights are multiplied by (a
        # weight 0 leaves them exactly as they were).
        out, gate = None, (t > 0).to(g.dtype) if isinstance(t, torch.Tensor) else 1.0 if t else None
        if gate is not None:
            s["exp_avg"].lerp_(g, (1 - b1) * gate)
            # Out of place: with no side rotated, _rotate returns its argument.
            s["exp_avg_sq"].lerp_(_rotate(g, ql, qr).square(), (1 - b2) * gate)
            den = s["exp_avg_sq"].sqrt().add_(eps)
            out = _rotate(_rotate(s["exp_avg"], ql, qr) / den, ql, qr, back=True)
        for side, (stats, q) in enumerate((("L", "QL"), ("R", "QR"))):
            if stats in s:  # the first update sets the eigenbases, refreshes update them
                s[stats].lerp_(g @ g.mT if side == 0 else g.mT @ g, decay)
                branch_(t == 0, lambda st, _: (eigenbasis(st),), (s[stats],), (s[q],))
                branch_((t % precondition_frequency == 0) & (t > 0),
                        lambda st, qs, v, side=side: _refresh(st, qs, v, side), (s[stats],),
                        (s[q], s["exp_avg_sq"]))
        return out

    def finish(views: list, updates: list, t: Any, lr: Any) -> None:
        size, rate = _sizes(t, lr, b1, b2, correct_bias)
        apply_(views, updates, size, rate, weight_decay, weight_decay_first)

    return owned("soap", lr, only, wave_size, stack_state, rule, finish, first_moves=False)
