"""Distributed Muon: Newton-Schulz once per matrix, on a load-balanced root rank.

Per step, for every 2-D matrix the optimizer owns:

1. momentum (Nesterov), two multi-tensor ops over every matrix of every unit:
   ``b.lerp_(g, 1 - mu)``, ``u = g.lerp(b, mu)``;
2. the full ``u`` is gathered on the matrix's **root**: one flat redistribution
   (:class:`vfsdp.collectives.Redistribution`, one ``all_to_all_single`` with uneven splits,
   counted with the other collectives) per wave of matrices, planned once by ``init``;
3. the root runs Newton-Schulz (5 quintic steps, coefficients (3.4445, -4.7750, 2.0315), bf16,
   tall matrices transposed) and scales the result;
4. the update goes back to the holders with the reverse redistribution;
5. ``p.mul_(1 - lr * wd)``, ``p.add_(update, alpha=-lr)`` on the shard, two multi-tensor
   ops over every matrix.

Every buffer it makes (exchange buffers, updates) is on the parameters' device; on CUDA the
exchanges run on vfsdp's communication stream while Newton-Schulz runs in bf16 on the compute
stream.

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

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives import comm
from vfsdp.collectives.redistribute import Redistribution
from vfsdp.collectives.slot import Role
from vfsdp.functional.state import param_tree
from vfsdp.optim.adamw import owned_views
from vfsdp.optim.base import (
    Mask,
    Optimizer,
    Schedule,
    as_schedule,
    check_hyper,
    flat_grads,
    grad_leaves,
    selected,
    state_dtype,
    unit_buffers,
)
from vfsdp.optim.fused import scale_
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["muon", "plan_roots", "newton_schulz", "MuonState", "MuonPlan", "Matrix", "Wave",
           "NS_CALLS"]

NS_CALLS = threading.local()  # .count: Newton-Schulz calls on this thread (rank), for tests


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Orthogonalise ``g`` with the quintic Newton-Schulz iteration (in bf16), as Muon does;
    the result is float32 (float64 for a float64 ``g``)."""
    NS_CALLS.count = getattr(NS_CALLS, "count", 0) + 1
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).to(torch.promote_types(g.dtype, torch.float32))


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
        held = [0] * world_size
        for r in t.ranks() if not split else ():
            lo, hi = t.local_range(r)
            held[r] = hi - lo
        r = min(range(world_size), key=lambda q: (load[q], -held[q], q))
        roots[i] = r
        load[r] += _cost(t)
    return roots


def _cost(t: TensorSpec) -> int:
    r, c = t.global_shape[-2], t.global_shape[-1]
    return r * c * min(r, c)


def _split(m: Matrix) -> bool:
    return m.spec.strided is not None and m.spec.strided.dim is not None \
        and m.spec.strided.size > 1


def _whole(mats: list, fulls: list, model: Any, device: torch.device, dtype: torch.dtype) -> list:
    """The global matrices of TP-split ``mats`` (this rank is their root), from their pieces
    ``fulls`` on every index of the model axis: one all-gather over it, padded to the largest
    index's share."""
    if not mats:
        return []
    st0 = mats[0].spec.strided
    size = st0.size

    def numels(i: int) -> list:
        out = []
        for m in mats:
            st = m.spec.strided
            shape = list(st.global_shape)
            shape[st.dim] = st.lengths[i]
            out.append(shape)
        return out

    shapes = [numels(i) for i in range(size)]
    widths = [sum(math.prod(sh) for sh in row) for row in shapes]
    width = max(widths)
    send = torch.zeros(width, dtype=dtype, device=device)
    if widths[st0.index]:
        torch.cat([f.reshape(-1) for f in fulls], out=send[:widths[st0.index]])
    recv = torch.empty(size * width, dtype=dtype, device=device)
    if model is None:
        raise ValueError(f"muon: {format_path(mats[0].spec.path)} is split over "
                         f"{st0.axis!r}; Newton-Schulz needs the whole matrix, so vfsdp needs "
                         f"that axis' group: shard with vfsdp.shard(params, spec, mesh=mesh) on "
                         f"the mesh with {st0.axis!r}, not its data sub-mesh")
    comm.all_gather_into(recv, send, model)
    out = []
    offsets = [i * width for i in range(size)]
    for j, m in enumerate(mats):
        parts = []
        for i in range(size):
            n = math.prod(shapes[i][j])
            parts.append(recv[offsets[i]:offsets[i] + n].view(shapes[i][j]))
            offsets[i] += n
        out.append(torch.cat(parts, m.spec.strided.dim))
    return out


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
class Wave:
    """Matrices exchanged together: one redistribution gathers their updates on their roots,
    the reverse one scatters the orthogonalised updates back."""

    matrices: tuple
    to_roots: Redistribution
    from_roots: Redistribution


