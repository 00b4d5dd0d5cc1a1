"""``vfsdp.shard_map`` against ``jax.shard_map``: the same programs, the same numbers, the same
verdicts on replication (``check_vma``).

Each program is written once against a small namespace of array ops (``o``), given JAX's
(``_Jax``: ``jax.lax`` collectives, ``jnp``) or vfsdp's (``_Torch``: ``vfsdp.lax``, torch),
and run by ``jax.shard_map`` on 4 CPU devices and by ``vfsdp.shard_map`` on 4 simulated
ranks over the same meshes (``("sp", 4)``, ``("dp", 2), ("tp", 2)``), on the same float32
inputs. Outputs and the gradients of ``sum(out * cotangent)`` agree within 1e-5, on every
rank. The replication cases compare verdicts only: accepted by both, or refused by both
(JAX's verdict comes from tracing, ``jax.eval_shape``, no compile). Skipped without jax
(``pip install "jax[cpu]"``, in the dev extra).
"""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=4").strip()
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import vfsdp  # noqa: E402
from vfsdp import lax  # noqa: E402
from vfsdp.testing import simulate  # noqa: E402

TOL = 1e-5


class _Jax:
    """The ops of the programs, in JAX."""

    def __init__(self):
        from jax.sharding import Mesh
        if len(jax.devices()) < 4:
            pytest.fail("jax was set up before this module with fewer than 4 CPU devices: run "
                        "with XLA_FLAGS=--xla_force_host_platform_device_count=4")
        devices = np.array(jax.devices()[:4])
        self.meshes = {1: Mesh(devices, ("sp",)), 2: Mesh(devices.reshape(2, 2), ("dp", "tp"))}
        self.P = jax.sharding.PartitionSpec

    def shard_map(self, f, mesh, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.meshes[mesh], in_specs=in_specs, out_specs=out_specs)

    psum, pmean, axis_index = map(staticmethod, (jax.lax.psum, jax.lax.pmean, jax.lax.axis_index))
    relu, sin, tanh, exp, zeros_like, einsum = map(staticmethod, (
        jax.nn.relu, jnp.sin, jnp.tanh, jnp.exp, jnp.zeros_like, jnp.einsum))

    def pvary(self, x, axis):
        return jax.lax.pcast(x, axis, to="varying")

    def all_gather(self, x, axis, dim):
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    def psum_scatter(self, x, axis, dim):
        return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)

    def all_to_all(self, x, axis, split, concat):
        return jax.lax.all_to_all(x, axis, split, concat, tiled=True)

    def sum(self, x, dim=None):
        return x.sum(axis=dim)

    def zeros(self, like, shape):
        return jnp.zeros(shape, like.dtype)

    def set_rows(self, buf, start, x):
        return jax.lax.dynamic_update_slice_in_dim(buf, x, start, 0)

    def causal_softmax(self, s):
        n = s.shape[-1]
        return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf), -1)

    def vmap(self, f):
        return jax.vmap(f)

    def const(self, v):
        return jnp.asarray(v, jnp.float32)


class _Torch:
    """The same ops in vfsdp (torch, ``vfsdp.lax``); the meshes are made on each rank."""

    def __init__(self):
        self.meshes = {1: vfsdp.mesh(("sp", 4)), 2: vfsdp.mesh(("dp", 2), ("tp", 2))}
        self.P = vfsdp.P

    def shard_map(self, f, mesh, in_specs, out_specs):
        return vfsdp.shard_map(f, self.meshes[mesh], in_specs, out_specs)

    psum, pmean, pvary, axis_index, all_gather, psum_scatter, all_to_all = map(staticmethod, (
        lax.psum, lax.pmean, lax.pvary, lax.axis_index, lax.all_gather, lax.psum_scatter,
        lax.all_to_all))
    relu, sin, tanh, exp, zeros_like, einsum = map(staticmethod, (
        torch.relu, torch.sin, torch.tanh, torch.exp, torch.zeros_like, torch.einsum))

    def sum(self, x, dim=None):
        return x.sum() if dim is None else x.sum(dim)

    def zeros(self, like, shape):
        return like.new_zeros(shape)

    def set_rows(self, buf, start, x):
        buf[start:start + x.shape[0]] = x  # a write in place: the tracking sees it
        return buf

    def causal_softmax(self, s):
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        return torch.softmax(s.masked_fill(~mask, float("-inf")), -1)

    def vmap(self, f):
        return torch.func.vmap(f)

    def const(self, v):
        return torch.tensor(v, dtype=torch.float32)


# ------------------------------------------------------------------ the programs
# name: (mesh, per input its spec's entries, the out_spec's, input shapes, body(o) -> the
# mapped function)

