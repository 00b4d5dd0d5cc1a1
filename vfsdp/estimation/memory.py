"""Memory per rank, exact for what vfsdp allocates: its buffers over the step's schedule.

Each unit owns, on each rank (``S`` elements per rank, ``m`` ranks in its shard group):

* the parameter shard, ``S`` elements in the parameters' dtype, always;
* while gathered, the full buffer, ``m*S`` in the compute dtype (``param_dtype``; a compute
  copy's shard is a view of it, so it costs nothing more);
* during its backward, the reduce-scatter input, ``m*S`` in the reduction dtype (the gradient
  buffer's own when that is the parameters' dtype, else a staging buffer, whose ``S``-element
  shard then stays);
* the reduced gradient shard, ``S`` in the parameters' dtype, from its backward until
  ``zero_grads``;
* the optimizer's state, measured by running the optimizer's own ``init`` over ``meta``
  shards of this rank (no memory, no process group); over only the tensors with a piece on
  the rank where the optimizer declares its state local (``Optimizer.local_state``).

:func:`timeline` replays the order in which ``run_layers`` (and a unit gathered around it for
the whole step, such as the embedding and head) allocate and free these, and its peak is what
:class:`~vfsdp.testing.memory.BufferBytes` measures (tested within 3 % at W = 2 and 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

import optree
import torch

from vfsdp._torch_private import storage_id
from vfsdp._warnings import warn_user
from vfsdp.collectives.comm import MeshGroups
from vfsdp.collectives.unit import Unit
from vfsdp.optim.base import state_tensors
from vfsdp.planner.plan import Prepared
from vfsdp.planner.spec import ShardSpec, TensorSpec, UnitLayout

__all__ = ["UnitBytes", "unit_bytes", "timeline", "peak", "optimizer_bytes", "alike_units",
           "alike_members", "split_units", "baseline_sizes", "baseline_padding", "group_keys"]


@dataclass(frozen=True)
class UnitBytes:
    """One unit's buffers on one rank, in bytes (see the module docstring)."""

    key: Any
    shard: int        # the parameter shard
    gathered: int     # the full buffer in the compute dtype
    reduce_in: int    # the reduce-scatter input
    stage_shard: int  # the staging buffer's shard (a reduction dtype other than the params')
    grad_shard: int   # the reduced gradient shard
    accum: int        # grad_sync=False's accumulator: the full unit in the parameters' dtype
    grads: int = 0    # FSDP2's unsharded gradients, autograd's: the full unit in the compute dtype


def baseline_padding(u: UnitLayout, system: str) -> int:
    """The padding unit ``u`` needs under another system's sharding rule (``"fsdp2"``: every
    tensor split on dim 0; ``"megatron"``: Megatron-FSDP's buffer padded to ``m`` LCM chunks,
    so every rank's shard starts on a row: its ``BufferIndex`` with a ``chunk_size_factor``),
    from :mod:`vfsdp.planner.baselines`."""
    from vfsdp.planner import baselines

    rule = baselines.fsdp2_padding if system == "fsdp2" else baselines.megatron_padding
    return rule([(tuple(sh), b) for sh, b in zip(u.shapes, u.blocks)], u.world_size)


