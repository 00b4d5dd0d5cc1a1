"""optax's vocabulary: chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate) is
adamw bit for bit; a user's chain (Lion) runs over the whole rank in a few ops and checkpoints."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt
from vfsdp.optim import (
    adamw,
    add_decayed_weights,
    chain,
    clip_by_global_norm,
    partition,
    scale_by_adam,
    scale_by_learning_rate,
    transform,
)
from vfsdp.optim.transforms import run
from vfsdp.testing import CopyCounter, simulate

ROOT = Path(__file__).resolve().parents[2]
NO_NORM = lambda path: path[-1] != "norm"
SCHEDULE = lambda step: 0.01 / step


def params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(10, 6, generator=g),
            "layers": [{"w": torch.randn(6, 6, generator=g), "norm": torch.ones(6)}
                       for _ in range(2)]}


def full_grads(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return optree.tree_map(lambda t: torch.randn(t.shape, generator=g), params())


def set_grads(grads, spec, step: int) -> None:
    mine = vfsdp.testing.shard_reference(full_grads(step), spec)[dist.get_rank()]
    for g, piece in zip(optree.tree_leaves(grads), optree.tree_leaves(mine)):
        g.copy_(piece)


def lion(b1: float = 0.9, b2: float = 0.99):
    """Lion's direction, sign(lerp(m, g, 1 - b1)), then m = lerp(m, g, 1 - b2)."""
    def apply(u, state):
        c = torch._foreach_lerp(state["m"], u.updates, 1 - b1)
        torch._foreach_lerp_(state["m"], u.updates, 1 - b2)
        torch._foreach_sign_(c)
        torch._foreach_copy_(u.updates, c)
    return transform(apply, ("m",), "lion")


def lion_chain(lr=1e-2, wd=0.1):
    return chain(lion(), add_decayed_weights(wd, NO_NORM), scale_by_learning_rate(lr))


def train(opt, steps: int, frozen: bool = False):
    spec = vfsdp.plan(params(), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params(), spec)
    if frozen:
        shards["layers"][1]["w"].requires_grad_(False)
    state = opt.init(shards, spec)
    for step in range(1, steps + 1):
        grads = vfsdp.grads(shards, spec)
        set_grads(grads, spec, step)
        state = opt.update(grads, state, shards, spec)
    full = optree.tree_map(lambda t: t.detach().clone(), vfsdp.gather(shards, spec))
    return full, state, spec


def adam_states(opt, steps: int):
    full, state, spec = train(opt, steps)
    state = state[0] if isinstance(state, list) else state
    tree = {k: v.tolist() if isinstance(v, torch.Tensor) else v
            for k, v in ckpt.to_state_dict({"opt": state}, spec).items()}
    return optree.tree_map(torch.Tensor.tolist, full), tree, type(state).__name__


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("lr", [1e-2, SCHEDULE])
def test_adam_chain_is_adamw_bit_for_bit(world, lr):
    composed = chain(scale_by_adam(0.8, 0.99, 1e-6), add_decayed_weights(0.1, NO_NORM),
                     scale_by_learning_rate(lr))
    fused = adamw(lr, (0.8, 0.99), 1e-6, 0.1, NO_NORM)
    got = simulate(world, adam_states, composed, 4)
    want = simulate(world, adam_states, fused, 4)
    assert got == want and got[0][2] == "AdamWState"  # params, moments and step: the same bits
    no_decay = simulate(world, adam_states, chain(scale_by_adam(), scale_by_learning_rate(lr)), 2)
    assert no_decay == simulate(world, adam_states, adamw(lr, weight_decay=0.0), 2)


