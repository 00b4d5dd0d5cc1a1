"""Activation checkpointing misused: a bad ``recompute`` value, ``recompute`` where nothing
can honour it: each refused, naming the fix; a reentrant checkpoint inside a ``run_layers``
layer (its gradients would be lost) runs as a non-reentrant one."""

import pytest
import torch

import vfsdp
from vfsdp.testing import simulate


def test_a_bad_recompute_value_is_refused_where_the_policy_is_made():
    with pytest.raises(ValueError, match="recompute must be None, 'full', 'selective' or a"):
        vfsdp.Policy(recompute="sometimes")
    assert vfsdp.Policy(recompute="selective").recompute == "selective"


def _plain_gather():
    spec = vfsdp.plan({"w": torch.ones(4)}, 2)
    shards = vfsdp.shard({"w": torch.ones(4)}, spec)
    try:
        vfsdp.gather(shards, spec, recompute="full")
    except ValueError as exc:
        return str(exc)


def test_recompute_is_refused_by_a_plain_gather_in_the_one_wording():
    for msg in simulate(2, _plain_gather):
        assert msg.startswith("vfsdp.gather: recompute='full' is not supported by a plain "
                              "gather (only run_layers runs its layers"), msg
        assert "torch.utils.checkpoint (use_reentrant=False)" in msg


def _reentrant():
    from torch.utils.checkpoint import checkpoint

    params = {"layers": [{"w": torch.full((4, 4), 0.1) + i} for i in range(3)]}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    fn = lambda p, h: checkpoint(lambda x: torch.tanh(x @ p["w"]), h, use_reentrant=True)
    x = torch.ones(1, 4, requires_grad=True)
    vfsdp.run_layers(fn, shards["layers"], spec["layers"], x).sum().backward()
    return x.grad, [s["w"].grad.reshape(-1) for s in shards["layers"]]


def test_a_reentrant_checkpoint_inside_run_layers_gives_torchs_gradients():
    """0.3 and stop 42 refused it (its recompute differentiated the regathered tensors, not
    the gather's outputs); inside a run it now runs as a non-reentrant checkpoint."""
    ws = [(torch.full((4, 4), 0.1) + i).requires_grad_() for i in range(3)]
    x = torch.ones(1, 4, requires_grad=True)
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    h.sum().backward()
    got = simulate(2, _reentrant)
    for gx, _ in got:
        torch.testing.assert_close(gx, x.grad)
    for i, w in enumerate(ws):
        torch.testing.assert_close(torch.cat([r[1][i] for r in got]), w.grad.reshape(-1))
