"""Gradient semantics: one scenario (a sequence of backwards with some options) run on every
rank, and the same scenario computed in one process with plain tensors.

A scenario is a dict:

* ``mode``: ``"return"`` or ``"buffer"`` (the ``grads=`` option);
* ``accumulate``: ``accumulate_grads`` (``None``, the default, and ``True`` add as torch does);
* ``steps``: a list of backwards, each ``{"sync": bool, "zero_before": bool}``;
* ``retain``: run the backwards on one forward with ``retain_graph=True`` (all but the last);
* ``path``: ``"backward"`` or ``"autograd"`` (``torch.autograd.grad`` on the shards);
* ``frozen``: indices of tensor leaves whose shards do not require grad;
* ``op``: ``"avg"`` or ``"sum"``; ``mesh``: the plan's mesh.

The result on each rank is this rank's gradient piece per tensor as seen by the user: the
shards' ``.grad`` for ``"return"``, ``vfsdp.grads`` for ``"buffer"`` (and, for
``"autograd"``, what the last ``autograd.grad`` returned).
"""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

import vfsdp

SHAPES = {"layers": [{"w": (4, 3), "b": (5,)}, {"w": (2, 2, 3), "e": (0, 3)}], "head": (7,)}


def params():
    g = torch.Generator().manual_seed(7)
    return optree.tree_map(lambda s: torch.randn(s, generator=g, dtype=torch.float64),
                           SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def loss(tree, rank: int, step: int):
    """A rank- and step-dependent loss that touches every tensor nonlinearly."""
    total = torch.zeros((), dtype=torch.float64)
    for j, t in enumerate(optree.tree_leaves(tree)):
        if t.numel():
            w = torch.linspace(-1, 1, t.numel(), dtype=torch.float64).reshape(t.shape)
            total = total + ((t * w + 0.3 * rank + 0.1 * step + 0.05 * j) ** 2).sum()
    return total


def run(case: dict):
    """The scenario on this rank: per tensor, this rank's flat gradient piece (or None)."""
    rank = dist.get_rank()
    spec = vfsdp.plan(params(), case["mesh"])
    shards = vfsdp.shard(params(), spec)
    leaves = optree.tree_leaves(shards)
    for i in case["frozen"]:
        leaves[i].requires_grad_(False)
    opts = {"grads": case["mode"], "accumulate_grads": case["accumulate"],
            "grad_reduce": case["op"]}
    returned = None
    full = None
    steps = case["steps"]
    for s, step in enumerate(steps):
        if step["zero_before"]:
            vfsdp.zero_grads(shards, spec)
        if full is None or not case["retain"]:
            full = vfsdp.gather(shards, spec, grad_sync=step["sync"], **opts)
            out = loss(full, rank, s if not case["retain"] else 0)
        last = s == len(steps) - 1
        keep = case["retain"] and not last
        if case["path"] == "autograd":
            need = [x for x in leaves if x.requires_grad]
            got = torch.autograd.grad(out, need, retain_graph=keep, allow_unused=True)
            it = iter(got)
            returned = [next(it) if x.requires_grad else None for x in leaves]
        else:
            out.backward(retain_graph=keep)
    if case["path"] == "autograd" and case["mode"] == "return":
        seen = returned
    elif case["mode"] == "return":
        seen = [x.grad for x in leaves]
    else:
        seen = optree.tree_leaves(vfsdp.grads(shards, spec))
    return [None if g is None else g.detach().reshape(-1).tolist() for g in seen]


def reference(case: dict, world: int):
    """The same scenario in one process: per rank, per tensor, the expected flat piece."""
    spec = vfsdp.plan(params(), case["mesh"])
    base = params()
    n = len(optree.tree_leaves(base))

    def reduced(step_index: int):  # the mean or sum over ranks of one backward's gradients
        total = None
        for r in range(world):
            tree = optree.tree_map(lambda t: t.clone().requires_grad_(True), base)
            ts = optree.tree_leaves(tree)
            gs = torch.autograd.grad(loss(tree, r, step_index), ts, allow_unused=True)
            gs = [torch.zeros_like(t) if g is None else g for t, g in zip(ts, gs)]
            total = gs if total is None else [a + b for a, b in zip(total, gs)]
        return [t / world for t in total] if case["op"] == "avg" else total

    zeros = [torch.zeros_like(t) for t in optree.tree_leaves(base)]
    value = [None] * n                # what the user sees
    pending = [z.clone() for z in zeros]  # unsynced, not yet reduced
    last_return = None
    for s, step in enumerate(case["steps"]):
        g = reduced(s if not case["retain"] else 0)
        if step["zero_before"]:  # zero_grads also drops what was accumulated unreduced
            value = [None] * n
            pending = [z.clone() for z in zeros]
        pending = [p + x for p, x in zip(pending, g)]
        if not step["sync"]:
            last_return = None
            continue
        this, pending = pending, [z.clone() for z in zeros]
        last_return = this
        value = [t if v is None else v + t for v, t in zip(value, this)]  # as torch: they add
    if case["path"] == "autograd" and case["mode"] == "return":
        value = last_return if last_return is not None else [None] * n
    out = []
    tensors = list(spec.tensors())
    for r in range(world):
        mine = []
        for i, (t, v) in enumerate(zip(tensors, value)):
            if i in case["frozen"] or v is None:
                mine.append(None if case["mode"] == "return" else
                            [0.0] * (t.local_range(r % spec.world_size)[1]
                                     - t.local_range(r % spec.world_size)[0]))
                continue
            lo, hi = t.local_range(r % spec.world_size)
            mine.append(v.reshape(-1)[lo:hi].tolist())
        out.append(mine)
    return out


def one_grad_replaced():
    """After a grads="buffer" backward the user sets one shard's .grad to None, as torch allows:
    the next backward gives that shard the new gradient alone and adds to the others'."""
    import vfsdp

    params = {"a": torch.ones(8), "b": torch.ones(8)}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    for step in range(2):
        full = vfsdp.gather(shards, spec, grads="buffer")
        (full["a"] * 2 + full["b"] * 3).sum().backward()
        if step == 0:
            shards["a"].grad = None
    grads = vfsdp.grads(shards, spec)
    return sorted(set(grads["a"].tolist())), sorted(set(grads["b"].tolist()))
