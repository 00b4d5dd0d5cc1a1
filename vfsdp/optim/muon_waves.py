"""Muon's waves: matrices of one shape exchanged and orthogonalised as one stack.

``init`` groups the matrices Muon updates by shape (the global shape, and under TP the piece's
cut), and cuts each group into waves of at most ``wave_size`` matrices per root. Per wave and
rank it plans, as pure data, what one update does with a fixed number of ops whatever the
number of matrices:

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
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from vfsdp.collectives.redistribute import Redistribution
from vfsdp.optim.base import cuts_of

__all__ = ["Wave", "plan_waves", "cuts_of", "group_matrices", "held_ranges"]


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
        back: Sizes of the pieces received back (``from_roots.recv`` order).
        targets: Per piece received back: ``(index into matrices, lo, hi)`` within that
            matrix's piece on this rank.
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
    targets: tuple


def held_ranges(t: Any, world: int) -> list:
    """Each rank's flat range of ``t`` (``local_range``), read only on the ranks it spans.

    Example:
        >>> held_ranges(vfsdp.plan({"w": torch.ones(3, 2)}, 2).tree["w"], 3)
        [(0, 4), (4, 6), (0, 0)]
    """
    out = [(0, 0)] * world
    for r in t.ranks():
        out[r] = t.local_range(r)
    return out


def plan_waves(groups: list, rank: int, world: int, base: dict) -> tuple[tuple, list]:
    """The :class:`Wave` values of ``groups`` (lists of matrices exchanged together), and the
    workspace ranges each wave sends (``base``: unit key -> the unit's offset in the
    workspace), for :func:`cuts_of`."""
    waves, sends = [], []
    for mats in groups:
        held = [held_ranges(m.spec, world) for m in mats]
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
                          out_cuts, tuple(out_send), tuple(hi - lo for _, lo, hi in
                                                          from_roots.recv),
                          tuple(from_roots.recv)))
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
