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

Under ``torch.compile`` the same step is traced: the gradients are laid out in the same
workspace from the ``.grad`` leaves (:class:`TracedOwned`, made by ``init``), the exchanges are
functional ``all_to_all_single`` collectives over the same wave plans, and the rules branch on
the step counter (a tensor) with :func:`branch` (``torch.cond``), never reading it back.

Checkpoints: a matrix's state is a :class:`~vfsdp.collectives.Piece` of the whole tensor
on its owner and an empty piece elsewhere, so a checkpoint reloads under any world size
(the owners change; each loads what it now owns).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import Role
from vfsdp.collectives.piece import Piece
from vfsdp.collectives.unit import group_name
from vfsdp.functional.state import param_tree
from vfsdp.functional.traced import traced_leaves
from vfsdp.optim.base import Mask, begin, decay_, descend_
from vfsdp.optim.muon import (
    MuonState,
    _split,
    eager_grads,
    init_owned_plan,
    owned_kind,
    refuse_compiled,
    run_waves,
)
from vfsdp.optim.traced import first_leaves
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["OwnedState", "init_owned", "owned_step", "begin", "apply_", "branch_", "TracedOwned"]


@dataclass
class OwnedState(MuonState):
    """The step counter, the 1-D tensors' moments (``momentum``, ``second``: unit key ->
    DBuffer), and per wave the state of this rank's matrices in it (``stacks``: name ->
    ``[B, ...]``; ``B = 0`` where it owns none). ``seen``: the counter, its version and its
    value on the host after the last eager update, so that an eager update branches on the
    step without reading the counter back (it reads it once after anything else changed it:
    a compiled update, a checkpoint load, ``state.step = n``).

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
    seen: Optional[tuple] = field(default=None, repr=False, compare=False)

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
        self.step = tree["step"]
        return self


class Begin:
    """An owned optimizer's update under way; called (``owned_step``'s ``ready``, once the
    inputs are checked), it counts the step (:func:`~vfsdp.optim.base.begin`: the ranks
    agree) and holds its learning rate in ``rate``. ``t`` is the number of updates before
    this one: eagerly an int, known at once (:attr:`OwnedState.seen`, or the counter read
    back); compiled, the counter (a 0-d tensor, ``None`` until called)."""

    def __init__(self, state: OwnedState, schedule: Callable) -> None:
        self.state, self.schedule, self.rate, self.t = state, schedule, None, None
        if not tp.compiling():
            count, version, n = state.seen or (None, -1, 0)
            same = count is state.count and version == tp.version(count)
            self.t = n if same else state.step

    def __call__(self) -> None:
        count = self.state.count
        self.rate = begin(count, self.schedule)
        if tp.compiling():
            self.t = count.reshape(()) - 1
            self.state.seen = None  # the next eager update reads the counter back once
        else:
            self.state.seen = (count, tp.version(count), self.t + 1)


def branch_(pred: Any, fn: Callable, args: tuple, state: tuple) -> None:
    """``state = fn(*args, *state)`` in place (copied into the state's storages) where
    ``pred`` holds: a Python ``if`` eagerly (``pred`` a bool); compiled (``pred`` a 0-d bool
    tensor: the counter is not read back), ``torch.cond``, whose branches return new
    contiguous tensors.

    Example:
        >>> x = torch.zeros(1)
        >>> branch_(False, lambda step, x: (x + step,), (torch.ones(1),), (x,))
        >>> branch_(True, lambda step, x: (x + step,), (torch.ones(1),), (x,))
        >>> x
        tensor([1.])
    """
    if not isinstance(pred, torch.Tensor):
        new = fn(*args, *state) if pred else state
    else:
        n = len(args)
        new = torch.cond(pred, lambda *xs: tuple(y.contiguous() for y in fn(*xs)),
                         lambda *xs: tuple(x.clone() for x in xs[n:]), (*args, *state))
    for x, y in zip(state, new):
        if x is not y:
            x.copy_(y)


def apply_(views: list, updates: list, size: Any, rate: Any, weight_decay: float,
           first: bool) -> None:
    """``p -= size * u`` over the lists, with decoupled weight decay (``p *= 1 - rate *
    weight_decay``) before it (``first``) or after it."""
    if first:
        decay_(views, rate, weight_decay)
    descend_(views, updates, size)
    if not first:
        decay_(views, rate, weight_decay)


@dataclass(frozen=True)
class TracedOwned:
    """What a compiled update reads, made by ``init`` (eager).

    Attributes:
        group: The shard group's name (the functional collectives').
        pieces: ``(leaf, lo, hi)`` of each tensor it updates with a piece here: the
            gradient's place in the workspace (the units' shards end to end).
        leaf: ``(unit key, buffer index) -> leaf index`` of every tensor it updates.
        owned: ``(leaf, path)`` of every tensor it updates (the frozen check).
        vectors: The leaves of the 1-D tensors kept on their shards (SOAP), and their
            moments' slices ``(m, v)``.
        split: Whether a matrix is split over a model axis (not compiled).
    """

    group: str
    pieces: tuple
    leaf: dict
    owned: tuple
    vectors: tuple
    split: bool


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
    def refuse(t: TensorSpec, why: str) -> None:
        if why not in ("", "matrix", "vector") and (mask is not None or "D (" in why):
            raise ValueError(f"{what}: {format_path(t.path)} is given to {what} (its mask, "
                             f"partition label or no label) but is {why}, which it does not "
                             f"update; label it for another optimizer (e.g. adamw) with "
                             f"vfsdp.optim.partition")

    kind = owned_kind(mask, only, lambda t: (
        ("vector" if vectors and len(t.shape) == 1 else "matrix") if len(t.shape) in (1, 2)
        else f"{len(t.shape)}-D ({tuple(t.global_shape)})"))
    state, units, owned, vecs, picked = init_owned_plan(OwnedState, what, what, shards, spec,
                                                        mask, kind, refuse, wave_size)
    plan, device = state.plan, state.count.device
    for u in units:
        if any(kind(t) == "vector" for _, t in owned.get(u.key, ())):
            state.momentum[u.key] = u.db.like(plan.dtype, Role.STATE, "exp_avg")
            state.second[u.key] = u.db.like(plan.dtype, Role.STATE, "exp_avg_sq")
    state.stacks = [stack_state(len(w.stacked), tuple(w.matrices[0].spec.global_shape),
                                plan.dtype, device) for w in plan.waves]
    state.kept["params"] = {u.key: u.db for u in units if u.key in owned}
    state.kept["vectors"] = vecs, picked  # and their cuts of the workspace
    leaf, paths, pieces = {}, [], []
    base = dict(zip(owned, itertools.accumulate((n for _, n in plan.units), initial=0)))
    for u in units:
        mine = dict(owned.get(u.key, ()))
        for k, i in first_leaves(u).items():
            if k in mine:
                leaf[(u.key, k)] = i
                paths.append((i, mine[k].path))
                lo, hi = mine[k].shard_range(u.db.rank)
                if hi > lo:
                    pieces.append((i, base[u.key] + lo, base[u.key] + hi))
    shard = units[0].db.groups.shard if units else None
    state.kept["traced"] = TracedOwned(  # no group: shards made without a process group
        group_name(shard) if shard is not None or dist.is_initialized() else "",
        tuple(pieces),
        leaf, tuple(paths),
        (tuple(leaf[(key, k)] for key, k, _, _ in vecs),
         tuple([d[key].shard[lo:hi] for key, _, lo, hi in vecs]
               for d in (state.momentum, state.second))),
        any(_split(m) for m in plan.matrices))
    return state


def owned_step(what: str, grads, state: OwnedState, shards, spec: ShardSpec,
               rule: Callable, back: bool, ready: Callable = lambda: None) -> tuple:
    """One exchange of the gradients to the owners, ``rule(w, stack)`` (wave ``w``'s
    gradients ``[B, rows, cols]`` on this rank, its updates returned), and, where ``back``,
    the updates' exchange back. ``ready()`` runs once the inputs are checked, before any
    write (:func:`~vfsdp.optim.base.begin`). Compiled, the same over functional collectives
    (see the module).

    Returns:
        ``(views, updates, vectors)``: the parameter slices the updates go to and the update
            pieces (the matrices), and ``(params, grads, m, v)`` lists of the 1-D tensors'
            shard pieces.

    Raises:
        ValueError: a frozen tensor (its path and the fix), or a gradient that does not fit;
            compiled, a matrix split over a model axis (:func:`~vfsdp.optim.muon.refuse_compiled`).
    """
    inputs = (_traced_inputs if tp.compiling() else _eager_inputs)(what, grads, state, shards,
                                                                  spec, ready)
    if inputs is None:
        return [], [], ([], [], [], [])
    work, send, model, views_of, (ps, ms, vs) = inputs
    plan = state.plan
    pieces = work.split_with_sizes(plan.cuts)
    vectors = (ps, [pieces[i] for i in state.kept["vectors"][1]], ms, vs)
    targets, updates = run_waves(plan, pieces, work, send, rule, model, back)
    return views_of(targets), updates, vectors


def _frozen(what: str, path: tuple) -> NoReturn:
    raise ValueError(f"{what}: {format_path(path)} is frozen (requires_grad=False); {what} "
                     f"keeps its statistics on an owner rank and does not skip frozen "
                     f"tensors: label it for no optimizer, or for adamw, with "
                     f"vfsdp.optim.partition")


def _eager_inputs(what: str, grads, state: OwnedState, shards, spec: ShardSpec,
                  ready: Callable) -> Any:
    """``(workspace, send, model group, views, (params, m, v) of the vectors)`` eagerly: the
    gradients in the units' flat layout, DBuffer slices, eager collectives; ``None`` when
    there is nothing to update."""
    plan = state.plan
    units, gflat, frozen = eager_grads(what, grads, state, shards, spec)
    for key, k in frozen:
        _frozen(what, units[key].db.tensors[k].path)
    ready()
    if not plan.units:
        return None
    work = torch.cat([gflat[key] for key, _ in plan.units])
    vecs, _ = state.kept["vectors"]
    shards = {key: u.db.shard for key, u in units.items()}
    found = state.kept.get("vector views")
    if found is None or any(found[0].get(k) is not x for k, x in shards.items()):
        # made once: the shards are fixed tensors
        found = state.kept["vector views"] = (shards, *(
            [bufs[key][lo:hi] for key, _, lo, hi in vecs]
            for bufs in (shards, *({k: b.shard for k, b in d.items()}
                                   for d in (state.momentum, state.second)))))
    groups = next(iter(units.values())).db.groups
    return (work, lambda r, x: r.exchange(x, groups.shard, async_op=True).wait, groups.model,
            lambda targets: state.views(units, targets), found[1:])


def _traced_inputs(what: str, grads, state: OwnedState, shards, spec: ShardSpec,
                   ready: Callable) -> Any:
    """:func:`_eager_inputs` while compiling: the workspace laid out from the gradient leaves
    (zeros between the pieces), functional ``all_to_all_single`` exchanges, the parameter
    leaves' slices (:class:`TracedOwned`)."""
    plan, rec = state.plan, state.kept["traced"]
    if rec.split:
        refuse_compiled(what, "a matrix split over a model axis is gathered eagerly")
    params, _ = traced_leaves(shards, spec, f"{what}.update")
    gleaves, _ = traced_leaves(grads, spec, f"{what}.update")
    for i, path in rec.owned:
        if not params[i].requires_grad:
            _frozen(what, path)
    ready()
    if not plan.units:
        return None
    work = state.count.new_zeros(sum(n for _, n in plan.units), dtype=plan.dtype)
    for i, lo, hi in rec.pieces:  # zeros between the pieces
        work[lo:hi] = gleaves[i].reshape(-1)

    def send(r, x):
        y = x if r.world == 1 else tp.traced_all_to_all(x, r.recv_sizes, r.send_sizes, rec.group)
        return lambda: y

    vector_leaves, (ms, vs) = rec.vectors
    return (work, send, None,
            lambda targets: [params[rec.leaf[(m.key, m.k)]].view(-1)[lo:hi]
                             for m, lo, hi in targets],
            ([params[i].view(-1) for i in vector_leaves], list(ms), list(vs)))

