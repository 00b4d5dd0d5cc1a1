"""Bodies for the offload tests (module-level: they run under simulate and spawn)."""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt
from vfsdp.collectives import slot_of
from vfsdp.optim import (
    Optimizer,
    adamw,
    adamw8bit,
    chain,
    clip_by_global_norm,
    muon,
    offload,
    partition,
    shampoo,
    soap,
)


def params(dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    return {"embed": torch.randn(48, 32, generator=g).to(dtype),
            "layers": [{"w": torch.randn(32, 32, generator=g).to(dtype),
                        "norm": torch.ones(32, dtype=dtype)} for _ in range(3)]}


def _label(path) -> str:
    return "m" if path[0] == "layers" and path[-1] == "w" else "a"


def optimizer(kind: str, offloaded: bool) -> Optimizer:
    """The optimizer ``kind``; offloaded whole, or (``"member"``) one member offloaded."""
    wrap = offload if offloaded else (lambda opt: opt)
    if kind == "adamw":
        return wrap(adamw(lr=0.05))
    if kind == "adamw8bit":
        return wrap(adamw8bit(lr=0.05))
    if kind == "muon":
        return wrap(partition({"m": muon(lr=0.05), "a": adamw(lr=0.05)}, _label))
    if kind == "soap":  # the norms on Adam inside SOAP
        return wrap(soap(lr=0.05, precondition_frequency=2))
    if kind == "shampoo":
        return wrap(partition({"m": shampoo(lr=0.05, precondition_frequency=2),
                               "a": adamw(lr=0.05)}, _label))
    if kind == "chain":
        return wrap(chain(clip_by_global_norm(0.5), adamw(lr=0.05)))
    if kind == "member":  # only the Muon member offloaded, the AdamW one on the device
        return partition({"m": wrap(muon(lr=0.05)), "a": adamw8bit(lr=0.05)}, _label)
    raise ValueError(kind)


def _step(shards, spec, step: int, mode: str = "buffer") -> None:
    """One backward: ``buffer`` (grads="buffer"), ``async`` (async_reduce=True), ``micro``
    (two micro-batches accumulated), ``return`` (grads="return": the gradients go to .grad),
    ``clip`` (then clipped on the device, in place)."""
    for micro in range(2 if mode == "micro" else 1):
        opts = {"grads": "return"} if mode == "return" else {"grads": "buffer"}
        if mode == "async":
            opts["async_reduce"] = True
        if mode == "micro":
            opts["accumulate_grads"] = True
        full = vfsdp.gather(shards, spec, **opts)
        leaves = optree.tree_leaves(full)
        loss = sum(((x.float() - 0.1 * step - micro) ** 2).sum() * (i + 1)
                   for i, x in enumerate(leaves))
        loss.backward()
    if mode == "clip":
        vfsdp.optim.clip_grad_norm(vfsdp.grads(shards, spec), spec, 1.0)


def _steps(opt, state, shards, spec, steps: int, start: int = 0):
    """``steps`` backwards and updates (steps ``start`` on), gradients zeroed after each."""
    for step in range(start, start + steps):
        _step(shards, spec, step)
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        vfsdp.zero_grads(shards, spec)
    return state


def train(kind: str, offloaded: bool, steps: int = 3, freeze: bool = False,
          poke: bool = False, mode: str = "buffer") -> dict:
    """``steps`` updates of ``kind``; ``freeze``: the first layer's norm is frozen after
    the first step; ``poke``: the embedding is scaled in place on the device after the
    second; ``mode``: how the backward runs (see ``_step``). Returns this rank's shards and
    what the offloaded state counted."""
    opt = optimizer(kind, offloaded)
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec)
    state = opt.init(shards, spec)
    for step in range(steps):
        if freeze and step == 1:
            shards["layers"][0]["norm"].requires_grad_(False)
        if poke and step == 2:
            with torch.no_grad():
                shards["embed"].mul_(0.5)
        _step(shards, spec, step, mode)
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        vfsdp.zero_grads(shards, spec)
    inner = state if offloaded and kind != "member" else None
    return {"shards": [x.detach().clone() for x in optree.tree_leaves(shards)],
            "resyncs": inner.resyncs if inner is not None else None,
            "grad_copies": inner.grad_copies if inner is not None else None,
            "host_bytes": inner.host_bytes() if inner is not None else None}


def train_both(kinds: list) -> dict:
    """Per kind, :func:`train` without and with offload, in this one process (one start
    of the gloo processes for all of them)."""
    return {kind: (train(kind, False), train(kind, True)) for kind in kinds}


def save(path: str, kind: str, offloaded: bool, steps: int = 2) -> dict:
    """Train ``steps`` updates and save the shards and the state; return the exported
    checkpoint tree."""
    opt = optimizer(kind, offloaded)
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec)
    state = opt.init(shards, spec)
    for step in range(steps):
        _step(shards, spec, step)
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        vfsdp.zero_grads(shards, spec)
    tree = {"params": shards, "opt": state}
    ckpt.save(path, tree, spec)
    return _export(tree, spec)


