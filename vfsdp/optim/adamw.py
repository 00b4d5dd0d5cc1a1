"""AdamW over flat DBuffers: a constant number of multi-tensor ops per step.

The state (``exp_avg``, ``exp_avg_sq``) lives in DBuffers with the parameters' layout, so a
step is PyTorch's AdamW applied to every unit's whole ``S``-element shard at once, as
multi-tensor ops over the list of shards (:mod:`vfsdp.optim.base`)::

    p.mul_(1 - lr * wd)                       # only over tensors that decay
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.addcdiv_(m, (v.sqrt() / sqrt(1 - b2**t)).add_(eps), value=-lr / (1 - b1**t))

with ``t`` the state's step counter, a tensor (``state.count``) the update adds one to and
takes the scalars from on the device. Bitwise equal to ``torch.optim.AdamW()`` (foreach
path, the default off CUDA; on a GPU the step size divides the denominator first, as
``capturable=True`` does) or to ``torch.optim.AdamW(fused=True)`` (fused path, the default on
CUDA). Padding stays zero: its gradient, moments and parameters are all zero.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import Role
from vfsdp.optim.base import (
    CountedState,
    Mask,
    Optimizer,
    OwnedPlan,
    Schedule,
    adamw_step,
    as_schedule,
    atomic,
    begin,
    both,
    check_hyper,
    cuts_of,
    flat_grads,
    grad_leaves,
    init_units,
    pieces_of,
    runs,
    selected,
    state_dtype,
    trained,
    use_fused,
)
from vfsdp.optim.traced import adam_views, traced_adamw
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec


@dataclass(frozen=True)
class AdamWPlan(OwnedPlan):
    """What ``init`` derives from the spec and the mask, per unit it updates: the tensors
    (``paths``), their flat ranges in this rank's shard (``update_runs``) and the ranges that
    decay (``decay_runs``). Never saved; ``init`` rebuilds it under any plan.

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(6), "b": torch.zeros(2)}
        ...     spec = vfsdp.plan(params, 2)
        ...     opt = vfsdp.optim.adamw(weight_decay_mask=lambda path: path != ("b",))
        ...     plan = opt.init(vfsdp.shard(params, spec), spec).plan
        ...     return plan.update_runs[()], plan.decay_runs[()]
        >>> vfsdp.testing.simulate(2, body)      # rank 0 holds b (no decay), then w[:2]
        [(((0, 4),), ((2, 4),)), (((0, 4),), ((0, 4),))]
    """

    update_runs: Mapping[Any, tuple] = field(default_factory=dict)
    decay_runs: Mapping[Any, tuple] = field(default_factory=dict)


def masked_plan(units: list, mask: Mask, decay_mask: Mask) -> AdamWPlan:
    """The :class:`AdamWPlan` of ``units`` (:func:`~vfsdp.optim.base.unit_buffers`) for the
    tensors ``mask`` selects, those ``decay_mask`` selects too taking weight decay; a unit
    holding none of them is not in it."""
    mine = [u for u in units if any(selected(mask, t.path) for t in u.db.tensors)]
    return AdamWPlan({u.key: frozenset(t.path for t in u.db.tensors if selected(mask, t.path))
                      for u in mine}, {u.key: runs(u.db, mask) for u in mine},
                     {u.key: runs(u.db, both(decay_mask, mask)) for u in mine})


def segments(update_runs: tuple, decay_runs: tuple) -> tuple[tuple[int, int, bool], ...]:
    """The update runs cut where decay starts or stops: ``(lo, hi, decays)`` each.

    Example:
        >>> segments(((0, 10), (12, 20)), ((4, 10), (12, 14)))
        ((0, 4, False), (4, 10, True), (12, 14, True), (14, 20, False))
    """
    cuts = sorted({x for run in decay_runs for x in run})
    return tuple((a, b, any(d0 <= a and b <= d1 for d0, d1 in decay_runs))
                 for lo, hi in update_runs
                 for a, b in itertools.pairwise([lo, *(c for c in cuts if lo < c < hi), hi]))


def _slices(u, state, update_runs: tuple, decay_runs: tuple, fused: bool) -> tuple:
    """Unit ``u``'s flat operands of a step: ``(gradient cuts, ps, ms, vs, decay, flags)``,
    made once and kept (the parameter and moment shards are fixed tensors, so their views are
    too); ``fused``: for the fused kernel, which takes weight decay per slice, not per range.

    A unit whose every tensor is updated is one slice per operand, padding included: padding
    is zero in the parameters, gradients and moments alike, and AdamW keeps it zero (gradient
    cuts ``None``). A mask or frozen tensors cut it into the updated ranges: the gradient is
    then cut by one op (``(sizes, indices of the updated pieces)``), each step; gradient
    slices are never kept: a kept view would hold the gradient buffer's memory after
    ``zero_grads(set_to_none=True)``.
    """
    p = u.db.shard
    m, v = state.exp_avg[u.key].shard, state.exp_avg_sq[u.key].shard
    every = runs(u.db, None)
    if update_runs == every and not (fused and decay_runs not in ((), every)):
        decay = [p] if decay_runs == every else [p[lo:hi] for lo, hi in decay_runs]
        return None, [p], [m], [v], decay, [bool(decay_runs)]
    cut = segments(update_runs, decay_runs)
    ps, ms, vs = ([x[lo:hi] for lo, hi, _ in cut] for x in (p, m, v))
    return (cuts_of([(lo, hi) for lo, hi, _ in cut], p.numel()), ps, ms, vs,
            [x for x, (_, _, d) in zip(ps, cut) if d], [d for _, _, d in cut])


@dataclass
class AdamWState(CountedState):
    """The step counter (:func:`~vfsdp.optim.base.new_count`) and, per unit it updates, the
    moment DBuffers (the parameters' layout).

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     state = vfsdp.optim.adamw().init(vfsdp.shard({"w": torch.ones(8)}, spec), spec)
        ...     return state.step, state.checkpoint_tree(spec)["exp_avg"]["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)      # zero moments, shaped like each shard
        [(0, [0.0, 0.0, 0.0, 0.0]), (0, [0.0, 0.0, 0.0, 0.0])]
    """

    exp_avg: dict
    exp_avg_sq: dict
    traced: Optional[list] = field(default=None, repr=False, compare=False)  # adam_views
    saved: ClassVar[tuple] = ("exp_avg", "exp_avg_sq")


def trainable_runs(u, plan, frozen: frozenset, weight_decay_mask: Mask) -> tuple[tuple, tuple]:
    """``(update runs, decay runs)`` of unit ``u`` for the tensors the plan owns whose shards
    require grad now: a frozen tensor (``requires_grad=False``) gets no update and no decay,
    as ``torch.optim`` skips a parameter without a gradient."""
    if not frozen:
        return plan.update_runs[u.key], plan.decay_runs[u.key]
    live = (plan.paths[u.key] - {u.db.tensors[k].path for k in frozen}).__contains__
    return runs(u.db, live), runs(u.db, both(weight_decay_mask, live))


def adamw(
    lr: Schedule = 1e-3,
    betas: tuple = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    weight_decay_mask: Optional[Callable[[tuple], bool]] = None,
    fused: Optional[bool] = None,
) -> Optimizer:
    """AdamW (decoupled weight decay): a constant number of multi-tensor ops per step over
    every unit's flat shard (:mod:`vfsdp.optim.base`).

    Args:
        lr: A float or a schedule ``step -> lr`` (steps count from 1).
        betas: ``(beta1, beta2)``.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay.
        weight_decay_mask: ``path -> bool``; tensors for which it is false (e.g. norms and
            biases) take no weight decay. Default: every tensor decays.
        fused: ``None`` (default): torch's fused AdamW kernel on CUDA where parameters,
            gradients and moments share a dtype (fp32 master shards), bitwise equal to
            ``torch.optim.AdamW(fused=True)``; elsewhere ``torch._foreach_*`` ops, bitwise
            equal to ``torch.optim.AdamW()``. ``True``/``False`` force one path.

    Returns:
        An :class:`vfsdp.optim.Optimizer`.

    Raises:
        ValueError: a negative learning rate, ``eps`` or weight decay, or betas outside [0, 1);
            from ``init``, ``fused=True`` for parameters whose dtype is not the state's
            (e.g. bf16 parameters with fp32 moments), naming the tensor.

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     opt = vfsdp.optim.adamw(lr=0.1, weight_decay=0.0)
        ...     state = opt.init(shards, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...     state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        ...     return [round(x, 4) for x in shards["w"].tolist()], state.step
        >>> vfsdp.testing.simulate(2, body)
        [([0.9, 0.9, 0.9, 0.9], 1), ([0.9, 0.9, 0.9, 0.9], 1)]
    """
    check_hyper("adamw", lr, weight_decay, betas=betas, eps=eps)
    schedule = as_schedule(lr)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> AdamWState:
        units, count = init_units(shards, spec, "adamw.init", mask=mask,
                                  weight_decay_mask=weight_decay_mask)
        state = AdamWState(count, {}, {}, plan=masked_plan(units, mask, weight_decay_mask))
        for u in [u for u in units if u.key in state.plan.paths]:  # no state for the others
            sdt = state_dtype(u.db.dtype)  # float32, or float64 for float64 parameters
            if fused:
                use_fused(True, u.db.device, {u.db.dtype, sdt}, format_path(next(
                    t.path for t in u.db.tensors if selected(mask, t.path))))
            state.exp_avg[u.key] = u.db.like(sdt, Role.STATE, "exp_avg")
            state.exp_avg_sq[u.key] = u.db.like(sdt, Role.STATE, "exp_avg_sq")
        # What a compiled update reads (vfsdp.optim.traced).
        state.traced = adam_views(units, state, lambda p: selected(mask, p),
                                  lambda p: selected(weight_decay_mask, p))
        return state

    def update(grads: Any, state: AdamWState, shards: Any, spec: ShardSpec) -> AdamWState:
        if tp.compiling():
            traced_adamw(grads, state, shards, spec, begin(state.count, schedule), betas, eps, weight_decay)
            return state
        leaves = grad_leaves(grads, spec, "adamw.update")
        groups: dict = {}  # (device, param dtype, fused) -> the operand lists of the step
        with torch.no_grad():
            for u, frozen in trained(shards, spec, state.plan, "adamw.update"):
                update_runs, decay_runs = trainable_runs(u, state.plan, frozen, weight_decay_mask)
                if not update_runs:
                    continue  # no element of ours here
                m = state.exp_avg[u.key].shard
                g = flat_grads(leaves, u, "adamw.update", m.dtype)
                on = use_fused(fused, m.device, {u.db.dtype, g.dtype, m.dtype})
                cuts, ps, ms, vs, decay, flags = state.cached(
                    (u.key, update_runs, decay_runs, on), (u.db.shard,),
                    lambda: _slices(u, state, update_runs, decay_runs, on))
                ops = groups.setdefault((m.device, u.db.dtype, on), ([], [], [], [], [], []))
                # one op cuts the whole shard (gaps included)
                for acc, xs in zip(ops, (ps, pieces_of(g, cuts), ms, vs, decay, flags)):
                    acc.extend(xs)
            rate = begin(state.count, schedule)  # the checks are done: nothing written yet
            for (_, _, on), (ps, gs, ms, vs, decay, flags) in groups.items():
                adamw_step(ps, gs, ms, vs, flags if on else decay, count=state.count, lr=rate,
                           betas=betas, eps=eps, weight_decay=weight_decay, fused=on)
        return state

    return Optimizer(init, atomic(update), local_state=True)
