"""Training with vfsdp equals a single-process reference that sees the same global batch."""

import optree
import pytest
import torch

import vfsdp
from tests.optim import bodies
from vfsdp.testing import simulate, spawn


def _compare(results, ref, world, mesh_shape=None, rtol=1e-4, atol=1e-5, loss_rtol=1e-4):
    ref_losses, ref_params = ref
    for _rank, (_losses, params, _peak) in enumerate(results):
        # each rank's loss is its share; the sum over ranks of rank losses is the global mean
        assert len(params) == len(ref_params)
        for got, want in zip(params, ref_params):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=atol)
    total = [sum(r[0][s] for r in results) / len(results) for s in range(len(ref_losses))]
    assert torch.allclose(torch.tensor(total), torch.tensor(ref_losses), rtol=loss_rtol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_adamw_training_matches_reference(world):
    results = simulate(world, bodies.train, 4, 1, "off")
    _compare(results, bodies.reference(4, 1, world), world)


@pytest.mark.parametrize("accumulate", ["every", "last"])
def test_gradient_accumulation_matches_reference(accumulate):
    results = simulate(3, bodies.train, 3, 2, accumulate)
    _compare(results, bodies.reference(3, 2, 3), 3)


def test_hsdp_2x2_matches_reference():
    results = simulate(4, bodies.train, 3, 1, "off", (2, 2))
    _compare(results, bodies.reference(3, 1, 4), 4, mesh_shape=(2, 2))


def test_bf16_params_fp32_reduce_loose():
    results = simulate(2, bodies.train, 3, 1, "off", None, torch.bfloat16, torch.float32)
    # Adam moves each coordinate by at most about lr per step, so bf16 rounding (which can
    # flip the sign of tiny gradients) bounds the drift by the sum of the learning rates.
    lr_sum = sum(vfsdp.optim.warmup_cosine(3e-2, 2, 10)(s) for s in range(1, 4))
    _compare(results, bodies.reference(3, 1, 2), 2, rtol=0.0, atol=lr_sum, loss_rtol=2e-2)


def test_at_most_two_units_gathered():
    for _losses, _params, peak in simulate(3, bodies.train, 1, 1, "off"):
        # the root unit (input and output projections) is gathered for the whole step,
        # run_layers keeps at most two layer units gathered besides it
        assert peak <= 3


def test_clip_grad_norm_matches_torch():
    results = simulate(3, bodies.clip_matches_torch, 0.05)
    params = bodies.init_params()
    leaves = optree.tree_leaves(params)
    for t in leaves:
        t.requires_grad_(True)
    total = 0
    for rank in range(3):
        x, y = bodies.data(1, rank, 0)
        h = x @ params["root"]["inp"]
        for p in params["layers"]:
            h = bodies.layer(p, h)
        total = total + (h @ params["root"]["out"] - y).pow(2).mean() / 3
    total.backward()
    norm = torch.nn.utils.clip_grad_norm_(leaves, 0.05)
    spec = vfsdp.plan(params, 3)
    for rank, (got_norm, clipped) in enumerate(results):
        assert got_norm == pytest.approx(float(norm), rel=1e-5)
        for g, t, ts in zip(clipped, leaves, spec.leaves()):
            lo, hi = ts.local_range(rank)
            assert torch.allclose(torch.tensor(g), t.grad.reshape(-1)[lo:hi], rtol=1e-5, atol=1e-7)


def test_training_with_clipping_and_gloo():
    results = spawn(bodies.train, 2, 3, 1, "off", None, None, None, 0.5)
    _compare(results, bodies.reference(3, 1, 2, clip=0.5), 2)


def test_memory_two_units_with_reshard_all_without():
    # measured at every dispatched op from the buffers' real storage sizes
    assert simulate(2, bodies.layers_only_peak, True) == [(2, 0)] * 2
    assert simulate(2, bodies.layers_only_peak, True, False) == [(1, 0)] * 2
    assert simulate(2, bodies.layers_only_peak, False) == [(bodies.L, 0)] * 2


def _adamw_bitwise_body(dtype=torch.float32):
    params = optree.tree_map(lambda t: t.to(dtype), bodies.init_params())
    spec = vfsdp.plan(params, 1)
    shards = vfsdp.shard(params, spec)
    opt = bodies.make_opt()
    state = opt.init(shards, spec)
    ref = optree.tree_map(lambda t: t.to(dtype), bodies.init_params())
    leaves, paths = optree.tree_leaves(ref), optree.tree_paths(ref)
    sched = vfsdp.optim.warmup_cosine(3e-2, 2, 10)
    torch_opt = torch.optim.AdamW(
        [{"params": [p for p, q in zip(leaves, paths) if bodies.no_decay(q)], "weight_decay": 0.1},
         {"params": [p for p, q in zip(leaves, paths) if not bodies.no_decay(q)],
          "weight_decay": 0.0}], lr=sched(1), foreach=False)
    g = torch.Generator().manual_seed(5)
    for step in range(1, 4):
        grads_full = [torch.randn(p.shape, generator=g).to(dtype) for p in leaves]
        for p, gr in zip(leaves, grads_full):
            p.grad = gr.clone()
        for group in torch_opt.param_groups:
            group["lr"] = sched(step)
        torch_opt.step()
        grads_tree = optree.tree_unflatten(optree.tree_structure(params), grads_full)
        state = opt.update(grads_tree, state, shards, spec)
    return all(torch.equal(a.detach().reshape(-1), b.reshape(-1))
               for a, b in zip(optree.tree_leaves(shards), leaves))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_is_bitwise_torch_adamw_given_the_same_gradients(dtype):
    """float64 parameters keep float64 moments, as torch's do."""
    assert simulate(1, _adamw_bitwise_body, dtype) == [True]


def _one_update(name: str, dtype: torch.dtype):
    params = {"w": torch.linspace(-1, 1, 64 * 32).reshape(64, 32).to(dtype),
              "v": torch.linspace(-1, 1, 32 * 32).reshape(32, 32).cos().to(dtype),
              "b": torch.linspace(0, 1, 32).to(dtype)}  # two matrices: Muon roots on both ranks
    opt = {"adamw": vfsdp.optim.adamw(lr=0.1), "adamw8bit": vfsdp.optim.adamw8bit(lr=0.1),
           "muon": vfsdp.optim.muon(lr=0.1)}[name]
    spec = vfsdp.plan(params, 2, granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    state = opt.init(shards, spec)
    full = vfsdp.gather(shards, spec)
    ((full["w"] ** 2).sum() + (full["v"] ** 3).sum() + full["b"].sum()).backward()
    opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    return {k: (v.dtype, v.detach().double()) for k, v in shards.items()}


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_optimizers_take_float64_and_bfloat16_parameters(name, dtype):
    """State in float32 (float64 for float64 parameters); the parameters keep their dtype and
    move as the float32 ones do."""
    got = simulate(2, _one_update, name, dtype)
    want = simulate(2, _one_update, name, torch.float32)
    tol = 1e-6 if dtype == torch.float64 else 4e-2  # bfloat16: its gradients round too
    for g, w in zip(got, want):
        for k in g:
            assert g[k][0] == dtype
            assert torch.allclose(g[k][1], w[k][1], atol=tol), (name, k)


def test_clipping_float64_gradients():
    def body():
        params = {"a": torch.ones(8, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
        spec = vfsdp.plan(params, 2)
        shards = vfsdp.shard(params, spec)
        grads = vfsdp.grads(shards, spec)
        grads["a"].fill_(3.0)
        grads["b"].fill_(4.0)
        return float(vfsdp.clip_grad_norm(grads, spec, 1.0))

    want = (8 * 9 + 3 * 16) ** 0.5
    assert simulate(2, body) == [pytest.approx(want, rel=1e-6)] * 2
