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
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import DBuffer, Role
from vfsdp.functional.state import param_tree
from vfsdp.optim.base import (
    Mask,
    Optimizer,
    Schedule,
    adamw_step,
    as_schedule,
    both,
    check_hyper,
    flat_grads,
    frozen_of,
    grad_leaves,
    learning_rate,
    new_count,
    read_step,
    runs,
    same_at_ties,
    selected,
    state_dtype,
    sync_step,
    unit_buffers,
    use_fused,
    write_step,
)
from vfsdp.optim.traced import TracedAdam, adam_views, traced_adamw
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec

__all__ = ["adamw", "AdamWState", "AdamWPlan", "StepSlices", "segments", "owned_views",
           "trainable_runs"]


@dataclass(frozen=True)
class AdamWPlan:
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

    paths: Mapping[Any, frozenset] = field(default_factory=dict)
    update_runs: Mapping[Any, tuple] = field(default_factory=dict)
    decay_runs: Mapping[Any, tuple] = field(default_factory=dict)

    def owns(self, db: DBuffer, k: int) -> bool:
        """Whether the plan updates tensor ``k`` of ``db``'s unit."""
        return db.tensors[k].path in self.paths.get(db.key, ())


def segments(update_runs: tuple, decay_runs: tuple) -> tuple[tuple[int, int, bool], ...]:
    """The update runs cut where decay starts or stops: ``(lo, hi, decays)`` each.

    Example:
        >>> segments(((0, 10), (12, 20)), ((4, 10), (12, 14)))
        ((0, 4, False), (4, 10, True), (12, 14, True), (14, 20, False))
    """
    cuts = sorted({x for run in decay_runs for x in run})
    out = []
    for lo, hi in update_runs:
        edges = [lo, *(c for c in cuts if lo < c < hi), hi]
        for a, b in itertools.pairwise(edges):
            out.append((a, b, any(d0 <= a and b <= d1 for d0, d1 in decay_runs)))
    return tuple(out)


class StepSlices:
    """The flat operands of each step, made once per unit and kept (the parameter and moment
    shards are fixed tensors, so their views are too).

    A unit whose every tensor is updated is one slice per operand, padding included: padding
    is zero in the parameters, gradients and moments alike, and AdamW keeps it zero. A mask
    or frozen tensors cut it into the updated ranges. Gradient slices are taken each step
    and never kept: a kept view would hold the gradient buffer's memory after
    ``zero_grads(set_to_none=True)``.
    """

    def __init__(self) -> None:
        self._units: dict = {}
        self._steps: dict = {}

    def add(self, ops: tuple, u, g: torch.Tensor, state, update_runs: tuple, decay_runs: tuple,
            fused: bool) -> None:
        """Append unit ``u``'s slices to ``ops = (ps, gs, ms, vs, decay, flags)``; ``fused``:
        for the fused kernel, which takes weight decay per slice, not per range."""
        key = (update_runs, decay_runs, fused)
        found = self._units.get(u.key)
        # Another shards tree for the same spec has other buffers: never reuse its slices.
        if found is None or found[0] != key or found[1] is not u.db.shard:
            found = self._units[u.key] = (key, u.db.shard, self._make(
                u, state, update_runs, decay_runs, fused))
        (whole, cuts, ps, ms, vs, decay, flags) = found[2]
        ops[0].extend(ps)
        if whole:
            ops[1].append(g)
        else:  # one op cuts the whole shard (gaps included); keep the updated pieces
            sizes, keep = cuts
            pieces = g.split_with_sizes(sizes)
            ops[1].extend(pieces[i] for i in keep)
        ops[2].extend(ms)
        ops[3].extend(vs)
        ops[4].extend(decay)
        ops[5].extend(flags)

    @staticmethod
    def _make(u, state, update_runs, decay_runs, fused) -> tuple:
        p = u.db.shard
        m, v = state.exp_avg[u.key].shard, state.exp_avg_sq[u.key].shard
        every = runs(u.db, None)
        partial_decay = decay_runs not in ((), every)
        if update_runs == every and not (fused and partial_decay):
            decay = [p[lo:hi] for lo, hi in decay_runs] if partial_decay else (
                [p] if decay_runs else [])
            return True, (), [p], [m], [v], decay, [bool(decay_runs)]
        cut = segments(update_runs, decay_runs)
        ps = [p[lo:hi] for lo, hi, _ in cut]
        sizes, keep, end = [], [], 0
        for lo, hi, _ in cut:
            if lo > end:
                sizes.append(lo - end)
            keep.append(len(sizes))
            sizes.append(hi - lo)
            end = hi
        if end < p.numel():
            sizes.append(p.numel() - end)
        return (False, (tuple(sizes), tuple(keep)), ps,
                [m[lo:hi] for lo, hi, _ in cut], [v[lo:hi] for lo, hi, _ in cut],
                [x for x, (_, _, d) in zip(ps, cut) if d], [d for _, _, d in cut])


