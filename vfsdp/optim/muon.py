"""Distributed Muon: Newton-Schulz once per matrix, on a load-balanced root rank.

Per step, for every 2-D matrix the optimizer owns:

1. momentum (Nesterov, group ops on this rank's shard): ``b.lerp_(g, 1 - mu)``,
   ``u = g.lerp(b, mu)``;
2. the full ``u`` is gathered on the matrix's **root** (a one-hot RaggedShard redistribute),
   built on ``all_to_all_single`` with uneven splits and batched over a wave of matrices;
3. the root runs Newton-Schulz (5 quintic steps, coefficients (3.4445, -4.7750, 2.0315), bf16,
   tall matrices transposed) and scales the result;
4. the update goes back to the holders with the reverse ``all_to_all_single``;
5. ``p.mul_(1 - lr * wd)``, ``p.add_(update, alpha=-lr)`` on the shard.

Roots come from a deterministic LPT plan (:func:`plan_roots`): matrices by Newton-Schulz cost
``rows * cols * min(rows, cols)`` descending, each to the least-loaded rank, ties to the rank
that holds most of it. The next wave's gather is in flight while the current wave's
Newton-Schulz runs. Over HSDP the shard group does this once per replica.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from vfsdp.optim.base import Optimizer, Schedule, as_schedule, flat_grads, grad_leaves, unit_buffers
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["muon", "plan_roots", "newton_schulz", "MuonState", "NS_CALLS"]

NS_CALLS = threading.local()  # .count: Newton-Schulz calls on this thread (rank), for tests


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Orthogonalise ``g`` with the quintic Newton-Schulz iteration (in bf16), as Muon does."""
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
    return (x.T if tall else x).float()


def plan_roots(tensors: list[TensorSpec], world_size: int) -> list[int]:
    """Root rank per matrix: LPT by ``rows*cols*min(rows, cols)``, ties to the biggest holder.

    Deterministic: the same on every rank. Returns roots in the order of ``tensors``.
    """
    load = [0] * world_size
    roots = [0] * len(tensors)
    order = sorted(range(len(tensors)), key=lambda i: (-_cost(tensors[i]), i))
    for i in order:
        t = tensors[i]
        held = [0] * world_size
        for r in t.ranks():
            lo, hi = t.local_range(r)
            held[r] = hi - lo
        r = min(range(world_size), key=lambda q: (load[q], -held[q], q))
        roots[i] = r
        load[r] += _cost(t)
    return roots


def _cost(t: TensorSpec) -> int:
    r, c = t.shape[-2], t.shape[-1]
    return r * c * min(r, c)


@dataclass
class _Matrix:
    key: Any
    k: int
    spec: TensorSpec
    root: int
    lo: int  # this rank's piece in its shard
    hi: int


