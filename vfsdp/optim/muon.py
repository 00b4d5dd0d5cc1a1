"""Distributed Muon: Newton-Schulz once per matrix, on a load-balanced root rank, batched by
shape.

Per step, for every 2-D matrix the optimizer owns (ops that grow with the number of distinct
shapes, not of matrices; the waves' plans: **Waves** below):

1. momentum (Nesterov), multi-tensor ops over every unit's whole shard:
   ``b.lerp_(g, 1 - mu)``, then ``u = g.lerp(b, mu)`` into one flat workspace (the units'
   shards end to end; only the matrices' elements are read);
2. the full ``u`` is gathered on the matrix's **root**, one wave of same-shape matrices at a
   time: a ``split`` and a ``cat`` of the workspace, one ``all_to_all_single`` with uneven
   splits (counted with the other collectives), a ``split`` and a ``cat`` into a stack
   ``[B, rows, cols]`` of the root's matrices;
3. the root runs Newton-Schulz on the stack (5 quintic steps, coefficients (3.4445, -4.7750,
   2.0315), bf16, batched matmuls, tall matrices transposed) and scales the result: each
   matrix bitwise as alone;
4. the updates go back to the holders with the reverse exchange, laid out the same way;
5. ``p.mul_(1 - lr * wd)``, ``p.add_(update, alpha=-lr)`` on the shard, two multi-tensor
   ops over every matrix.

Roots come from a deterministic LPT plan (:func:`plan_roots`): matrices by Newton-Schulz cost
``rows * cols * min(rows, cols)`` descending, each to the least-loaded rank, ties to the rank
that holds most of it. The next wave's gather is in flight while the current wave's
Newton-Schulz runs. Over HSDP the shard group does this once per replica.

Tensor parallelism (a ``vfsdp.plan(..., tp=rule)`` spec): Muon orthogonalises the **global**
matrix, not a TP piece. Roots are then planned on global shapes alone, so a matrix has the same
root on every index of the model axis; each root gathers the pieces over that axis (one
all-gather per wave, of every such matrix the rank is root of), runs Newton-Schulz on the
whole matrix and keeps its own piece. Every index computes the same result (the model axis'
ranks repeat the Newton-Schulz work rather than exchange it again). The model axis' group
comes from the mesh the shards were made on (``vfsdp.shard(params, spec, mesh=mesh)``).

**Waves**: matrices of one shape exchanged and orthogonalised as one stack. ``init`` groups
the matrices Muon updates by shape (the global shape, and under TP the piece's cut), and cuts
each group into waves of at most ``wave_size`` matrices per root. Per wave and rank it plans,
as pure data, what one update does with a fixed number of ops whatever the number of
matrices:

* **to the roots**: the momentum updates of every unit are one flat workspace (the units'
  shards end to end); one ``split`` of it gives every piece a rank sends, a ``cat`` lays out a
  wave's send buffer, one ``all_to_all_single`` moves it, and on each root a ``split`` and a
  ``cat`` put the received pieces in stack order: ``[B, rows, cols]``, its matrices in wave
  order;
* **back to the holders**: the root's orthogonalised stack is cut and laid out the same way;
  each holder receives its pieces and adds them into its parameter shard with one
  multi-tensor op per update.

The exchanges are :class:`~vfsdp.collectives.Redistribution` plans (their ``send``/``recv``
lists), turned into these cuts and orders.

**Owners**: optimizers whose matrices are updated whole on one owner rank, with state held
there (SOAP, Shampoo), run on Muon's root plan and waves, carrying the gradients.

Per step, for the matrices:

1. every rank's gradient shards go to the matrices' owners, one wave of same-shape matrices at
   a time (Muon's exchange: one ``all_to_all_single`` per wave), as a stack ``[B, rows,
   cols]``;
2. the owner runs the optimizer's rule on the stack with the state it holds for that wave
   (stacked the same way: moments, statistics, preconditioners), batched per shape;
3. the updates go back to the holders, which add them to their shards (multi-tensor ops).

1-D tensors are owned the same way, as a stack ``[B, n]``. Over HSDP each replica's shard
group does the same work.

Under ``torch.compile`` the same step is traced: the gradients are laid out in the same
workspace from the ``.grad`` leaves (:class:`TracedOwned`, made by ``init``), the exchanges are
functional ``all_to_all_single`` collectives over the same wave plans, and the rules branch on
the step counter (a tensor) with :func:`branch_` (``torch.cond``), never reading it back.

Checkpoints: a matrix's state is a :class:`~vfsdp.collectives.Piece` of the whole tensor
on its owner and an empty piece elsewhere, so a checkpoint reloads under any world size
(the owners change; each loads what it now owns).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NoReturn, Optional

import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import Role
from vfsdp.collectives.mesh import Axis
from vfsdp.collectives.piece import Piece
from vfsdp.collectives.redistribute import Redistribution
from vfsdp.collectives.unit import group_name
from vfsdp.functional.state import param_tree
from vfsdp.functional.traced import traced_leaves
from vfsdp.optim.base import (
    CountedState,
    Mask,
    Optimizer,
    OwnedPlan,
    Schedule,
    as_schedule,
    atomic,
    begin,
    check_hyper,
    cuts_of,
    decay_,
    descend_,
    flat_grads,
    frozen_of,
    grad_leaves,
    init_units,
    selected,
    state_dtype,
    unit_buffers,
)
from vfsdp.optim.traced import first_leaves
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec
from vfsdp.spmd.lax import _gather


@dataclass(frozen=True)
class Wave:
    """One wave, as seen from one rank.

    Attributes:
        matrices: Its :class:`~vfsdp.optim.muon.Matrix` values, in wave order.
        stacked: Indices (into ``matrices``) of those whose root is this rank, in stack order.
        to_roots: The exchange of the momentum updates to the roots.
        send: Indices of the workspace cuts (:attr:`MuonPlan.cuts`) this rank sends, in
            ``to_roots.send`` order.
        pieces: Sizes of the received pieces (``to_roots.recv`` order).
        order: Those pieces' indices in stack order.
        from_roots: The exchange of the orthogonalised updates back to the holders.
        out_cuts: Sizes cutting this rank's flat stack of updates into what it sends.
        out_send: Indices of those cuts in ``from_roots.send`` order.
        back: Sizes of the pieces received back (``from_roots.recv`` order: per piece,
            ``(index into matrices, lo, hi)`` within that matrix's piece on this rank).
    """

    matrices: tuple
    stacked: tuple
    to_roots: Redistribution
    send: tuple
    pieces: tuple
    order: tuple
    from_roots: Redistribution
    out_cuts: tuple
    out_send: tuple
    back: tuple


def plan_waves(groups: list, rank: int, world: int, base: dict) -> tuple[tuple, list]:
    """The :class:`Wave` values of ``groups`` (lists of matrices exchanged together), and the
    workspace ranges each wave sends (``base``: unit key -> the unit's offset in the
    workspace), for :func:`cuts_of`."""
    waves, sends = [], []
    for mats in groups:
        held = [[m.spec.local_range(r) for r in range(world)] for m in mats]
        at_root = [[(0, m.spec.numel) if r == m.root else (0, 0) for r in range(world)]
                   for m in mats]
        to_roots = Redistribution(held, at_root, rank, world)
        from_roots = Redistribution(at_root, held, rank, world)
        stacked = tuple(j for j, m in enumerate(mats) if m.root == rank)
        sizes = [mats[j].spec.numel for j in stacked]
        first, at = dict(zip(stacked, itertools.accumulate(sizes, initial=0))), sum(sizes)
        sends.append([(base[mats[i].key] + mats[i].lo + lo, base[mats[i].key] + mats[i].lo + hi)
                      for i, lo, hi in to_roots.send])
        pieces = tuple(hi - lo for _, lo, hi in to_roots.recv)
        order = tuple(sorted(range(len(pieces)),
                             key=lambda c: first[to_roots.recv[c][0]] + to_roots.recv[c][1]))
        out_cuts, out_send = cuts_of([(first[i] + lo, first[i] + hi)
                                      for i, lo, hi in from_roots.send], at)
        waves.append(Wave(tuple(mats), stacked, to_roots, (), pieces, order, from_roots,
                          out_cuts, tuple(out_send),
                          tuple(hi - lo for _, lo, hi in from_roots.recv)))
    return tuple(waves), sends


def group_matrices(matrices: tuple, wave_size: int, key: Any) -> list:
    """Matrices with the same ``key(m)`` (their shape), in order of first appearance, cut so
    that no root holds more than ``wave_size`` of one wave.

    Example:
        >>> from types import SimpleNamespace as M
        >>> ms = [M(i=i, root=r, s=s) for i, (r, s) in enumerate([(0, "a"), (0, "a"), (1, "b"),
        ...                                                       (0, "a"), (1, "a")])]
        >>> [[m.i for m in g] for g in group_matrices(ms, 2, lambda m: m.s)]
        [[0, 1, 4], [3], [2]]
    """
    out: dict = {}
    counts: Counter = Counter()
    for m in matrices:
        k = key(m)
        out.setdefault(k, defaultdict(list))[counts[k, m.root] // wave_size].append(m)
        counts[k, m.root] += 1
    return [w for waves in out.values() for _, w in sorted(waves.items())]


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Orthogonalise ``g`` (a matrix, or a stack ``[B, rows, cols]`` of matrices of one
    shape, each on its own) with the quintic Newton-Schulz iteration (in bf16), as Muon does;
    the result is float32 (float64 for a float64 ``g``). Each matrix of a stack comes out
    bitwise as it would alone (tested on the CPU)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return (x.mT if tall else x).to(torch.promote_types(g.dtype, torch.float32))


def refuse_compiled(what: str, why: str) -> NoReturn:
    """Refuse an update ``torch.compile`` cannot trace, in one wording (Muon's, and a SOAP or
    Shampoo matrix split over a model axis).

    Raises:
        ValueError: always, naming ``what``, ``why`` and what to do instead.
    """
    raise ValueError(f"{what}.update under torch.compile is not supported yet ({why}); "
                     f"compile the forward and backward and call the update outside, or use "
                     f"an optimizer that compiles (adamw, adamw8bit, soap, shampoo)")


def plan_roots(tensors: list[TensorSpec], world_size: int) -> list[int]:
    """Root rank per matrix: LPT by ``rows*cols*min(rows, cols)``, ties to the biggest holder.

    Deterministic: the same on every rank. Returns roots in the order of ``tensors``.
    """
    load = [0] * world_size
    roots = [0] * len(tensors)
    split = any(t.strided is not None for t in tensors)  # the same roots on every model index
    for i in sorted(range(len(tensors)), key=lambda i: (-_cost(tensors[i]), i)):
        held = [0 if split else hi - lo for lo, hi in map(tensors[i].local_range, range(world_size))]
        roots[i] = r = min(range(world_size), key=lambda q: (load[q], -held[q], q))
        load[r] += _cost(tensors[i])
    return roots


def _cost(t: TensorSpec) -> int:
    return math.prod(t.global_shape) * min(t.global_shape[-2:])  # a vector (Shampoo's): n^2


def init_owned_plan(state_type: type, what: str, why: str, shards: Any, spec: ShardSpec,
                    mask: Mask, only: Optional[Callable], of: Callable, refuse: Callable,
                    wave_size: int) -> tuple:
    """A new state and its :class:`MuonPlan` over the tensors it updates (exchanged whole to
    an owner chosen by :func:`plan_roots`, in waves of one shape), after ``refuse(t, kind)``
    of every tensor. ``kind``: ``""`` for a tensor not selected (by ``mask``) or empty (by
    the global size: a TP piece may be empty on some index of the model axis, which still
    takes part in its matrix's exchanges), ``"excluded by only="``, else ``of(t)``
    (``"matrix"``: updated, or why not). One dtype for every matrix (the exchanges carry
    many units at once): float32, or float64 where a unit's parameters are.

    Returns:
        ``(state, units, base)``: ``base``: the key of each unit holding a tensor it updates
        -> the unit's offset in the workspace (the units' shards end to end).

    Raises:
        ValueError: what ``refuse`` raises; ``mask`` or ``only`` answering differently at a
            tied tensor's places; a matrix split over a model axis whose group the shards
            lack (``why`` names what needs the whole matrix).
    """
    def kind(t: TensorSpec) -> str:
        if not math.prod(t.global_shape) or not selected(mask, t.path):
            return ""
        return "excluded by only=" if only is not None and not only(t.path) else of(t)

    for t in spec.tensors():
        refuse(t, kind(t))
    units, count = init_units(shards, spec, f"{what}.init", mask=mask, only=only)
    state = state_type(count, {})
    owned = {u.key: mine for u in units if (mine := [(k, t) for k, t in enumerate(u.db.tensors)
                                                     if kind(t) == "matrix"])}
    dtype = functools.reduce(torch.promote_types, [state_dtype(u.db.dtype) for u in units
                                                   if u.key in owned], torch.float32)
    rank = units[0].db.rank if units else 0
    found = [(key, k, t) for key, mine in owned.items() for k, t in mine]
    roots = plan_roots([t for _, _, t in found], spec.world_size)
    matrices = tuple(Matrix(key, k, t, root, *t.shard_range(rank))
                     for (key, k, t), root in zip(found, roots))
    split = next((m for m in matrices if _split(m)), None)
    if split is not None and units[0].db.groups.model is None:
        axis = split.spec.strided.axis
        raise ValueError(f"{what}: {format_path(split.spec.path)} is split over {axis!r}; "
                         f"{why} needs the whole matrix, so vfsdp needs that axis' group: "
                         f"shard with vfsdp.shard(params, spec, mesh=mesh) on the mesh with "
                         f"{axis!r}, not its data sub-mesh")
    # The workspace: the units' shards end to end.
    layout = tuple((u.key, u.db.shard.numel()) for u in units if u.key in owned)
    base = dict(zip(owned, itertools.accumulate((n for _, n in layout), initial=0)))
    waves, sends = plan_waves(group_matrices(matrices, wave_size, _shape), rank,
                              spec.world_size, base)
    cuts, index = cuts_of([r for wave in sends for r in wave], sum(n for _, n in layout))
    picked = iter(index)
    waves = tuple(replace(w, send=tuple(next(picked) for _ in wave))
                  for w, wave in zip(waves, sends))
    state.plan = MuonPlan({key: frozenset(t.path for _, t in mine) for key, mine in owned.items()},
                          matrices, waves, dtype, layout, cuts)
    return state, units, base


def eager_grads(what: str, grads: Any, state: MuonState, shards: Any, spec: ShardSpec) -> tuple:
    """``(units, gradients, frozen)`` of an eager update: the plan's units by key, their
    gradients in the units' flat layout (the plan's dtype) and the ``(key, k)`` of the frozen
    tensors it updates.

    Raises:
        ValueError: a tree that does not match the spec, or a gradient that does not fit.
    """
    plan = state.plan
    units = {u.key: u for u in unit_buffers(shards, spec, f"{what}.update")
             if u.key in plan.paths}
    frozen = {(key, k) for key, u in units.items() for k in frozen_of(u, plan.paths[key])}
    leaves = grad_leaves(grads, spec, f"{what}.update")
    with torch.no_grad():
        return units, {key: flat_grads(leaves, units[key], f"{what}.update", plan.dtype)
                       for key, _ in plan.units}, frozen


def eager_send(group: Any) -> Callable:
    """:func:`run_waves`'s ``send`` over eager collectives on ``group``."""
    return lambda r, x, later=False: (r.exchange(x, group, async_op=True).wait if later
                                      else r.exchange(x, group))


