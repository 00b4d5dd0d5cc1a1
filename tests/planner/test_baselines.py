"""FSDP2 and Megatron padding rules, checked against figures measured on the real systems."""

import os

import pytest

from vfsdp import plan
from vfsdp.planner.baselines import fsdp2_padding, megatron_padding
from vfsdp.planner.shapes import load_shapes

SHAPES = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "shapes")


def _items(name):
    spec = plan(load_shapes(os.path.join(SHAPES, f"{name}.json")), 1)
    return spec, [(tuple(t.shape), 1) for t in spec.tensors()]


@pytest.mark.parametrize("ws, expected", [(8, 0), (24, 9_241_096), (48, 36_571_168),
                                          (512, 69_206_016), (1024, 73_400_320)])
def test_fsdp2_llama2_7b_matches_real_fully_shard(ws, expected):
    # the expected values: measured against torch 2.13 fully_shard
    assert fsdp2_padding(_items("llama2-7b")[1], ws) == expected


def test_fsdp2_small_cases_and_blocks():
    assert fsdp2_padding([((17, 10), 1)], 3) == 10  # Linear(10, 17) on 3 ranks: 6/6/5 rows
    # keeping 4-row blocks whole: 17 rows -> 2 blocks per rank (8 rows) on 3 ranks
    assert fsdp2_padding([((17, 10), 40)], 3) == (24 - 17) * 10
    assert fsdp2_padding([((0, 5), 1), ((), 1)], 4) == 3


def test_megatron_fixture_and_llama2_7b():
    assert megatron_padding([((5, 4), 1), ((2, 6), 1), ((3,), 1)], 2) == 48 - 35  # size 48
    spec, _ = _items("llama2-7b")
    total = {}
    for ws in (8, 512, 1024):
        total[ws] = sum(
            megatron_padding([(tuple(spec.tensor(p).shape), 1) for p in u.paths], ws)
            for u in spec.units.values()
        )
    n = 6_738_415_616
    assert total[8] / n == pytest.approx(0.0025, abs=0.0002)  # 16.5M
    assert total[512] / n == pytest.approx(0.32, abs=0.01)  # 2.18B
    assert total[1024] / n == pytest.approx(0.75, abs=0.01)  # 5.07B
