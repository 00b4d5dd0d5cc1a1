"""The optimizers' and clipping's compiled path: what runs while ``torch.compile`` traces.

The eager update walks DBuffers and caches slices: none of it is traceable. So ``init``
(eager) also keeps, per tensor it updates, the views the compiled update reads (the
parameter's leaf index, whether it decays, its moment views), and the compiled update runs
the eager update's own arithmetic over them: the same step counter (the state's ``count``,
which both add one to), the same scalars (:func:`~vfsdp.optim.base.step_scalars`), the same
AdamW (:func:`~vfsdp.optim.base.adamw_step`) and 8-bit pass
(:func:`~vfsdp.optim.quant.step8_flat`), the same frozen-tensor rule (a shard that does not
require grad gets no update and no decay). The compiler fuses the element-wise ops; the
result equals the eager step within fp32 rounding (the compiler may fuse the arithmetic
differently). Eager and compiled updates on one state count in one counter, in any order.

:func:`traced_clip` is ``clip_grad_norm`` over the shards' ``.grad``: a norm per tensor, one
functional all-reduce over the shard group (and the model axis), one scaling. The gradients
carry no unit, so its groups are what the eager clip uses for such pieces: ``mesh=``, else
the default group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.comm import resolve_groups
from vfsdp.collectives.unit import group_name
from vfsdp.functional.traced import traced_leaves
from vfsdp.optim.base import adamw_step, decay_, step_scalars
from vfsdp.optim.clip import model_group, scale_by_norm
from vfsdp.optim.quant import span_tiles, step8_flat
from vfsdp.planner.local import local_plan
from vfsdp.planner.spec import ShardSpec


def first_leaves(u: Any) -> dict:
    """Unit ``u``'s buffer index -> the first leaf (spec order) holding that tensor (a tied
    tensor sits at several)."""
    return {k: i for i, k in reversed(u.leaves)}


def adam_views(units: list, state: Any, owns: Any, decays: Any) -> list:
    """What the compiled AdamW update reads, made by ``init`` (eager): per tensor it updates,
    ``(leaf index, decays, exp_avg view, exp_avg_sq view)``.

    Args:
        units: ``unit_buffers(shards, spec)``.
        state: The state (``exp_avg``/``exp_avg_sq`` DBuffers per unit key).
        owns: ``path -> bool``: the tensors it updates.
        decays: ``path -> bool``: those that take weight decay.

    Returns:
        The views.
    """
    return [(i, bool(decays(u.db.tensors[k].path)), state.exp_avg[u.key].local(k).view(-1),
             state.exp_avg_sq[u.key].local(k).view(-1))
            for u in units if u.key in state.exp_avg
            for k, i in sorted(first_leaves(u).items()) if owns(u.db.tensors[k].path)]


def traced_adamw(grads: Any, state: Any, shards: Any, spec: ShardSpec, lr: Any,
                 betas: tuple, eps: float, weight_decay: float) -> None:
    """One AdamW step while compiling (see the module); the state's counter already counts it.

    Args:
        grads: The gradient tree (``vfsdp.grads``).
        state: The :class:`~vfsdp.optim.AdamWState` (its ``traced`` views, :func:`adam_views`,
            and ``count``).
        shards: The shards.
        spec: The plan.
        lr: This step's learning rate.
        betas, eps, weight_decay: The hyperparameters.

    Returns:
        ``None``: the shards and moments change in place.

    Raises:
        ValueError: a tree that does not match the spec.
    """
    params, _ = traced_leaves(shards, spec, "adamw.update")
    gleaves, _ = traced_leaves(grads, spec, "adamw.update")
    _adam(state.traced, params, gleaves, state.count, lr, betas, eps, weight_decay)


def _adam(members: Any, params: list, gleaves: list, count: torch.Tensor, lr: Any,
          betas: tuple, eps: float, weight_decay: float) -> None:
    """The eager update's own AdamW step (:func:`~vfsdp.optim.base.adamw_step`) over the
    trained tensors of ``members`` (``(leaf, decays, exp_avg, exp_avg_sq)``)."""
    live = [x for x in members if params[x[0]].requires_grad]  # frozen: no update, no decay
    ps = [params[i].view(-1) for i, _, _, _ in live]
    gs = [gleaves[i].reshape(-1).to(m.dtype) for i, _, m, _ in live]
    with torch.no_grad():
        adamw_step(ps, gs, [x[2] for x in live], [x[3] for x in live],
                   [p for p, x in zip(ps, live) if x[1]], count=count, lr=lr, betas=betas,
                   eps=eps, weight_decay=weight_decay, fused=False)


@tp.untraced
def _norm_groups(spec: ShardSpec, mesh: Any) -> tuple:
    """``(shard group name, model axis group name or None, device, None)`` of the groups the
    eager clip adds loose pieces over (``mesh=``, else the default group: the same rule, the
    same checks and messages), or ``(None, None, None, the eager message)``. Run for real
    while dynamo traces (:func:`~vfsdp._torch_private.untraced`), once per spec and mesh: no
    collective (the ranks' agreement on the spec was checked when its shards were made) and
    no new process group (a collective call, which tracing cannot make)."""
    try:
        groups = resolve_groups(spec, mesh, check=False, build=False)
        model = model_group(spec, groups)
    except ValueError as exc:
        return None, None, None, str(exc)
    return group_name(groups.shard), None if model is None else group_name(model), groups.device, None


def traced_clip(grads: Any, spec: ShardSpec, max_norm: float, eps: float,
                mask: Any = None, mesh: Any = None) -> torch.Tensor:
    """``clip_grad_norm`` while compiling: every tensor's norm, one functional all-reduce
    over the shard group (and over the model axis of a ``tp=`` plan), one scaling. The
    gradients carry no unit, so the groups are the eager path's for loose pieces: ``mesh=``,
    else the default group.

    Args:
        grads: The gradient tree.
        spec: The plan.
        max_norm, eps, mask, mesh: As for ``clip_grad_norm``.

    Returns:
        The norm before clipping.

    Raises:
        ValueError: a tree that does not match the spec, an unprepared spec, what the eager
            clip raises for ``mesh`` (a mesh or default group that does not match the spec, a
            ``tp=`` spec without the mesh with its axis), or an HSDP spec without ``mesh=``
            whose default mesh this rank has not built.
    """
    leaves, _ = traced_leaves(grads, spec, "vfsdp.clip_grad_norm")
    tensors, counted = local_plan(spec, None)[3:]
    shard_name, model, device, refused = _norm_groups(spec, mesh)
    if refused is not None:
        raise ValueError(refused)
    chosen = [(i, c) for (i, path), c in zip(tensors, counted)
              if mask is None or bool(mask(path))]
    pieces = [leaves[i] for i, c in chosen if c]
    if pieces:
        total = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32)
                             for p in pieces]).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32,
                            device=leaves[tensors[0][0]].device if tensors else device)
    total = tp.traced_all_reduce(total, "sum", shard_name)
    if model is not None:
        total = tp.traced_all_reduce(total, "sum", model)
    norm = total.sqrt()
    scale_by_norm([], [leaves[i] for i, _c in chosen], norm, max_norm, eps)
    return norm


@dataclass
class TracedAdam8:
    """What the compiled 8-bit AdamW update reads, made by ``init`` (eager).

    Attributes:
        quantized: Every quantized tensor with a piece on this rank, in unit and shard
            order: ``(leaf index, Quantized, decays, codes m, codes v)``, the codes flat.
        sm, sv: The rank's scales (every unit's tiles, then the spare one).
        small: Per tensor with fp32 moments: ``(leaf index, decays, m, v)``.
        maps: The code maps and their midpoints (``qm, qv, mids_m, mids_v``).
    """

    quantized: list
    sm: torch.Tensor
    sv: torch.Tensor
    small: list
    maps: tuple


def traced_adamw8bit(grads: Any, state: Any, shards: Any, spec: ShardSpec, lr: Any,
                     betas: tuple, eps: float, weight_decay: float) -> None:
    """One 8-bit AdamW step while compiling: the eager update's one flat pass
    (:func:`~vfsdp.optim.quant.step8_flat`) over every trained quantized tensor of the rank
    laid end to end (the compiler fuses the concatenation and the copies back), and AdamW on
    the fp32 moments of the small tensors; the state's counter already counts the step.

    Args:
        grads, shards, spec: As for ``update``.
        state: The :class:`~vfsdp.optim.AdamW8bitState` (its ``traced`` views and ``count``).
        lr, betas, eps, weight_decay: This step's learning rate and the hyperparameters.

    Returns:
        ``None``: the shards, codes, scales and moments change in place.

    Raises:
        ValueError: a tree that does not match the spec.
    """
    views = state.traced
    params, _ = traced_leaves(shards, spec, "adamw8bit.update")
    gleaves, _ = traced_leaves(grads, spec, "adamw8bit.update")
    scalars = step_scalars(state.count, betas)
    live = [x for x in views.quantized if params[x[0]].requires_grad]  # frozen: left alone
    with torch.no_grad():
        decay_([params[i] for i, _t, d, _m, _v in live if d], lr, weight_decay)
        if live:
            still = tuple((x[1].t0, x[1].n_tiles) for x in views.quantized
                          if not params[x[0]].requires_grad)  # their scales stay
            tiles = span_tiles([(x[1].hi - x[1].lo, x[1].view, x[1].t0) for x in live],
                               views.sm.numel() - 1, views.sm.device, still)
            cols = [list(xs) for xs in zip(*[
                (params[i].view(-1), gleaves[i].reshape(-1).float(), cm, cv)
                for i, _t, _d, cm, cv in live])]
            flat = [torch.cat(xs) for xs in cols]
            step8_flat(*flat, views.sm, views.sv, tiles, *views.maps, *betas, eps, lr, *scalars)
            sizes = [x[1].hi - x[1].lo for x in live]
            for j in (0, 2, 3):  # back into the parameters and codes
                tp.foreach("copy_", cols[j], list(flat[j].split(sizes)))
    _adam(views.small, params, gleaves, state.count, lr, betas, eps, weight_decay)
