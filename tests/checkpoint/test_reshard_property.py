"""Save/load round trips over random trees, world sizes, granularities and units."""

import os
import shutil
import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
import vfsdp.checkpoint as ckpt
from tests.functional.test_gather import GRANS, model_shapes
from vfsdp.functional import match_tree
from vfsdp.testing import simulate


def _save(path, shapes, gran, seed, units=None):
    from tests.functional import bodies as fb

    params = fb.make_params(seed, shapes)
    spec = vfsdp.plan(params, torch.distributed.get_world_size(), granularity=gran, units=units)
    ckpt.save(path, {"p": vfsdp.shard(params, spec), "seed": seed}, spec)
    return True


def _load(path, shapes, gran, seed, units=None):
    from tests.functional import bodies as fb

    params = fb.make_params(seed, shapes)
    spec = vfsdp.plan(params, torch.distributed.get_world_size(), granularity=gran, units=units)
    shards = vfsdp.shard(params, spec, init_fn=lambda p, local, t: local.fill_(-1))
    tree = ckpt.load(path, {"p": shards, "seed": 0}, spec)
    full = vfsdp.gather(shards, spec)
    same = all(torch.equal(a, b) for a, b in zip(match_tree(full, spec, "t"),
                                                 match_tree(params, spec, "t"))
               if isinstance(a, torch.Tensor))
    return same and tree["seed"] == seed


UNITS = st.sampled_from([None, 1, 2])  # default units, or split by tree depth


@settings(max_examples=25, deadline=None)
@given(model_shapes(), st.integers(1, 7), st.integers(1, 7), GRANS, GRANS, UNITS, UNITS,
       st.integers(0, 99))
def test_random_trees_reload_bitwise_under_any_world_granularity_and_units(
        shapes, w_save, w_load, g_save, g_load, u_save, u_load, seed):
    tmp = tempfile.mkdtemp(prefix="vfsdp-ckpt-")
    try:
        path = os.path.join(tmp, "c")
        simulate(w_save, _save, path, shapes, g_save, seed, u_save)
        assert all(simulate(w_load, _load, path, shapes, g_load, seed, u_load))
    finally:
        shutil.rmtree(tmp)
