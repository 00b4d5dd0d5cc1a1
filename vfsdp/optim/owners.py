"""Optimizers whose matrices are updated whole on one owner rank, with state held there (SOAP,
Shampoo): Muon's root plan and waves (:mod:`vfsdp.optim.muon`), carrying the gradients.

Per step, for the matrices:

1. every rank's gradient shards go to the matrices' owners, one wave of same-shape matrices at
   a time (Muon's exchange: one ``all_to_all_single`` per wave), as a stack ``[B, rows,
   cols]``;
2. the owner runs the optimizer's rule on the stack with the state it holds for that wave
   (stacked the same way: moments, statistics, preconditioners), batched per shape;
3. the updates go back to the holders, which add them to their shards (multi-tensor ops).

1-D tensors are owned the same way (Shampoo: a stack ``[B, n]``), or keep their state sharded
like the parameters (SOAP: its own elementwise rule). Over HSDP each replica's shard group
does the same work.

Checkpoints: a matrix's state is a :class:`~vfsdp.collectives.Piece` of the whole tensor
on its owner and an empty piece elsewhere, so a checkpoint reloads under any world size
(the owners change; each loads what it now owns).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import Role
from vfsdp.collectives.piece import Piece
from vfsdp.functional.state import param_tree
from vfsdp.optim.base import (
    Mask,
    begin,
    decay_,
    descend_,
    flat_grads,
    frozen_of,
    grad_leaves,
    new_count,
    selected,
    state_dtype,
    unit_buffers,
)
from vfsdp.optim.muon import (
    MuonPlan,
    MuonState,
    _split,
    _whole,
    owned_matrices,
    planned_waves,
)
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["OwnedState", "init_owned", "owned_step", "begin", "apply_"]


@dataclass
class OwnedState(MuonState):
    """The step counter, the 1-D tensors' moments (``momentum``, ``second``: unit key ->
    DBuffer), and per wave the state of this rank's matrices in it (``stacks``: name ->
    ``[B, ...]``; ``B = 0`` where it owns none). ``n`` is the step on the host (the rules
    branch on it: no sync).

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(4, 6), "b": torch.ones(4)}
        ...     spec = vfsdp.plan(params, 2)
        ...     state = vfsdp.optim.soap().init(vfsdp.shard(params, spec), spec)
        ...     return [{k: tuple(v.shape) for k, v in s.items()} for s in state.stacks]
        >>> vfsdp.testing.simulate(2, body)[0]            # rank 0 owns w
        [{'exp_avg': (1, 4, 6), 'exp_avg_sq': (1, 4, 6), 'L': (1, 4, 4), 'R': (1, 6, 6), \
'QL': (1, 4, 4), 'QR': (1, 6, 6)}]
    """

    second: dict = field(default_factory=dict)
    stacks: list = field(default_factory=list)
    n: int = 0

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step, and per state name a tree shaped like the parameters: a matrix's state
        as a Piece (whole on its owner, empty elsewhere), a 1-D tensor's as its shard."""
        plan = self.plan
        units = self.kept["params"]
        writer = all(db.groups.replicate_rank == 0 for db in units.values())
        mine, shapes = {}, {}
        for wave, stacks in zip(plan.waves, self.stacks):
            for j, m in enumerate(wave.matrices):
                shapes[(m.key, m.k)] = {n: s.shape[1:] for n, s in stacks.items()}
                if j in wave.stacked:
                    at = wave.stacked.index(j)
                    mine[(m.key, m.k)] = {n: s[at] for n, s in stacks.items()}
        firsts = {"exp_avg": self.momentum, "exp_avg_sq": self.second}
        names = dict.fromkeys([*(firsts if self.momentum else ()),
                               *(n for s in shapes.values() for n in s)])

        def leaf(name: str) -> Callable:
            def pick(db, k):
                found = shapes.get((db.key, k))
                if found is None:  # a 1-D tensor, or not this optimizer's
                    vec = firsts.get(name, {}).get(db.key)
                    return vec.local(k) if vec is not None and plan.owns(db, k) else None
                if name not in found:
                    return None
                local = mine.get((db.key, k), {}).get(name)
                if local is None:
                    local = torch.empty(0, dtype=plan.dtype, device=db.device)
                st = db.tensors[k].strided  # under TP, every index holds the same: one writes
                first = st is None or st.index == 0
                return Piece(local, tuple(found[name]), 0,
                             writer=writer and first and local.numel() > 0)
            return pick

        return {"step": self.step, **{n: param_tree(units, spec, leaf(n)) for n in names}}

    def restore_checkpoint(self, tree: dict) -> OwnedState:
        self.step = self.n = tree["step"]
        return self


