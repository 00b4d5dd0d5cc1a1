"""The silent failures found by trying 0.2 as a user would (issue "Core v3"): each is now right
or refused, on threads and, where processes behave differently, on gloo processes too."""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vfsdp
from vfsdp.testing import RankError, simulate, spawn


# ------------------------------------------------------------------ per-rank seeding


def _module_built_in_rank():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Embedding(5, 2))
    w = torch.empty(3, 3)
    torch.nn.init.orthogonal_(w)
    return [p.detach().clone() for p in layer.parameters()] + [w]


def test_nn_init_draws_from_the_rank_generator():
    """An nn.Module built inside the rank function after the same seed has the same weights on
    every rank, and those of one process (it had different weights on each rank)."""
    torch.manual_seed(0)
    want = _module_built_in_rank()
    for got in simulate(2, _module_built_in_rank):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _dropouts(seed_by_rank):
    torch.manual_seed(dist.get_rank() if seed_by_rank else 3)
    x = torch.ones(2, 3, 4, 4)
    d = torch.nn.Dropout(0.5)(torch.ones(64))
    d2 = F.dropout2d(x, 0.5)
    channels = all(bool((d2[n, c] == d2[n, c, 0, 0]).all()) for n in range(2) for c in range(3))
    a = F.alpha_dropout(torch.randn(20000), 0.2, training=True)
    eval_mode = F.dropout(torch.ones(4), 0.5, training=False)
    return d, d2, channels, a, eval_mode, torch.dropout(torch.ones(64), 0.25, True)


def test_dropout_draws_from_the_rank_generator():
    (d0, c0, ch0, a0, e0, t0), (d1, c1, ch1, a1, e1, t1) = simulate(2, _dropouts, False)
    assert torch.equal(d0, d1) and torch.equal(c0, c1) and torch.equal(t0, t1)  # same seed
    assert set(d0.tolist()) == {0.0, 2.0} and {round(v, 5) for v in t0.tolist()} == {0.0, 1.33333}
    assert ch0 and ch1                                     # dropout2d zeroes whole channels
    assert abs(a0.mean().item()) < 0.05 and abs(a0.std().item() - 1.0) < 0.05  # alpha: SELU
    assert e0.tolist() == [1.0] * 4                        # eval: untouched
    (d0, *_), (d1, *_) = simulate(2, _dropouts, True)
    assert not torch.equal(d0, d1)                         # seeded per rank: different masks