def baseline_sizes(units: Mapping[Any, UnitLayout], system: str) -> dict:
    """Each unit's ``S`` under another system's sharding rule and padding
    (:func:`baseline_padding`): padding only, none of their copies (``units``: a spec's
    ``units``)."""
    return {key: -(-(u.total_numel + baseline_padding(u, system)) // u.world_size)
            for key, u in units.items()}


def unit_bytes(units: Mapping[Any, UnitLayout], param_dtype: Optional[torch.dtype] = None,
               reduce_dtype: Optional[torch.dtype] = None,
               sizes: Optional[dict] = None) -> list:
    """Every unit's :class:`UnitBytes`, in the spec's unit order (``sizes``: ``S`` per unit
    key in place of the plan's, e.g. :func:`baseline_sizes`)."""
    out = []
    for key, u in units.items():
        r_dtype = reduce_dtype or param_dtype or u.dtype
        p, c, r = u.dtype.itemsize, (param_dtype or u.dtype).itemsize, r_dtype.itemsize
        S, m = (sizes or {}).get(key, u.shard_numel), u.world_size
        out.append(UnitBytes(key, S * p, m * S * c, m * S * r,
                             S * r if r_dtype != u.dtype else 0, S * p, m * S * p, m * S * c))
    return out


def split_units(units: Mapping[Any, UnitLayout], layers: Optional[list] = None) -> tuple:
    """The units ``run_layers`` runs (``layers``, or by default the longest run of units
    keyed ``(name, i)``, in order) and the others (gathered around them for the whole
    step).

    Raises:
        ValueError: ``layers`` names a unit the plan does not have.
    """
    if layers is None:
        runs = group_keys((key[:-1], key) for key in units
                        if isinstance(key, tuple) and len(key) >= 2 and isinstance(key[-1], int))
        layers = max(runs, key=len) if runs else []
        if not layers and len(units) > 1:
            warn_user("estimate: no run of units keyed (name, i) found, so every unit is "
                      "taken as gathered for the whole step (no prefetch, no release); pass "
                      "layers= with the unit keys run_layers runs")
    missing = [k for k in layers if k not in units]
    if missing:
        raise ValueError(f"estimate: layers= names units the plan does not have: "
                         f"{missing[:3]}; pass keys of spec.units")
    chosen = set(layers)
    return list(layers), [k for k in units if k not in chosen]


def timeline(units: list, layers: list, prefetch: bool, reshard_after_forward: bool,
             acts: dict, transient: dict, copies: bool = False,
             accumulated: Optional[Mapping] = None) -> list:
    """The step's buffer events, as ``(label, kind, delta_bytes)`` in the order vfsdp runs
    them: the whole-step units gathered, ``run_layers``' forward and backward over ``layers``
    (gather ahead by one with ``prefetch``, release after forward unless the last), each
    unit's reduce-scatter input allocated as its backward ends and freed when the next
    reduction waits for it, the whole-step units reduced last. ``acts``: bytes each
    unit's forward saves for its backward (kind ``"activations"``), the whole-step
    units' (the head's logits) from the end of the layers' forward to the start of their
    backward; ``transient``: bytes a layer's backward holds while it runs (what activation
    checkpointing recomputes); ``copies``: FSDP2's, each all-gather's output beside the
    unsharded parameters it is copied into when the unit's turn comes (a prefetched one's
    lives until then), and each unit's unsharded gradients (autograd's, in the compute
    dtype) beside the reduce-scatter input they are copied into; ``accumulated``: per unit
    key, the bytes of its gradients accumulated without a reduce (``grad_sync=False``; in
    the caller's base), freed unit by unit as the last backward reduces them: vfsdp's
    accumulator is the reduce-scatter input where it is in the reduce dtype, else copied
    into one; FSDP2 adds autograd's unsharded gradients into its own, copies that into the
    input and drops it; the gradient shard comes after."""
    by = {u.key: u for u in units}
    rest = [by[k] for k in by if k not in set(layers)]
    run = [by[k] for k in layers]
    ev: list = []
    gathered: set = set()
    landing: set = set()  # FSDP2: all-gather outputs not copied out yet

    def gather(u, own=True):
        if u.key not in gathered:
            gathered.add(u.key)
            ev.append((f"gather {u.key}", "buffers", u.gathered))
            if copies:
                landing.add(u.key)
                ev.append((f"all-gather output {u.key}", "buffers", u.gathered))
        if own and u.key in landing:  # its turn: copied out, the output freed
            landing.discard(u.key)
            ev.append((f"copied out {u.key}", "buffers", -u.gathered))

    def release(u):  # every unit released is gathered
        gathered.discard(u.key)
        ev.append((f"release {u.key}", "buffers", -u.gathered))

    def reduced(u):  # its reduce-scatter input freed
        if u is not None:
            ev.append((f"reduced {u.key}", "buffers", -u.reduce_in))

    def reduce(u):  # returns u while its reduce-scatter input is in flight
        acc = (accumulated or {}).get(u.key, 0)
        shard = [(f"gradient shard {u.key}", "gradients", u.grad_shard)]
        freed = [(f"accumulator reduced {u.key}", "gradients", -acc)]
        if acc and not copies and not u.stage_shard:  # the accumulator is the input
            ev.extend(shard + freed)
            return None
        first = [(f"gradient shard {u.key}", "gradients", u.stage_shard + (0 if acc else u.grad_shard))]
        # FSDP2: autograd's unsharded gradients, added into the accumulator and dropped, or
        # copied into the input
        grads = [(f"unsharded gradients {u.key}", "buffers", u.grads)] if copies else []
        done = [(f"copied in {u.key}", "buffers", -u.grads)] if copies else []
        red = [(f"reduce {u.key}", "buffers", u.reduce_in)]
        ev.extend(first + grads + done + red + freed + shard if acc else first + grads + red + done)
        return u

    def saved(u, sign):
        if acts.get(u.key):
            ev.append((f"{'forward' if sign > 0 else 'backward'} {u.key}", "activations",
                       sign * acts[u.key]))

    for u in rest:
        gather(u)
    for i, u in enumerate(run):  # forward
        gather(u)
        if prefetch and i + 1 < len(run):
            gather(run[i + 1], own=False)
        saved(u, 1)
        if reshard_after_forward and i + 1 < len(run):
            release(u)
    for u in rest:  # the head's forward (the logits), and its backward, before the layers'
        saved(u, 1)
    for u in reversed(rest):
        saved(u, -1)
    pending = None
    for i, u in reversed(list(enumerate(run))):  # backward
        gather(u)
        if prefetch and i > 0:
            gather(run[i - 1], own=False)
        if transient.get(u.key):  # what its backward recomputes, while it runs
            ev.append((f"recompute {u.key}", "activations", transient[u.key]))
            ev.append((f"recomputed {u.key}", "activations", -transient[u.key]))
        saved(u, -1)
        release(u)
        now, pending = pending, reduce(u)  # reduced once the next reduction waits for it
        reduced(now)
    for u in reversed(rest):
        reduced(reduce(u))
    reduced(pending)
    for u in rest:
        release(u)
    return ev


def peak(base: int, events: list) -> tuple:
    """``(peak bytes, the event at the peak, bytes by kind at the peak)`` of ``base`` plus
    the running sum of the events."""
    now, best, at = base, base, "start"
    kinds: dict = {"buffers": 0, "gradients": 0, "activations": 0}
    best_kinds = dict(kinds)
    for label, kind, delta in events:
        now += delta
        kinds[kind] += delta
        if now > best:
            best, at, best_kinds = now, label, dict(kinds)
    return best, at, best_kinds


def optimizer_bytes(opt: Any, units: Mapping[Any, UnitLayout], rank: int = 0,
                    replicas: int = 1, alike: Optional[list] = None) -> int:
    """Bytes of the optimizer's state on ``rank`` of a plan's ``units`` (``spec.units``): its
    ``init`` run over ``meta`` shards of that rank (no memory, no process group), every tensor
    of the state counted once; once per distinct unit (the same layout and shapes give the
    same state), times its count. An optimizer whose state is local
    (``opt.local_state``) is run over only the tensors with a piece on the rank (the same
    count: tested), which a rank of a large shard group holds few of. ``alike``: the
    distinct units as lists of keys, where the caller has them (:func:`alike_units`). What
    the optimizer makes once and shares between units (8-bit AdamW's code maps: the same
    storages from a second ``init`` of the first unit) is counted once."""
    total, shared = 0, None
    for keys in alike if alike is not None else alike_units(units):
        u = units[keys[0]]
        if u.paths:
            r = min(rank, u.world_size - 1)
            part = _on_rank(u, r) if getattr(opt, "local_state", False) else u
            state, sizes = _unit_state_bytes(opt, part, replicas, r)
            if shared is None:  # both inits alive: a storage in both is the optimizer's own
                again = _unit_state_bytes(opt, part, replicas, r)[1]
                shared = {sid: n for sid, n in sizes.items() if sid in again}
                total += sum(shared.values())
            total += len(keys) * sum(n for sid, n in sizes.items() if sid not in shared)
            del state
    return total


def alike_units(units: Mapping[Any, UnitLayout]) -> list:
    """The keys of ``units`` grouped by layout and shapes (what an optimizer's state of a
    unit depends on), in unit order."""
    return group_keys(((u.signature, u.shapes), key) for key, u in units.items())


def alike_members(prepared: Prepared) -> list:
    """:func:`alike_units` of any plan of ``prepared``, from its tree alone: units of the same
    numels, blocks, dtype and shapes are laid out alike at every shard group size (the
    solver's input), so a sweep groups them once."""
    return group_keys(((numels, blocks, dtype, shapes), key)
                    for key, (_, _, shapes, numels, blocks, dtype) in prepared.members.items())


def group_keys(pairs: Any) -> list:
    """The keys of ``(group, key)`` pairs, as a list per group in first-seen order.

    Example:
        >>> group_keys([("a", 1), ("b", 2), ("a", 3)])
        [[1, 3], [2]]
    """
    groups: dict = {}
    for group, key in pairs:
        groups.setdefault(group, []).append(key)
    return list(groups.values())


def _on_rank(u: UnitLayout, rank: int) -> UnitLayout:
    """``u`` with only the tensors that have a piece on ``rank`` (S, offsets and the rest
    kept), or its first tensor where ``rank`` holds none (its state buffers are made all the
    same)."""
    lo, hi = rank * u.shard_numel, (rank + 1) * u.shard_numel
    keep = [k for k, (o, n) in enumerate(zip(u.offsets, u.numels)) if o < hi and o + n > lo]
    if len(keep) == len(u.paths):
        return u
    keep = keep or [0]
    names = ("paths", "offsets", "numels", "blocks", "shapes") + (("strided",) if u.strided else ())
    return replace(u, split=None, **{f: tuple(getattr(u, f)[k] for k in keep) for f in names})


def _unit_state_bytes(opt: Any, u: UnitLayout, replicas: int, rank: int) -> tuple:
    """``(state, {storage id: bytes})``: the optimizer's state of unit ``u`` on ``rank`` (meta
    shards of a spec of its tensors, under their own paths: what labels and ties read), and
    its storages but the parameters'."""
    root: Any = u.tensors[0] if len(u.paths) == 1 and not u.paths[0] else {}  # one tensor: the tree
    for t in u.tensors if isinstance(root, dict) else ():
        node = root
        for part in t.path[:-1]:
            node = node.setdefault(part, {})
        node[t.path[-1]] = t
    ordered, treespec = optree.tree_flatten(root, is_leaf=lambda x: isinstance(x, TensorSpec))
    spec = ShardSpec(treespec, ordered, {u.key: u},
                     (replicas, u.world_size) if replicas > 1 else (u.world_size,))
    unit = Unit(u, MeshGroups(None, None, rank, u.world_size, 0, replicas,
                              torch.device("meta"), (tuple(range(u.world_size)),)))
    with torch.no_grad():
        views = [v.requires_grad_(v.is_floating_point())
                 for v in map(unit.params.local, range(len(u.paths)))]
    state = opt.init(optree.tree_unflatten(spec.treespec, [views[u.index(t.path)]
                                                           for t in spec.leaves()]), spec)
    skip = {storage_id(x) for x in views}
    return state, {storage_id(x): x.untyped_storage().nbytes() for x in state_tensors(state)
                   if storage_id(x) not in skip}
