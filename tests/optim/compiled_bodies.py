"""Bodies of the compiled SOAP and Shampoo tests (run on gloo processes by ``spawn``)."""

import optree
import torch
import torch.distributed as dist

import vfsdp


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 10, generator=g) / 3,   # larger than a shard at W = 2
            "v": torch.randn(6, 10, generator=g) / 3,   # same shape: one wave of two
            "u": torch.randn(4, 6, generator=g) / 3,
            "b": torch.randn(6, generator=g)}           # 1-D


def _opt(kind):
    o = vfsdp.optim
    if kind == "soap":
        return o.soap(lr=1e-2, weight_decay=0.1, precondition_frequency=2)
    return o.shampoo(lr=1e-2, weight_decay=0.1, precondition_frequency=2, block_size=8)


def compiled_vs_eager(kind, steps=6, compiled_steps=(0, 1, 3, 5), backend="aot_eager"):
    """``steps`` updates on two copies, one eager, the other compiled at ``compiled_steps``
    and eager at the others (one counter: the sequences must agree); then a frozen tensor.
    The update is compiled alone (the backward runs eagerly), as for gradient accumulation.
    Returns the largest parameter gap, the graphs compiled, both steps and the refusal."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    params, opt = _params(), _opt(kind)
    spec = vfsdp.plan(params, dist.get_world_size())
    eager, mixed = vfsdp.shard(params, spec), vfsdp.shard(params, spec)
    se, sm = opt.init(eager, spec), opt.init(mixed, spec)

    def backward(shards, x):
        vfsdp.zero_grads(shards, spec)
        f = vfsdp.gather(shards, spec)
        # Every matrix's statistics full rank by the first refresh: SOAP's refresh sorts the
        # eigenvalues, and a rank-deficient side's zeros tie (rounding then picks the order)
        loss = sum((x[:, :m.shape[1]] @ m.T).pow(2).mean() for m in (f["v"], f["u"]))
        (loss + torch.tanh(x @ f["w"].T + f["b"]).pow(2).mean()).backward()

    def update(shards, state):
        opt.update(vfsdp.grads(shards, spec), state, shards, spec)

    fast = torch.compile(update, fullgraph=True, backend=backend)
    for s in range(steps):
        g = torch.Generator().manual_seed(10 * s + dist.get_rank())
        x = torch.randn(16, 10, generator=g)  # full-rank statistics: no ties
        for shards, state, fn in ((eager, se, update),
                                  (mixed, sm, fast if s in compiled_steps else update)):
            backward(shards, x)
            fn(shards, state)
    gap = max(float((a - b).detach().abs().max()) if a.numel() else 0.0
              for a, b in zip(optree.tree_leaves(eager), optree.tree_leaves(mixed)))
    graphs = counters["stats"]["unique_graphs"] - before
    mixed["u"].requires_grad_(False)
    try:
        fast(mixed, sm)
        refused = "no error"
    except Exception as exc:  # noqa: BLE001 - dynamo wraps the ValueError
        refused = str(exc)
    return gap, graphs, se.step, sm.step, refused


def both(backend="aot_eager"):
    """:func:`compiled_vs_eager` for SOAP and Shampoo, in one process."""
    return [compiled_vs_eager(kind, backend=backend) for kind in ("soap", "shampoo")]