def _ulysses(o, x, wq, wk, wv, wo):
    n, heads, hd = x.shape[0], 4, 2

    def heads_of(w):  # [my tokens, all heads] -> [all tokens, my heads]
        return o.all_to_all((x @ w).reshape(n, heads, hd), "sp", 1, 0)

    q, k, v = heads_of(wq), heads_of(wk), heads_of(wv)
    att = o.causal_softmax(o.einsum("shd,thd->hst", q, k) / 2 ** 0.5)
    out = o.all_to_all(o.einsum("hst,thd->shd", att, v), "sp", 0, 1)  # back to my tokens
    return out.reshape(n, heads * hd) @ wo


PROGRAMS = {
    "psum": (1, [("sp",)], (), [(8, 3)], lambda o: lambda x: o.psum(o.sum(x, 0), "sp")),
    "pmean": (1, [("sp",)], (), [(8, 3)], lambda o: lambda x: o.pmean(o.sin(x) * x, "sp")),
    "all_gather": (1, [("sp",)], ("sp",), [(8, 3)],
                   lambda o: lambda x: o.sin(o.all_gather(x, "sp", 0))),
    "all_gather dim 1": (1, [(None, "sp")], (None, "sp"), [(3, 8)],
                         lambda o: lambda x: o.all_gather(x, "sp", 1) * 2),
    "psum_scatter": (1, [("sp",)], ("sp",), [(8, 4)],
                     lambda o: lambda x: o.psum_scatter(o.tanh(x), "sp", 1)),
    "all_to_all": (1, [("sp",)], (None, "sp"), [(8, 8)],
                   lambda o: lambda x: o.all_to_all(x * x, "sp", 1, 0)),
    "tuple psum": (2, [(("dp", "tp"),)], (), [(8, 3)],
                   lambda o: lambda x: o.psum(o.sum(o.exp(x), 0), ("dp", "tp"))),
    "tuple all_gather": (2, [(("dp", "tp"),)], (("dp", "tp"),), [(8, 3)],
                         lambda o: lambda x: o.all_gather(x, ("dp", "tp"), 0) + 1),
    "TP MLP": (1, [(), (None, "sp"), ("sp",)], (), [(3, 4), (4, 8), (8, 4)],
               lambda o: lambda x, up, down: o.psum(o.relu(o.pvary(x, "sp") @ up) @ down,
                                                    "sp")),
    "TP MLP, pvary forgotten": (1, [(), (None, "sp"), ("sp",)], (), [(3, 4), (4, 8), (8, 4)],
                                lambda o: lambda x, up, down: o.psum(o.relu(x @ up) @ down,
                                                                     "sp")),
    "Megatron SP block": (1, [("sp",), (None, "sp"), ("sp",)], ("sp",),
                          [(8, 4), (4, 8), (8, 4)],
                          lambda o: lambda x, up, down: x + o.psum_scatter(
                              o.relu(o.all_gather(x, "sp", 0) @ up) @ down, "sp", 0)),
    "Ulysses attention": (1, [("sp",), (), (), (), ()], ("sp",),
                          [(8, 4), (4, 8), (4, 8), (4, 8), (8, 4)],
                          lambda o: lambda *a: _ulysses(o, *a)),
    "DP loss": (1, [("sp",), ()], (), [(8, 4), (4, 2)],
                lambda o: lambda x, w: o.pmean(o.sum(o.tanh(x @ w) ** 2), "sp")),
    "TP x DP MLP": (2, [("dp",), (None, "tp"), ("tp",)], ("dp",), [(4, 4), (4, 8), (8, 4)],
                    lambda o: lambda x, up, down: o.psum(o.relu(x @ up) @ down, "tp")),
    "axis_index scales": (1, [()], ("sp",), [(2, 3)],
                          lambda o: lambda x: x * (o.axis_index("sp") + 1)),
    "invariant output tiled": (1, [()], ("sp",), [(2, 3)], lambda o: lambda x: o.sin(x)),
    "psum of invariant": (1, [()], (), [(2, 3)], lambda o: lambda x: o.psum(x * x, "sp")),
    "all_gather of invariant": (1, [()], ("sp",), [(2, 3)],
                                lambda o: lambda x: o.all_gather(o.tanh(x), "sp", 0)),
    "tuple specs out of order": (2, [(("tp", "dp"),)], (("tp", "dp"),), [(8, 3)],
                                 lambda o: lambda x: x * x),
    "tuple specs reordered": (2, [(("dp", "tp"),)], (("tp", "dp"),), [(8, 3)],
                              lambda o: lambda x: x * 3),
    "psum over dp of tp pieces": (2, [("tp",)], ("tp",), [(4, 3)],
                                  lambda o: lambda x: o.psum(x, "dp")),
    "scatter then psum": (1, [("sp",)], (), [(8, 3)], lambda o: lambda x: o.psum(o.set_rows(
        o.zeros(x, (8, 3)), o.axis_index("sp") * 2, x), "sp")),
    "psum(1) is the axis size": (1, [("sp",)], ("sp",), [(8, 3)],
                                 lambda o: lambda x: x * o.psum(o.const(1.0), "sp")),
    "vmap over rows": (1, [("sp",), ()], ("sp",), [(8, 3), (3, 3)],
                       lambda o: lambda x, w: o.vmap(lambda r: o.tanh(r @ w))(x)),
}