class Begin:
    """An owned optimizer's update under way: Muon's refusal under ``torch.compile`` (in its
    words) at once; called (``owned_step``'s ``ready``, once the inputs are checked), it
    counts the step (:func:`~vfsdp.optim.base.begin`: the ranks agree) and holds its
    learning rate in ``rate``. ``t`` is the number of updates before this one."""

    def __init__(self, what: str, state: OwnedState, schedule: Callable) -> None:
        if tp.compiling():
            raise ValueError(f"{what}.update under torch.compile is not supported yet (its "
                             f"per-tensor kernels and exchanges run eagerly); compile the "
                             f"forward and backward and call the update outside, or use "
                             f"vfsdp.optim.adamw, which compiles")
        self.state, self.schedule, self.t, self.rate = state, schedule, state.n, None

    def __call__(self) -> None:
        self.rate = begin(self.state.count, self.schedule)
        self.state.n = self.t + 1


def apply_(views: list, updates: list, size: Any, rate: Any, weight_decay: float,
           first: bool) -> None:
    """``p -= size * u`` over the lists, with decoupled weight decay (``p *= 1 - rate *
    weight_decay``) before it (``first``) or after it."""
    if first:
        decay_(views, rate, weight_decay)
    descend_(views, updates, size)
    if not first:
        decay_(views, rate, weight_decay)


def init_owned(what: str, shards, spec: ShardSpec, mask: Mask, only, wave_size: int,
               stack_state: Callable, vectors: bool) -> OwnedState:
    """The owner plan and state: the 1-D and 2-D tensors selected (by ``mask`` and ``only``)
    are the owned tensors (the "matrices"), with roots and waves as Muon plans them;
    ``stack_state(b, shape, dtype, device)`` makes a wave's stacked state; ``vectors``: 1-D
    tensors stay on their shards instead, with two sharded moments (SOAP's Adam).

    Raises:
        ValueError: a selected tensor of 3 or more dimensions, a matrix split over a model
            axis the shards' mesh lacks (naming its path and the fix).
    """
    def kind(t: TensorSpec) -> str:
        if not math.prod(t.global_shape) or not selected(mask, t.path):
            return ""
        if only is not None and not only(t.path):
            return "excluded by only="
        if len(t.shape) in (1, 2):
            return "vector" if vectors and len(t.shape) == 1 else "matrix"
        return f"{len(t.shape)}-D ({tuple(t.global_shape)})"

    for t in spec.tensors():
        why = kind(t)
        if why and why not in ("matrix", "vector") and (mask is not None or "D (" in why):
            raise ValueError(f"{what}: {format_path(t.path)} is given to {what} (its mask, "
                             f"partition label or no label) but is {why}, which it does not "
                             f"update; label it for another optimizer (e.g. adamw) with "
                             f"vfsdp.optim.partition")
    units = unit_buffers(shards, spec, f"{what}.init")
    state = OwnedState(new_count(units[0].db.device if units else "cpu"), {})
    dtype = torch.float32
    for u in units:
        if any(kind(t) in ("matrix", "vector") for t in u.db.tensors):
            dtype = torch.promote_types(dtype, state_dtype(u.db.dtype))
    found, paths, vecs = [], {}, []
    for u in units:
        mine = [(k, t) for k, t in enumerate(u.db.tensors) if kind(t) in ("matrix", "vector")]
        if not mine:
            continue
        paths[u.key] = frozenset(t.path for _, t in mine)
        found += [(u.key, k, t, u.db.rank) for k, t in mine if kind(t) == "matrix"]
        if any(kind(t) == "vector" for _, t in mine):
            state.momentum[u.key] = u.db.like(dtype, Role.STATE, "exp_avg")
            state.second[u.key] = u.db.like(dtype, Role.STATE, "exp_avg_sq")
            vecs += [(u.key, k, *t.shard_range(u.db.rank)) for k, t in mine
                     if kind(t) == "vector"]
    matrices = owned_matrices(found, spec.world_size, units, what, what)
    layout = tuple((u.key, u.db.shard.numel()) for u in units if u.key in paths)
    vecs = tuple(v for v in vecs if v[3] > v[2])
    waves, cuts, picked = planned_waves(matrices, wave_size, units[0].db.rank if units else 0,
                                        spec.world_size, layout,
                                        tuple((key, lo, hi) for key, _, lo, hi in vecs))
    state.plan = MuonPlan(paths, matrices, waves, dtype, layout, cuts)
    device = state.count.device
    state.stacks = [stack_state(len(w.stacked), tuple(w.matrices[0].spec.global_shape), dtype,
                                device) for w in waves]
    state.kept["params"] = {u.key: u.db for u in units if u.key in paths}
    state.kept["vectors"] = vecs, picked  # and their cuts of the workspace
    return state


