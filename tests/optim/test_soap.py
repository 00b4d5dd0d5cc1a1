"""Distributed SOAP against pytorch-optimizer's SOAP in one process, its checkpoints, partition."""

import os
import tempfile

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from tests.optim import compiled_bodies as cb
from vfsdp.testing import simulate, spawn

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.01, "precondition_frequency": 5,
         "eps": 1e-8}


def _params():
    g = torch.Generator().manual_seed(1)
    return {"layers": [{"w_up": torch.randn(8, 20, generator=g, dtype=torch.float64),  # wide
                        "w_down": torch.randn(20, 8, generator=g, dtype=torch.float64),  # tall
                        "norm": torch.randn(8, generator=g, dtype=torch.float64)}
                       for _ in range(2)],
            "head": torch.randn(24, 30, generator=g, dtype=torch.float64),  # over a shard at W=4
            "bias": torch.randn(24, generator=g, dtype=torch.float64)}


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return optree.tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), params)


def _reference(steps=12, **extra):
    """pytorch-optimizer's SOAP over the same parameters and gradients, in one process."""
    from pytorch_optimizer import SOAP

    params = optree.tree_map(lambda t: torch.nn.Parameter(t.clone()), _params())
    opt = SOAP(optree.tree_leaves(params), **HYPER, **extra)
    for step in range(1, steps + 1):
        for p, g in zip(optree.tree_leaves(params), optree.tree_leaves(_grads(step, params))):
            p.grad = g
        opt.step()
    return [p.detach() for p in optree.tree_leaves(params)]


def _train(mesh_shape=None, steps=12, opt=None, save=None, load=None, start=1):
    params = _params()
    spec = vfsdp.plan(params, mesh_shape or dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    opt = opt or vfsdp.optim.soap(**HYPER)
    state = opt.init(shards, spec)
    if load:
        loaded = vfsdp.checkpoint.load(load, {"params": shards, "opt": state}, spec)
        shards, state = loaded["params"], loaded["opt"]
    rank = dist.get_rank() % spec.world_size
    for step in range(start, steps + 1):
        local = optree.tree_map(lambda t, s: t.reshape(-1)[slice(*s.local_range(rank))],
                                _grads(step, params), spec.tree)
        state = opt.update(local, state, shards, spec)
    if save:
        vfsdp.checkpoint.save(save, {"params": shards, "opt": state}, spec)
    spans = [len(t.ranks()) for t in spec.tensors()]
    return [t.detach().clone() for t in optree.tree_leaves(vfsdp.gather(shards, spec))], spans


def _close(got, want, start):
    for a, b, p0 in zip(got, want, start):
        assert (a - b).norm() <= 1e-5 * (b - p0).norm(), ((a - b).norm(), (b - p0).norm())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("world, mesh", [(1, None), (2, None), (4, None), (4, (2, 2))])
def test_soap_equals_pytorch_optimizer_soap(world, mesh):
    """12 steps, the eigenbases refreshed at steps 5 and 10 (the reference's count), matrices
    wide, tall and over a shard, 1-D tensors on Adam; HSDP as (2, 2)."""
    pytest.importorskip("pytorch_optimizer")
    want, start = _reference(), optree.tree_leaves(_params())
    results = simulate(world, _train, mesh)
    if world == 4 and mesh is None:
        assert max(results[0][1]) > 1  # a matrix is split between ranks
    for got, _ in results:
        _close(got, want, start)


def _tp_rule(path):
    from torch.distributed.tensor import Replicate, Shard

    return {"w_up": Shard(1), "w_down": Shard(0), "head": Shard(1)}.get(path[-1], Replicate())


def _train_tp(dp, tp, steps=12, opt=None):
    """SOAP (or ``opt``) on a TP x FSDP plan (Muon's test): each index's piece of the full
    parameters."""
    mesh = vfsdp.mesh(("dp", dp), ("tp", tp))
    params = _params()
    spec = vfsdp.plan(params, mesh, tp=_tp_rule)
    shards = vfsdp.shard(params, spec, mesh=mesh)
    opt = opt or vfsdp.optim.soap(**HYPER)
    state = opt.init(shards, spec)
    rank = mesh.get_local_rank("dp")

    def local(t, s):
        st = s.strided
        if st.dim is not None:
            t = t.narrow(st.dim, st.start, st.lengths[st.index])
        return t.reshape(-1)[slice(*s.local_range(rank))]

    for step in range(1, steps + 1):
        state = opt.update(optree.tree_map(local, _grads(step, params), spec.tree), state,
                           shards, spec)
    return [t.detach().clone() for t in optree.tree_leaves(vfsdp.gather(shards, spec))]


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 3)])  # 20 and 30 columns: uneven at tp=3
def test_soap_under_tp_equals_one_process(dp, tp):
    one = simulate(1, _train)[0][0]
    paths = list(optree.tree_paths(_params()))
    for rank, got in enumerate(simulate(dp * tp, _train_tp, dp, tp)):
        for path, a, b in zip(paths, got, one):
            place = _tp_rule(path)
            if hasattr(place, "dim"):
                b = b.tensor_split(tp, place.dim)[rank % tp]
            assert torch.equal(a, b), (rank, path)


