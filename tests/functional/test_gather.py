"""shard / gather / reduce_scatter against the reference semantics, in simulation and with gloo."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from tests.functional import bodies
from vfsdp.testing import simulate, spawn
from vfsdp.testing.strategies import shapes as shape_st

SMALL = {"layers": [[(4, 3), (5,)], [(4, 3), (5,)], [(2, 2, 3), (0, 3), ()]], "root": [(7, 3), (1,)]}


@st.composite
def model_shapes(draw):
    layers = [[draw(shape_st(max_dims=2, max_side=5)) for _ in range(draw(st.integers(1, 3)))]
              for _ in range(draw(st.integers(0, 3)))]
    root = [draw(shape_st(max_dims=2, max_side=6)) for _ in range(draw(st.integers(0, 2)))]
    return {"layers": layers, "root": root}


GRANS = st.sampled_from([None, vfsdp.rows(1), vfsdp.rows(2), vfsdp.whole])


@settings(max_examples=40)
@given(model_shapes(), st.integers(1, 8), GRANS, st.integers(0, 10**6))
def test_roundtrip_bitwise_zero_copy_sim(shapes, world, gran, seed):
    assert all(simulate(world, bodies.roundtrip, seed, shapes, gran))


def _check_grads(results, shapes, world, op, seed=3, mesh_shape=None):
    params = bodies.make_params(seed, shapes)
    spec = vfsdp.plan(params, mesh_shape or world)
    ref = bodies.reference_gradients(seed, shapes, world, op)
    for rank, got in enumerate(results):
        want = bodies.flat_index(spec, [r.tolist() for r in ref], rank)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g is not None or not w
            assert torch.allclose(torch.tensor(g or [], dtype=torch.float64),
                                  torch.tensor(w, dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["backward", "autograd", "func"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_gradients_match_reference_sim(mode, op, world):
    results = simulate(world, bodies.gradients, 3, SMALL, None, op, mode)
    _check_grads(results, SMALL, world, op)


@settings(max_examples=15)
@given(model_shapes(), st.integers(1, 6), st.sampled_from(["sum", "avg"]))
def test_gradients_random_trees_sim(shapes, world, op):
    shapes = {"layers": shapes["layers"], "root": [*shapes["root"], (3,)]}  # at least one tensor
    results = simulate(world, bodies.gradients, 3, shapes, None, op, "autograd")
    _check_grads(results, shapes, world, op)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_hsdp_2x2_equals_fsdp4_equals_single_process(op):
    hsdp = simulate(4, bodies.hsdp_gradients, 3, SMALL, (2, 2), op)
    _check_grads(hsdp, SMALL, 4, op, mesh_shape=(2, 2))
    fsdp = simulate(4, bodies.gradients, 3, SMALL, None, op, "autograd")
    _check_grads(fsdp, SMALL, 4, op)
    assert all(simulate(4, bodies.roundtrip, 5, SMALL, None, (2, 2)))


@pytest.mark.parametrize("mode", ["everywhere", "src0", "init"])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_shard_modes_sim(mode, world):
    assert all(simulate(world, bodies.shard_modes, 11, SMALL, vfsdp.rows(1), mode))


@pytest.mark.parametrize("mode", ["everywhere", "src0", "init"])
def test_shard_modes_hsdp_sim(mode):
    assert all(simulate(4, bodies.shard_modes, 12, SMALL, vfsdp.rows(1), mode, (2, 2)))


def test_gather_async_and_gather_twice_sim():
    assert all(simulate(3, bodies.async_and_twice, 2, SMALL))


def test_gradient_path_copies_each_tensor_once_sim():
    for copies, copy_bytes, nbytes, n_rs, n_units in simulate(3, bodies.copies_on_grad_path, 1, SMALL):
        n_tensors = sum(len(layer) for layer in SMALL["layers"]) + len(SMALL["root"])
        assert copies <= n_tensors and copy_bytes <= nbytes
        assert n_rs == n_units


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_explicit_reduce_scatter_sim(op):
    assert all(simulate(3, bodies.explicit_reduce_scatter, 4, SMALL, op))


# ------------------------------------------------------------------ real processes (gloo)


def test_roundtrip_and_grads_gloo():
    assert all(spawn(bodies.roundtrip, 3, 7, SMALL, vfsdp.rows(1)))
    _check_grads(spawn(bodies.gradients, 3, 3, SMALL, None, "avg", "backward"), SMALL, 3, "avg")


def test_hsdp_and_src0_gloo():
    _check_grads(spawn(bodies.hsdp_gradients, 4, 3, SMALL, (2, 2), "avg"), SMALL, 4, "avg",
                 mesh_shape=(2, 2))
    assert all(spawn(bodies.shard_modes, 4, 11, SMALL, None, "src0"))