@dataclass
class MuonState:
    step: int
    momentum: dict                      # unit -> fp32 DBuffer
    matrices: list = field(default_factory=list)
    waves: list = field(default_factory=list)


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
        only: ``path -> bool``: the matrices this optimizer updates (default: every 2-D tensor).
        wave_size: Matrices per batched gather/scatter; the next wave overlaps this one's
            Newton-Schulz.

    Returns:
        An :class:`vfsdp.optim.Optimizer` (whole matrices need no special granularity: the
        root gathers them).

    Raises:
        ValueError: an unknown ``scale``.
    """
    if scale not in ("original", "moonlight"):
        raise ValueError(f"scale must be 'original' or 'moonlight', got {scale!r}")
    schedule = as_schedule(lr)

    def init(shards: Any, spec: ShardSpec, mask: Optional[Callable[[tuple], bool]] = None) -> MuonState:
        def owns(t: TensorSpec) -> bool:
            return (len(t.shape) == 2 and (only is None or only(t.path))
                    and (mask is None or mask(t.path)))

        state = MuonState(0, {})
        units = unit_buffers(shards, spec, "muon.init")
        mats: list[tuple] = []
        for u in units:
            state.momentum[u.key] = u.db.like(torch.float32, role="muon_momentum")
            for k, t in enumerate(u.db.tensors):
                if owns(t):
                    mats.append((u.key, k, t, u.db))
        roots = plan_roots([m[2] for m in mats], spec.world_size)
        for (key, k, t, db), root in zip(mats, roots):
            lo, hi = t.shard_range(db.rank)
            state.matrices.append(_Matrix(key, k, t, root, lo, hi))
        state.waves = [state.matrices[i:i + wave_size]
                       for i in range(0, len(state.matrices), wave_size)]
        return state

    def update(grads: Any, state: MuonState, shards: Any, spec: ShardSpec) -> MuonState:
        state.step += 1
        rate = schedule(state.step)
        units = {u.key: u for u in unit_buffers(shards, spec, "muon.update")}
        group = units[next(iter(units))].db.groups.shard if units else None
        rank = dist.get_rank(group)
        leaves = grad_leaves(grads, spec, "muon.update")
        with torch.no_grad():
            upd: dict = {}
            for key, u in units.items():
                g = flat_grads(leaves, u, "muon.update")
                buf = state.momentum[key].shard
                for m in state.matrices:
                    if m.key != key or m.hi <= m.lo:
                        continue
                    gs, bs = g[m.lo:m.hi], buf[m.lo:m.hi]
                    bs.lerp_(gs, 1 - momentum)
                    upd[id(m)] = gs.lerp(bs, momentum) if nesterov else bs.clone()
            pending = _exchange(state.waves[0], upd, rank, group, spec) if state.waves else None
            for w, wave in enumerate(state.waves):
                recv, meta = pending.wait()
                nxt = w + 1 < len(state.waves)
                pending = _exchange(state.waves[w + 1], upd, rank, group, spec) if nxt else None
                out = {}
                for m in wave:
                    if m.root == rank:
                        full = meta.assemble(recv, m).view(m.spec.shape)
                        o = newton_schulz(full, ns_steps)
                        rows, cols = m.spec.shape
                        o.mul_(max(1.0, rows / cols) ** 0.5 if scale == "original"
                               else 0.2 * max(rows, cols) ** 0.5)
                        out[id(m)] = o.reshape(-1)
                back = _scatter_back(wave, out, rank, group, spec)
                for m in wave:
                    if m.hi > m.lo:
                        p = units[m.key].db.shard[m.lo:m.hi]
                        if weight_decay:
                            p.mul_(1 - rate * weight_decay)
                        p.add_(back[id(m)], alpha=-rate)
        return state

    return Optimizer(init, update)


class _Layout:
    """Where each matrix's pieces sit in one all_to_all_single's send/receive buffers."""

    def __init__(self, wave, rank: int, world: int) -> None:
        self.send_sizes = [0] * world
        self.recv_sizes = [0] * world
        self.recv_at: dict = {}  # (id(m), source) -> offset in recv
        for q in range(world):  # sends grouped by destination root, in wave order
            for m in wave:
                if m.root == q:
                    self.send_sizes[q] += m.hi - m.lo
        off = 0
        for q in range(world):  # receives grouped by source, in wave order
            for m in wave:
                if m.root == rank:
                    lo, hi = m.spec.local_range(q)
                    self.recv_at[(id(m), q)] = (off, hi - lo)
                    off += hi - lo
                    self.recv_sizes[q] += hi - lo
        self.world = world

    def assemble(self, recv: torch.Tensor, m) -> torch.Tensor:
        parts = [recv[o:o + n] for q in range(self.world)
                 for o, n in [self.recv_at[(id(m), q)]]]
        return torch.cat(parts)


class _Pending:
    def __init__(self, work, recv, meta) -> None:
        self.work, self.recv, self.meta = work, recv, meta

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.recv, self.meta


def _exchange(wave, upd: dict, rank: int, group, spec: ShardSpec) -> _Pending:
    """Start gathering a wave's full updates on their roots (async all_to_all_single)."""
    world = spec.world_size
    meta = _Layout(wave, rank, world)
    pieces = [upd[id(m)] for q in range(world) for m in wave if m.root == q and m.hi > m.lo]
    send = torch.cat(pieces) if pieces else torch.empty(0)
    recv = torch.empty(sum(meta.recv_sizes))
    work = dist.all_to_all_single(recv, send, meta.recv_sizes, meta.send_sizes, group=group,
                                  async_op=True)
    return _Pending(work, recv, meta)


def _scatter_back(wave, out: dict, rank: int, group, spec: ShardSpec) -> dict:
    """Send each root's updates back to the ranks holding the pieces (the reverse exchange)."""
    world = spec.world_size
    meta = _Layout(wave, rank, world)
    pieces = []
    for q in range(world):
        for m in wave:
            if m.root == rank:
                lo, hi = m.spec.local_range(q)
                pieces.append(out[id(m)][lo:hi])
    send = torch.cat(pieces) if pieces else torch.empty(0)
    recv = torch.empty(sum(meta.send_sizes))
    dist.all_to_all_single(recv, send, meta.send_sizes, meta.recv_sizes, group=group)
    back, off = {}, 0
    for q in range(world):
        for m in wave:
            if m.root == q and m.hi > m.lo:
                back[id(m)] = recv[off:off + m.hi - m.lo]
                off += m.hi - m.lo
    return back