def run_waves(plan: MuonPlan, pieces: tuple, work: torch.Tensor, send: Callable,
              rule: Callable, model: Any = None, back: bool = True) -> tuple:
    """Every wave of ``plan``: its pieces of the workspace (``pieces``: ``work`` cut at the
    plan's cuts) to the roots, ``rule(w, stack)`` on the root's stack of wave ``w`` (the
    global matrices under TP: gathered over ``model``), and, where ``back``, the updates back
    to the holders. ``send(redistribution, buffer, later=False)`` exchanges, or (``later``)
    starts an exchange and returns what waits for it: the next wave's gather is in flight
    while a wave's rule runs.

    Returns:
        ``(targets, updates)``: per piece received back, ``(matrix, lo, hi)`` within its
        piece on this rank, and the piece.
    """
    targets, updates = [], []
    starts = (send(wave.to_roots, _cat([pieces[i] for i in wave.send], work), True)
              for wave in plan.waves)  # next() starts one: a wave's exchange while the last runs
    pending = next(starts, None)
    for w, wave in enumerate(plan.waves):
        recv, pending = pending(), next(starts, None)  # in flight during the rule
        if wave.stacked:
            m = wave.matrices[wave.stacked[0]]
            g = _laid_out(recv, wave.pieces, wave.order).view(len(wave.stacked), *m.spec.shape)
            o = rule(w, _whole(g, m, model) if _split(m) else g)
            if back and _split(m):  # this index's piece of the global updates
                st = m.spec.strided
                o = o.narrow(st.dim + 1, st.start, st.lengths[st.index])
        if back:  # (a rank that is no root of the wave sends nothing back)
            updates += send(wave.from_roots, _laid_out(o.reshape(-1), wave.out_cuts, wave.out_send)
                            if wave.stacked else work.new_empty(0)).split_with_sizes(wave.back)
            targets += [(wave.matrices[j], lo, hi) for j, lo, hi in wave.from_roots.recv]
    return targets, updates