def load_and_step(path: str, kind: str, offloaded: bool) -> dict:
    """Load into fresh (zeroed) shards and state, then take one more update; return the
    loaded checkpoint tree and the shards after the update (gathered)."""
    opt = optimizer(kind, offloaded)
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec, init_fn=lambda p, local, t: local.zero_())
    tree = ckpt.load(path, {"params": shards, "opt": opt.init(shards, spec)}, spec)
    loaded = _export(tree, spec)
    _step(shards, spec, 2)
    state = opt.update(vfsdp.grads(shards, spec), tree["opt"], shards, spec)
    del state
    full = vfsdp.gather(shards, spec)
    return {"loaded": loaded, "after": [x.tolist() for x in optree.tree_leaves(full)]}


def _export(tree, spec) -> dict:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v
            for k, v in ckpt.to_state_dict(tree, spec).items()}


def failing_update() -> str:
    """The host update raises on rank 1 only: every rank raises, none waits."""
    def init(shards, spec, mask=None):
        return 0

    def update(grads, state, shards, spec):
        if dist.get_rank() == 1:
            raise ArithmeticError("host kernel failed")
        return state + 1

    opt = offload(Optimizer(init, update))
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)
    state = opt.init(shards, spec)
    _step(shards, spec, 0)
    try:
        opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        # every rank reads its masters back before the next update
        return f"{type(exc).__name__}: {exc}" + ("" if not state.seen else " (seen kept)")
    return "no error"


def bf16_masters(steps: int = 4) -> dict:
    """bf16 device shards with fp32 host masters, an update below bf16's resolution: the
    masters move, and the device shard is always the master rounded to bf16."""
    opt = offload(adamw(lr=1e-4, weight_decay=0.0))
    spec = vfsdp.plan(params(torch.bfloat16), dist.get_world_size())
    shards = vfsdp.shard(params(torch.bfloat16), spec)
    before = [x.detach().clone() for x in optree.tree_leaves(shards)]
    state = opt.init(shards, spec)
    plain = adamw(lr=1e-4, weight_decay=0.0)
    shards2 = vfsdp.shard(params(torch.bfloat16), spec)
    state2 = plain.init(shards2, spec)
    state = _steps(opt, state, shards, spec, steps)
    _steps(plain, state2, shards2, spec, steps)
    masters = optree.tree_leaves(state.shards)
    device = optree.tree_leaves(shards)
    return {"master_dtype": str(masters[0].dtype),
            "rounded": all(torch.equal(m.to(torch.bfloat16), d) for m, d in zip(masters, device)),
            "masters_moved": sum(int((m != b.float()).sum()) for m, b in zip(masters, before)),
            "device_moved": sum(int((d != b).sum()) for d, b in zip(device, before)),
            "plain_moved": sum(int((d != b).sum()) for d, b in
                               zip(optree.tree_leaves(shards2), before)),
            "resyncs": state.resyncs, "grad_copies": state.grad_copies}


def hidden_writes(offloaded: bool, steps: int = 3) -> dict:
    """Writes no version counter sees, between the backward and the update: the gradients
    summed over the ranks by ``torch.distributed.all_reduce`` (gloo), unscaled as
    ``GradScaler.unscale_`` does, halved through ``.data``; the parameters broadcast from
    rank 0 after rank 1 changed its own, and a frozen tensor written through ``.data``."""
    opt = optimizer("adamw", offloaded)
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec)
    state = opt.init(shards, spec)
    shards["layers"][1]["norm"].requires_grad_(False)
    for step in range(steps):
        _step(shards, spec, step)
        grads = optree.tree_leaves(vfsdp.grads(shards, spec))
        if step == 0:  # each unit's gradient shard (the same size on every rank)
            units = {id(u): u for u in (slot_of(x).unit for x in optree.tree_leaves(shards))}
            for u in units.values():
                dist.all_reduce(u.grads().shard)
        if step == 1:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1),
                                                            torch.tensor(0.25))
        if step == 2:
            grads[0].data.mul_(0.5)
            with torch.no_grad():
                if dist.get_rank() == 1:
                    shards["embed"].data.add_(1.0)
                dist.broadcast(shards["embed"], 0)
                shards["layers"][1]["norm"].data.fill_(3.0)
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        vfsdp.zero_grads(shards, spec)
    inner = state if offloaded else None
    return {"shards": [x.detach().clone() for x in optree.tree_leaves(shards)],
            "resyncs": inner.resyncs if inner is not None else None,
            "grad_copies": inner.grad_copies if inner is not None else None}



def reinit(steps: int = 2) -> dict:
    """A second init while the first state lives: the newest state gets the units' mirrors
    (the backward's copies); the older one, used again, copies for itself."""
    opt = optimizer("adamw", True)
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec)
    old = opt.init(shards, spec)
    new = opt.init(shards, spec)
    new = _steps(opt, new, shards, spec, steps)
    old = _steps(opt, old, shards, spec, 1, start=steps)
    return {"new": (new.grad_copies, new.resyncs), "old": (old.grad_copies, old.resyncs)}
