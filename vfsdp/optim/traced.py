"""The optimizers' and clipping's compiled path: what runs while ``torch.compile`` traces.

The eager update walks DBuffers, caches slices and counts steps in Python: none of it is
traceable, and a Python step count would be a new constant (a recompile) every step. So:

* ``init`` (eager) also keeps, per tensor it updates, the views the compiled update reads:
  the parameter's leaf index, whether it decays, its two moment views (``TracedAdam``), and a
  one-element float64 step counter on the parameters' device (dynamo would take a 0-d
  float64 CPU tensor for a constant);
* the compiled update (:func:`traced_adamw`) adds one to that counter in the graph, computes
  the learning rate (schedules take tensors), the bias corrections in float64 and runs
  AdamW's element-wise update per tensor, which the compiler fuses; the result equals the
  eager step within fp32 rounding (the bias corrections are taken as tensors, and the
  compiler may fuse the arithmetic differently);
* :func:`traced_clip` is ``clip_grad_norm`` over the shards' ``.grad``: a norm per tensor,
  one functional all-reduce over the shard group (and the model axis), one scaling.

One count, whatever mixes: the step counter is the truth while compiling, and ``state.step``
follows it at the next eager call or checkpoint (``AdamWState.sync_step``); an eager update
counts in ``state.step`` and marks the counter stale (no op), and the next compiled update
fills it from ``state.step`` first (a graph of its own, traced once). So eager and compiled
updates on one state give the all-eager bias corrections and schedule in any order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vfsdp import _torch_private as tp
from vfsdp.functional.traced import clip_groups, traced_leaves
from vfsdp.optim.fused import adamw_step
from vfsdp.optim.quant import span_tiles, step8_flat
from vfsdp.planner.local import local_plan
from vfsdp.planner.spec import ShardSpec

__all__ = ["TracedAdam", "traced_adamw", "traced_clip", "adam_views", "TracedAdam8",
           "traced_adamw8bit", "compiled_update"]


@dataclass
class TracedAdam:
    """What the compiled AdamW update reads, made by ``init`` (eager).

    Attributes:
        leaves: Leaf index (spec order) of each tensor it updates.
        decay: Whether each decays.
        m, v: Each one's moment views (views of the state DBuffers).
        step: A one-element float64 tensor on the parameters' device: the step count.
        stale: An eager update counted a step the tensor does not hold yet (the next
            compiled update fills it from ``state.step`` first): no op per eager update.
        ran: Set by the compiled update (a plain attribute: dynamo replays it).
    """

    leaves: tuple
    decay: tuple
    m: list
    v: list
    step: torch.Tensor
    stale: bool = False  # eager updates counted steps ``step`` does not hold yet
    ran: bool = False  # compiled updates ran since ``state.step`` last caught up


def adam_views(units: list, state: Any, spec: ShardSpec, owns: Any, decays: Any,
               device: torch.device) -> TracedAdam:
    """The :class:`TracedAdam` of an AdamW state (eager, at ``init``).

    Args:
        units: ``unit_buffers(shards, spec)``.
        state: The state (``exp_avg``/``exp_avg_sq`` DBuffers per unit key).
        spec: The plan.
        owns: ``path -> bool``: the tensors it updates.
        decays: ``path -> bool``: those that take weight decay.
        device: The parameters' device (for the counter).

    Returns:
        The views.
    """
    leaves, decay, ms, vs = [], [], [], []
    for u in units:
        if u.key not in state.exp_avg:
            continue
        seen = set()
        for i, k in u.leaves:
            t = u.db.tensors[k]
            if k in seen or not owns(t.path):
                continue
            seen.add(k)
            leaves.append(i)
            decay.append(bool(decays(t.path)))
            ms.append(state.exp_avg[u.key].local(k).view(-1))
            vs.append(state.exp_avg_sq[u.key].local(k).view(-1))
    step = torch.zeros(1, dtype=torch.float64, device=device)  # a 0-d float64 would be a constant
    return TracedAdam(tuple(leaves), tuple(decay), ms, vs, step)


def traced_adamw(grads: Any, views: TracedAdam, shards: Any, spec: ShardSpec, schedule: Any,
                 betas: tuple, eps: float, weight_decay: float) -> None:
    """One AdamW step while compiling (see the module).

    Args:
        grads: The gradient tree (``vfsdp.grads``).
        views: The state's :class:`TracedAdam`.
        shards: The shards.
        spec: The plan.
        schedule: ``step -> lr`` (given the one-element step tensor).
        betas, eps, weight_decay: The hyperparameters.

    Returns:
        ``None``: the shards and moments change in place.

    Raises:
        ValueError: a tree that does not match the spec.
    """
    params, _ = traced_leaves(shards, spec, "adamw.update")
    gleaves, _ = traced_leaves(grads, spec, "adamw.update")
    lr = _step_scalars(views, schedule, betas)[0]
    _adam(zip(views.leaves, views.decay, views.m, views.v), params, gleaves, views.step, lr,
          betas, eps, weight_decay)


def _adam(members: Any, params: list, gleaves: list, step: torch.Tensor, lr: torch.Tensor,
          betas: tuple, eps: float, weight_decay: float) -> None:
    """The eager update's own AdamW step (:func:`~vfsdp.optim.fused.adamw_step`) over the
    trained tensors of ``members`` (``(leaf, decays, exp_avg, exp_avg_sq)``), its scalars
    tensors of the graph."""
    ps, gs, ms, vs, decay = [], [], [], [], []
    for i, decays, m, v in members:
        if not params[i].requires_grad:  # frozen: no update, no decay
            continue
        ps.append(params[i].view(-1))
        gs.append(gleaves[i].reshape(-1).to(m.dtype))
        ms.append(m)
        vs.append(v)
        if decays:
            decay.append(ps[-1])
    with torch.no_grad():
        adamw_step(ps, gs, ms, vs, decay, step=step, lr=lr, betas=betas, eps=eps,
                   weight_decay=weight_decay, fused=False)


def _step_scalars(views: Any, schedule: Any, betas: tuple) -> tuple:
    """Count the step in the graph: ``(lr, bias correction 1, sqrt of bias correction 2)`` as
    tensors."""
    b1, b2 = betas
    views.ran = True  # a Python side effect: dynamo applies it after each call
    views.step.add_(1)
    step = views.step
    lr = torch.as_tensor(schedule(step), dtype=torch.float64, device=step.device)
    return lr, 1 - b1 ** step, torch.sqrt(1 - b2 ** step)


def traced_clip(grads: Any, spec: ShardSpec, max_norm: float, eps: float,
                mask: Any = None) -> torch.Tensor:
    """``clip_grad_norm`` while compiling: every tensor's norm, one functional all-reduce
    over the shard group (and over the model axis of a ``tp=`` plan), one scaling.

    Args:
        grads: The gradient tree.
        spec: The plan.
        max_norm, eps, mask: As for ``clip_grad_norm``.

    Returns:
        The norm before clipping.

    Raises:
        ValueError: a tree that does not match the spec, or an unprepared spec.
    """
    what = "vfsdp.clip_grad_norm"
    leaves, _ = traced_leaves(grads, spec, what)
    tensors, counted = local_plan(spec, None)[3:]
    shard_name, model = clip_groups(spec, what)
    if model == "":
        raise ValueError("vfsdp.clip_grad_norm: the spec is split over a model axis, but its "
                         "shards were made on the data mesh only; make them with "
                         "vfsdp.shard(params, spec, mesh=mesh) on the mesh with that axis")
    chosen = [(i, c) for (i, path), c in zip(tensors, counted)
              if mask is None or bool(mask(path))]
    pieces = [leaves[i] for i, c in chosen if c]
    device = leaves[tensors[0][0]].device if tensors else torch.device("cpu")
    if pieces:
        total = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32)
                             for p in pieces]).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    total = tp.traced_all_reduce(total, "sum", shard_name)
    if model is not None:
        total = tp.traced_all_reduce(total, "sum", model)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    with torch.no_grad():
        for i, _c in chosen:
            leaves[i].mul_(coef.to(leaves[i].dtype))
    return norm


@dataclass
class TracedAdam8:
    """What the compiled 8-bit AdamW update reads, made by ``init`` (eager).

    Attributes:
        quantized: Per unit with quantized tensors: ``(pieces, scales m, scales v)``, each
            piece ``(leaf index, Quantized, decays, codes m, codes v)`` with the codes flat,
            the scales the unit's (its tiles, then the spare one).
        small: Per tensor with fp32 moments: ``(leaf index, decays, m, v)``.
        maps: The code maps and their midpoints (``qm, qv, mids_m, mids_v``).
        step: A one-element float64 step counter (as :class:`TracedAdam`'s).
        stale, ran: As :class:`TracedAdam`'s.
    """

    quantized: list
    small: list
    maps: tuple
    step: torch.Tensor
    stale: bool = False
    ran: bool = False


def traced_adamw8bit(grads: Any, views: TracedAdam8, shards: Any, spec: ShardSpec,
                     schedule: Any, betas: tuple, eps: float, weight_decay: float) -> None:
    """One 8-bit AdamW step while compiling: per unit the eager update's flat pass
    (:func:`~vfsdp.optim.quant.step8_flat`) over its trained quantized tensors laid end to
    end (the compiler fuses the concatenation and the copies back), and AdamW on the fp32
    moments of the small tensors; the step counts in a tensor.

    Args:
        grads, shards, spec: As for ``update``.
        views: The state's :class:`TracedAdam8`.
        schedule, betas, eps, weight_decay: The hyperparameters.

    Returns:
        ``None``: the shards, codes, scales and moments change in place.

    Raises:
        ValueError: a tree that does not match the spec.
    """
    params, _ = traced_leaves(shards, spec, "adamw8bit.update")
    gleaves, _ = traced_leaves(grads, spec, "adamw8bit.update")
    b1, b2 = betas
    lr, bc1, bc2_sqrt = _step_scalars(views, schedule, betas)
    step = (-lr / bc1).float()  # the eager update's scalars, as tensors
    with torch.no_grad():
        for pieces, sm, sv in views.quantized:
            live = [x for x in pieces if params[x[0]].requires_grad]
            if not live:
                continue
            for i, _t, decays, _cm, _cv in live:
                if weight_decay and decays:
                    params[i].mul_((1 - lr * weight_decay).to(params[i].dtype))
            n = sm.numel() - 1
            skip = tuple((x[1].t0, x[1].n_tiles) for x in pieces
                         if not params[x[0]].requires_grad)  # their scales stay
            tiles = span_tiles([(x[1].hi - x[1].lo, x[1].view, x[1].t0) for x in live], n,
                               sm.device, skip)
            flat = [torch.cat(xs) for xs in zip(*[
                (params[i].view(-1), gleaves[i].reshape(-1).float(), cm, cv)
                for i, _t, _d, cm, cv in live])]
            step8_flat(*flat, sm, sv, tiles, *views.maps, b1, b2, eps, bc2_sqrt.float(), step)
            at = 0
            for (i, t, _d, cm, cv) in live:
                n_i = t.hi - t.lo
                params[i].view(-1).copy_(flat[0][at:at + n_i])
                cm.copy_(flat[2][at:at + n_i])
                cv.copy_(flat[3][at:at + n_i])
                at += n_i
    _adam(views.small, params, gleaves, views.step, lr, betas, eps, weight_decay)


def compiled_update(state: Any, what: str, run: Any) -> bool:
    """The start of an optimizer's ``update``: while compiling, ``run()`` (the traced update)
    and ``True``; eagerly, ``state.step`` caught up and advanced (the compiled counter kept in
    step once a compiled update ran) and ``False``.

    Raises:
        ValueError: compiling a state that ``init`` made no views for.
    """
    if tp.compiling():
        if state.traced is None:
            raise ValueError(f"{what} under torch.compile: this state has no views for the "
                             f"compiled path; make it with opt.init before compiling")
        if state.traced.stale:  # after eager updates: go on from their count (one count on
            state.traced.step.fill_(state.step)  # every path; a graph of its own)
            state.traced.stale = False
        run()
        return True
    state.sync_step()
    state.step += 1
    if state.traced is not None:
        state.traced.stale = True  # no op here: the next compiled update catches up
    return False
