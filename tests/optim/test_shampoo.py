"""Distributed Shampoo against a plain single-process reference of the published algorithm."""

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


def reference(steps=12):
    """Shampoo (Gupta et al. 2018, Algorithm 1) per matrix in one process, the inverse 4th
    roots by SVD every FREQ steps from the first; the matrices' final values."""
    params = _params_matrices()
    stats = {k: [EPS * torch.eye(n, dtype=p.dtype) for n in p.shape] for k, p in params.items()}
    roots = {}
    for step in range(1, steps + 1):
        grads = dict(zip(_paths(), optree.tree_leaves(ts._grads(step, ts._params()))))
        for k, p in params.items():
            g = grads[k]
            stats[k][0] += g @ g.T
            stats[k][1] += g.T @ g
            if (step - 1) % FREQ == 0:
                roots[k] = []
                for s in stats[k]:
                    u, sv, _ = torch.linalg.svd(s)
                    roots[k].append(u @ torch.diag(sv.clamp_min(EPS) ** -0.25) @ u.T)
            p.mul_(1 - LR * WD)
            p.sub_(LR * roots[k][0] @ g @ roots[k][1])
    return params


def _paths():
    return ["/".join(map(str, p)) for p in optree.tree_paths(ts._params())]


def _params_matrices():
    return {k: v.clone() for k, v in zip(_paths(), optree.tree_leaves(ts._params()))
            if _label(k.split("/")) == "shampoo"}


def _check(got):
    want, start = reference(), _params_matrices()
    found = dict(zip(_paths(), got))
    for k, b in want.items():
        a = found[k]
        assert (a - b).norm() <= 1e-5 * (b - start[k]).norm(), (k, (a - b).norm())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("world, mesh", [(1, None), (2, None), (4, None), (4, (2, 2))])
def test_shampoo_equals_the_reference(world, mesh):
    for got, _ in simulate(world, ts._train, mesh, 12, _opt()):
        _check(got)


def test_shampoo_under_tp_equals_one_process():
    one = simulate(1, ts._train, None, 12, _opt())[0][0]
    for rank, got in enumerate(simulate(4, ts._train_tp, 2, 2, 12, _opt())):
        for path, a, b in zip(optree.tree_paths(ts._params()), got, one):
            place = ts._tp_rule(path)
            if hasattr(place, "dim"):
                b = b.tensor_split(2, place.dim)[rank % 2]
            assert torch.equal(a, b), (rank, path)


def test_shampoo_resumes_bitwise_at_another_world_size():
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    whole = simulate(2, ts._train, None, 12, _opt())[0][0]
    simulate(2, ts._train, None, 6, _opt(), path)
    for got, _ in simulate(3, ts._train, None, 12, _opt(), None, path, 7):
        assert all(torch.equal(a, b) for a, b in zip(got, whole))
