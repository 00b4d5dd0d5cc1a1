"""Rank bodies for the checkpoint tests (module level: simulate and spawn both run them)."""

from __future__ import annotations

import os

import optree
import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt

MIN8 = 256  # small model: quantize matrices from 256 elements


def params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) / 5

    return {
        "embed": r(40, 24),
        "layers": [{"w1": r(64, 24), "w2": r(24, 64), "b": r(64), "norm": 1 + r(24)}
                   for _ in range(2)],
        "head": r(24, 40),
        "scale": 1 + r(()),
        "empty": torch.zeros(0, 8),
    }


def make_opts() -> dict:
    return {"adamw": vfsdp.optim.adamw(lr=vfsdp.optim.warmup_cosine(1e-2, 2, 10), weight_decay=0.1),
            "adamw8bit": vfsdp.optim.adamw8bit(lr=1e-2, min_8bit_numel=MIN8, weight_decay=0.1),
            "muon": vfsdp.optim.partition(
                {"muon": vfsdp.optim.muon(lr=0.02, weight_decay=0.1, scale="moonlight"),
                 "adamw": vfsdp.optim.adamw(lr=1e-2)},
                lambda path: "muon" if path[0] == "layers" and path[-1] in ("w1", "w2")
                else "adamw")}


GRANULARITY = vfsdp.optim.adamw8bit(min_8bit_numel=MIN8).granularity


def make_spec(mesh):
    return vfsdp.plan(params(), mesh, granularity=GRANULARITY)


def blank(mesh, names=("adamw", "adamw8bit", "muon")):
    """Fresh zero shards and freshly initialised states under ``mesh``: what a load fills."""
    spec = make_spec(mesh)
    shards = vfsdp.shard(params(), spec, init_fn=lambda path, local, t: local.zero_())
    opts = make_opts()
    return spec, shards, {n: opts[n].init(shards, spec) for n in names}


