"""Bodies of the misuse tests: module-level, so they run under simulate and spawn."""

from __future__ import annotations

import math

import optree
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import counts, reset_counts, slot_of


def one_tensor(n: int = 8):
    return {"w": torch.ones(n)}


def reused_shards_gradients():
    """Row 1: step k's loss is k * sum(w); zero_grads between steps. .grad must read k."""
    spec = vfsdp.plan(one_tensor(), dist.get_world_size())
    shards = vfsdp.shard(one_tensor(), spec)
    seen, norms = [], []
    for k in (1.0, 2.0, 3.0):
        vfsdp.zero_grads(shards, spec)
        full = vfsdp.gather(shards, spec)
        (k * full["w"].sum()).backward()
        seen.append(shards["w"].grad.tolist())
        norms.append(float(vfsdp.clip_grad_norm(vfsdp.grads(shards, spec), spec, 1e9)))
    return seen, norms


def two_backwards(accumulate: bool, mode: str):
    """Row 2: two backwards of sum(w) and 2*sum(w) without zeroing: torch gives 3."""
    spec = vfsdp.plan(one_tensor(), dist.get_world_size())
    shards = vfsdp.shard(one_tensor(), spec)
    for k in (1.0, 2.0):
        full = vfsdp.gather(shards, spec, grads=mode, accumulate_grads=accumulate)
        (k * full["w"].sum()).backward()
    return optree.tree_leaves(vfsdp.grads(shards, spec))[0].tolist()