def _split(m: Matrix) -> bool:
    return m.spec.strided is not None and m.spec.strided.dim is not None \
        and m.spec.strided.size > 1


def _whole(stack: torch.Tensor, m: Matrix, model: Any) -> torch.Tensor:
    """The global matrices of a stack of TP pieces ``[B, *piece]`` (this rank is their root;
    every matrix of the stack is cut like ``m``), from the stacks of every index of the model
    axis: one all-gather over it (:mod:`vfsdp.lax`'s, padded to the largest index's share)."""
    st = m.spec.strided
    shapes = [(stack.shape[0], *replace(st, index=i).local_shape) for i in range(st.size)]
    return _gather(stack, Axis(st.axis, st.size, st.index, model), st.dim + 1,
                   shapes).contiguous()  # (the rule's matmuls round by the layout)


@dataclass(frozen=True)
class Matrix:
    """One matrix Muon updates: its unit, buffer index, spec, root rank and this rank's range
    ``[lo, hi)`` in the unit's shard."""

    key: Any
    k: int
    spec: TensorSpec
    root: int
    lo: int
    hi: int


@dataclass(frozen=True)
class MuonPlan(OwnedPlan):
    """What ``init`` derives from the spec and the mask: the matrices, their roots, the waves
    with their exchange plans (:class:`~vfsdp.optim.muon.Wave`), the units they live in (the
    workspace's layout) and its cuts. Never saved; rebuilt by ``init``.

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(4, 4), "b": torch.ones(4)}   # b is not a matrix
        ...     spec = vfsdp.plan(params, 2)
        ...     plan = vfsdp.optim.muon().init(vfsdp.shard(params, spec), spec).plan
        ...     return [(m.k, m.root, m.lo, m.hi) for m in plan.matrices], len(plan.waves)
        >>> vfsdp.testing.simulate(2, body)      # w: rank 0 gathers it, each holds a part
        [([(1, 0, 4, 12)], 1), ([(1, 0, 0, 8)], 1)]
    """

    matrices: tuple = ()
    waves: tuple = ()
    dtype: torch.dtype = torch.float32  # momentum and exchange dtype (float64 for float64)
    units: tuple = ()  # (key, shard elements) of the units in the workspace, in its order
    cuts: tuple = ()   # sizes cutting the workspace at every piece a wave sends


