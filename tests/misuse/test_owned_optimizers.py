"""SOAP's and Shampoo's refusals: what they do not implement or cannot update, named."""

import pytest
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import simulate


def _message(opt, params, freeze=None, tp=False):
    if tp:
        from torch.distributed.tensor import Shard

        mesh = vfsdp.mesh(("dp", 1), ("tp", 2))
        spec = vfsdp.plan(params, mesh, tp=lambda path: Shard(0))
        shards = vfsdp.shard(params, spec, mesh=mesh["dp"])  # the data sub-mesh: no 'tp'
    else:
        spec = vfsdp.plan(params, dist.get_world_size())
        shards = vfsdp.shard(params, spec)
    try:
        state = opt.init(shards, spec)
        if freeze:
            shards[freeze].requires_grad_(False)
        opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_soap_refuses_the_options_it_does_not_implement():
    for name in ("merge_dims", "precondition_1d", "normalize_grads"):
        with pytest.raises(ValueError, match=f"soap: {name}=True is not implemented"):
            vfsdp.optim.soap(**{name: True})
    with pytest.raises(ValueError, match="precondition_frequency must be >= 1"):
        vfsdp.optim.shampoo(precondition_frequency=0)
    with pytest.raises(ValueError, match="shampoo: block_size must be >= 1"):
        vfsdp.optim.shampoo(block_size=0)
    with pytest.raises(ValueError, match="muon: wave_size must be >= 1, got 0"):
        vfsdp.optim.muon(wave_size=0)


def test_what_soap_and_shampoo_cannot_update_is_named():
    soap, shampoo = vfsdp.optim.soap(), vfsdp.optim.shampoo()
    w, b, conv = torch.ones(4, 4), torch.ones(4), torch.ones(2, 3, 4)
    got = simulate(2, _message, soap, {"w": w, "conv": conv})[0]
    assert got.startswith("soap: conv is given to soap") and "3-D" in got and "adamw" in got
    got = simulate(2, _message, shampoo, {"w": w, "b": b, "conv": conv})[0]
    assert got.startswith("shampoo: conv is given to shampoo") and "3-D" in got, got
    got = simulate(2, _message, soap, {"w": w, "b": b}, "w")[0]
    assert got.startswith("soap: w is frozen (requires_grad=False)") and "partition" in got
    got = simulate(2, _message, shampoo, {"w": w}, None, True)[0]
    assert "shampoo: w is split over 'tp'" in got and "mesh=mesh" in got, got