def _close(a, b) -> bool:
    return all(torch.allclose(torch.tensor(x), torch.tensor(y), rtol=1e-5, atol=1e-7)
               for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


@pytest.mark.parametrize("world", [1, 3])
def test_unfused_adam_sequence_runs_the_same_arithmetic(world):
    """The generic path (run) of the same transforms: AdamW's result up to rounding (it adds
    the decay to the update instead of scaling the parameters first)."""
    generic = run(scale_by_adam(), add_decayed_weights(0.1, NO_NORM), scale_by_learning_rate(SCHEDULE))
    got = simulate(world, adam_states, generic, 3)[0]
    want = simulate(world, adam_states, adamw(SCHEDULE, weight_decay=0.1, weight_decay_mask=NO_NORM),
                    3)[0]
    assert got[2] == "TransformsState" and _close(got[0], want[0])
    assert got[0] != simulate(world, adam_states, generic, 1)[0][0]  # it moved


def lion_reference(steps: int, lr=1e-2, wd=0.1, b1=0.9, b2=0.99, frozen=()):
    ps = {p: t.clone() for p, t in zip(optree.tree_paths(params()), optree.tree_leaves(params()))}
    ms = {p: torch.zeros_like(t) for p, t in ps.items()}
    for step in range(1, steps + 1):
        for p, g in zip(optree.tree_paths(params()), optree.tree_leaves(full_grads(step))):
            if p in frozen:
                continue
            u = torch.lerp(ms[p], g, 1 - b1).sign_()
            ms[p].lerp_(g, 1 - b2)
            if NO_NORM(p):
                u.add_(ps[p], alpha=wd)
            ps[p].add_(u, alpha=-lr)
    return ps


@pytest.mark.parametrize("world", [1, 2, 3])
def test_user_built_lion_equals_a_single_process_reference(world):
    want = lion_reference(4)
    full, _, _ = simulate(world, train, lion_chain(), 4)[0]
    got = dict(zip(optree.tree_paths(full), optree.tree_leaves(full)))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[p], want[p]) for p in want)


def test_lion_under_partition_clip_and_a_frozen_tensor():
    """A transform run nests in a chain after a gradient transform and in a partition (which
    gives it a subset: the other label's tensors move by AdamW), and a frozen tensor keeps its
    value. (The clip is too loose to act: Lion's result is compared bit for bit.)"""
    labels = lambda path: "adamw" if path[0] == "embed" else "lion"
    opt = chain(clip_by_global_norm(1e9), partition({"lion": lion_chain(), "adamw": adamw()},
                                                    labels))
    full, state, _ = simulate(2, train, opt, 3, True)[0]
    want = lion_reference(3, frozen={("layers", 1, "w")})
    got = dict(zip(optree.tree_paths(full), optree.tree_leaves(full)))
    assert all(torch.equal(got[p], want[p]) for p in want if p[0] == "layers")
    assert torch.equal(got[("layers", 1, "w")], params()["layers"][1]["w"])
    assert not torch.equal(got[("embed",)], params()["embed"])
    assert type(state[1]["lion"][0]).__name__ == "TransformsState"


def _unit_ops(layers: int, dim: int) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from op_counts import unit_params
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    opt = lion_chain(lr=SCHEDULE)
    ps = unit_params(layers, dim)
    spec = vfsdp.plan(ps, dist.get_world_size())
    shards = vfsdp.shard(ps, spec)
    state, grads = opt.init(shards, spec), vfsdp.grads(shards, spec)
    for g in optree.tree_leaves(grads):
        g.fill_(0.01)
    state = opt.update(grads, state, shards, spec)
    with CopyCounter() as c:
        opt.update(grads, state, shards, spec)
    return sum(c.ops.values())


def test_user_chain_ops_do_not_grow_with_the_number_of_units():
    """The same parameters in 4x the units (6 layers of 128-wide matrices, then 24 of 64-wide):
    a few multi-tensor ops per transform over the whole rank, not a few per unit."""
    one, four = simulate(2, _unit_ops, 6, 128)[0], simulate(2, _unit_ops, 24, 64)[0]
    assert four <= 1.1 * one, (one, four)
    assert one <= 40, one


def _save(path: str, steps: int):
    opt = lion_chain()
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec)
    state = opt.init(shards, spec)
    for step in range(1, steps + 1):
        grads = vfsdp.grads(shards, spec)
        set_grads(grads, spec, step)
        state = opt.update(grads, state, shards, spec)
    tree = {"params": shards, "opt": state}
    ckpt.save(path, tree, spec)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v
            for k, v in ckpt.to_state_dict(tree, spec).items()}