@dataclass
class MuonState(CountedState):
    """The step counter (``count``) and, per unit holding matrices it updates, the momentum
    DBuffer (float32, or float64 for float64 parameters).

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(4, 4)}
        ...     spec = vfsdp.plan(params, 2)
        ...     state = vfsdp.optim.muon().init(vfsdp.shard(params, spec), spec)
        ...     return state.step, state.checkpoint_tree(spec)["momentum"]["w"].shape
        >>> vfsdp.testing.simulate(2, body)
        [(0, torch.Size([8])), (0, torch.Size([8]))]
    """

    momentum: dict
    saved: ClassVar[tuple] = ("momentum",)

    def views(self, units: dict, targets: list) -> list:
        """The parameter shard slices an update adds into (``targets``: ``(matrix, lo, hi)``
        within its piece), made once and kept: the parameter shards are fixed tensors."""
        shards = [units[m.key].db.shard for m, _, _ in targets]
        return self.cached(tuple((m.key, m.k, lo, hi) for m, lo, hi in targets), shards,
                           lambda: [p[m.lo + lo:m.lo + hi] for p, (m, lo, hi) in zip(shards, targets)])


def muon(
    lr: Schedule = 0.02,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: float = 0.0,
    scale: str = "original",
    only: Optional[Callable[[tuple], bool]] = None,
    wave_size: int = 8,
) -> Optimizer:
    """Muon for 2-D matrices (pair it with AdamW for the rest via :func:`vfsdp.optim.partition`).

    Args:
        lr: A float or a schedule ``step -> lr``.
        momentum: The momentum coefficient (0.95).
        nesterov: Nesterov momentum.
        ns_steps: Newton-Schulz iterations.
        weight_decay: Decoupled weight decay.
        scale: ``"original"``: ``max(1, rows/cols) ** 0.5``; ``"moonlight"``:
            ``0.2 * sqrt(max(rows, cols))`` (matches AdamW's update RMS).
        only: ``path -> bool``: the matrices this optimizer updates (default: every 2-D tensor
            its ``mask`` selects).
        wave_size: Matrices of one shape per root in one wave (one stack, one exchange each
            way); the next wave's gather overlaps this one's Newton-Schulz. It bounds the
            full matrices a root holds at once.

    Returns:
        An :class:`vfsdp.optim.Optimizer` (whole matrices need no special granularity: the
            root gathers them).

    Raises:
        ValueError: an unknown ``scale``, a ``wave_size`` below 1, a negative ``lr`` or
            ``weight_decay``, or ``momentum`` outside [0, 1); from ``init``, a matrix split
            over a model axis the shards' mesh lacks, or a tensor its mask (a partition
            label) selects that it would not update (not 2-D, or excluded by ``only``).

    Example:
        >>> params = {"w": torch.randn(6, 4), "v": torch.randn(4, 4)}
        >>> def body():
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     opt = vfsdp.optim.muon(lr=0.02)
        ...     state = opt.init(shards, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...     state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        ...     return [m.root for m in state.plan.matrices]   # the same plan on every rank
        >>> a, b = vfsdp.testing.simulate(2, body)
        >>> a == b and sorted(a) == [0, 1]
        True
    """
    check_hyper("muon", lr, weight_decay, momentum=momentum, wave_size=wave_size)
    if scale not in ("original", "moonlight"):
        raise ValueError(f"scale must be 'original' or 'moonlight', got {scale!r}")
    schedule = as_schedule(lr)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> MuonState:
        def refuse(t: TensorSpec, why: str) -> None:
            if why not in ("", "matrix") and mask is not None:  # a partition's label: what
                #                                     it gives Muon, Muon must update
                raise ValueError(f"muon: {format_path(t.path)} is given to Muon (its mask "
                                 f"or partition label) but is {why}, so nothing would "
                                 f"update it; label it for another optimizer (e.g. "
                                 f"adamw)")

        state, units, owned = init_owned_plan(
            MuonState, "muon", "Newton-Schulz", shards, spec, mask, only, lambda t: "matrix"
            if len(t.shape) == 2 else f"not a 2-D matrix ({tuple(t.global_shape)})", refuse,
            wave_size)
        state.momentum.update({u.key: u.db.like(state.plan.dtype, Role.STATE, "momentum")
                               for u in units if u.key in owned})
        return state

    def rule(w: int, stack: torch.Tensor) -> torch.Tensor:
        rows, cols = stack.shape[1:]  # the global matrices
        return newton_schulz(stack, ns_steps).mul_(
            max(1.0, rows / cols) ** 0.5 if scale == "original" else 0.2 * max(rows, cols) ** 0.5)

    def update(grads: Any, state: MuonState, shards: Any, spec: ShardSpec) -> MuonState:
        if tp.compiling():
            refuse_compiled("muon", "its per-tensor kernels and exchanges run eagerly")
        plan = state.plan
        units, gflat, frozen = eager_grads("muon", grads, state, shards, spec)
        rate = begin(state.count, schedule)  # the checks are done: nothing written yet
        if not plan.waves:
            return state
        first = next(iter(units.values())).db
        with torch.no_grad():
            moms = [state.momentum[key].shard for key, _ in plan.units]
            # (momentum, gradient): the whole shard (only matrices are read), or the matrices'
            # slices where one is frozen (it keeps its momentum)
            pairs = [pair for (key, _), b in zip(plan.units, moms) for pair in (
                [(b, gflat[key])] if all(k != key for k, _ in frozen) else
                [(b[m.lo:m.hi], gflat[key][m.lo:m.hi]) for m in plan.matrices
                 if m.key == key and (key, m.k) not in frozen])]
            # Momentum, then the updates it sends, as multi-tensor ops into one workspace.
            tp.foreach("lerp_", *zip(*pairs), scalar=1 - momentum)
            work = torch.cat(list(gflat.values()) if nesterov else moms)
            if nesterov:
                tp.foreach("lerp_", list(work.split_with_sizes([n for _, n in plan.units])), moms,
                           scalar=momentum)
            targets, updates = run_waves(
                plan, work.split_with_sizes(plan.cuts), work,
                eager_send(first.groups.shard), rule, first.groups.model)
            kept = [i for i, (m, _, _) in enumerate(targets) if (m.key, m.k) not in frozen]
            views = state.views(units, [targets[i] for i in kept])  # frozen: no update, no decay
            # The parameter update: two multi-tensor ops over every matrix.
            apply_(views, [updates[i] for i in kept], rate, rate, weight_decay, True)
        return state

    return Optimizer(init, atomic(update))