def frozen_layer():
    """Row 4: a frozen tensor gets no gradient, no update, no weight decay; the unit whose
    tensors are all frozen is not reduce-scattered."""
    params = {"layers": [{"w": torch.ones(4, 4), "b": torch.ones(4)},
                         {"w": torch.ones(4, 4)}]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    shards["layers"][0]["b"].requires_grad_(False)    # a mixed unit
    shards["layers"][1]["w"].requires_grad_(False)    # a fully frozen unit
    opt = vfsdp.optim.adamw(lr=0.1, weight_decay=0.1)
    state = opt.init(shards, spec)
    full = vfsdp.gather(shards, spec, grads="buffer")
    h = torch.ones(2, 4)
    for p in full["layers"]:
        h = h @ p["w"] + p.get("b", 0)
    reset_counts()
    h.sum().backward()
    reduced = counts()["reduce_scatter"]
    state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    after = vfsdp.gather(shards, spec)
    return (reduced, after["layers"][0]["b"].tolist(), after["layers"][1]["w"].tolist(),
            after["layers"][0]["w"].tolist())


def frozen_reference():
    """The same step with torch.optim.AdamW on plain tensors (frozen ones excluded)."""
    w0, b0, w1 = torch.ones(4, 4, requires_grad=True), torch.ones(4), torch.ones(4, 4)
    opt = torch.optim.AdamW([w0], lr=0.1, weight_decay=0.1)
    h = torch.ones(2, 4)
    h = h @ w0 + b0
    h = h @ w1
    h.sum().backward()
    grads = w0.grad.clone()
    opt.step()
    return w0.detach(), grads


def tied(world_mesh):
    """Row 5: embed and head are one tensor: one storage, gradients summed, one state."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    params = {"embed": w, "head": w, "norm": torch.ones(4)}
    spec = vfsdp.plan(params, world_mesh)
    shards = vfsdp.shard(params, spec)
    same_object = shards["embed"] is shards["head"]
    opt = vfsdp.optim.adamw(lr=0.05)
    state = opt.init(shards, spec)
    for step in range(2):
        vfsdp.zero_grads(shards, spec)
        full = vfsdp.gather(shards, spec, grads="buffer")
        x = torch.eye(6)[: 3 + step]
        h = (x @ full["embed"]) * full["norm"]
        loss = (h @ full["head"].T).pow(2).sum()
        loss.backward()
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    out = vfsdp.gather(shards, spec)
    n_states = len(state.exp_avg)
    return same_object, out["embed"].tolist(), out["head"].tolist(), n_states


def tied_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g).requires_grad_(True)
    norm = torch.ones(4, requires_grad=True)
    opt = torch.optim.AdamW([w, norm], lr=0.05, weight_decay=0.01)
    for step in range(2):
        opt.zero_grad()
        x = torch.eye(6)[: 3 + step]
        h = (x @ w) * norm
        (h @ w.T).pow(2).sum().backward()
        opt.step()
    return w.detach().tolist()


def different_plans(how: str):
    """Row 6: ranks plan differently; every rank must get an error naming the unit."""
    rank = dist.get_rank()
    if how == "layout":  # same S, different order of tensors
        params = {"a": torch.zeros(4), "b": torch.zeros(4)} if rank == 0 else \
            {"b": torch.zeros(4), "c": torch.zeros(4)}
    elif how in ("granularity", "replan"):  # same tensors and S, rows whole on one rank only
        params = {"w": torch.zeros(8, 4)}
        if how == "replan":  # after both agreed on one plan, each plans again: one differently
            vfsdp.shard(params, vfsdp.plan(params, dist.get_world_size()))
        spec = vfsdp.plan(params, dist.get_world_size(),
                          granularity=vfsdp.rows(1) if rank == 0 else None)
    else:  # different S
        params = {"a": torch.zeros(4 if rank == 0 else 40)}
    if how not in ("granularity", "replan"):
        spec = vfsdp.plan(params, dist.get_world_size())
    try:
        vfsdp.shard(params, spec)
    except ValueError as exc:
        return str(exc)
    return "no error"


def unused_on_some_ranks(mode: str):
    """Row 7: unit 1 is used in the loss on rank 0 only: no hang, gradients as one process."""
    rank = dist.get_rank()
    params = {"layers": [{"w": torch.full((8,), 1.0 + i)} for i in range(3)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    full = vfsdp.gather(shards, spec, grads=mode)
    loss = (full["layers"][0]["w"] * 2).sum() + (full["layers"][2]["w"] * 3).sum()
    if rank == 0:
        loss = loss + (full["layers"][1]["w"] * 5).sum()
    loss.backward()
    got = optree.tree_leaves(vfsdp.grads(shards, spec))
    return [g.tolist() for g in got]


def modified_between(path: str, how: str = "add_"):
    """Row 8: a shard changed in place between forward and backward: ``add_`` on one shard,
    or (``how="update"``) an optimizer update, which writes the units' flat shards."""
    params = {"layers": [{"w": torch.ones(4, 4)} for _ in range(2)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.adamw(0.1)
    state = opt.init(shards, spec)
    x = torch.ones(1, 4)
    if path == "gather":
        full = vfsdp.gather(shards, spec)
        h = x @ full["layers"][0]["w"] @ full["layers"][1]["w"]
    else:
        h = vfsdp.run_layers(lambda p, a: a @ p["w"], shards["layers"], spec["layers"], x)
    if how == "update":
        opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    else:
        with torch.no_grad():
            shards["layers"][0]["w"].add_(100.0)
    try:
        h.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def func_grad():
    """Row 9: torch.func.grad over gather (run on gloo processes)."""
    params = {"w": torch.arange(8.0), "b": torch.ones(3)}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    g = torch.func.grad(lambda s: (vfsdp.gather(s, spec)["w"] ** 2).sum()
                        + vfsdp.gather(s, spec)["b"].sum())(shards)
    return g["w"].tolist(), g["b"].tolist()


def unit_probe():
    """Ranks agree: the spec is checked once per group, however often it is used."""
    spec = vfsdp.plan(one_tensor(), dist.get_world_size())
    reset_counts()
    shards = vfsdp.shard(one_tensor(), spec)
    vfsdp.shard(one_tensor(), spec)
    vfsdp.gather(shards, spec)
    return counts().get("spec_check", 0)


def released_gradient_view():
    """A gradient view read after zero_grads(set_to_none=True): an error, not a crash."""
    spec = vfsdp.plan(one_tensor(), dist.get_world_size())
    shards = vfsdp.shard(one_tensor(), spec)
    full = vfsdp.gather(shards, spec, grads="buffer")
    full["w"].sum().backward()
    grads = vfsdp.grads(shards, spec)
    vfsdp.zero_grads(shards, spec)
    try:
        grads["w"].sum()
    except RuntimeError as exc:
        return str(exc), slot_of(grads["w"]) is not None
    return "no error", False


def norm_of(tree) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in optree.tree_leaves(tree)))


def skip_params():
    g = torch.Generator().manual_seed(0)
    return {"io": {"embed": torch.randn(4, 6, generator=g)},
            "layers": [{"w": torch.randn(6, 6, generator=g) / 3, "b": torch.randn(6, generator=g)}
                       for _ in range(3)]}


def skip_layer(p, h):
    return torch.tanh(p["w"] @ h + p["b"])


def skip_loss(params, rank: int, skipped) -> torch.Tensor:
    """The loss of rank ``rank``: ``skipped(rank, i)`` layers are not run (their unit unused)."""
    h = params["io"]["embed"][rank]
    for i, layer in enumerate(params["layers"]):
        if not skipped(rank, i):
            h = skip_layer(layer, h)
    return (h ** 2).sum()


SKIPS = {
    "none": lambda r, i: False,
    "middle_on_rank1": lambda r, i: r == 1 and i == 1,
    "first_on_rank0": lambda r, i: r == 0 and i == 0,
    "last_on_all_but_rank0": lambda r, i: i == 2 and r != 0,
}


def unused_dropped(path: str, skip: str, options: dict, evaluate: bool = False):
    """Row 7, the gathered tree dropped before backward: a helper returning only the loss, or
    run_layers (which drops each unit's tree after its forward), with units unused on some
    ranks. Two steps; returns the second step's gradients. ``evaluate``: before each step an
    evaluation forward with gradients enabled, other options and other ranks skipping, whose
    graph is dropped without a backward."""
    rank = dist.get_rank()
    skipped = SKIPS[skip]
    spec = vfsdp.plan(skip_params(), dist.get_world_size())
    shards = vfsdp.shard(skip_params(), spec)

    def helper_loss():
        full = vfsdp.gather(shards, spec, **options)
        return skip_loss(full, rank, skipped)  # `full` dies here: only the loss is kept

    def run_layers_loss():
        io = vfsdp.gather(shards["io"], spec["io"], grads="buffer")
        count = [0]

        def layer(p, h):
            i = count[0]
            count[0] += 1
            return h * 1.0 if skipped(rank, i) else skip_layer(p, h)

        h = vfsdp.run_layers(layer, shards["layers"], spec["layers"], io["embed"][rank],
                             **options)
        return (h ** 2).sum()

    def evaluation():
        other = lambda r, i: r == 1 - rank % 2 and i == 1  # not the same skips as training
        io = vfsdp.gather(shards["io"], spec["io"])
        count = [0]

        def layer(p, h):
            i = count[0]
            count[0] += 1
            return h if other(rank, i) else skip_layer(p, h)

        h = vfsdp.run_layers(layer, shards["layers"], spec["layers"], io["embed"][rank])
        full = vfsdp.gather(shards["layers"], spec["layers"], grads="return")
        loss = skip_layer(full[0], h).sum()
        return float(loss.detach())  # both graphs are dropped here

    for _ in range(2):
        if evaluate:
            evaluation()
        vfsdp.zero_grads(shards, spec)
        (helper_loss() if path == "gather" else run_layers_loss()).backward()
    return optree.tree_map(lambda t: t.clone(), vfsdp.grads(shards, spec))


def released_read():
    """Row 3 in one process of a gloo world: a released view raises (no crash)."""
    spec = vfsdp.plan(one_tensor(), dist.get_world_size())
    shards = vfsdp.shard(one_tensor(), spec)
    full = vfsdp.gather(shards, spec)
    vfsdp.release(shards, spec)
    try:
        full["w"].sum()
    except RuntimeError as exc:
        return str(exc).split(";")[0]
    return "no error"


def rows_on_gloo():
    """The table's collective rows, one after another in one world (threads or gloo
    processes): the results must not depend on the backend."""
    def as_lists(tree):
        return [t.tolist() for t in optree.tree_leaves(tree)]

    return {
        "01": reused_shards_gradients(),
        "02": [two_backwards(acc, mode) for acc in (None, True) for mode in ("return", "buffer")],
        "03": released_read(),
        "04": frozen_layer(),
        "05": tied(dist.get_world_size()),
        "06": [different_plans(how) for how in ("layout", "size")],
        "07": [as_lists(unused_dropped(path, skip, opts)) for path, skip, opts in (
            ("gather", "first_on_rank0", {"grads": "return"}),
            ("gather", "middle_on_rank1", {"grads": "buffer", "free_after_backward": True}),
            ("run_layers", "middle_on_rank1", {}),
            ("run_layers", "first_on_rank0", {"prefetch": False}))],
        "08": [modified_between(path) for path in ("gather", "run_layers")],
    }


def _message(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def parallelism_errors() -> dict:
    """Issue 25's collective misuses, one after another on the same ranks (W=2): each must be
    the same clear error on every rank, and the ranks must go on to the next."""
    from vfsdp import lax

    r = dist.get_rank()
    mesh = vfsdp.mesh(("x", 2))
    out = {"psum": _message(lambda: lax.psum(torch.ones(2 + r), "x", mesh=mesh)),
           "pmean": _message(lambda: lax.pmean(torch.ones(2, 1 + r), "x", mesh=mesh))}

    def pvary_backward():
        x = torch.ones(2 + r, requires_grad=True)
        lax.pvary(x, "x", mesh=mesh).sum().backward()

    out["pvary"] = _message(pvary_backward)
    params = {"b": torch.ones(4), "w": torch.ones(4, 4)}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.partition({"muon": vfsdp.optim.muon(), "adamw": vfsdp.optim.adamw()},
                                lambda path: "muon")
    out["muon"] = _message(lambda: opt.init(shards, spec))
    got = vfsdp.scatter(params if r == 0 else None, spec, src=0)  # None off the source
    out["scatter"] = all(torch.equal(got[k], shards[k]) for k in params)
    out["after"] = lax.psum(torch.ones(3), "x", mesh=mesh).tolist()  # the ranks go on
    return out