def _load(path: str):
    opt = lion_chain()
    spec = vfsdp.plan(params(), dist.get_world_size())
    shards = vfsdp.shard(params(), spec, init_fn=lambda p, local, t: local.zero_())
    tree = ckpt.load(path, {"params": shards, "opt": opt.init(shards, spec)}, spec)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v
            for k, v in ckpt.to_state_dict(tree, spec).items()}


def test_transform_state_checkpoints_and_reshards():
    tmp = tempfile.mkdtemp(prefix="vfsdp-transforms-")
    try:
        path = os.path.join(tmp, "lion")
        saved = simulate(2, _save, path, 2)[0]
        loaded = simulate(3, _load, path)[0]
        assert saved == loaded and saved["opt.0.step"] == 2
        assert any(".transforms.0.m." in k and any(v) for k, v in saved.items())
    finally:
        shutil.rmtree(tmp)


def _matrix_pair(name):
    """(a chain of the matrix preconditioner ``name``, the optimizer it should equal)."""
    from tests.optim import test_soap as ts
    from vfsdp.optim import scale_by_muon, scale_by_shampoo, scale_by_soap

    decay = add_decayed_weights(0.01)
    if name == "soap":
        options = {k: v for k, v in ts.HYPER.items() if k not in ("lr", "weight_decay")}
        return (chain(scale_by_soap(**options), scale_by_learning_rate(3e-3)),
                vfsdp.optim.soap(lr=3e-3, weight_decay=0.0, **options))
    if name == "shampoo":
        options = {"precondition_frequency": 5, "block_size": 7}
        return (chain(scale_by_shampoo(**options), decay, scale_by_learning_rate(SCHEDULE)),
                vfsdp.optim.shampoo(lr=SCHEDULE, weight_decay=0.01, **options))
    return (chain(scale_by_muon(momentum=0.9), decay, scale_by_learning_rate(0.02)),
            vfsdp.optim.muon(lr=0.02, momentum=0.9, weight_decay=0.01))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["soap", "shampoo", "muon"])
def test_matrix_preconditioner_chains_are_the_optimizers_bit_for_bit(world, name):
    """Shampoo in blocks with vectors, Muon with weight decay, SOAP without (its reference
    decays after the step: the next test): the same parameters, bit for bit, each matrix on
    its owner (the same state type, so the same owners' plan)."""
    from tests.optim import test_soap as ts

    composed, fused = _matrix_pair(name)
    got = simulate(world, ts._train, None, 8, composed)
    want = simulate(world, ts._train, None, 8, fused)
    for (a, _), (b, _) in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(got[0][0][0], ts._params()["layers"][0]["w_up"])  # it moved


def test_soap_chain_decays_before_the_step():
    """chain(scale_by_soap, add_decayed_weights(wd), scale_by_learning_rate(lr)) decays the
    parameters before each step (p * a - s u, a = 1 - lr wd), pytorch-optimizer's SOAP after
    it (a * (p - s u)); SOAP's direction u does not read p, so after n moving steps from p0
    the chain's change from a^n p0 is the reference's divided by a."""
    pytest.importorskip("pytorch_optimizer")
    from tests.optim import test_soap as ts
    from vfsdp.optim import scale_by_soap

    h = dict(ts.HYPER)
    lr, wd = h.pop("lr"), h.pop("weight_decay")
    opt = chain(scale_by_soap(**h), add_decayed_weights(wd), scale_by_learning_rate(lr))
    a, n = 1 - lr * wd, 11  # the first of 12 updates only sets the eigenbases
    want = ts._reference()
    for got, _ in simulate(2, ts._train, None, 12, opt):
        for c, r, p0 in zip(got, want, optree.tree_leaves(ts._params())):
            base = a ** n * p0
            ts._close([c - base], [(r - base) / a], [torch.zeros_like(p0)])