def _cat(parts: list, like: torch.Tensor) -> torch.Tensor:
    """``torch.cat(parts)``, or an empty tensor like ``like`` (a rank with nothing to send)."""
    return torch.cat(parts) if parts else like.new_empty(0)


def _laid_out(x: torch.Tensor, sizes: tuple, order: tuple) -> torch.Tensor:
    """``x`` cut at ``sizes``, the pieces ``order`` names end to end: ``x`` itself where that
    is every piece in order (no copy)."""
    if order == tuple(range(len(sizes))):
        return x
    parts = x.split_with_sizes(sizes)
    return _cat([parts[c] for c in order], x)


def _shape(m: Matrix) -> tuple:
    """What a wave's matrices share: the shape, and under TP the cut of this index's piece."""
    st = m.spec.strided
    return (tuple(m.spec.global_shape), tuple(m.spec.shape),
            (st.dim, tuple(st.lengths), st.index) if _split(m) else None)


@dataclass
class OwnedState(MuonState):
    """The step counter and per wave the state of this rank's tensors in it (``stacks``: name
    -> ``[B, ...]``; ``B = 0`` where it owns none; ``momentum`` stays empty). ``seen``: the
    counter, its version and its value on the host after the last eager update, so that an
    eager update branches on the step without reading the counter back (it reads it once after
    anything else changed it: a compiled update, a checkpoint load, ``state.step = n``).

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(4, 6), "b": torch.ones(4)}
        ...     spec = vfsdp.plan(params, 2)
        ...     state = vfsdp.optim.soap().init(vfsdp.shard(params, spec), spec)
        ...     return [{k: tuple(v.shape) for k, v in s.items()} for s in state.stacks]
        >>> vfsdp.testing.simulate(2, body)[0]   # rank 0 owns w; b's wave: none of it here
        [{'exp_avg': (0, 4), 'exp_avg_sq': (0, 4)}, {'exp_avg': (1, 4, 6), 'exp_avg_sq': \
(1, 4, 6), 'L': (1, 4, 4), 'R': (1, 6, 6), 'QL': (1, 4, 4), 'QR': (1, 6, 6)}]
    """

    stacks: list = field(default_factory=list)
    seen: Optional[tuple] = field(default=None, repr=False, compare=False)

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step, and per state name a tree shaped like the parameters: a tensor's state
        as a Piece (whole on its owner, empty elsewhere)."""
        plan, units = self.plan, self.kept["params"]
        writer = all(db.groups.replicate_rank == 0 for db in units.values())
        # (key, k) -> its wave's stacks and its place in them (None: not owned here)
        held = {(m.key, m.k): (stacks, wave.stacked.index(j) if j in wave.stacked else None)
                for wave, stacks in zip(plan.waves, self.stacks)
                for j, m in enumerate(wave.matrices)}
        names = dict.fromkeys(n for s in self.stacks for n in s)

        def pick(name: str, db: Any, k: int) -> Any:
            stacks, at = held.get((db.key, k), ({}, None))  # not this optimizer's: no stacks
            if name not in stacks:
                return None
            local = (torch.empty(0, dtype=plan.dtype, device=db.device) if at is None
                     else stacks[name][at])
            st = db.tensors[k].strided  # under TP, every index holds the same: one writes
            return Piece(local, tuple(stacks[name].shape[1:]), 0,
                         writer=writer and (st is None or st.index == 0) and local.numel() > 0)

        return {"step": self.step,
                **{n: param_tree(units, spec, functools.partial(pick, n)) for n in names}}


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
        new = torch.cond(pred, lambda *xs: tuple(y.contiguous() for y in fn(*xs)),
                         lambda *xs: tuple(x.clone() for x in xs[len(args):]), (*args, *state))
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
    """

    group: str
    pieces: tuple
    leaf: dict


