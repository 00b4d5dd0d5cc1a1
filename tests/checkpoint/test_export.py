"""Export to full state dicts and safetensors, import back, under other world sizes."""

import os

import pytest
import torch

from tests.checkpoint import bodies, export_bodies
from tests.checkpoint.test_save_load import _equal
from vfsdp.testing import simulate, spawn


def test_exported_state_dict_loads_into_a_plain_module_with_identical_outputs():
    results = simulate(3, export_bodies.export_into_module)
    (names, same, got, want), _peak = results[0]
    assert same, (got, want)
    assert names[:3] == ["io.embed", "io.head", "io.norm"] and "layers.1.w_down" in names
    assert all(r[0] == {} for r in results[1:])         # only rank 0 receives
    assert max(r[1] for r in results) == 1               # one unit gathered at a time


def test_to_state_dict_of_every_state_roundtrips_through_from_state_dict():
    full = simulate(2, bodies.save_trained_full)[0]
    for world in (1, 3):
        _equal(simulate(world, export_bodies.state_dict_roundtrip, full)[0], full)


def test_from_state_dict_refuses_bad_input_on_every_rank():
    results = simulate(2, export_bodies.from_state_dict_errors)
    msgs, full = results[0]
    assert "no 'head'" in msgs[0]
    assert "'head' is (3, 3) float32, head needs (24, 40) float32" in msgs[1]
    assert "unused names ['extra']" in msgs[2]
    assert results[1][0] == msgs
    assert torch.equal(full["embed"], bodies.params()["embed"])


def test_safetensors_streams_and_reads_back_per_rank(tmp_path):
    path = str(tmp_path / "model.safetensors")
    results = spawn(export_bodies.write_safetensors, 2, path)
    full, _peak = results[0]
    assert max(r[1] for r in results) == 1
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f]
    for world in (1, 3):
        step, got = simulate(world, export_bodies.read_safetensors, path)[0]
        assert step == 7
        _equal(got, {k[len("params."):]: v for k, v in full.items() if k.startswith("params.")})


def test_safetensors_file_reads_with_the_safetensors_library(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "model.safetensors")
    full, _ = spawn(export_bodies.write_safetensors, 2, path)[0]
    loaded = st.load_file(path)
    tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    _equal(loaded, tensors)
    with st.safe_open(path, "pt") as f:
        assert f.metadata()["model"] == "test" and '"step": 7' in f.metadata()["vfsdp.values"]


def test_truncated_safetensors_is_refused(tmp_path):
    path = str(tmp_path / "model.safetensors")
    spawn(export_bodies.write_safetensors, 2, path)
    os.truncate(path, os.path.getsize(path) - 8)
    msg = simulate(2, export_bodies.read_safetensors_error, path)[0]
    assert "truncated" in msg


def test_a_tie_exports_once_under_the_path_registered_first():
    """``{"wte": w, "io": {"lm_head": w}}``: the plan names the tensor after ``wte`` (dict
    insertion order, as a module registers it), and the state dict holds it once."""
    import vfsdp

    w = torch.arange(8.0).reshape(4, 2)
    params = {"wte": w, "io": {"lm_head": w}, "b": torch.ones(3)}
    spec = vfsdp.plan(params, 2)
    assert dict(spec.ties) == {("io", "lm_head"): ("wte",)}

    def body():
        shards = vfsdp.shard(params, spec)
        sd = vfsdp.checkpoint.to_state_dict(shards, spec)
        back = vfsdp.shard({"wte": torch.zeros(4, 2), "b": torch.zeros(3)}, vfsdp.plan(
            {"wte": w, "b": w.new_ones(3)}, 2))
        return sorted(sd), back is not None

    names, _ = simulate(2, body)[0]
    assert names == ["b", "wte"]
