"""Distributed Shampoo against a plain single-process reference of the published algorithm."""

import itertools
import os
import tempfile

import optree
import pytest
import torch

import vfsdp
from tests.optim import test_soap as ts
from vfsdp.testing import simulate

LR, EPS, WD, FREQ = 0.01, 1e-6, 0.01, 5


def _label(path):
    return "shampoo" if path[-1] in ("w_up", "w_down", "head") else "adamw"


def _opt():
    return vfsdp.optim.partition(
        {"shampoo": vfsdp.optim.shampoo(lr=LR, eps=EPS, weight_decay=WD,
                                        precondition_frequency=FREQ),
         "adamw": vfsdp.optim.adamw(lr=LR)}, _label)


def reference(steps=12, block=None, label=_label):
    """Shampoo (Gupta et al. 2018, Algorithm 2: a matrix's roots -1/4, a vector's -1/2) per
    tensor in one process, each cut into blocks of at most ``block`` per side
    (``torch.split`` per dimension, as Distributed Shampoo), the inverse roots by SVD every
    FREQ steps from the first; the tensors' final values."""
    params = _params_matrices(label)
    blocks = {k: list(itertools.product(*(_pieces(n, block) for n in p.shape)))
              for k, p in params.items()}
    stats = {(k, i): [EPS * torch.eye(s.stop - s.start, dtype=p.dtype) for s in b]
             for k, p in params.items() for i, b in enumerate(blocks[k])}
    roots = {}
    for step in range(1, steps + 1):
        grads = dict(zip(_paths(), optree.tree_leaves(ts._grads(step, ts._params()))))
        for k, p in params.items():
            p.mul_(1 - LR * WD)
            for i, b in enumerate(blocks[k]):
                g, st = grads[k][b], stats[(k, i)]
                if g.dim() == 1:
                    st[0] += torch.outer(g, g)
                else:
                    st[0] += g @ g.T
                    st[1] += g.T @ g
                if (step - 1) % FREQ == 0:
                    roots[(k, i)] = []
                    for s in st:
                        u, sv, _ = torch.linalg.svd(s)
                        roots[(k, i)].append(u @ torch.diag(sv.clamp_min(EPS) ** (-0.5 / g.dim())) @ u.T)
                r = roots[(k, i)]
                p[b] -= LR * (r[0] @ g if g.dim() == 1 else r[0] @ g @ r[1])
    return params


def _pieces(n, block):
    return [slice(i, min(n, i + (block or n))) for i in range(0, n, block or n)]


def _paths():
    return ["/".join(map(str, p)) for p in optree.tree_paths(ts._params())]


def _params_matrices(label=_label):
    return {k: v.clone() for k, v in zip(_paths(), optree.tree_leaves(ts._params()))
            if label(k.split("/")) == "shampoo"}


def _check(got, **reference_options):
    want = reference(**reference_options)
    start = _params_matrices(reference_options.get("label", _label))
    found = dict(zip(_paths(), got))
    for k, b in want.items():
        a = found[k]
        assert (a - b).norm() <= 1e-5 * (b - start[k]).norm(), (k, (a - b).norm())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("world, mesh", [(1, None), (2, None), (4, None), (4, (2, 2))])
def test_shampoo_equals_the_reference(world, mesh):
    for got, _ in simulate(world, ts._train, mesh, 12, _opt()):
        _check(got)


def _all(block):
    """Shampoo on every tensor, vectors included, in blocks of ``block``."""
    return vfsdp.optim.shampoo(lr=LR, eps=EPS, weight_decay=WD, precondition_frequency=FREQ,
                               block_size=block)


@pytest.mark.parametrize("make", [_opt, lambda: _all(7)])
def test_shampoo_under_tp_equals_one_process(make):
    one = simulate(1, ts._train, None, 12, make())[0][0]
    for rank, got in enumerate(simulate(4, ts._train_tp, 2, 2, 12, make())):
        for path, a, b in zip(optree.tree_paths(ts._params()), got, one):
            place = ts._tp_rule(path)
            if hasattr(place, "dim"):
                b = b.tensor_split(2, place.dim)[rank % 2]
            assert torch.equal(a, b), (rank, path)


@pytest.mark.parametrize("make", [_opt, lambda: _all(7)])
def test_shampoo_resumes_bitwise_at_another_world_size(make):
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    whole = simulate(2, ts._train, None, 12, make())[0][0]
    simulate(2, ts._train, None, 6, make(), path)
    for got, _ in simulate(3, ts._train, None, 12, make(), None, path, 7):
        assert all(torch.equal(a, b) for a, b in zip(got, whole))


@pytest.mark.parametrize("world, block", [(1, 7), (2, 7), (4, 7), (2, None)])
def test_blocked_shampoo_and_vectors_equal_the_reference(world, block):
    """Every tensor on Shampoo: matrices 8x20, 20x8 and 24x30 and vectors of 8 and 24, in
    blocks of 7 (no side divisible: full blocks and edges) or whole (vectors: n x n)."""
    for got, _ in simulate(world, ts._train, None, 12, _all(block)):
        _check(got, block=block, label=lambda path: "shampoo")
    if block:  # the blocks' statistics are not the whole tensors'
        whole = reference(block=None, label=lambda path: "shampoo")
        assert all(not torch.allclose(a, whole[k], rtol=1e-3)
                   for k, a in reference(block=block, label=lambda path: "shampoo").items())


def _compiled_step():
    params = {"w": torch.randn(6, 4, generator=torch.Generator().manual_seed(0))}
    spec = vfsdp.plan(params, 1)
    out = []
    for compiled in (False, True):
        shards = vfsdp.shard(params, spec)
        opt = vfsdp.optim.shampoo(lr=1e-2, block_size=2)
        state = opt.init(shards, spec)
        vfsdp.gather(shards, spec)["w"].pow(2).sum().backward()

        def update(shards, state):
            opt.update(vfsdp.grads(shards, spec), state, shards, spec)

        (torch.compile(update, fullgraph=True, backend="aot_eager") if compiled else update)(
            shards, state)
        out.append(shards["w"].detach().clone())
    return torch.equal(*out)


def test_a_compiled_update_runs_under_simulate():
    assert simulate(1, _compiled_step)[0]
