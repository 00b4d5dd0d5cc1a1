"""One small training step on every path (eager ``gather``, eager ``run_layers``, both through
an identity low-precision hook, ``torch.func``, compiled) under a set of options, and the same
step in one plain-torch process.

A case is a dict: ``path``; ``micro`` (backwards before the gradients are read, one
``grad_sync`` flag each); ``accumulate`` (``accumulate_grads``: ``None`` or ``True``);
``op`` (``grad_reduce``); ``reduce_dtype`` (``None`` or ``"float64"``); ``world``.
"""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

import vfsdp

SHAPES = [{"w": (4, 4), "b": (4,)}, {"w": (4, 4), "b": (4,)}, {"w": (4, 4), "b": (4,)}]


class Identity:
    """A low-precision hook that sends the shard as it is."""

    def pre_all_gather(self, shard, unit):
        return shard, shard.new_zeros(0)

    def post_all_gather(self, payload, meta, unit):
        return payload


def params():
    g = torch.Generator().manual_seed(3)
    return {"layers": [{k: torch.randn(s, generator=g) * 0.5 for k, s in layer.items()}
                       for layer in SHAPES]}


def layer(p, h):
    return torch.tanh(h @ p["w"] + p["b"])


def batch(rank: int, micro: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 8).reshape(2, 4) * (1 + rank) + 0.1 * micro


def loss_of(full, x):
    for p in full["layers"]:
        x = layer(p, x)
    return (x ** 2).sum()


def _options(case, sync: bool) -> dict:
    opts = {"grad_reduce": case["op"], "grad_sync": sync}
    if case["accumulate"] is not None:
        opts["accumulate_grads"] = case["accumulate"]
    if case["reduce_dtype"] is not None:
        opts["reduce_dtype"] = getattr(torch, case["reduce_dtype"])
    if case["path"].startswith("lowp"):
        opts["all_gather"] = Identity()
    return opts


def step(case: dict, shards, spec, compiled=None):
    """The micro-batches' backwards on this rank, by the case's path."""
    rank = dist.get_rank()
    path = case["path"]
    for i, sync in enumerate(case["micro"]):
        x = batch(rank, i)
        opts = _options(case, sync)
        if path in ("gather", "lowp"):
            loss_of(vfsdp.gather(shards, spec, **opts), x).backward()
        elif path in ("run_layers", "lowp_layers"):
            vfsdp.run_layers(layer, shards["layers"], spec["layers"], x,
                             **opts).pow(2).sum().backward()
        elif path == "compiled":
            compiled(shards, x, sync)
        else:  # torch.func: the returned gradients, summed by hand (they are values)
            got = torch.func.grad(lambda s: loss_of(vfsdp.gather(s, spec, **opts), x))(shards)
            for s_, g in zip(optree.tree_leaves(shards), optree.tree_leaves(got)):
                s_.grad = g if s_.grad is None else s_.grad + g


def run(case: dict):
    """The case on this rank: its gradient pieces, flat, or the refusal's message."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)
    try:
        step(case, shards, spec)
    except ValueError as exc:
        return str(exc)
    return [g.reshape(-1).tolist() for g in optree.tree_leaves(vfsdp.grads(shards, spec))]


def run_compiled(case: dict):
    """As :func:`run`, the step compiled (one graph per grad_sync value)."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)
    opts = {k: v for k, v in _options(case, True).items() if k != "grad_sync"}

    def body(shards, x, sync):
        if case["entry"] == "gather":
            loss_of(vfsdp.gather(shards, spec, grad_sync=sync, **opts), x).backward()
        else:
            vfsdp.run_layers(layer, shards["layers"], spec["layers"], x, grad_sync=sync,
                             **opts).pow(2).sum().backward()

    try:
        # the graph's meaning, as traced (inductor's code: tests/functional/test_compiled.py)
        step(case, shards, spec, torch.compile(body, fullgraph=True, backend="aot_eager"))
    except Exception as exc:  # noqa: BLE001 - dynamo wraps a refusal
        return str(exc)
    return [g.reshape(-1).tolist() for g in optree.tree_leaves(vfsdp.grads(shards, spec))]


def reference(case: dict) -> list:
    """Per rank, per tensor, the flat gradient piece one plain-torch process gives: the sum
    over the micro-batches of the mean (or sum) over the ranks."""
    world = case["world"]
    base = optree.tree_map(lambda t: t.clone().requires_grad_(), params())
    total = 0
    for i in range(case.get("zero_before") or 0, len(case["micro"])):
        per_rank = sum(loss_of(base, batch(r, i)) for r in range(world))
        total = total + (per_rank / world if case["op"] == "avg" else per_rank)
    total.backward()
    spec = vfsdp.plan(params(), world)
    grads = optree.tree_map(lambda t: t.grad, base)
    return [[g.reshape(-1).tolist() for g in optree.tree_leaves(piece)]
            for piece in vfsdp.testing.shard_reference(grads, spec)]


def refusal(case: dict):
    """The words a path refuses the case's options in, or ``None`` when it honours them."""
    if case["path"] == "func":
        if case["accumulate"]:
            return "vfsdp.gather: accumulate_grads=True is not supported under torch.func"
        if not all(case["micro"]):
            return "vfsdp.gather: grad_sync=False is not supported under torch.func"
    return None


def run_mixed(case: dict):
    """Micro-batches run eagerly or compiled, one path each (``case["paths"]``), with a
    compiled ``zero_grads`` before micro-batch ``case["zero_before"]`` (or none): one
    accumulator serves both paths, so nothing is dropped or reduced twice."""
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)
    opts = {k: v for k, v in _options(case, True).items() if k != "grad_sync"}

    def body(shards, x, sync):
        loss_of(vfsdp.gather(shards, spec, grad_sync=sync, **opts), x).backward()

    compiled = torch.compile(body, fullgraph=True, backend="aot_eager")
    zero = torch.compile(lambda s: vfsdp.zero_grads(s, spec), fullgraph=True, backend="aot_eager")
    for i, (sync, path) in enumerate(zip(case["micro"], case["paths"])):
        if i == case.get("zero_before"):
            zero(shards)
        (compiled if path == "compiled" else body)(shards, batch(dist.get_rank(), i), sync)
    return [g.reshape(-1).tolist() for g in optree.tree_leaves(vfsdp.grads(shards, spec))]