def test_soap_leaves_sides_over_max_precondition_dim_unrotated():
    """Sides longer than 10 (20, 24, 30) take no eigenbasis, as in the reference."""
    pytest.importorskip("pytorch_optimizer")
    opt = vfsdp.optim.soap(**HYPER, max_precondition_dim=10)
    want, start = _reference(max_precondition_dim=10), optree.tree_leaves(_params())
    for got, _ in simulate(2, _train, None, 12, opt):
        _close(got, want, start)


@pytest.mark.parametrize("world, mesh", [(2, None), (4, (2, 2))])
def test_soap_resumes_bitwise_at_another_world_size(world, mesh):
    """6 steps at W=2 (or HSDP 2x2: one replica writes), saved; loaded at W=3 and 6 more: bit
    for bit the 12 steps at W=2."""
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    whole = simulate(2, _train)[0][0]
    simulate(world, _train, mesh, 6, None, path)
    resumed = simulate(3, _train, None, 12, None, None, path, 7)
    for got, _ in resumed:
        assert all(torch.equal(a, b) for a, b in zip(got, whole))


def test_soap_in_a_partition_with_adamw():
    """1-D tensors on AdamW, the matrices on SOAP: the matrices as the reference moves them."""
    pytest.importorskip("pytorch_optimizer")
    opt = vfsdp.optim.partition({"soap": vfsdp.optim.soap(**HYPER), "adamw": vfsdp.optim.adamw()},
                                lambda path: "soap" if path[-1] in ("w_up", "w_down", "head")
                                else "adamw")
    want, start = _reference(), optree.tree_leaves(_params())
    got = simulate(2, _train, None, 12, opt)[0][0]
    names = ["/".join(map(str, p)) for p in optree.tree_paths(_params())]
    matrices = [i for i, n in enumerate(names) if "norm" not in n and "bias" not in n]
    _close([got[i] for i in matrices], [want[i] for i in matrices], [start[i] for i in matrices])
    assert not torch.allclose(got[names.index("bias")], want[names.index("bias")], rtol=1e-5)


@pytest.mark.parametrize("kind", ["soap", "shampoo"])
def test_offloaded_soap_and_shampoo_equal_them_on_the_device(kind):
    from tests.optim import offload_bodies as ob

    plain, off = (simulate(2, ob.train, kind, o, 5) for o in (False, True))
    assert all(torch.equal(a, b) for x, y in zip(plain, off)
               for a, b in zip(x["shards"], y["shards"]))
    assert all(r["host_bytes"] > 0 for r in off)


def test_compiled_updates_equal_eager_ones_and_continue_one_count():
    """SOAP and Shampoo compiled with the step (2 gloo processes, aot_eager: the traced graph
    itself), refreshing every 2 steps, over 6 updates of which the third and fifth are eager
    (each after a compiled one, which it must count): the parameters equal an all-eager run's
    within fp32 rounding, in one graph per optimizer; a frozen tensor is refused as eagerly."""
    for rank in spawn(cb.both, 2, timeout=900):  # compiling: minutes on a loaded machine
        for (gap, graphs, eager, mixed, refused), name in zip(rank, ("soap", "shampoo")):
            assert gap < 1e-6 and graphs == 1 and eager == mixed == 6, (name, gap, graphs)
            assert f"{name}: u is frozen (requires_grad=False)" in refused, refused
