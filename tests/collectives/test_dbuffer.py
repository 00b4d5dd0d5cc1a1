import pytest
import torch

from tests.collectives import bodies
from vfsdp.testing import simulate, spawn


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_group_ops_keep_padding_zero(world):
    assert all(simulate(world, bodies.group_ops_keep_padding_zero))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_a_release_lets_go_of_the_memory_and_a_gather_hands_out_fresh(world):
    assert all(simulate(world, bodies.release_lets_go_of_memory))


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


def test_a_release_keeps_no_reference_to_memory_a_users_tensor_holds():
    for got in simulate(2, bodies.release_keeps_no_reference):
        assert got[:2] == (1, 1)  # the user's tensor alone: freed when it goes
        assert got[2] == 120.0 and got[3] == {2.0}  # the values it was made from
        assert got[4:] == ("ReleasedTensor", "ReleasedTensor")


def test_dbuffer_on_gloo():
    assert all(spawn(bodies.release_lets_go_of_memory, 2))
    assert spawn(bodies.hsdp_reduce, 4, "avg") == [(2, 2, True)] * 4
