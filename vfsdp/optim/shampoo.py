"""Distributed Shampoo (Gupta, Koren and Singer, 2018), each tensor whole on one owner
(:mod:`vfsdp.optim.muon`'s owners), cut into blocks there (Shi et al., 2023), batched per
block shape.

The published rule for a tensor of order ``k`` (a matrix: ``k = 2``, a vector: ``k = 1``;
Algorithm 2), its inverse roots refreshed every ``precondition_frequency`` steps (stale in
between, as the paper's large-scale practice), for a matrix ``G``:

* ``L = eps I + sum G G^T``, ``R = eps I + sum G^T G`` (accumulated every step);
* at steps ``1, 1 + f, 1 + 2f, ...``: ``PL = L^(-1/4)``, ``PR = R^(-1/4)`` by ``eigh``
  (eigenvalues floored at ``eps``);
* ``p *= 1 - lr * weight_decay``; ``p -= lr * PL G PR``;

and for a vector ``g``: ``L = eps I + sum g g^T`` (full-matrix AdaGrad), ``p -= lr *
L^(-1/2) g``. Blocking (Distributed Shampoo's ``max_preconditioner_dim``): each dimension
is cut into pieces of ``block_size`` (the last one shorter), and each block of a tensor takes
the rule on its own, with its own statistics: an ``n``-vector holds ``O(n * block_size)``
state, not ``O(n^2)``. A stack's blocks of one shape (at most 4 shapes per matrix shape: the
full blocks and the edges) are one batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from vfsdp.optim.base import Optimizer, Schedule, check_hyper
from vfsdp.optim.muon import apply_, branch_, owned


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


def _regions(shape: tuple, size: Optional[int]) -> list:
    """The blocks of a tensor of ``shape`` cut into pieces of at most ``size`` per dimension,
    grouped by block shape: per group, per dimension ``(lo, hi, block)`` (``hi - lo`` a
    multiple of ``block``); the group of full blocks first.

    Example:
        >>> _regions((5, 4), 2)
        [((0, 4, 2), (0, 4, 2)), ((4, 5, 1), (0, 4, 2))]
    """
    def pieces(n: int) -> list:
        b = n if size is None else min(n, size)
        full = n - n % b
        return [(0, full, b)] + ([(full, n, n - full)] if full < n else [])
    return list(itertools.product(*(pieces(n) for n in shape)))


def _blocks(x: torch.Tensor, region: tuple) -> torch.Tensor:
    """The blocks of ``region`` (:func:`_regions`) of a stack ``x`` ``[B, rows, cols]``, as a
    view ``[B, row blocks, column blocks, rows, cols]``."""
    (r0, r1, br), (c0, c1, bc) = region
    # view, not unflatten: under simulate dynamo traces RankRNG's __torch_function__ into
    # Tensor.unflatten's super() call, and stops
    return x[:, r0:r1, c0:c1].view(x.shape[0], (r1 - r0) // br, br, (c1 - c0) // bc,
                                   bc).transpose(2, 3)


def shampoo(
    lr: Schedule = 1e-3,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    precondition_frequency: int = 1,
    block_size: Optional[int] = 1024,
    only: Optional[Callable[[tuple], bool]] = None,
    wave_size: int = 8,
) -> Optimizer:
    """Shampoo for matrices and vectors, each updated whole on one owner rank (Muon's root
    plan), which holds its statistics and inverse roots, per block of at most ``block_size``
    per side; pair it with AdamW for other tensors through :func:`vfsdp.optim.partition`.

    Args:
        lr: A float or a schedule ``step -> lr``.
        eps: The statistics start at ``eps * I``; the floor of their eigenvalues.
        weight_decay: Decoupled weight decay (before the step).
        precondition_frequency: Steps between refreshes of the inverse roots.
        block_size: The longest side of a block (Distributed Shampoo's
            ``max_preconditioner_dim``, whose default it takes); ``None``: whole tensors
            (a vector of ``n`` then holds ``n x n`` statistics).
        only: ``path -> bool``: the tensors it updates (default: every 1-D and 2-D tensor its
            ``mask`` selects).
        wave_size: Tensors of one shape per owner in one exchange.

    Returns:
        An :class:`vfsdp.optim.Optimizer`.

    Raises:
        ValueError: a negative ``lr``, ``eps`` or ``weight_decay``, a
            ``precondition_frequency``, ``block_size`` or ``wave_size`` below 1; from
            ``init``, a selected tensor of 3 or more dimensions (naming it), or a matrix split
            over a model axis the shards' mesh lacks; from ``update``, under
            ``torch.compile`` a matrix split over a model axis (Muon's words), or a frozen
            tensor.

    Example:
        >>> params = {"w": torch.randn(6, 4), "b": torch.zeros(6)}
        >>> opt = vfsdp.optim.shampoo(lr=0.01, block_size=4)
        >>> def body():
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     state = opt.init(shards, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...     state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        ...     return [{k: tuple(v.shape) for k, v in s.items() if k[0] in "LR"}
        ...             for s in state.stacks if len(s["L"])]
        >>> b, w = vfsdp.testing.simulate(2, body)   # [tensors, blocks, side, side]
        >>> b                # rank 0 owns b: blocks of 4 and 2, one statistic each
        [{'L': (1, 1, 4, 4), 'L1': (1, 1, 2, 2)}]
        >>> w                # rank 1 owns w (6 x 4): blocks 4 x 4 and 2 x 4, an L and R each
        [{'L': (1, 1, 4, 4), 'R': (1, 1, 4, 4), 'L1': (1, 1, 2, 2), 'R1': (1, 1, 4, 4)}]
    """
    check_hyper("shampoo", lr, weight_decay, eps=eps,
                precondition_frequency=precondition_frequency, wave_size=wave_size)
    if block_size is not None and block_size < 1:
        raise ValueError(f"shampoo: block_size must be >= 1 (or None: whole matrices), got "
                         f"{block_size}")
    # The new inverse roots of a matrix's (order 2: -1/4) or a vector's (order 1: -1/2) blocks.
    roots = {order: (lambda stats, root, p=2 * order: (inverse_root(stats, p, eps),))
             for order in (1, 2)}

    def stack_state(b: int, shape: tuple, dtype: torch.dtype, device: Any) -> dict:
        out = {}  # a vector is a column: its blocks have one side, L
        for i, region in enumerate(_regions((*shape, 1)[:2], block_size)):
            blocks = math.prod((hi - lo) // n for lo, hi, n in region)
            for side, (_, _, n) in zip("LR"[:len(shape)], region):
                eye = torch.eye(n, dtype=dtype, device=device).mul_(eps)
                out[f"{side}{i or ''}"] = eye.expand(b, blocks, n, n).clone()
                out[f"P{side}{i or ''}"] = torch.zeros_like(out[f"{side}{i or ''}"])
        return out

    def rule(s: dict, t: Any, g: torch.Tensor) -> torch.Tensor:
        order = g.dim() - 1  # a matrix's roots -1/4, a vector's -1/2
        refresh = t % precondition_frequency == 0  # compiled: a tensor
        g = g if order == 2 else g.unsqueeze(-1)
        out = torch.empty_like(g)
        for i, region in enumerate(_regions(g.shape[1:], block_size)):
            y = x = _blocks(g, region).reshape(-1, region[0][2], region[1][2])
            for side in "LR"[:order]:
                n = x.shape[-2] if side == "L" else x.shape[-1]
                stats, root = (s[f"{p}{side}{i or ''}"].view(-1, n, n) for p in ("", "P"))
                stats.add_(x @ x.mT if side == "L" else x.mT @ x)
                branch_(refresh, roots[order], (stats,), (root,))
                y = root @ y if side == "L" else y @ root
            _blocks(out, region).copy_(y.view(_blocks(out, region).shape))
        return out if order == 2 else out.squeeze(-1)

    return owned("shampoo", lr, only, wave_size, stack_state, rule, lambda views, updates, t, lr:
                 apply_(views, updates, lr, lr, weight_decay, True))
