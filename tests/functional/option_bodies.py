"""Bodies for the gradient-option tests (module-level: simulate and spawn)."""

from __future__ import annotations

import gc
import weakref

import optree
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import slot_of


def params():
    g = torch.Generator().manual_seed(5)
    return {"layers": [{"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)}
                       for _ in range(2)],
            "head": torch.randn(4, 3, generator=g)}


def loss_of(full, x):
    h = x.to(full["head"].dtype)
    for p in full["layers"]:
        h = torch.tanh(h @ p["w"][:4] + p["b"])
    return (h @ full["head"]).float().pow(2).sum()


def _x():
    return torch.linspace(-1, 1, 8).reshape(2, 4) * (1 + dist.get_rank())


def func_refused(option: dict):
    """gather under torch.func.grad with an option it cannot honour: the message."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)

    def f(s):
        return loss_of(vfsdp.gather(s, spec, **option), _x())

    try:
        torch.func.grad(f)(shards)
    except ValueError as exc:
        return str(exc)
    return "no error"


def paths(option: dict):
    """Gradients of the same loss by backward, autograd.grad, torch.func.grad and grads='buffer'."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    out = {}
    shards = vfsdp.shard(params(), spec)
    loss_of(vfsdp.gather(shards, spec, **option), _x()).backward()
    out["backward"] = [t.grad for t in optree.tree_leaves(shards)]
    shards = vfsdp.shard(params(), spec)
    leaves = optree.tree_leaves(shards)
    out["autograd"] = list(torch.autograd.grad(loss_of(vfsdp.gather(shards, spec, **option),
                                                       _x()), leaves))
    shards = vfsdp.shard(params(), spec)
    g = torch.func.grad(lambda s: loss_of(vfsdp.gather(s, spec, **option), _x()))(shards)
    out["func"] = optree.tree_leaves(g)
    shards = vfsdp.shard(params(), spec)
    full = vfsdp.gather(shards, spec, grads="buffer", **option)
    loss_of(full, _x()).backward()
    out["buffer"] = optree.tree_leaves(vfsdp.grads(shards, spec))
    freed = not any(slot_of(t).buffer.is_allocated for t in optree.tree_leaves(full))
    return {k: [t.detach().clone() for t in v] for k, v in out.items()}, freed


def async_buffer(micro: int):
    """grads='buffer' with async_reduce over micro-batches (accumulating) vs synchronous."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    results = []
    for async_reduce in (False, True):
        shards = vfsdp.shard(params(), spec)
        for _ in range(micro):
            full = vfsdp.gather(shards, spec, grads="buffer", accumulate_grads=True,
                                async_reduce=async_reduce)
            loss_of(full, _x()).backward()
        results.append([t.clone() for t in optree.tree_leaves(vfsdp.grads(shards, spec))])
    return all(torch.equal(a, b) for a, b in zip(*results))


def run_layers_refusals():
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)
    msgs = {}
    for name, opts in (("return", {"grads": "return"}), ("unknown", {"grad_sink": 1})):
        try:
            vfsdp.run_layers(lambda p, h: h, shards["layers"], spec["layers"], _x(), **opts)
            msgs[name] = "no error"
        except (TypeError, ValueError) as exc:
            msgs[name] = f"{type(exc).__name__}: {exc}"
    return msgs


def explicit_reduce_scatter():
    """reduce_scatter: grad_reduce and accumulate_grads honoured, by keyword or a Policy (its
    gather-side fields do not apply); options it cannot honour refused; the 0.1 spelling op=
    is gone."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)
    g = optree.tree_map(lambda t: torch.ones_like(t) * (1 + dist.get_rank()), params())
    once = [t.clone() for t in optree.tree_leaves(
        vfsdp.reduce_scatter(g, spec, shards=shards, grad_reduce="sum"))]
    twice = [t.clone() for t in optree.tree_leaves(vfsdp.reduce_scatter(
        g, spec, shards=shards, grad_reduce="sum", accumulate_grads=True))]
    by_policy = optree.tree_leaves(vfsdp.reduce_scatter(
        g, spec, vfsdp.Policy(grad_reduce="sum", param_dtype=torch.bfloat16), shards=shards))
    refused = []
    for bad in ({"op": "sum"}, {"grad_sync": False}, {"grads": "return"}, {"grad_reduce": "max"}):
        try:
            vfsdp.reduce_scatter(g, spec, shards=shards, **bad)
            refused.append(None)
        except (TypeError, ValueError) as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    total = sum(1 + r for r in range(dist.get_world_size()))
    return (all(torch.all(t == total) for t in once),
            all(torch.equal(a * 2, b) for a, b in zip(once, twice)),
            all(torch.equal(a, b) for a, b in zip(once, by_policy)), refused)


def temporary_units_are_not_kept():
    """Plain tensors are packed into a unit for one call; nothing keeps it afterwards."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    plain = [t.detach().clone() for t in optree.tree_leaves(vfsdp.shard(params(), spec))]
    tree = optree.tree_unflatten(spec.treespec, plain)
    full = vfsdp.gather(tree, spec)
    ok = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(full),
                                               optree.tree_leaves(params())))
    refs = [weakref.ref(slot_of(t).unit) for t in optree.tree_leaves(full)]
    del full
    gc.collect()
    return ok, all(r() is None for r in refs)
