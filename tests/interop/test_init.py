"""Sharded initialisation materialises only local pieces and equals unsharded initialisation."""

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import simulate
from vfsdp.testing.models import GPTConfig, init_rule, meta_params


def _body(granularity):
    cfg = GPTConfig(dim=16, layers=2, heads=2, kv_heads=1, ffn=40, experts=3, expert_ffn=8)
    meta = meta_params(cfg)
    spec = vfsdp.plan(meta, dist.get_world_size(), granularity=granularity)
    sharded = vfsdp.shard(meta, spec, init_fn=vfsdp.init.sharded(init_rule(cfg), seed=7))
    full = vfsdp.init.full_tree(init_rule(cfg), meta, seed=7)
    direct = vfsdp.shard(full, spec)
    same = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(sharded), optree.tree_leaves(direct)))
    back = vfsdp.gather(sharded, spec)
    whole = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(full)))
    return same and whole


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_init_equals_unsharded(world):
    assert all(simulate(world, _body, None))
    assert all(simulate(world, _body, vfsdp.rows(2)))


def test_init_values_and_rules():
    rule = vfsdp.init.rule(vfsdp.init.normal(0.5), ones=lambda p: p[-1] == "norm")
    t = vfsdp.init.full_tensor(rule, ("w",), (300, 300), seed=1)
    assert abs(float(t.std()) - 0.5) < 0.01 and abs(float(t.mean())) < 0.01
    assert torch.equal(vfsdp.init.full_tensor(rule, ("w",), (300, 300), seed=1), t)
    assert not torch.equal(vfsdp.init.full_tensor(rule, ("w",), (300, 300), seed=2), t)
    assert torch.equal(vfsdp.init.full_tensor(rule, ("x", "norm"), (4,)), torch.ones(4))
    with pytest.raises(TypeError, match="normal or constant"):
        vfsdp.init.full_tensor(lambda p, s: 3, ("w",), (2,))
