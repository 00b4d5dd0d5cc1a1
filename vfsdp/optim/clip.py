"""Global gradient-norm clipping over sharded gradients, exact with padding, empty ranks and HSDP.

Over trees that live on different meshes (:class:`GradTree`, :func:`global_norm_of`,
:func:`clip_grad_norm_of`): composed parallelism shards different parameters over different
process groups: the router or the dense layers over every rank, each expert group over its
data-parallel ranks only. The global norm must count every element exactly once: each rank
adds the squares of its own pieces of every tree, one all-reduce over all ranks adds those
(pieces of a sharded tree are disjoint over its shard group, and different expert groups hold
different parameters), and a tree whose gradients are identical over some ranks (HSDP
replicas, or a ``replicated`` group you name) is counted by one of them only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp._warnings import refuse_mesh, warn_user
from vfsdp.collectives import comm
from vfsdp.collectives.comm import resolve_groups
from vfsdp.collectives.dbuffer import Role, View, slot_of
from vfsdp.functional.gather import gradient_leaves
from vfsdp.functional.pieces import Planned
from vfsdp.optim.base import Mask, by_dtype, selected
from vfsdp.planner.local import local_plan
from vfsdp.planner.spec import ShardSpec


def check_max_norm(max_norm: float) -> None:
    """Refuse a ``max_norm`` that is not a finite number ``>= 0``.

    Raises:
        ValueError: negative, NaN or infinite (every gradient would silently become NaN or
            never be clipped).
    """
    if not math.isfinite(value := float(max_norm)) or value < 0:
        raise ValueError(f"max_norm must be a finite number >= 0, got {max_norm!r}")


def _plan(leaves: list, spec: ShardSpec, mask: Mask) -> tuple[list, list]:
    """``(whole, loose)``: gradient buffers whose whole shard is the unit's selected
    gradients (one op each), and the other selected pieces (one op per tensor)."""
    whole, loose = [], []
    tensors = spec.leaves()
    for key, members in spec.unit_leaves().items():
        chosen: dict = {}  # buffer index -> its first selected leaf: a tied tensor sits at several
        for i, k in members:
            if selected(mask, tensors[i].path):
                chosen.setdefault(k, i)
        pieces = [(leaves[i], k) for k, i in chosen.items() if isinstance(leaves[i], torch.Tensor)]
        slots = [slot_of(p) for p, _ in pieces]
        first = slots[0] if slots else None
        if (first is not None and len(chosen) == len(spec.units[key].paths)
                and len(pieces) == len(chosen) and first.buffer.role is Role.GRAD
                and all(s is not None and s.buffer is first.buffer and s.view is View.LOCAL
                        and s.index == k for s, (_, k) in zip(slots, pieces))):
            first.buffer.wait()
            whole.append(first.buffer)
        else:
            for (p, _), s in zip(pieces, slots):
                if s is not None:
                    s.buffer.wait()
                loose.append(p)
    return whole, loose


def _groups_and_device(leaves: list, spec: ShardSpec, mesh: Any, what: Optional[str]):
    slot = next((s for s in map(slot_of, leaves) if s is not None), None)
    if slot is not None:  # gradient buffer views: their unit's groups
        if mesh is not None and what is not None:
            refuse_mesh(what)
        return slot.buffer.groups, slot.buffer.device
    groups = resolve_groups(spec, mesh)
    return groups, next((x.device for x in leaves if isinstance(x, torch.Tensor)), groups.device)


def global_norm(grads: Any, spec: ShardSpec, *, mesh: Any = None, mask: Mask = None
                ) -> torch.Tensor:
    """The 2-norm of all gradients across ranks (a replicated fp32 scalar tensor).

    Each rank adds the squared norms of its gradient pieces (one multi-tensor norm over the whole
    shards of the units whose pieces are a gradient buffer's views, and the other pieces:
    a fixed number of ops; padding is zero and adds nothing, an empty shard adds nothing);
    one all-reduce over the shard group adds the ranks' sums. Over HSDP's replicate dim the
    gradients are already identical, so they are not added again. For a plan split over a
    model axis (``vfsdp.plan(..., tp=rule)``) a second all-reduce over that axis adds the
    other indices' pieces; tensors it replicates are counted by index 0 only.

    Args:
        grads: This rank's gradient pieces, shaped like the spec's tree.
        spec: The plan.
        mesh: For pieces that are not gradient buffer views: the ``DeviceMesh`` (as for
            :func:`clip_grad_norm`).
        mask: ``path -> bool``: only the selected tensors count (default: all).

    Returns:
        The global norm, a replicated fp32 scalar tensor on the gradients' device.

    Raises:
        ValueError: the tree does not match the spec.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"a": torch.ones(8), "b": torch.ones(3)}, 2)
        ...     shards = vfsdp.shard({"a": torch.ones(8), "b": torch.ones(3)}, spec)
        ...     grads = vfsdp.grads(shards, spec)
        ...     grads["a"].fill_(1.0)
        ...     return (float(vfsdp.optim.global_norm(grads, spec)),
        ...             float(vfsdp.optim.global_norm(grads, spec, mask=lambda p: p == ("b",))))
        >>> vfsdp.testing.simulate(2, body)[0]
        (2.8284270763397217, 0.0)
    """
    return _norm(grads, spec, mesh, mask, "vfsdp.global_norm")[0]


def _norm(grads: Any, spec: ShardSpec, mesh: Any, mask: Mask, what: str) -> tuple:
    total, whole, loose, groups = local_squares(gradient_leaves(grads, spec, what), spec, mesh, mask, what)
    comm.all_reduce_(total, "sum", groups.shard)
    model = model_group(spec, groups)
    if model is not None:  # TP/EP: the other indices' pieces
        comm.all_reduce_(total, "sum", model)
    return total.sqrt(), whole, loose


def model_group(spec: ShardSpec, groups: Any) -> Any:
    """The group over which a norm adds the other model indices' pieces: ``groups.model``
    for a spec split over a model axis (``tp=``), else ``None``.

    Raises:
        ValueError: a split spec whose groups lack that axis (a data mesh given or shards
            made on one).
    """
    if spec.model_axis is None or spec.model_axis[1] <= 1:
        return None
    if groups.model is None:
        axis = spec.model_axis[0]
        raise ValueError(f"vfsdp.clip_grad_norm: the spec is split over {axis!r}; its norm adds "
                         f"every index's pieces, so vfsdp needs that axis: pass mesh= the mesh "
                         f"with {axis!r} (for .grad pieces), and make the shards with "
                         f"vfsdp.shard(params, spec, mesh=mesh) on it")
    return groups.model


def local_squares(leaves: list, spec: ShardSpec, mesh: Any, mask: Mask,
                  what: Optional[str] = None) -> tuple:
    """``(sum of squares of this rank's pieces (fp32 scalar), whole, loose, groups)``: the
    gradient buffers whose whole shard is selected, the other selected pieces, and the
    tree's :class:`~vfsdp.collectives.MeshGroups`."""
    groups, device = _groups_and_device(leaves, spec, mesh, what)
    whole, loose = _plan(leaves, spec, mask)
    pieces = [gdb.shard for gdb in whole] + [p for p in loose if p.numel()]
    if spec.model_axis is not None and spec.model_axis[2] != 0:
        # Off model index 0 of a tp= plan: only the pieces of tensors split over the model
        # axis count (a replicated tensor is counted by index 0 only).
        tensors, counted = local_plan(spec)[3:]
        pieces = [leaves[i] for (i, path), c in zip(tensors, counted) if c and selected(mask, path)
                  and isinstance(leaves[i], torch.Tensor) and leaves[i].numel()]
    if pieces:
        # One multi-tensor norm over every piece (fp32 arithmetic, no cast copy of bf16
        # gradients), then the sum of their squares: a fixed number of ops per step.
        wide = [p for p in pieces if p.dtype == torch.float64]  # float32 would narrow them
        rest = [p for p in pieces if p.dtype != torch.float64]
        norms = list(tp.foreach("norm", rest, scalar=2, dtype=torch.float32))
        norms += [n.float() for n in tp.foreach("norm", wide, scalar=2)]
        total = torch.stack(norms).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    return total, whole, loose, groups


def clip_grad_norm(grads: Any, spec: ShardSpec, max_norm: float, *, mesh: Any = None,
                   eps: float = 1e-6, mask: Mask = None) -> torch.Tensor:
    """Scale the gradients in place so their global 2-norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: multiply by
    ``min(1, max_norm / (norm + eps))``.

    Args:
        grads: This rank's gradient pieces (``vfsdp.grads(shards, spec)``: scaled in place,
            one multi-tensor op per gradient dtype).
        spec: The plan.
        max_norm: The largest allowed norm.
        mesh: A ``DeviceMesh`` matching the spec, for pieces that are not gradient buffer
            views (the shards' ``.grad``, and every gradient under ``torch.compile``);
            default: the default group. With gradient buffer views (which carry their mesh)
            it is refused.
        eps: Added to the norm before dividing.
        mask: ``path -> bool``: clip only the selected tensors, by their own norm.

    Returns:
        The norm before clipping, as a plain replicated fp32 scalar tensor.

    Raises:
        ValueError: ``max_norm`` is negative or not finite, or the tree does not match the
            spec.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     grads = vfsdp.grads(shards, spec)
        ...     grads["w"].fill_(3.0)                    # 8 elements of 3: norm 8.4853
        ...     norm = vfsdp.clip_grad_norm(grads, spec, 1.0)
        ...     return round(float(norm), 4), round(float(grads["w"][0]), 4)
        >>> vfsdp.testing.simulate(2, body)[0]
        (8.4853, 0.3536)
    """
    check_max_norm(max_norm)
    if tp.compiling():  # torch.compile: functional collectives over the shards' .grad
        from vfsdp.optim.traced import traced_clip

        return traced_clip(grads, spec, max_norm, eps, mask, mesh)
    norm, whole, loose = _norm(grads, spec, mesh, mask, "vfsdp.clip_grad_norm")
    scale_by_norm(whole, loose, norm, max_norm, eps)
    return norm


def scale_by_norm(whole: list, loose: list, norm: torch.Tensor, max_norm: float,
                  eps: float) -> None:
    """Multiply the gradient buffers ``whole`` and pieces ``loose`` by
    ``min(1, max_norm / (norm + eps))``: one multi-tensor op per gradient dtype."""
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    with torch.no_grad():
        for dtype, gs in by_dtype([gdb.shard for gdb in whole] + loose).items():
            tp.foreach("mul_", gs, scalar=coef if dtype == coef.dtype else coef.to(dtype))


@dataclass(frozen=True, init=False)
class GradTree(Planned):
    """One tree of gradient pieces and where it lives: a
    :class:`~vfsdp.functional.pieces.Planned` (``tree``: the gradients, also read as
    ``grads``) with ``replicated``. Made as before: ``GradTree(grads, spec, mesh=None,
    replicated=None)``.

    Attributes:
        grads: This rank's gradient pieces (``vfsdp.grads(shards, spec)``), the ``tree``.
        spec: Its plan.
        mesh: The ``DeviceMesh`` its shards were made on (``None``: the default group).
        replicated: A process group over which this tree's gradients are identical (e.g. a
            tensor-parallel group for parameters every TP rank holds whole): only its rank 0
            counts them. HSDP's replicate dim, and the replicated tensors of a
            ``vfsdp.plan(..., tp=rule)`` spec, are handled without it.

    Before vfsdp 0.4 a ``NamedTuple``: indexing or unpacking one still works, with a
    ``DeprecationWarning``, until the next release.

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

    replicated: Any = None

    def __init__(self, grads: Any, spec: ShardSpec, mesh: Any = None, replicated: Any = None) -> None:
        super().__init__(grads, spec, mesh)
        object.__setattr__(self, "replicated", replicated)

    grads = property(lambda self: self.tree)

    def __getitem__(self, i: Any) -> Any:
        warn_user("GradTree is no longer a tuple (vfsdp 0.4); indexing or unpacking one goes in the "
                  "next release: read .grads, .spec, .mesh, .replicated", DeprecationWarning)
        return (self.tree, self.spec, self.mesh, self.replicated)[i]


def _norm_of(trees: Sequence[GradTree], group: Any, what: str) -> tuple[torch.Tensor, list]:
    """``(the joint norm over group, (whole, loose) of each tree)``."""
    if not trees:
        raise ValueError(f"{what}: give at least one GradTree")
    total, parts = None, []
    for t in trees:
        t = t if isinstance(t, GradTree) else GradTree(*t)
        if t.replicated is not None and t.spec.model_axis is not None:
            raise ValueError(f"{what}: a tree of a tp= plan (split over "
                             f"{t.spec.model_axis[0]!r}) already counts the tensors it "
                             f"replicates once; drop replicated=")
        sq, whole, loose, groups = local_squares(gradient_leaves(t.tree, t.spec, what), t.spec, t.mesh, None)
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
    return _norm_of(trees, group, "vfsdp.optim.global_norm_of")[0]


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
    norm, parts = _norm_of(trees, group, "vfsdp.optim.clip_grad_norm_of")
    for whole, loose in parts:
        scale_by_norm(whole, loose, norm, max_norm, eps)
    return norm
