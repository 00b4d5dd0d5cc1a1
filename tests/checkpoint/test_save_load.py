"""Save/load: resharding across world sizes and meshes, bitwise resume, atomicity, corruption."""

import os

import pytest
import torch

from tests.checkpoint import bodies
from vfsdp.testing import simulate, spawn


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint saved by 2 gloo processes, and its full contents."""
    path = str(tmp_path_factory.mktemp("ckpt") / "w2")
    full = spawn(bodies.save_trained, 2, path)[0]
    return path, full


def test_checkpoint_holds_every_state(trained):
    path, full = trained
    names = set(full)
    for opt in ("adamw", "adamw8bit", "muon"):
        assert f"{opt}.params.layers.1.w2" in names
    assert {"adamw.opt.exp_avg.embed", "adamw.opt.exp_avg_sq.head", "adamw.opt.step"} <= names
    assert {"adamw8bit.opt.codes_m.layers.0.w1", "adamw8bit.opt.scales_v.layers.0.w1",
            "adamw8bit.opt.fp32_m.layers.0.b"} <= names
    assert {"muon.opt.muon.momentum.layers.0.w1", "muon.opt.adamw.exp_avg.embed"} <= names
    assert full["adamw8bit.opt.codes_m.layers.0.w1"].dtype == torch.uint8
    assert full["adamw8bit.opt.codes_m.layers.0.w1"].any()
    assert full["adamw8bit.opt.scales_m.layers.0.w1"].shape == (2,)  # 64x24: 2 stripes x 1 tile
    assert full["muon.opt.muon.momentum.layers.0.w1"].abs().sum() > 0
    assert full["adamw.params.empty"].shape == (0, 8)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "vfsdp.json"]


@pytest.mark.parametrize("mesh", [1, 3, 4, (2, 2)], ids=["w1", "w3", "w4", "hsdp2x2"])
def test_load_under_another_world_size_or_mesh_is_bitwise(trained, mesh):
    path, full = trained
    world = mesh if isinstance(mesh, int) else mesh[0] * mesh[1]
    got = simulate(world, bodies.load_all, path, mesh)[0]
    _equal(got, full)


def test_load_under_gloo_processes(trained):
    path, full = trained
    _equal(spawn(bodies.load_all, 3, path)[0], full)


def test_resume_equals_uninterrupted_training_bitwise(tmp_path):
    names = ["adamw", "adamw8bit", "muon"]
    straight = spawn(bodies.resume_each, 2, str(tmp_path), names, "first")[0]
    resumed = spawn(bodies.resume_each, 2, str(tmp_path), names, "second")[0]  # new processes
    for name in names:
        _equal(resumed[name], straight[name])


def test_async_save_snapshots_then_writes_while_training_goes_on(tmp_path):
    path = str(tmp_path / "async")
    before, after, loaded = spawn(bodies.async_overlap, 2, path)[0]
    _equal(loaded, before)
    assert not torch.equal(after["params.embed"], before["params.embed"])


def test_async_save_of_every_state_reshards(tmp_path):
    path = str(tmp_path / "async_all")
    full = spawn(bodies.save_trained, 2, path, None, True)[0]
    _equal(simulate(3, bodies.load_all, path)[0], full)


@pytest.mark.parametrize("save_mesh, load_mesh", [((2, 2), 2), (1, (2, 2)), (3, 1)],
                         ids=["hsdp-to-w2", "w1-to-hsdp", "w3-to-w1"])
def test_save_from_any_mesh(tmp_path, save_mesh, load_mesh):
    path = str(tmp_path / "c")
    world = lambda m: m if isinstance(m, int) else m[0] * m[1]
    full = simulate(world(save_mesh), bodies.save_trained, path, save_mesh)[0]
    _equal(simulate(world(load_mesh), bodies.load_all, path, load_mesh)[0], full)
    names = os.listdir(path)
    assert sum(n.endswith(".distcp") for n in names) == world(save_mesh)


def test_sharded_checkpoint_loads_into_plain_full_tensors(trained):
    path, full = trained
    got = simulate(1, bodies.load_into_full_tensors, path)[0]
    _equal(got, {k: v for k, v in full.items() if k.startswith("adamw.params.")})


def test_registered_user_state_reshards(tmp_path):
    path = str(tmp_path / "c")
    simulate(4, bodies.custom_state, path, True)
    for step, got, idx in simulate(3, bodies.custom_state, path, False):
        assert step == 4 and got == [float(i) for i in idx]


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_the_next_update_after_a_reshard_is_bitwise_the_same(tmp_path, name):
    """8-bit AdamW included: the reloaded tiles, codes and scales line up exactly."""
    path = str(tmp_path / "c")
    before = simulate(2, bodies.step_after, path, name, True)[0]
    for mesh in (3, (2, 2)):
        world = mesh if isinstance(mesh, int) else 4
        _equal(simulate(world, bodies.step_after, path, name, False, mesh)[0], before)


def test_dcp_metadata_tiles_every_tensor_exactly_once(trained):
    """Global offsets and sizes are right, and ranks holding nothing add no chunk."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path, full = trained
    md = FileSystemReader(path).read_metadata()
    checked = 0
    for name, meta in md.state_dict_metadata.items():
        assert isinstance(meta, TensorStorageMetadata)
        assert tuple(meta.size) == tuple(full[name].shape), name
        seen = torch.zeros(tuple(meta.size), dtype=torch.int32)
        for c in meta.chunks:
            seen[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] += 1
        assert bool((seen == 1).all()), name
        checked += 1
    assert checked > 40 and "adamw.params.empty" not in md.state_dict_metadata  # 0-size: manifest only
