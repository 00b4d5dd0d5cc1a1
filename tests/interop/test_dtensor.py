"""DTensor interop: zero-copy where DTensor can express the layout, explicit everywhere else."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import vfsdp
from tests.interop import dtensor_bodies as b
from vfsdp.testing import simulate, spawn


def test_placement_is_named_only_when_dtensor_can_express_it():
    spec = vfsdp.plan({"w": torch.empty(8, 4)}, 2)
    assert vfsdp.dtensor_placement(spec.tensor(("w",))) == Shard(0)
    assert vfsdp.dtensor_placement(vfsdp.plan({"w": torch.empty(8, 4)}, 1).tensor(("w",))) == Replicate()
    ragged = vfsdp.plan({"a": torch.empty(5), "w": torch.empty(6, 2)}, 3)
    assert vfsdp.dtensor_placement(ragged.tensor(("w",))) is None


@pytest.mark.parametrize("world", [2, 4])
def test_even_layouts_become_zero_copy_dtensors(world):
    for placements, zero_copy, sees_update in simulate(world, b.even_views):
        assert placements == [Shard(0)] and zero_copy and sees_update


def test_even_layouts_on_hsdp_replicate_the_first_mesh_dim():
    for placements, zero_copy, sees_update in simulate(4, b.even_views, (2, 2)):
        assert placements == [Replicate(), Shard(0)] and zero_copy and sees_update


def test_ragged_layouts_are_refused_by_default_naming_the_tensor():
    msg = simulate(3, b.ragged, "error")[0]
    assert "RaggedShard" in msg and "ragged='redistribute'" in msg and "layers." in msg


def test_ragged_redistribute_gives_full_dtensor_semantics():
    for out in simulate(3, b.ragged, "redistribute"):
        assert torch.equal(out["w0"], b.RAGGED["layers"][0]["w"])
        assert torch.equal(out["v1"], b.RAGGED["layers"][1]["v"])
        assert torch.equal(out["s"], b.RAGGED["s"])


def test_ragged_keep_leaves_local_shards():
    out = simulate(3, b.ragged, "keep")
    assert any(isinstance(v, tuple) and v[0] == "local" for o in out for v in o.values())


@pytest.mark.parametrize("world", [1, 3])
def test_from_dtensor_under_another_plan(world):
    assert all(simulate(world, b.roundtrip_other_plan))


def test_from_full_tensors_and_unsupported_placements():
    ok, msg = simulate(2, b.from_full_and_bad_placement)[0]
    assert ok and "Shard(dim=1)" in msg and "layers.0.w" in msg and "Shard(0)" in msg


def test_plain_dcp_loads_a_vfsdp_checkpoint_into_shard0_dtensors(tmp_path):
    assert all(spawn(b.plain_dcp_reads_vfsdp_checkpoint, 3, str(tmp_path / "c")))