@dataclass
class AdamWState:
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

    count: torch.Tensor
    exp_avg: dict
    exp_avg_sq: dict
    plan: AdamWPlan = field(default_factory=AdamWPlan, repr=False, compare=False)
    slices: StepSlices = field(default_factory=StepSlices, repr=False, compare=False)
    traced: Optional[TracedAdam] = field(default=None, repr=False, compare=False)

    step = property(read_step, write_step, doc=read_step.__doc__)
    sync_step = sync_step

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step, and the moments of the tensors it updates, shaped like the parameters."""
        keep = owned_views(self.plan)
        return {"step": self.step, "exp_avg": param_tree(self.exp_avg, spec, keep),
                "exp_avg_sq": param_tree(self.exp_avg_sq, spec, keep)}

    def restore_checkpoint(self, tree: dict) -> AdamWState:
        self.step = tree["step"]
        return self


def trainable_runs(u, plan, weight_decay_mask: Mask) -> tuple[tuple, tuple]:
    """``(update runs, decay runs)`` of unit ``u`` for the tensors the plan owns whose shards
    require grad now: a frozen tensor (``requires_grad=False``) gets no update and no decay,
    as ``torch.optim`` skips a parameter without a gradient."""
    owned = plan.paths[u.key]
    frozen = frozen_of(u, owned)
    if not frozen:
        return plan.update_runs[u.key], plan.decay_runs[u.key]
    gone = {u.db.tensors[k].path for k in frozen}
    live = lambda path: path in owned and path not in gone
    return runs(u.db, live), runs(u.db, both(weight_decay_mask, live))


def owned_views(plan) -> Callable:
    """A ``param_tree`` leaf rule: tensor ``k``'s local view when ``plan.owns`` it."""
    return lambda db, k: db.local(k) if plan.owns(db, k) else None


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
        same_at_ties(mask and (lambda p: selected(mask, p)), spec, "adamw.init", "mask")
        same_at_ties(weight_decay_mask and (lambda p: selected(weight_decay_mask, p)), spec,
                     "adamw.init", "weight_decay_mask")
        units = unit_buffers(shards, spec, "adamw.init")
        state = AdamWState(new_count(units[0].db.device if units else "cpu"), {}, {})
        update_runs, decay_runs, paths = {}, {}, {}
        for u in units:
            chosen = tuple(t.path for t in u.db.tensors if selected(mask, t.path))
            if not chosen:
                continue  # nothing of this unit is ours: no state for it
            sdt = state_dtype(u.db.dtype)  # float32, or float64 for float64 parameters
            if fused:
                use_fused(True, u.db.device, {u.db.dtype, sdt}, format_path(chosen[0]))
            state.exp_avg[u.key] = u.db.like(sdt, Role.STATE, "exp_avg")
            state.exp_avg_sq[u.key] = u.db.like(sdt, Role.STATE, "exp_avg_sq")
            update_runs[u.key] = runs(u.db, mask)
            decay_runs[u.key] = runs(u.db, both(weight_decay_mask, mask))
            paths[u.key] = frozenset(chosen)
        state.plan = AdamWPlan(paths, update_runs, decay_runs)
        # What a compiled update reads (vfsdp.optim.traced).
        state.traced = adam_views(units, state, lambda p: selected(mask, p),
                                  lambda p: selected(weight_decay_mask, p))
        return state

    def update(grads: Any, state: AdamWState, shards: Any, spec: ShardSpec) -> AdamWState:
        state.count.add_(1)
        rate = learning_rate(schedule, state.count)
        if tp.compiling():
            traced_adamw(grads, state, shards, spec, rate, betas, eps, weight_decay)
            return state
        leaves = grad_leaves(grads, spec, "adamw.update")
        groups: dict = {}  # (device, param dtype, fused) -> the operand lists of the step
        with torch.no_grad():
            for u in unit_buffers(shards, spec, "adamw.update"):
                if u.key not in state.exp_avg:
                    continue
                update_runs, decay_runs = trainable_runs(u, state.plan, weight_decay_mask)
                if not update_runs:
                    continue  # every tensor of ours here is frozen
                m = state.exp_avg[u.key].shard
                g = flat_grads(leaves, u, "adamw.update", m.dtype)
                on = use_fused(fused, m.device, {u.db.dtype, g.dtype, m.dtype})
                ops = groups.setdefault((m.device, u.db.dtype, on), ([], [], [], [], [], []))
                state.slices.add(ops, u, g, state, update_runs, decay_runs, on)
            for (_, _, on), (ps, gs, ms, vs, decay, flags) in groups.items():
                adamw_step(ps, gs, ms, vs, flags if on else decay, count=state.count, lr=rate,
                           betas=betas, eps=eps, weight_decay=weight_decay, fused=on)
        return state

    return Optimizer(init, update, local_state=True)