def owned_step(what: str, grads, state: OwnedState, shards, spec: ShardSpec,
               rule: Callable, back: bool, ready: Callable = lambda: None) -> tuple:
    """One exchange of the gradients to the owners, ``rule(w, stack)`` (wave ``w``'s
    gradients ``[B, rows, cols]`` on this rank, its updates returned), and, where ``back``,
    the updates' exchange back. ``ready()`` runs once the inputs are checked, before any
    write (:func:`~vfsdp.optim.base.begin`).

    Returns:
        ``(views, updates, vectors)``: the parameter slices the updates go to and the update
            pieces (the matrices), and ``(params, grads, m, v)`` lists of the 1-D tensors'
            shard pieces.

    Raises:
        ValueError: a frozen tensor (its path and the fix), or a gradient that does not fit.
    """
    plan = state.plan
    units = {u.key: u for u in unit_buffers(shards, spec, f"{what}.update")
             if u.key in plan.paths}
    for key, u in units.items():
        for k in frozen_of(u, plan.paths[key]):
            raise ValueError(f"{what}: {format_path(u.db.tensors[k].path)} is frozen "
                             f"(requires_grad=False); {what} keeps its statistics on an owner "
                             f"rank and does not skip frozen tensors: label it for no "
                             f"optimizer, or for adamw, with vfsdp.optim.partition")
    leaves = grad_leaves(grads, spec, f"{what}.update")
    gflat = {key: flat_grads(leaves, units[key], f"{what}.update", plan.dtype)
             for key, _ in plan.units}
    ready()
    if not plan.units:
        return [], [], ([], [], [], [])
    work = torch.cat([gflat[key] for key, _ in plan.units])
    pieces = work.split_with_sizes(plan.cuts)
    vecs, cuts = state.kept["vectors"]
    shards = {key: u.db.shard for key, u in units.items()}
    found = state.kept.get("vector views")
    if found is None or any(found[0].get(k) is not x for k, x in shards.items()):
        # made once: the shards are fixed tensors
        found = state.kept["vector views"] = (shards, *(
            [bufs[key][lo:hi] for key, _, lo, hi in vecs]
            for bufs in (shards, *({k: b.shard for k, b in d.items()}
                                   for d in (state.momentum, state.second)))))
    ps, ms, vs = found[1:]
    vectors = (ps, [pieces[i] for i in cuts], ms, vs)
    targets, updates = [], []
    groups = next(iter(units.values())).db.groups
    for w, wave in enumerate(plan.waves):
        recv = wave.to_roots.exchange(_cat([pieces[i] for i in wave.send], work), groups.shard)
        out = work.new_empty(0)
        if wave.stacked:
            got = recv.split_with_sizes(wave.pieces)
            m = wave.matrices[wave.stacked[0]]
            g = _cat([got[c] for c in wave.order], work).view(len(wave.stacked), *m.spec.shape)
            o = rule(w, _whole(g, m, groups.model) if _split(m) else g)
            if back and _split(m):  # this index's piece of the global updates
                st = m.spec.strided
                o = o.narrow(st.dim + 1, st.start, st.lengths[st.index])
            if back:
                cut = o.reshape(-1).split_with_sizes(wave.out_cuts)
                out = _cat([cut[c] for c in wave.out_send], work)
        if back:
            got = wave.from_roots.exchange(out, groups.shard).split_with_sizes(wave.back)
            for (j, lo, hi), piece in zip(wave.targets, got):
                targets.append((wave.matrices[j], lo, hi))
                updates.append(piece)
    return state.views(units, targets), updates, vectors


def _cat(parts: list, like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)
