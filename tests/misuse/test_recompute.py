"""Activation checkpointing misused: a bad ``recompute`` value, ``recompute`` where nothing
can honour it: each refused, naming the fix; a reentrant checkpoint inside a ``run_layers``
layer (its gradients would be lost) runs as a non-reentrant one."""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

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


def _skipping(mode):
    """Each layer uses its unit on rank 0 only (the data decides): rank 1's layers save
    nothing, so its backward reaches no recompute of theirs."""
    ws = [torch.full((4, 4), 0.1) * (i + 1) for i in range(3)]

    def layer(p, h):
        return torch.tanh(h @ p["w"]) if h.sum() > 0 else h * 2

    params = {"layers": [{"w": w} for w in ws]}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    x = torch.full((1, 4), 1.0 if dist.get_rank() == 0 else -1.0, requires_grad=True)
    run = lambda h, **kw: vfsdp.run_layers(layer if mode != "inside" else lambda p, t: checkpoint(
        layer, p, t, use_reentrant=False), shards["layers"], spec["layers"], h, **kw)
    out = (run(x, recompute="full") if mode == "recompute" else
           checkpoint(run, x, use_reentrant=False) if mode == "around" else run(x))
    out.sum().backward()
    return x.grad, [g["w"] for g in vfsdp.gather(vfsdp.grads(shards, spec), spec)["layers"]]


@pytest.mark.parametrize("mode", ["recompute", "inside", "around"])
def test_a_unit_used_on_some_ranks_only_under_a_checkpoint_is_exact(mode):
    """A checkpoint (``recompute``, one inside the layer, one around ``run_layers``) whose
    layers use their unit on some ranks only: every rank joins the backward at each layer's
    output (``recompute="full"`` hung: rank 0 regathered in its recompute, rank 1 never
    entered the backward's agreement), and the gradients are one process's."""
    want_x, want_w = [], [torch.zeros(4, 4) for _ in range(3)]
    for sign in (1.0, -1.0):  # rank 0's data, rank 1's
        ws = [(torch.full((4, 4), 0.1) * (i + 1)).requires_grad_() for i in range(3)]
        x = torch.full((1, 4), sign, requires_grad=True)
        h = x
        for w in ws:
            h = torch.tanh(h @ w) if h.sum() > 0 else h * 2
        h.sum().backward()
        want_x.append(x.grad)
        want_w = [a + (w.grad if w.grad is not None else 0) / 2 for a, w in zip(want_w, ws)]
    for r, (gx, gw) in enumerate(simulate(2, _skipping, mode, timeout=60)):
        torch.testing.assert_close(gx, want_x[r])
        for g, w in zip(gw, want_w):
            torch.testing.assert_close(g, w)


def test_checkpoint_internals_are_checked_on_an_untested_torch():
    """The torch.utils.checkpoint internals vfsdp wraps: used as they are on a tested torch,
    with a warning on another, refused (naming what moved) where they changed."""
    import types
    import warnings

    from torch.utils import checkpoint as ckpt

    from vfsdp._torch_private import TESTED_TORCH, checkpoint_internals

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoint_internals(ckpt, TESTED_TORCH[-1])[1] is ckpt.CheckpointFunction
    with pytest.warns(RuntimeWarning, match=r"tested with torch .*; torch 2.99 has the same"):
        checkpoint_internals(ckpt, (2, 99))
    moved = types.SimpleNamespace(**{n: getattr(ckpt, n) for n in (
        "CheckpointFunction", "check_backward_validity")},
        _checkpoint_without_reentrant_generator=lambda function, *args: None)
    with pytest.raises(RuntimeError, match=r"torch 2.99 changed torch.utils.checkpoint._checkpoint"
                       r"_without_reentrant_generator \(expected parameters \['fn', "
                       r"'preserve_rng_state'\], found \['function', 'args'\]\).*install one"):
        checkpoint_internals(moved, (2, 99))
    gone = types.SimpleNamespace(_checkpoint_without_reentrant_generator=(
        ckpt._checkpoint_without_reentrant_generator))
    with pytest.raises(RuntimeError, match=r"changed torch.utils.checkpoint.CheckpointFunction "
                       r"\(expected parameters \['ctx', 'run_function', 'preserve_rng_state'\], "
                       r"found None\)"):
        checkpoint_internals(gone, (2, 99))
