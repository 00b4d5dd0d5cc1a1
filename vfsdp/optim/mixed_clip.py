"""Gradient norm and clipping over trees that live on different meshes.

Composed parallelism shards different parameters over different process groups: the router
or the dense layers over every rank, each expert group over its data-parallel ranks only. The
global norm must count every element exactly once: each rank adds the squares of its own
pieces of every tree, one all-reduce over all ranks adds those (pieces of a sharded tree are
disjoint over its shard group, and different expert groups hold different parameters), and a
tree whose gradients are identical over some ranks (HSDP replicas, or a ``replicated`` group
you name) is counted by one of them only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from vfsdp.collectives import comm
from vfsdp.functional.gather import gradient_leaves
from vfsdp.optim.clip import check_max_norm, local_squares, scale_by_norm
from vfsdp.planner.spec import ShardSpec


class GradTree(NamedTuple):
    """One tree of gradient pieces and where it lives.

    Attributes:
        grads: This rank's gradient pieces (``vfsdp.grads(shards, spec)``).
        spec: Its plan.
        mesh: The ``DeviceMesh`` its shards were made on (``None``: the default group).
        replicated: A process group over which this tree's gradients are identical (e.g. a
            tensor-parallel group for parameters every TP rank holds whole): only its rank 0
            counts them. HSDP's replicate dim, and the replicated tensors of a
            ``vfsdp.plan(..., tp=rule)`` spec, are handled without it.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...     tree = GradTree(vfsdp.grads(shards, spec), spec)
        ...     return tree.mesh, float(global_norm_of([tree]))
        >>> vfsdp.testing.simulate(2, body)
        [(None, 2.0), (None, 2.0)]
    """

    grads: Any
    spec: ShardSpec
    mesh: Any = None
    replicated: Any = None


def _norm(trees: Sequence[GradTree], group: Any, what: str) -> tuple[torch.Tensor, list]:
    """``(the joint norm over group, (whole, loose) of each tree)``."""
    if not trees:
        raise ValueError(f"{what}: give at least one GradTree")
    total, parts = None, []
    for t in trees:
        if not isinstance(t, GradTree):
            t = GradTree(*t)
        if t.replicated is not None and t.spec.model_axis is not None:
            raise ValueError(f"{what}: a tree of a tp= plan (split over "
                             f"{t.spec.model_axis[0]!r}) already counts the tensors it "
                             f"replicates once; drop replicated=")
        sq, whole, loose, groups = local_squares(gradient_leaves(t.grads, t.spec, what), t.spec, t.mesh, None)
        if groups.replicate_rank != 0 or (t.replicated is not None and dist.get_rank(t.replicated) != 0):
            sq = torch.zeros_like(sq)  # counted by another rank
        total = sq if total is None else total + sq.to(total.device)
        parts.append((whole, loose))
    comm.all_reduce_(total, "sum", group)
    return total.sqrt(), parts


def global_norm_of(trees: Sequence[GradTree], *, group: Optional[Any] = None) -> torch.Tensor:
    """The 2-norm of the gradients of several trees on different meshes, each element
    counted once.

    Args:
        trees: :class:`GradTree` values (or ``(grads, spec[, mesh[, replicated]])`` tuples).
        group: The ranks to add over (default: every rank).

    Returns:
        The norm, a replicated fp32 scalar tensor.

    Raises:
        ValueError: no trees, or a tree that does not match its spec.

    Example:
        >>> def body():
        ...     m = vfsdp.mesh(("dp", 2), ("ep", 2))
        ...     dense = {"w": torch.ones(4)}                       # FSDP over all 4 ranks
        ...     d_spec = vfsdp.plan(dense, 4)
        ...     d = vfsdp.shard(dense, d_spec)
        ...     mine = {"e": torch.ones(2) * (1 + m.get_local_rank("ep"))}  # one expert each
        ...     e_spec = vfsdp.plan(mine, 2)
        ...     e = vfsdp.shard(mine, e_spec, mesh=m["dp"])        # FSDP over "dp"
        ...     for g in (*vfsdp.grads(d, d_spec).values(), *vfsdp.grads(e, e_spec).values()):
        ...         g.fill_(1.0)
        ...     return float(global_norm_of([(vfsdp.grads(d, d_spec), d_spec),
        ...                                  (vfsdp.grads(e, e_spec), e_spec, m["dp"])]))
        >>> round(vfsdp.testing.simulate(4, body)[0] ** 2, 4)      # 4 dense + 2 x 2 expert
        8.0
    """
    return _norm(trees, group, "vfsdp.optim.global_norm_of")[0]


def clip_grad_norm_of(trees: Sequence[GradTree], max_norm: float, *,
                      group: Optional[Any] = None, eps: float = 1e-6) -> torch.Tensor:
    """Clip the gradients of several trees on different meshes by their joint norm
    (:func:`global_norm_of`), as ``torch.nn.utils.clip_grad_norm_`` clips one model's.

    Args:
        trees: :class:`GradTree` values (or tuples), scaled in place.
        max_norm: The largest allowed norm.
        group: The ranks to add over (default: every rank).
        eps: Added to the norm before dividing.

    Returns:
        The norm before clipping.

    Raises:
        ValueError: ``max_norm`` negative or not finite, no trees, or a tree that does not
            match its spec.

    Example:
        >>> def body():
        ...     a_spec = vfsdp.plan({"a": torch.ones(3)}, 2)
        ...     b_spec = vfsdp.plan({"b": torch.ones(4)}, 2)
        ...     a = vfsdp.shard({"a": torch.ones(3)}, a_spec)
        ...     b = vfsdp.shard({"b": torch.ones(4)}, b_spec)
        ...     vfsdp.grads(a, a_spec)["a"].fill_(1.0)
        ...     vfsdp.grads(b, b_spec)["b"].fill_(1.0)            # joint norm sqrt(3 + 4)
        ...     trees = [(vfsdp.grads(a, a_spec), a_spec), (vfsdp.grads(b, b_spec), b_spec)]
        ...     before = clip_grad_norm_of(trees, 1.0)
        ...     return round(float(before), 4), round(float(global_norm_of(trees)), 4)
        >>> vfsdp.testing.simulate(2, body)[0]
        (2.6458, 1.0)
    """
    check_max_norm(max_norm)
    norm, parts = _norm(trees, group, "vfsdp.optim.clip_grad_norm_of")
    for whole, loose in parts:
        scale_by_norm(whole, loose, norm, max_norm, eps)
    return norm