def _p(o, spec):
    return o.P(*spec)


def _specs(o, ins, out):
    return tuple(_p(o, s) for s in ins), _p(o, out)


def _inputs(name):
    rng = np.random.RandomState(sum(map(ord, name)))
    return [rng.randn(*s).astype(np.float32) for s in PROGRAMS[name][3]]


@pytest.fixture(scope="module")
def jax_results():
    """Every program's output, cotangent and input gradients, by JAX (one jit each)."""
    o, out = _Jax(), {}
    for name, (mesh, ins, spec, _, body) in PROGRAMS.items():
        in_specs, out_spec = _specs(o, ins, spec)
        f = o.shard_map(body(o), mesh, in_specs, out_spec)
        xs = _inputs(name)
        shape = jax.eval_shape(f, *xs).shape
        ct = np.asarray(np.random.RandomState(7).standard_normal(shape), np.float32)

        def run(ct, *xs, f=f):
            y, vjp = jax.vjp(f, *xs)
            return y, vjp(ct)
        y, grads = jax.jit(run)(ct, *xs)
        out[name] = (np.asarray(y), ct, [np.asarray(g) for g in grads])
    return out


def _vfsdp_programs(cts: dict) -> dict:
    o, out = _Torch(), {}
    for name, (mesh, ins, spec, _, body) in PROGRAMS.items():
        in_specs, out_spec = _specs(o, ins, spec)
        xs = [torch.from_numpy(x).requires_grad_() for x in _inputs(name)]
        y = o.shard_map(body(o), mesh, in_specs, out_spec)(*xs)
        (y * torch.from_numpy(cts[name])).sum().backward()
        out[name] = (y.detach().numpy(), [x.grad.numpy() for x in xs])
    return out


def test_the_programs_give_jaxs_outputs_and_gradients(jax_results):
    assert len(PROGRAMS) >= 20
    cts = {k: v[1] for k, v in jax_results.items()}
    for rank, got in enumerate(simulate(4, _vfsdp_programs, cts)):
        for name, (y, grads) in got.items():
            want_y, _, want_grads = jax_results[name]
            assert y.shape == want_y.shape, (name, rank, y.shape, want_y.shape)
            np.testing.assert_allclose(y, want_y, atol=TOL, rtol=TOL, err_msg=f"{name} r{rank}")
            for i, (g, w) in enumerate(zip(grads, want_grads)):
                np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL,
                                           err_msg=f"{name}: input {i}'s gradient, rank {rank}")


# ------------------------------------------------------------------ replication verdicts
# name: (mesh, in_specs, out_spec, input shapes, body(o)), as the programs

def _nested(o):
    inner = o.shard_map(lambda y: y * 2, 1, (o.P("sp"),), o.P("sp"))
    return lambda x: inner(x)


