"""Checkpoint adapters for vfsdp's optimizer states.

Each state is saved as what cannot be recomputed from the spec and the optimizer's
arguments: the step and the moments, as trees shaped like the parameters (so they reload
under any plan). Derived data (decay ranges, tile maps, Muon's roots and waves) is rebuilt by
``opt.init`` on the loading side.

* AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``.
* 8-bit AdamW: ``step``, the uint8 codes ``codes_m`` / ``codes_v`` (per element, so a new
  block placement gets the same codes), the per-tile scales ``scales_m`` / ``scales_v`` (one
  global vector per tensor, indexed by tile: ``(matrix, row stripe, column tile)``) and the
  fp32 moments of the small tensors, ``fp32_m`` / ``fp32_v``.
* Muon: ``step``, ``momentum``.
"""

from __future__ import annotations

import math

import optree

from vfsdp.checkpoint.entries import register_state
from vfsdp.checkpoint.pieces import Piece
from vfsdp.optim.adamw import AdamWState
from vfsdp.optim.adamw8bit import AdamW8bitState
from vfsdp.optim.muon import MuonState
from vfsdp.optim.quant import TILE
from vfsdp.planner.spec import PASSTHROUGH, ShardSpec

__all__ = ["param_tree"]


def param_tree(dbs: dict, spec: ShardSpec, pieces=None) -> dict:
    """A tree shaped like the parameters holding, per tensor, its piece of ``dbs[unit]``.

    ``pieces(db, k) -> Piece or None`` overrides the default (the tensor's local view).
    Tensors whose unit is not in ``dbs``, or for which ``pieces`` returns ``None``, are left
    out (their subtree is empty).
    """
    leaves = []
    for s in spec.leaves():
        db = dbs.get(getattr(s, "unit", None)) if s is not PASSTHROUGH else None
        if db is None:
            leaves.append(None)
            continue
        k = db.index(s.path)
        leaves.append(pieces(db, k) if pieces else
                      Piece(db.local(k), tuple(s.shape), s.local_range(db.rank)[0],
                            writer=db.groups.replicate_rank == 0, db=db, index=k))
    return optree.tree_unflatten(spec.treespec, leaves)


def _adamw(state: AdamWState, spec: ShardSpec) -> dict:
    return {"step": state.step, "exp_avg": param_tree(state.exp_avg, spec),
            "exp_avg_sq": param_tree(state.exp_avg_sq, spec)}


def _set_step(state, tree: dict):
    state.step = tree["step"]
    return state


def _tile_range(shape: tuple, start: int) -> tuple[int, int]:
    """``(first global tile, total tiles)`` of a rank range starting at flat ``start``."""
    rows, cols = shape[-2], shape[-1]
    row_tiles, col_tiles = math.ceil(rows / TILE), math.ceil(cols / TILE)
    total = math.prod(shape[:-2]) * row_tiles * col_tiles
    g0 = start // cols
    stripe = (g0 // rows) * row_tiles + (g0 % rows) // TILE
    return stripe * col_tiles, total


def _adamw8bit(state: AdamW8bitState, spec: ShardSpec) -> dict:
    tree = {"step": state.step, "codes_m": param_tree(state.codes_m, spec),
            "codes_v": param_tree(state.codes_v, spec)}
    q8 = {(key, t.k): t for key, ts in state.quantized.items() for t in ts}
    f32 = {(key, k): (lo, m, v) for key, ts in state.fp32.items() for k, lo, _, m, v in ts}
    for attr in ("m", "v"):
        def scales(db, k, attr=attr):
            t = q8.get((db.key, k))
            if t is None:
                return None
            ts = db.tensors[k]
            first, total = _tile_range(tuple(ts.shape), ts.local_range(db.rank)[0])
            first = first if t.n_tiles else 0
            return Piece(getattr(t, f"scale_{attr}"), (total,), first,
                         writer=db.groups.replicate_rank == 0)

        def small(db, k, attr=attr):
            found = f32.get((db.key, k))
            if found is None:
                return None
            ts = db.tensors[k]
            return Piece(found[1] if attr == "m" else found[2], tuple(ts.shape),
                         ts.local_range(db.rank)[0], writer=db.groups.replicate_rank == 0)

        tree[f"scales_{attr}"] = param_tree(state.codes_m, spec, scales)
        tree[f"fp32_{attr}"] = param_tree(state.codes_m, spec, small)
    return tree


def _muon(state: MuonState, spec: ShardSpec) -> dict:
    return {"step": state.step, "momentum": param_tree(state.momentum, spec)}


register_state(AdamWState, _adamw, _set_step)
register_state(AdamW8bitState, _adamw8bit, _set_step)
register_state(MuonState, _muon, _set_step)