def owned(what: str, lr: Schedule, only: Optional[Callable], wave_size: int,
          stack_state: Callable, rule: Callable, finish: Callable, first_moves: bool = True,
          ) -> Optimizer:
    """An optimizer on owners (SOAP, Shampoo): the 1-D and 2-D tensors selected (by ``mask``
    and ``only``) are the owned tensors (the "matrices"), with roots and waves as Muon plans
    them. ``init`` makes a wave's stacked state by ``stack_state(b, shape, dtype, device)``;
    ``update`` exchanges the gradients to the owners, runs ``rule(stacks, t, g)`` (a wave's
    state, the number ``t`` of updates before this one, its gradients ``[B, ...]`` on this
    rank; the updates returned), exchanges the updates back (eagerly not at ``t = 0`` unless
    ``first_moves``), and calls ``finish(views, updates, t, lr)`` (the parameter slices, the
    update pieces, ``t``, the learning rate) where it got any. ``t`` is eagerly an int,
    known at once (:attr:`OwnedState.seen`, or the counter read back); compiled, the
    counter, a 0-d tensor (the same step over functional collectives: see the module).

    Raises:
        ValueError: from ``init``, a selected tensor of 3 or more dimensions, a matrix split
            over a model axis the shards' mesh lacks (naming its path and the fix); from
            ``update``, a frozen tensor (its path and the fix), or a gradient that does not
            fit; compiled, a matrix split over a model axis (:func:`refuse_compiled`).
    """
    schedule = as_schedule(lr)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> OwnedState:
        def refuse(t: TensorSpec, why: str) -> None:
            if why not in ("", "matrix") and (mask is not None or "D (" in why):
                raise ValueError(f"{what}: {format_path(t.path)} is given to {what} (its mask, "
                                 f"partition label or no label) but is {why}, which it does "
                                 f"not update; label it for another optimizer (e.g. adamw) "
                                 f"with vfsdp.optim.partition")

        state, units, base = init_owned_plan(
            OwnedState, what, what, shards, spec, mask, only, lambda t: "matrix"
            if len(t.shape) in (1, 2) else f"{len(t.shape)}-D ({tuple(t.global_shape)})",
            refuse, wave_size)
        plan = state.plan
        state.stacks = [stack_state(len(w.stacked), tuple(w.matrices[0].spec.global_shape),
                                    plan.dtype, state.count.device) for w in plan.waves]
        state.kept["params"] = {u.key: u.db for u in units if u.key in base}
        leaf = {(u.key, k): i for u in units for k, i in first_leaves(u).items()
                if plan.owns(u.db, k)}
        pieces = tuple((leaf[(m.key, m.k)], base[m.key] + m.lo, base[m.key] + m.hi)
                       for m in plan.matrices if m.hi > m.lo)
        shard = units[0].db.groups.shard if units else None
        state.kept["traced"] = TracedOwned(  # no group: shards made without a process group
            group_name(shard) if shard is not None or dist.is_initialized() else "", pieces, leaf)
        return state

    def update(grads: Any, state: OwnedState, shards: Any, spec: ShardSpec) -> OwnedState:
        count, compiling, t = state.count, tp.compiling(), None
        if not compiling:
            seen, version, n = state.seen or (None, -1, 0)
            t = n if seen is count and version == tp.version(count) else state.step
        back = compiling or first_moves or t != 0  # (compiled: always exchanged back)
        with torch.no_grad():
            inputs = (_traced_inputs if compiling else _eager_inputs)(what, grads, state,
                                                                     shards, spec)
            rate = begin(count, schedule)  # the checks are done: nothing written yet
            # compiled: the next eager update reads the counter back once
            t, state.seen = (count.reshape(()) - 1, None) if compiling else (
                t, (count, tp.version(count), t + 1))
            if inputs is None:
                return state
            work, send, model, views_of = inputs
            targets, updates = run_waves(
                state.plan, work.split_with_sizes(state.plan.cuts), work, send,
                lambda w, g: rule(state.stacks[w], t, g), model, back)
            if targets:
                finish(views_of(targets), updates, t, rate)
        return state

    return Optimizer(init, atomic(update))


