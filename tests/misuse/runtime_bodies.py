"""Bodies of tests/misuse/test_runtime.py: each runs on threads (simulate) and gloo (spawn)."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import vfsdp
from vfsdp.collectives import slot_of
from vfsdp.functional.gather import pending


class _WorldSum(torch.autograd.Function):
    """Identity forward; the backward all-reduces the cotangent over the world (a stand-in
    for an expert dispatch's all-to-all: a data collective inside the backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def _collapse_params():
    torch.manual_seed(0)
    dense = {"a": torch.randn(4, 4)}
    experts = {"e": torch.randn(2, 4, 4)}  # one expert per EP rank
    return dense, experts


def routing_collapse():
    """EP x FSDP with one rank's experts getting no tokens: its backward reaches no expert
    unit before the data collective the other rank's backward runs after its expert unit.
    The gradients equal one process's (each rank holds its own experts whole)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dense, experts = _collapse_params()
    mesh = vfsdp.mesh(("dp", 1), ("ep", world))
    d_spec = vfsdp.plan(dense, world)
    e_spec = vfsdp.plan(experts, mesh, tp=lambda path: Shard(0), tp_axis="ep")
    d_sh, e_sh = vfsdp.shard(dense, d_spec), vfsdp.shard(experts, e_spec, mesh=mesh)
    x = torch.ones(2, 4) * (rank + 1)
    fd = vfsdp.gather(d_sh, d_spec)
    h = _WorldSum.apply(x @ fd["a"])
    fe = vfsdp.gather(e_sh, e_spec)
    loss = (h @ fe["e"][0]).sum() if rank == 0 else h.sum()  # rank 1's expert: no tokens
    loss.backward()
    ga, ge = routing_collapse_reference(world)
    want = vfsdp.shard({"a": ga}, d_spec, requires_grad=False)["a"]
    e_grad = e_sh["e"].grad
    unused = e_grad is None or not e_grad.any()
    return (float((d_sh["a"].grad - want).abs().max()),
            unused if rank else float((e_grad.reshape(4, 4) - ge).abs().max()))


def routing_collapse_reference(world: int) -> tuple:
    """One process: rank r's h_r = x_r @ a, whose cotangent the world sum makes the sum of
    every rank's; the dense gradient averaged over the ranks, rank 0's expert gradient."""
    dense, experts = _collapse_params()
    a, e = dense["a"], experts["e"][0]
    xs = [torch.ones(2, 4) * (r + 1) for r in range(world)]
    cot = [torch.ones(2, 4) @ e.T] + [torch.ones(2, 4)] * (world - 1)
    total = sum(cot)
    ga = sum(x.T @ total for x in xs) / world
    ge = (xs[0] @ a).T @ torch.ones(2, 4)
    return ga, ge


def reshard_keeps_a_held_graph():
    """A gather of layer 0 of your own, saved by autograd, then run_layers over layer 0:
    the reshard leaves the memory to that graph, and both backwards give torch's grads."""
    world = dist.get_world_size()
    torch.manual_seed(1)
    params = {"layers": [{"w": torch.randn(4, 4) / 2} for _ in range(2)]}
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    x = torch.ones(1, 4)
    mine = vfsdp.gather(shards["layers"][0], spec["layers"][0])
    y = (x @ mine["w"]).sum()                      # autograd saves x, reads mine["w"] later
    h = vfsdp.run_layers(lambda p, v: torch.tanh(v @ p["w"]), shards["layers"], spec["layers"],
                         x)
    (y + h.sum()).backward()
    return [s["w"].grad.tolist() if s["w"].grad is not None else
            vfsdp.grads(shards, spec)["layers"][i]["w"].tolist()
            for i, s in enumerate(shards["layers"])]


def shared_unit_prefetch():
    """run_layers over [l0, l0, l1]: a unit shared by two consecutive layers is not freed
    by the first one's reshard while the second one's prefetch holds it."""
    world = dist.get_world_size()
    torch.manual_seed(2)
    params = {"layers": [{"w": torch.randn(4, 4) / 2} for _ in range(2)]}
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    order = [0, 0, 1]
    h = vfsdp.run_layers(lambda p, v: torch.tanh(v @ p["w"]), [shards["layers"][i] for i in order],
                         [spec["layers"][i] for i in order], torch.ones(1, 4))
    h.sum().backward()
    g = vfsdp.grads(shards, spec)
    return h.tolist(), [g["layers"][i]["w"].tolist() for i in range(2)]


def frozen_units_are_released():
    """run_layers over units whose tensors are all frozen: after the backward none of them
    stays gathered (only what the next forward needs is gathered)."""
    world = dist.get_world_size()
    params = {"layers": [{"w": torch.eye(4)} for _ in range(4)]}
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec, requires_grad=False)
    x = torch.ones(1, 4, requires_grad=True)
    h = vfsdp.run_layers(lambda p, v: torch.tanh(v @ p["w"]), shards["layers"], spec["layers"], x)
    h.sum().backward()
    units = [slot_of(s["w"]).unit for s in shards["layers"]]
    return [bool(u.gathered()) for u in units], x.grad is not None


