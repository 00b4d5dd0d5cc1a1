"""Flat ranges as DCP boxes, and save/load round trips over random trees and world sizes."""

import math
import os
import shutil
import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
import vfsdp.checkpoint as ckpt
from tests.functional.test_gather import GRANS, model_shapes
from tests.strategies import shapes as shape_st
from vfsdp.collectives.piece import Piece, boxes, boxes_reference
from vfsdp.functional import match_tree
from vfsdp.testing import simulate


@st.composite
def ranges(draw):
    shape = draw(shape_st(max_dims=4, max_side=5))
    n = math.prod(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@given(ranges())
def test_boxes_tile_the_range_exactly(case):
    shape, a, b = case
    got = boxes(shape, a, b)
    assert boxes_reference(shape, a, b) == set(range(a, b))
    assert sum(math.prod(s) for _, s in got) == b - a        # no overlap
    assert len(got) <= max(1, 2 * len(shape) - 1)
    flat = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(0)
    start = a
    for o, s in got:  # in flat order, each box contiguous
        idx = flat[tuple(slice(i, i + k) for i, k in zip(o, s))].reshape(-1)
        assert idx.tolist() == list(range(start, start + idx.numel()))
        start += idx.numel()


@given(shape_st(max_dims=3, max_side=5), st.data())
def test_whole_rows_are_one_box_and_box_data_is_a_view(shape, data):
    if not shape or not math.prod(shape):
        return
    inner = math.prod(shape[1:])
    r0 = data.draw(st.integers(0, shape[0] - 1))
    r1 = data.draw(st.integers(r0 + 1, shape[0]))
    assert len(boxes(shape, r0 * inner, r1 * inner)) == 1
    full = torch.arange(math.prod(shape)).reshape(shape)
    a = data.draw(st.integers(0, full.numel() - 1))
    b = data.draw(st.integers(a + 1, full.numel()))
    piece = Piece(full.reshape(-1)[a:b], shape, a)
    for o, s in piece.boxes():
        view = piece.box_data(o, s)
        assert view.data_ptr() >= piece.local.data_ptr()
        assert torch.equal(view, full[tuple(slice(i, i + k) for i, k in zip(o, s))])


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
