"""Distributed Muon: Newton-Schulz once per matrix, on a load-balanced root rank, batched by
shape.

Per step, for every 2-D matrix the optimizer owns (ops that grow with the number of distinct
shapes, not of matrices; the waves' plans are in :mod:`vfsdp.optim.muon_waves`):

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
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NoReturn, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives import comm
from vfsdp.collectives.dbuffer import Role
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
from vfsdp.optim.muon_waves import group_matrices, held_ranges, plan_waves
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["muon", "plan_roots", "newton_schulz", "MuonState", "MuonPlan", "Matrix"]


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
    order = sorted(range(len(tensors)), key=lambda i: (-_cost(tensors[i]), i))
    split = any(t.strided is not None for t in tensors)  # the same roots on every model index
    for i in order:
        t = tensors[i]
        held = [0 if split else hi - lo for lo, hi in held_ranges(t, world_size)]
        r = min(range(world_size), key=lambda q: (load[q], -held[q], q))
        roots[i] = r
        load[r] += _cost(t)
    return roots


def _cost(t: TensorSpec) -> int:
    return math.prod(t.global_shape) * min(t.global_shape[-2:])  # a vector (Shampoo's): n^2


def owned_kind(mask: Mask, only: Optional[Callable], of: Callable) -> Callable:
    """``t -> kind``: ``""`` for a tensor not selected (by ``mask``) or empty (by the global
    size: a TP piece may be empty on some index of the model axis, which still takes part in
    its matrix's exchanges), ``"excluded by only="``, else ``of(t)`` (``"matrix"``,
    ``"vector"`` or why it is neither)."""
    def kind(t: TensorSpec) -> str:
        if not math.prod(t.global_shape) or not selected(mask, t.path):
            return ""
        return "excluded by only=" if only is not None and not only(t.path) else of(t)
    return kind


def init_owned_plan(state_type: type, what: str, why: str, shards: Any, spec: ShardSpec,
                    mask: Mask, kind: Callable, refuse: Callable, wave_size: int) -> tuple:
    """A new state and its :class:`MuonPlan` over the tensors ``kind`` calls ``"matrix"``
    (exchanged whole to an owner chosen by :func:`plan_roots`, in waves of one shape) or
    ``"vector"`` (kept on their shards: their ranges cut the workspace too), after
    ``refuse(t, kind(t))`` of every tensor. One dtype for every matrix (the exchanges carry
    many units at once): float32, or float64 where a unit's parameters are.

    Returns:
        ``(state, units, owned, vectors, picked)``: ``owned``: unit key -> its ``(k, spec)``
        updated; ``vectors``: ``(key, k, lo, hi)`` of this rank's vector pieces; ``picked``:
        their cuts of the workspace.

    Raises:
        ValueError: what ``refuse`` raises; a matrix split over a model axis whose group the
            shards lack (``why`` names what needs the whole matrix).
    """
    for t in spec.tensors():
        refuse(t, kind(t))
    units, count = init_units(shards, spec, f"{what}.init", mask=mask)
    state = state_type(count, {})
    owned = {u.key: [(k, t) for k, t in enumerate(u.db.tensors) if kind(t) in ("matrix", "vector")]
             for u in units}
    owned = {key: mine for key, mine in owned.items() if mine}
    dtype = functools.reduce(torch.promote_types, [state_dtype(u.db.dtype) for u in units
                                                   if u.key in owned], torch.float32)
    rank = units[0].db.rank if units else 0
    found = [(key, k, t) for key, mine in owned.items() for k, t in mine if kind(t) == "matrix"]
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
    vectors = tuple((key, k, lo, hi) for key, mine in owned.items() for k, t in mine
                    if kind(t) == "vector" for lo, hi in [t.shard_range(rank)] if hi > lo)
    # The workspace: the units' shards end to end.
    layout = tuple((u.key, u.db.shard.numel()) for u in units if u.key in owned)
    base = dict(zip(owned, itertools.accumulate((n for _, n in layout), initial=0)))
    waves, sends = plan_waves(group_matrices(matrices, wave_size, _shape), rank,
                              spec.world_size, base)
    cuts, index = cuts_of([r for wave in sends for r in wave]
                          + [(base[key] + lo, base[key] + hi) for key, _, lo, hi in vectors],
                          sum(n for _, n in layout))
    picked = iter(index)
    waves = tuple(replace(w, send=tuple(next(picked) for _ in wave))
                  for w, wave in zip(waves, sends))
    state.plan = MuonPlan({key: frozenset(t.path for _, t in mine) for key, mine in owned.items()},
                          matrices, waves, dtype, layout, cuts)
    return state, units, owned, vectors, tuple(picked)


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


def run_waves(plan: MuonPlan, pieces: tuple, work: torch.Tensor, send: Callable,
              rule: Callable, model: Any = None, back: bool = True) -> tuple:
    """Every wave of ``plan``: its pieces of the workspace (``pieces``: ``work`` cut at the
    plan's cuts) to the roots, ``rule(w, stack)`` on the root's stack of wave ``w`` (the
    global matrices under TP: gathered over ``model``), and, where ``back``, the updates back
    to the holders. ``send(redistribution, buffer)`` starts an exchange and returns what
    waits for it: the next wave's gather is in flight while a wave's rule runs.

    Returns:
        ``(targets, updates)``: per piece received back, ``(matrix, lo, hi)`` within its
        piece on this rank, and the piece.
    """
    def start(wave):
        return send(wave.to_roots, _cat([pieces[i] for i in wave.send], work))

    targets, updates = [], []
    pending = start(plan.waves[0]) if plan.waves else None
    for w, wave in enumerate(plan.waves):
        recv = pending()
        if w + 1 < len(plan.waves):
            pending = start(plan.waves[w + 1])  # in flight during the rule
        out = work.new_empty(0)
        if wave.stacked:
            m = wave.matrices[wave.stacked[0]]
            got = recv.split_with_sizes(wave.pieces)
            g = _cat([got[c] for c in wave.order], work).view(len(wave.stacked), *m.spec.shape)
            o = rule(w, _whole(g, m, model) if _split(m) else g)
            if back and _split(m):  # this index's piece of the global updates
                st = m.spec.strided
                o = o.narrow(st.dim + 1, st.start, st.lengths[st.index])
            if back:
                cut = o.reshape(-1).split_with_sizes(wave.out_cuts)
                out = _cat([cut[c] for c in wave.out_send], work)
        if back:
            got = send(wave.from_roots, out)().split_with_sizes(wave.back)
            for (j, lo, hi), piece in zip(wave.targets, got):
                targets.append((wave.matrices[j], lo, hi))
                updates.append(piece)
    return targets, updates


def _split(m: Matrix) -> bool:
    return m.spec.strided is not None and m.spec.strided.dim is not None \
        and m.spec.strided.size > 1


def _whole(stack: torch.Tensor, m: Matrix, model: Any) -> torch.Tensor:
    """The global matrices of a stack of TP pieces ``[B, *piece]`` (this rank is their root;
    every matrix of the stack is cut like ``m``), from the stacks of every index of the model
    axis: one all-gather over it, padded to the largest index's share."""
    st = m.spec.strided
    b = stack.shape[0]
    shapes = [replace(st, index=i).local_shape for i in range(st.size)]
    widths = [b * math.prod(sh) for sh in shapes]
    width = max(widths)
    send = torch.zeros(width, dtype=stack.dtype, device=stack.device)
    send[:widths[st.index]] = stack.reshape(-1)
    recv = torch.empty(st.size * width, dtype=stack.dtype, device=stack.device)
    comm.all_gather_into(recv, send, model)
    parts = [recv[i * width:i * width + widths[i]].view(b, *shapes[i]) for i in range(st.size)]
    return torch.cat(parts, st.dim + 1)


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
    with their exchange plans (:mod:`vfsdp.optim.muon_waves`), the units they live in (the
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
    plan: MuonPlan = field(default_factory=MuonPlan, repr=False, compare=False)
    kept: dict = field(default_factory=dict, repr=False, compare=False)
    saved: ClassVar[tuple] = ("momentum",)

    def views(self, units: dict, targets: list) -> list:
        """The parameter shard slices an update adds into (``targets``: ``(matrix, lo, hi)``
        within its piece), made once and kept: the parameter shards are fixed tensors."""
        key = tuple((m.key, m.k, lo, hi) for m, lo, hi in targets)
        found = self.kept.get(key)
        if found is None or any(units[k].db.shard is not x for k, x in found[0].items()):
            shards = {m.key: units[m.key].db.shard for m, _, _ in targets}
            found = self.kept[key] = (shards, [shards[m.key][m.lo + lo:m.lo + hi]
                                               for m, lo, hi in targets])
        return found[1]


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
    check_hyper("muon", lr, weight_decay, momentum=momentum)
    if scale not in ("original", "moonlight"):
        raise ValueError(f"scale must be 'original' or 'moonlight', got {scale!r}")
    if wave_size < 1:
        raise ValueError(f"wave_size must be >= 1, got {wave_size}")
    schedule = as_schedule(lr)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> MuonState:
        def refuse(t: TensorSpec, why: str) -> None:
            if why not in ("", "matrix") and mask is not None:  # a partition's label: what
                #                                     it gives Muon, Muon must update
                raise ValueError(f"muon: {format_path(t.path)} is given to Muon (its mask "
                                 f"or partition label) but is {why}, so nothing would "
                                 f"update it; label it for another optimizer (e.g. "
                                 f"adamw)")

        kind = owned_kind(mask, only, lambda t: "matrix" if len(t.shape) == 2 else
                          f"not a 2-D matrix ({tuple(t.global_shape)})")
        state, units, owned, _, _ = init_owned_plan(MuonState, "muon", "Newton-Schulz", shards,
                                                    spec, mask, kind, refuse, wave_size)
        for u in units:
            if u.key in owned:
                state.momentum[u.key] = u.db.like(state.plan.dtype, Role.STATE, "momentum")
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
            bufs, gs = [], []
            for (key, _), buf in zip(plan.units, moms):
                if not any(k == key for k, _ in frozen):  # the whole shard (only matrices
                    bufs.append(buf)                     # are read)
                    gs.append(gflat[key])
                    continue
                for m in plan.matrices:  # a frozen matrix keeps its momentum
                    if m.key == key and (key, m.k) not in frozen and m.hi > m.lo:
                        bufs.append(buf[m.lo:m.hi])
                        gs.append(gflat[key][m.lo:m.hi])
            # Momentum, then the updates it sends, as multi-tensor ops into one workspace.
            tp.foreach("lerp_", bufs, gs, scalar=1 - momentum)
            work = torch.empty(sum(n for _, n in plan.units), dtype=plan.dtype,
                               device=first.device)
            ws = list(work.split_with_sizes([n for _, n in plan.units]))
            if nesterov:
                tp.foreach("copy_", ws, list(gflat.values()))
                tp.foreach("lerp_", ws, moms, scalar=momentum)
            else:
                tp.foreach("copy_", ws, moms)
            targets, updates = run_waves(
                plan, work.split_with_sizes(plan.cuts), work,
                lambda r, x: r.exchange(x, first.groups.shard, async_op=True).wait, rule,
                first.groups.model)
            kept = [i for i, (m, _, _) in enumerate(targets) if (m.key, m.k) not in frozen]
            views = state.views(units, [targets[i] for i in kept])  # frozen: no update, no decay
            # The parameter update: two multi-tensor ops over every matrix.
            decay_(views, rate, weight_decay)
            descend_(views, [updates[i] for i in kept], rate)
        return state

    return Optimizer(init, atomic(update))


def _cat(parts: list, like: torch.Tensor) -> torch.Tensor:
    """``torch.cat(parts)``, or an empty tensor like ``like`` (a rank with nothing to send)."""
    return torch.cat(parts) if parts else like.new_empty(0)


def _shape(m: Matrix) -> tuple:
    """What a wave's matrices share: the shape, and under TP the cut of this index's piece."""
    st = m.spec.strided
    return (tuple(m.spec.global_shape), tuple(m.spec.shape),
            (st.dim, tuple(st.lengths), st.index) if _split(m) else None)