CASES = {
    "varying output under P()": (1, [("sp",)], (), [(8, 3)], lambda o: lambda x: x * 2),
    "psum of an invariant value": (1, [()], (), [(2, 3)], lambda o: lambda x: o.psum(x, "sp")),
    "pvary of a varying value": (1, [("sp",)], ("sp",), [(8, 3)],
                                 lambda o: lambda x: o.pvary(x, "sp")),
    "all_gather of invariant under P()": (1, [()], (), [(2, 3)],
                                          lambda o: lambda x: o.all_gather(x, "sp", 0)),
    "all_gather of invariant under P('sp')": (1, [()], ("sp",), [(2, 3)],
                                              lambda o: lambda x: o.all_gather(x, "sp", 0)),
    "axis_index under P()": (1, [()], (), [(2, 3)],
                             lambda o: lambda x: x * (o.axis_index("sp") + 1)),
    "axis_index under P('sp')": (1, [()], ("sp",), [(2, 3)],
                                 lambda o: lambda x: x * (o.axis_index("sp") + 1)),
    "invariant output under P('sp')": (1, [()], ("sp",), [(2, 3)], lambda o: lambda x: x),
    "zeros_like of a piece under P()": (1, [("sp",)], (), [(8, 3)],
                                        lambda o: lambda x: o.zeros_like(x)),
    "zeros of a shape under P()": (1, [("sp",)], (), [(8, 3)],
                                   lambda o: lambda x: o.zeros(x, (2, 3))),
    "tuple out_spec out of the mesh's order": (2, [(("dp", "tp"),)], (("tp", "dp"),), [(8, 3)],
                                               lambda o: lambda x: x),
    "psum over dp of tp pieces under P()": (2, [("tp",)], (), [(4, 3)],
                                            lambda o: lambda x: o.psum(x, "dp")),
    "psum over dp of tp pieces under P('tp')": (2, [("tp",)], ("tp",), [(4, 3)],
                                                lambda o: lambda x: o.psum(x, "dp")),
    "pmean over tp of dp x tp pieces under P()": (2, [(("dp", "tp"),)], (), [(8, 3)],
                                                  lambda o: lambda x: o.pmean(x, "tp")),
    "nested shard_map": (1, [("sp",)], ("sp",), [(8, 3)], _nested),
    "psum_scatter of an invariant value": (1, [()], ("sp",), [(8, 3)],
                                           lambda o: lambda x: o.psum_scatter(x, "sp", 0)),
    "replicated weight times split data": (1, [("sp",), ()], ("sp",), [(8, 3), (3, 3)],
                                           lambda o: lambda x, w: x @ w),
    "a piece written into a buffer, under P()": (
        1, [("sp",)], (), [(8, 3)],
        lambda o: lambda x: o.set_rows(o.zeros(x, (8, 3)), o.axis_index("sp") * 2, x)),
    "a piece written into a buffer, psum-ed": (
        1, [("sp",)], (), [(8, 3)],
        lambda o: lambda x: o.psum(o.set_rows(o.zeros(x, (8, 3)), o.axis_index("sp") * 2, x),
                                   "sp")),
    "psum of a constant": (1, [("sp",)], ("sp",), [(8, 3)],
                           lambda o: lambda x: x * o.psum(o.const(1.0), "sp")),
    "vmap's result under P()": (1, [("sp",)], (), [(8, 3)],
                                lambda o: lambda x: o.vmap(o.sin)(x)),
}


def _verdict(f) -> str:
    try:
        f()
    except (ValueError, TypeError) as exc:
        return "refused: " + str(exc).split("\n")[0][:200]
    return "accepted"


def _jax_verdicts() -> dict:
    o, out = _Jax(), {}
    for name, (mesh, ins, spec, shapes, body) in CASES.items():
        in_specs, out_spec = _specs(o, ins, spec)
        xs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
        out[name] = _verdict(lambda: jax.eval_shape(o.shard_map(body(o), mesh, in_specs,
                                                                 out_spec), *xs))
    return out


def _vfsdp_verdicts() -> dict:
    o, out = _Torch(), {}
    for name, (mesh, ins, spec, shapes, body) in CASES.items():
        in_specs, out_spec = _specs(o, ins, spec)
        xs = [torch.ones(s, requires_grad=True) for s in shapes]
        out[name] = _verdict(lambda: o.shard_map(body(o), mesh, in_specs, out_spec)(*xs))
    return out


def test_replication_cases_are_accepted_or_refused_as_jax_does():
    assert len(CASES) >= 15
    want = _jax_verdicts()
    assert sum(v.startswith("refused") for v in want.values()) >= 6, want
    for rank, got in enumerate(simulate(4, _vfsdp_verdicts)):
        for name in CASES:
            assert got[name].split(":")[0] == want[name].split(":")[0], \
                (name, rank, "vfsdp", got[name], "jax", want[name])


def test_keyword_arguments_are_refused_by_name_as_jax_refuses_them():
    o = _Jax()
    f = o.shard_map(lambda x, y=1: x * y, 1, (o.P("sp"),), o.P("sp"))
    assert _verdict(lambda: f(np.ones((8, 3), np.float32), y=2)).startswith("refused")

    def body():
        g = vfsdp.shard_map(lambda x, y=1: x * y, vfsdp.mesh(("sp", 4)), vfsdp.P("sp"),
                            vfsdp.P("sp"))
        return _verdict(lambda: g(torch.ones(8, 3), y=2))

    for v in simulate(4, body):
        assert v.startswith("refused: shard_map(") and "<lambda>): keyword arguments ['y'] " \
            "are not mapped" in v, v