# ------------------------------------------------------------------ uneven use of units


def _uneven_params():
    torch.manual_seed(3)
    return {"layers": [{"w": torch.randn(4, 4) / 2} for _ in range(3)], "head": torch.randn(4)}


def uneven_reference(world: int, uses: list, retain: bool = False) -> list:
    """One process: ``uses[r]`` is rank r's list of micro-batches, each a list of the layer
    indices it runs; the gradients of the mean over the ranks of the summed losses (twice
    with ``retain``)."""
    params = _uneven_params()
    ws = [layer["w"].clone().requires_grad_(True) for layer in params["layers"]]
    head = params["head"].clone().requires_grad_(True)
    total = 0
    for r in range(world):
        for k, order in enumerate(uses[r]):
            h = torch.full((1, 4), 1.0 + r + k)
            for i in order:
                h = torch.tanh(h @ ws[i])
            total = total + (h * head).sum()
    (total * (2 if retain else 1) / world).backward()
    return [w.grad for w in ws] + [head.grad]


def uneven_use(uses: list, how: str) -> list:
    """Each rank runs its micro-batches (``uses[rank]``: per micro-batch, the layers it uses)
    forward first, then their backwards one by one (``how="gather"`` or ``"run_layers"``),
    or one backward run twice (``how`` ending in ``"-retain"``). Returns this rank's pieces
    of the gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = _uneven_params()
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    head = vfsdp.gather(shards["head"], spec["head"])
    losses = []
    for k, order in enumerate(uses[rank]):
        x = torch.full((1, 4), 1.0 + rank + k)
        if how.startswith("run_layers"):
            step = {"j": 0}

            def layer(p, h, order=order, step=step):
                j = step["j"]
                step["j"] += 1
                return torch.tanh(h @ p["w"]) if j in order else h
            h = vfsdp.run_layers(layer, shards["layers"], spec["layers"], x)
        else:
            full = vfsdp.gather(shards["layers"], spec["layers"])
            h = x
            for i in order:
                h = torch.tanh(h @ full[i]["w"])
            del full
        losses.append((h * head).sum())
    if how.endswith("-retain"):
        losses[0].backward(retain_graph=True)
        losses[0].backward()
    else:
        for loss in losses:
            loss.backward()
    grads = vfsdp.grads(shards, spec) if how.startswith("run_layers") else None
    out = []
    for i in range(3):
        g = grads["layers"][i]["w"] if grads is not None else shards["layers"][i]["w"].grad
        out.append(None if g is None else g.clone())
    out.append(shards["head"].grad.clone())
    ranges = {tuple(t.path): t.local_range(rank) for t in spec.tensors()}
    return out, [ranges[("layers", i, "w")] for i in range(3)] + [ranges[("head",)]]


def evaluations_with_grad_on(evals: int) -> tuple:
    """``evals`` forwards with gradients enabled whose graphs are dropped (an evaluation
    without ``torch.no_grad``), then one training step. Returns the records still awaiting a
    backward after the evaluations, and the step's largest difference from one process."""
    world = dist.get_world_size()
    params = {"layers": [{"w": torch.eye(4) + i} for i in range(3)]}
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    x = torch.ones(2, 4)

    def loss_of(full, h):
        for p in full["layers"]:
            h = torch.tanh(h @ p["w"])
        return h.sum()

    for _ in range(evals):
        loss_of(vfsdp.gather(shards, spec), x)  # the graph is dropped at once
    kept = len(pending().entries)
    loss_of(vfsdp.gather(shards, spec), x * (dist.get_rank() + 1)).backward()
    ref = {"layers": [{"w": (torch.eye(4) + i).requires_grad_()} for i in range(3)]}
    (sum(loss_of(ref, x * (r + 1)) for r in range(world)) / world).backward()
    want = vfsdp.shard({"layers": [{"w": p["w"].grad} for p in ref["layers"]]}, spec,
                       requires_grad=False)
    diff = max(float((s["w"].grad - w["w"]).abs().max()) if s["w"].numel() else 0.0
               for s, w in zip(shards["layers"], want["layers"]))
    return kept, diff, len(pending().entries)


def kept_forward_after_a_dropped_one(how: str) -> list:
    """A ``run_layers`` forward kept for later, another one (grad on) dropped at once (an
    evaluation), then the first one's backward: this rank's gradient pieces, flat. The
    dropped forward's gathers used to free the last layer's memory, which the kept forward's
    backward reads without regathering (0.3: ``setStorage ... out of bounds``)."""
    g = torch.Generator().manual_seed(0)
    params = {"layers": [{"w": torch.randn(4, 4, generator=g) / 2} for _ in range(2)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    x = torch.ones(2, 4)
    opts = {} if how == "resharded" else {"reshard_after_forward": False}
    run = lambda: vfsdp.run_layers(_tanh_layer, shards["layers"], spec["layers"], x, **opts)
    loss = run().sum()
    run().sum().item()  # an evaluation with grad mode on: its graph is dropped
    loss.backward()
    return [s["w"].grad.reshape(-1).tolist() for s in shards["layers"]]


def _tanh_layer(p, h):
    return torch.tanh(h @ p["w"])
