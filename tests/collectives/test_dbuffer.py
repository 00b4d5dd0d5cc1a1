import pytest
import torch

from tests.collectives import bodies
from vfsdp.testing import simulate, spawn


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_group_ops_keep_padding_zero(world):
    assert all(simulate(world, bodies.group_ops_keep_padding_zero))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_release_and_regather_keep_views(world):
    assert all(simulate(world, bodies.release_keeps_views_valid))


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_reduce_scatter_matches_reference(op, reduce_dtype):
    assert all(simulate(3, bodies.reduce_scatter_semantics, op, reduce_dtype))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_hsdp_reduce_scatter_then_all_reduce(op):
    assert simulate(4, bodies.hsdp_reduce, op) == [(2, 2, True)] * 4


def test_spec_for_another_world_size_is_refused():
    for msg in simulate(2, bodies.wrong_world_size):
        assert "planned for mesh (3,)" in msg and "re-plan" in msg


def test_dbuffer_on_gloo():
    assert all(spawn(bodies.release_keeps_views_valid, 2))
    assert spawn(bodies.hsdp_reduce, 4, "avg") == [(2, 2, True)] * 4
