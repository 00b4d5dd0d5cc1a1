"""One name per option, honoured on every gradient path or refused there with the reason."""

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from tests.functional import option_bodies as ob
from vfsdp.functional.options import Policy, merge
from vfsdp.testing import simulate


@pytest.mark.parametrize("option, name", [
    ({"grads": "buffer"}, "grads='buffer'"),
    ({"accumulate_grads": True}, "accumulate_grads=True"),
    ({"grad_sync": False}, "grad_sync=False"),
    ({"grads": "buffer", "async_reduce": True}, "grads='buffer'"),
])
def test_torch_func_refuses_what_it_cannot_honour(option, name):
    for msg in simulate(2, ob.func_refused, option):
        assert f"{name} is not supported under torch.func" in msg, msg
        assert "vfsdp.gather" in msg


@pytest.mark.parametrize("option", [
    {},
    {"grad_reduce": "sum"},
    {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    {"free_after_backward": True},
])
def test_every_path_gives_the_same_gradients(option):
    want = _plain_torch(option, world=3)
    for rank, (grads, freed) in enumerate(simulate(3, ob.paths, option)):
        ref = grads["autograd"]
        for path in ("backward", "func", "buffer"):
            for a, b in zip(grads[path], ref):
                assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-6, atol=1e-6), path
        assert freed == option.get("free_after_backward", False)
        tol = 2e-2 if "param_dtype" in option else 1e-5  # bf16 forward: bf16 rounding
        for a, b in zip(ref, want[rank]):
            assert torch.allclose(a.float(), b, rtol=tol, atol=tol)


def _plain_torch(option: dict, world: int) -> list:
    """The same gradients from plain tensors in one process (the mean, or with
    grad_reduce="sum" the sum, of the ranks' gradients), cut into each rank's pieces."""
    params = optree.tree_map(lambda t: t.clone().requires_grad_(), ob.params())
    dtype = option.get("param_dtype", torch.float32)
    total = 0
    for r in range(world):
        full = optree.tree_map(lambda t: t.to(dtype), params)
        total = total + ob.loss_of(full, torch.linspace(-1, 1, 8).reshape(2, 4) * (1 + r))
    if option.get("grad_reduce", "avg") == "avg":
        total = total / world
    total.backward()
    spec = vfsdp.plan(ob.params(), world)
    grads = optree.tree_map(lambda t: t.grad, params)
    return [optree.tree_leaves(piece) for piece in vfsdp.testing.shard_reference(grads, spec)]


@pytest.mark.parametrize("world", [1, 3])
def test_async_reduce_through_gather_equals_synchronous(world):
    assert all(simulate(world, ob.async_buffer, 2))


def test_async_reduce_needs_the_buffer():
    spec = vfsdp.plan({"w": torch.ones(4)}, 1)
    with pytest.raises(ValueError, match="async_reduce=True needs grads='buffer'"):
        vfsdp.gather({"w": torch.ones(4)}, spec, async_reduce=True)


def test_bad_values_and_unknown_names():
    """Values are checked once, where a call's policy is made: a Policy, or the one merge()
    makes of a policy and keyword overrides (what every path then reads)."""
    got = merge(Policy(grad_reduce="sum"), {"param_dtype": torch.bfloat16, "grad_sync": None}, "g")
    assert got == Policy(param_dtype=torch.bfloat16, grad_reduce="sum", grad_sync=True)
    with pytest.raises(ValueError, match="grad_reduce must be one of"):
        Policy(grad_reduce="max")
    with pytest.raises(ValueError, match="grads must be one of"):
        merge(None, {"grads": "keep"}, "vfsdp.gather")
    with pytest.raises(ValueError, match="reduce_dtype must be a floating-point"):
        merge(Policy(), {"reduce_dtype": torch.int32}, "vfsdp.gather")
    with pytest.raises(ValueError, match="free_after_backward must be True, False or None"):
        merge(None, {"free_after_backward": "yes"}, "vfsdp.run_layers")
    with pytest.raises(TypeError, match="unexpected options \\['accumulate'\\]"):
        merge(None, {"accumulate": True}, "vfsdp.gather_async")