@dataclass(frozen=True)
class MuonPlan:
    """What ``init`` derives from the spec and the mask: the matrices, their roots, the waves
    with their exchange plans, and the units they live in. Never saved; rebuilt by ``init``.

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
    paths: Mapping[Any, frozenset] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32  # momentum and exchange dtype (float64 for float64)

    def owns(self, db, k: int) -> bool:
        """Whether the plan updates tensor ``k`` of ``db``'s unit."""
        return db.tensors[k].path in self.paths.get(db.key, ())


@dataclass
class MuonState:
    """The step and, per unit holding matrices it updates, the momentum DBuffer (float32, or
    float64 for float64 parameters).

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(4, 4)}
        ...     spec = vfsdp.plan(params, 2)
        ...     state = vfsdp.optim.muon().init(vfsdp.shard(params, spec), spec)
        ...     return state.step, state.checkpoint_tree(spec)["momentum"]["w"].shape
        >>> vfsdp.testing.simulate(2, body)
        [(0, torch.Size([8])), (0, torch.Size([8]))]
    """

    step: int
    momentum: dict
    plan: MuonPlan = field(default_factory=MuonPlan, repr=False, compare=False)

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step, and the momentum of the matrices it updates, shaped like the parameters."""
        return {"step": self.step,
                "momentum": param_tree(self.momentum, spec, owned_views(self.plan))}

    def restore_checkpoint(self, tree: dict) -> MuonState:
        self.step = tree["step"]
        return self


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
        wave_size: Matrices per batched gather/scatter; the next wave overlaps this one's
            Newton-Schulz.

    Returns:
        An :class:`vfsdp.optim.Optimizer` (whole matrices need no special granularity: the
            root gathers them).

    Raises:
        ValueError: an unknown ``scale``, a ``wave_size`` below 1, a negative ``lr`` or
            ``weight_decay``, or ``momentum`` outside [0, 1).

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
        def owns(t: TensorSpec) -> bool:
            return (len(t.shape) == 2 and t.numel > 0 and (only is None or only(t.path))
                    and selected(mask, t.path))

        state = MuonState(0, {})
        units = unit_buffers(shards, spec, "muon.init")
        found: list[tuple] = []
        paths: dict = {}
        # One dtype for every matrix (the exchanges carry many units at once): float32, or
        # float64 where a unit's parameters are (the same on every rank: units are).
        dtype = torch.float32
        for u in units:
            if any(owns(t) for t in u.db.tensors):
                dtype = torch.promote_types(dtype, state_dtype(u.db.dtype))
        for u in units:
            mine = [(k, t) for k, t in enumerate(u.db.tensors) if owns(t)]
            if not mine:
                continue
            state.momentum[u.key] = u.db.like(dtype, Role.STATE, "momentum")
            paths[u.key] = frozenset(t.path for _, t in mine)
            found += [(u.key, k, t, u.db.rank) for k, t in mine]
        roots = plan_roots([f[2] for f in found], spec.world_size)
        matrices = tuple(Matrix(key, k, t, root, *t.shard_range(rank))
                         for (key, k, t, rank), root in zip(found, roots))
        rank = units[0].db.rank if units else 0
        waves = tuple(_wave(matrices[i:i + wave_size], rank, spec.world_size)
                      for i in range(0, len(matrices), wave_size))
        state.plan = MuonPlan(matrices, waves, paths, dtype)
        return state

    def update(grads: Any, state: MuonState, shards: Any, spec: ShardSpec) -> MuonState:
        if tp.compiling():
            raise ValueError("muon.update under torch.compile is not supported yet (its "
                             "per-tensor kernels and exchanges run eagerly); compile the "
                             "forward and backward and call the update outside, or use "
                             "vfsdp.optim.adamw, which compiles")
        state.step += 1
        rate = schedule(state.step)
        plan = state.plan
        units = {u.key: u for u in unit_buffers(shards, spec, "muon.update")
                 if u.key in state.momentum}
        if not plan.waves:
            return state
        first = next(iter(units.values())).db
        group, device, rank = first.groups.shard, first.device, first.rank
        leaves = grad_leaves(grads, spec, "muon.update")
        by_unit: dict = {}
        for m in plan.matrices:
            by_unit.setdefault(m.key, []).append(m)
        frozen = {(key, k) for key, u in units.items() for k in u.frozen()}
        with torch.no_grad():
            upd: dict = {}
            bufs, gs, live = [], [], []
            for key, mats in by_unit.items():
                g = flat_grads(leaves, units[key], "muon.update", plan.dtype)
                buf = state.momentum[key].shard
                for m in mats:
                    if (m.key, m.k) in frozen:  # still exchanged (every rank plans the same
                        upd[id(m)] = torch.zeros_like(g[m.lo:m.hi])  # waves), never applied
                        continue
                    bufs.append(buf[m.lo:m.hi])
                    gs.append(g[m.lo:m.hi])
                    live.append(m)
            # Momentum as two multi-tensor ops over every matrix of every unit.
            tp.foreach("lerp_", bufs, gs, scalar=1 - momentum)
            # The exchange copies what it sends: without Nesterov the buffer itself is sent.
            ups = tp.foreach("lerp", gs, bufs, scalar=momentum) if nesterov else bufs
            upd.update((id(m), x) for m, x in zip(live, ups))

            def start(wave: Wave):
                return wave.to_roots.run([upd[id(m)] for m in wave.matrices], group, device,
                                         plan.dtype, async_op=True)

            ps, pieces = [], []
            pending = start(plan.waves[0])
            for w, wave in enumerate(plan.waves):
                fulls = pending.wait()
                if w + 1 < len(plan.waves):
                    pending = start(plan.waves[w + 1])  # in flight during Newton-Schulz
                split = [j for j, m in enumerate(wave.matrices) if m.root == rank and _split(m)]
                whole = dict(zip(split, _whole(
                    [wave.matrices[j] for j in split],
                    [fulls[j].view(wave.matrices[j].spec.shape) for j in split],
                    first.groups.model, device, plan.dtype)))
                out = []
                for j, (m, full) in enumerate(zip(wave.matrices, fulls)):
                    if m.root != rank:
                        out.append(full)  # empty: this rank is not the root
                        continue
                    o = newton_schulz(whole.get(j, full.view(m.spec.shape)), ns_steps)
                    rows, cols = m.spec.global_shape
                    o.mul_(max(1.0, rows / cols) ** 0.5 if scale == "original"
                           else 0.2 * max(rows, cols) ** 0.5)
                    if j in whole:  # this index's piece of the global update
                        st = m.spec.strided
                        o = o.narrow(st.dim, st.start, st.lengths[st.index])
                    out.append(o.reshape(-1))
                back = wave.from_roots.run(out, group, device, plan.dtype)
                for m, piece in zip(wave.matrices, back):
                    if m.hi > m.lo and (m.key, m.k) not in frozen:
                        ps.append(units[m.key].db.shard[m.lo:m.hi])
                        pieces.append(piece)
            # The parameter update: two multi-tensor ops over every matrix.
            if weight_decay:
                scale_(ps, 1 - rate * weight_decay)
            tp.foreach("add_", ps, pieces, alpha=-rate)
        return state

    return Optimizer(init, update)


def _wave(matrices: tuple, rank: int, world: int) -> Wave:
    """The two exchange plans of a wave: pieces to their roots, and back."""
    held = [[m.spec.local_range(r) for r in range(world)] for m in matrices]
    at_root = [[(0, m.spec.numel) if r == m.root else (0, 0) for r in range(world)]
               for m in matrices]
    return Wave(matrices, Redistribution(held, at_root, rank, world),
                Redistribution(at_root, held, rank, world))