def _frozen(what: str, path: tuple) -> NoReturn:
    raise ValueError(f"{what}: {format_path(path)} is frozen (requires_grad=False); {what} "
                     f"keeps its statistics on an owner rank and does not skip frozen "
                     f"tensors: label it for no optimizer, or for adamw, with "
                     f"vfsdp.optim.partition")


def _eager_inputs(what: str, grads, state: OwnedState, shards, spec: ShardSpec) -> Any:
    """``(workspace, send, model group, views)`` eagerly: the gradients in the units' flat
    layout, DBuffer slices, eager collectives; ``None`` when there is nothing to update."""
    plan = state.plan
    units, gflat, frozen = eager_grads(what, grads, state, shards, spec)
    for key, k in frozen:
        _frozen(what, units[key].db.tensors[k].path)
    if not plan.units:
        return None
    work = torch.cat([gflat[key] for key, _ in plan.units])
    groups = next(iter(units.values())).db.groups
    return (work, eager_send(groups.shard), groups.model,
            lambda targets: state.views(units, targets))


def _traced_inputs(what: str, grads, state: OwnedState, shards, spec: ShardSpec) -> Any:
    """:func:`_eager_inputs` while compiling: the workspace laid out from the gradient leaves
    (zeros between the pieces), functional ``all_to_all_single`` exchanges, the parameter
    leaves' slices (:class:`TracedOwned`)."""
    plan, rec = state.plan, state.kept["traced"]
    if any(_split(m) for m in plan.matrices):
        refuse_compiled(what, "a matrix split over a model axis is gathered eagerly")
    params, _ = traced_leaves(shards, spec, f"{what}.update")
    gleaves, _ = traced_leaves(grads, spec, f"{what}.update")
    for (key, k), i in rec.leaf.items():
        if not params[i].requires_grad:
            _frozen(what, state.kept["params"][key].tensors[k].path)
    if not plan.units:
        return None
    work = state.count.new_zeros(sum(n for _, n in plan.units), dtype=plan.dtype)
    for i, lo, hi in rec.pieces:  # zeros between the pieces
        work[lo:hi] = gleaves[i].reshape(-1)

    def send(r, x, later=False):
        y = x if r.world == 1 else tp.traced_all_to_all(x, r.recv_sizes, r.send_sizes, rec.group)
        return (lambda: y) if later else y

    return (work, send, None, lambda targets: [params[rec.leaf[(m.key, m.k)]].view(-1)[lo:hi]
                                               for m, lo, hi in targets])