def test_run_layers_refuses_returned_grads_and_unknown_options():
    msgs = simulate(2, ob.run_layers_refusals)[0]
    assert msgs["return"].startswith("ValueError") and "read them with vfsdp.grads" in msgs["return"]
    assert msgs["unknown"].startswith("TypeError") and "grad_sink" in msgs["unknown"]


def test_reduce_scatter_options():
    for once, twice, by_policy, refused in simulate(2, ob.explicit_reduce_scatter):
        assert once and twice and by_policy
        assert refused[0].startswith("TypeError") and "unexpected options ['op']" in refused[0]
        for msg, name in zip(refused[1:3], ("grad_sync=False", "grads='return'")):
            assert msg == (f"ValueError: vfsdp.reduce_scatter: {name} is not supported by an "
                           f"explicit reduction (it reduces now, into the gradient buffers); "
                           f"drop it")
        assert refused[3].startswith("ValueError: grad_reduce must be one of")


def test_plain_tensors_use_a_temporary_unit_that_is_freed():
    assert simulate(2, ob.temporary_units_are_not_kept) == [(True, True)] * 2


def _mesh_with_carrying_shards():
    import warnings

    mesh = vfsdp.mesh(("dp", dist.get_world_size()))
    params = {"layers": [{"w": torch.arange(16.0).view(4, 4) + i} for i in range(2)]}
    spec = vfsdp.plan(params, mesh)
    shards = vfsdp.shard(params, spec, mesh=mesh)
    other = vfsdp.mesh(("x", dist.get_world_size()))     # a different mesh: never read
    calls = {
        "vfsdp.gather": lambda m: vfsdp.gather(shards, spec, grads="buffer", mesh=m),
        "vfsdp.gather_async": lambda m: vfsdp.gather_async(shards, spec, mesh=m).wait(),
        "vfsdp.run_layers": lambda m: vfsdp.run_layers(
            lambda p, h: h @ p["w"], shards["layers"], spec["layers"], torch.ones(1, 4), mesh=m),
        "vfsdp.clip_grad_norm": lambda m: vfsdp.clip_grad_norm(vfsdp.grads(shards, spec), spec,
                                                               1e6, mesh=m),
        "vfsdp.global_norm": lambda m: vfsdp.optim.global_norm(vfsdp.grads(shards, spec), spec,
                                                                mesh=m),
        "vfsdp.reduce_scatter": lambda m: vfsdp.reduce_scatter(
            {"layers": [{"w": torch.ones(4, 4) * i} for i in range(2)]}, spec, shards=shards,
            mesh=m),
    }
    out = {}
    for name, call in calls.items():
        call(None)
        try:
            call(other)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
        vfsdp.release(shards, spec)
    with warnings.catch_warnings(record=True) as seen:  # plain tensors: mesh= is theirs
        warnings.simplefilter("always")
        plain = vfsdp.gather({"layers": [{"w": shards["layers"][i]["w"].detach().clone()}
                                         for i in range(2)]}, spec, mesh=mesh)
    out["plain"] = ([str(w.message) for w in seen], float(plain["layers"][1]["w"].sum()))
    return out


def test_mesh_with_shards_that_carry_their_mesh_is_refused():
    """mesh= was threaded through every entry point though shards of vfsdp.shard carry their
    mesh (a different mesh there was silently ignored, then deprecated in 0.3): now each call
    refuses it, naming the entry point; plain-tensor shards still take it."""
    for out in simulate(1, _mesh_with_carrying_shards):
        for name in ("vfsdp.gather", "vfsdp.gather_async", "vfsdp.run_layers",
                     "vfsdp.clip_grad_norm", "vfsdp.global_norm", "vfsdp.reduce_scatter"):
            assert out[name] == (f"{name}: mesh= is not taken with the shards (and gradients) "
                                 f"of vfsdp.shard, which carry the mesh they were made on "
                                 f"(removed in vfsdp 0.4); drop it. It stays for plain-tensor "
                                 f"shards"), name
        assert out["plain"] == ([], float((torch.arange(16.0) + 1).sum()))