def loss_fn(full: dict, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(6, 40, generator=g)
    h = x @ full["embed"]
    for p in full["layers"]:
        h = h + torch.tanh(h @ p["w1"].T + p["b"]) @ p["w2"].T
        h = h * p["norm"]
    out = h @ full["head"] * full["scale"]
    return (out - x.roll(1, -1)).pow(2).mean()


def train(shards, spec, opt, state, steps: range):
    rank = dist.get_rank()
    for step in steps:
        vfsdp.zero_grads(shards, spec)
        full = vfsdp.gather(shards, spec, grads="buffer", free_after_backward=True)
        loss_fn(full, step, rank).backward()
        grads = vfsdp.grads(shards, spec)
        vfsdp.clip_grad_norm(grads, spec, 1.0)
        state = opt.update(grads, state, shards, spec)
    return state


def full_dict(tree, spec) -> dict:
    """Every entry in full on rank 0 (plain CPU tensors and values), ``{}`` elsewhere."""
    return ckpt.to_state_dict(tree, spec)


# ------------------------------------------------------------------------- bodies


def save_trained(path: str, mesh=None, async_save: bool = False):
    """Train each optimizer 3 steps on its own copy of the model, save everything."""
    mesh = mesh or dist.get_world_size()
    spec = make_spec(mesh)
    opts = make_opts()
    tree = {"step": 3, "note": "hello", "lr_scale": 0.5, "rng": torch.arange(5)}
    for name, opt in opts.items():
        shards = vfsdp.shard(params(), spec)
        state = train(shards, spec, opt, opt.init(shards, spec), range(1, 4))
        tree[name] = {"params": shards, "opt": state}
    handle = ckpt.save(path, tree, spec, async_save=async_save)
    if handle is not None:
        handle.wait()
    return full_dict(tree, spec)


def load_all(path: str, mesh=None):
    """Load the checkpoint of :func:`save_trained` under ``mesh``; full entries on rank 0."""
    mesh = mesh or dist.get_world_size()
    like = {"step": 0, "note": "", "lr_scale": 0.0, "rng": torch.zeros(5, dtype=torch.long)}
    spec = None
    for name in ("adamw", "adamw8bit", "muon"):
        spec, shards, states = blank(mesh, (name,))
        like[name] = {"params": shards, "opt": states[name]}
    tree = ckpt.load(path, like, spec)
    assert tree["adamw"]["opt"].step == 3 and tree["step"] == 3 and tree["note"] == "hello"
    return full_dict(tree, spec)


def resume(path: str, name: str, phase: str):
    """``"first"``: 10 steps straight (returned), and separately 5 steps then save;
    ``"second"``: load into fresh shards and states, 5 more steps (returned)."""
    opt = make_opts()[name]
    if phase == "first":
        spec = make_spec(dist.get_world_size())
        shards = vfsdp.shard(params(), spec)
        state = train(shards, spec, opt, opt.init(shards, spec), range(1, 11))
        straight = full_dict({"params": shards, "opt": state}, spec)
        shards = vfsdp.shard(params(), spec)
        state = train(shards, spec, opt, opt.init(shards, spec), range(1, 6))
        ckpt.save(path, {"params": shards, "opt": state, "step": 5}, spec)
        return straight
    spec, shards, states = blank(dist.get_world_size(), (name,))
    tree = ckpt.load(path, {"params": shards, "opt": states[name], "step": 0}, spec)
    assert tree["step"] == 5
    state = train(shards, spec, opt, tree["opt"], range(tree["step"] + 1, 11))
    return full_dict({"params": shards, "opt": state}, spec)


def resume_each(path: str, names: list, phase: str) -> dict:
    """:func:`resume` for each optimizer name, its checkpoint under ``path/<name>``: one start
    of the processes per phase for all of them."""
    return {name: resume(f"{path}/{name}", name, phase) for name in names}


def save_params(path: str, overwrite: bool = False, seed: int = 0):
    spec = make_spec(dist.get_world_size())
    shards = vfsdp.shard(params(seed), spec)
    ckpt.save(path, {"params": shards}, spec, overwrite=overwrite)
    return True


def load_params(path: str, world_mesh=None):
    spec, shards, _ = blank(world_mesh or dist.get_world_size(), ())
    ckpt.load(path, {"params": shards}, spec)
    return full_dict(shards, spec)


def save_dying(path: str, how: str, overwrite: bool = False):
    """Save with rank 1 failing while it writes its data: ``how`` = "raise" or "exit"."""
    from torch.distributed.checkpoint import FileSystemWriter

    if dist.get_rank() == 1:
        real = FileSystemWriter.write_data

        def dying(self, plan, planner):
            real(self, plan, planner)        # the data is written ...
            if how == "exit":
                os._exit(3)                  # ... and the rank dies before anything commits
            raise OSError("injected: disk full")

        FileSystemWriter.write_data = dying
    try:
        save_params(path, overwrite=overwrite, seed=1)
    except ckpt.CheckpointError as exc:
        return str(exc)
    return "saved"


def try_load(path: str, variant: str = "same"):
    """Load params into a tree that matches (``"same"``) or differs from the saved one."""
    world = dist.get_world_size()
    spec, shards, _ = blank(world, ())
    like: dict = {"params": shards}
    strict = True
    if variant == "shape":
        p = params()
        p["embed"] = torch.zeros(41, 24)
        spec = vfsdp.plan(p, world, granularity=GRANULARITY)
        like = {"params": vfsdp.shard(p, spec)}
    elif variant == "dtype":
        p = optree.tree_map(lambda t: t.bfloat16(), params())
        spec = vfsdp.plan(p, world, granularity=GRANULARITY)
        like = {"params": vfsdp.shard(p, spec)}
    elif variant == "extra_in_tree":
        like["step"] = 0
    elif variant == "subset":
        p = {"embed": params()["embed"]}
        spec = vfsdp.plan(p, world)
        like = {"params": vfsdp.shard(p, spec, init_fn=lambda path, local, t: local.zero_())}
        strict = False
    elif variant == "subset_strict":
        p = {"embed": params()["embed"]}
        spec = vfsdp.plan(p, world)
        like = {"params": vfsdp.shard(p, spec)}
    try:
        ckpt.load(path, like, spec, strict=strict)
    except (ckpt.CheckpointError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return full_dict(like, spec)


def async_overlap(path: str):
    """Start an async save, keep training while it writes, then check what was saved."""
    spec = make_spec(dist.get_world_size())
    opt = make_opts()["adamw"]
    shards = vfsdp.shard(params(), spec)
    state = train(shards, spec, opt, opt.init(shards, spec), range(1, 3))
    before = full_dict({"params": shards, "opt": state}, spec)
    handle = ckpt.save(path, {"params": shards, "opt": state}, spec, async_save=True)
    state = train(shards, spec, opt, state, range(3, 5))  # overlaps the write
    after = full_dict({"params": shards, "opt": state}, spec)
    assert handle.wait() == path and handle.done()
    spec, fresh, states = blank(dist.get_world_size(), ("adamw",))
    tree = ckpt.load(path, {"params": fresh, "opt": states["adamw"]}, spec)
    return before, after, full_dict(tree, spec)


def save_trained_full():
    """The full contents of :func:`save_trained`'s tree, without saving it."""
    spec = make_spec(dist.get_world_size())
    tree = {"step": 3, "note": "hello", "lr_scale": 0.5, "rng": torch.arange(5)}
    for name, opt in make_opts().items():
        shards = vfsdp.shard(params(), spec)
        tree[name] = {"params": shards, "opt": train(shards, spec, opt, opt.init(shards, spec),
                                                     range(1, 4))}
    return full_dict(tree, spec)


def load_into_full_tensors(path: str):
    """A sharded checkpoint read into plain, unsharded tensors (e.g. on one process)."""
    like = {"adamw": {"params": optree.tree_map(torch.zeros_like, params())}}
    spec = make_spec(dist.get_world_size())
    tree = ckpt.load(path, like, spec, strict=False)
    paths, leaves, _ = optree.tree_flatten_with_path(tree["adamw"]["params"])
    return {"adamw.params." + ".".join(map(str, p)): v for p, v in zip(paths, leaves)}


class Counter:
    """A user state type: a step and a sharded running sum (a Piece of a global vector)."""

    def __init__(self, step: int, total: torch.Tensor, start: int, length: int):
        self.step, self.total, self.start, self.length = step, total, start, length


def _flatten_counter(c: Counter, spec):
    return {"step": c.step, "total": ckpt.Piece(c.total, (c.length,), c.start)}


def _restore_counter(c: Counter, tree):
    c.step = tree["step"]
    return c


ckpt.register_state(Counter, _flatten_counter, _restore_counter)


def custom_state(path: str, save: bool):
    """Each rank holds an uneven slice of a 10-element vector; save at one world size, load at another."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuts = [0] + [min(10, (r + 1) * (r + 2) // 2) for r in range(world - 1)] + [10]
    lo, hi = cuts[rank], cuts[rank + 1]
    spec = make_spec(world)
    if save:
        c = Counter(4, torch.arange(lo, hi, dtype=torch.float64), lo, 10)
        ckpt.save(path, {"c": c}, spec)
        return None
    c = Counter(0, torch.zeros(hi - lo, dtype=torch.float64), lo, 10)
    tree = ckpt.load(path, {"c": c}, spec)
    return tree["c"].step, c.total.tolist(), list(range(lo, hi))


def inconsistent(path: str, what: str):
    """Ranks pass different trees (``"paths"``) or different replicated values (``"value"``)."""
    rank = dist.get_rank()
    spec = make_spec(dist.get_world_size())
    tree = {"params": vfsdp.shard(params(), spec), "step": 3 if what == "paths" else 3 + rank}
    if what == "paths" and rank == 1:
        tree["extra"] = 1
    if what == "tensor":
        tree["rng"] = torch.full((2,), float(rank))
    try:
        ckpt.save(path, tree, spec)
    except ValueError as exc:
        return str(exc)
    return "saved"


def _synthetic_grads(shards, spec):
    """The same global gradients whatever the world size: sin of the flat index, per tensor."""
    def piece(path, local):
        t = spec.tensor(path)
        lo, hi = t.local_range(spec_rank(local))
        return (torch.arange(lo, hi, dtype=torch.float32) * 0.37 + len(path)).sin().reshape(local.shape)

    paths, leaves, treespec = optree.tree_flatten_with_path(shards)
    return optree.tree_unflatten(treespec, [piece(p, x) if isinstance(x, torch.Tensor) else x
                                            for p, x in zip(paths, leaves)])


def spec_rank(local) -> int:
    from vfsdp.collectives import slot_of

    return slot_of(local).buffer.rank


def step_after(path: str, name: str, save: bool, mesh=None):
    """Save (3 trained steps) then one synthetic-gradient update, or load and the same update:
    the update must not depend on the block placement, so the results match bitwise."""
    mesh = mesh or dist.get_world_size()
    opt = make_opts()[name]
    if save:
        spec = make_spec(mesh)
        shards = vfsdp.shard(params(), spec)
        state = train(shards, spec, opt, opt.init(shards, spec), range(1, 4))
        ckpt.save(path, {"params": shards, "opt": state}, spec)
    else:
        spec, shards, states = blank(mesh, (name,))
        state = ckpt.load(path, {"params": shards, "opt": states[name]}, spec)["opt"]
    state = opt.update(_synthetic_grads(shards, spec), state, shards, spec)
    return full_dict({"params": shards, "opt": state}, spec)
