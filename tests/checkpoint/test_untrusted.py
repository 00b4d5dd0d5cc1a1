"""Readers that trust nothing: a safetensors header is checked as the format requires, a
directory holds one checkpoint, and a dead save's leftovers are removed by the next save."""

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from tests.checkpoint import untrusted_bodies as ub
from vfsdp.checkpoint import CheckpointError
from vfsdp.checkpoint.safetensors import read_header
from vfsdp.testing import simulate

QUICK = 60


def _write(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def _file(path, a_offsets=(0, 12), b_offsets=(12, 44), extra=b""):
    data = ub.P["a"].numpy().tobytes() + ub.P["b"].numpy().tobytes() + extra
    _write(path, {"a": {"dtype": "F32", "shape": [3], "data_offsets": list(a_offsets)},
                  "b": {"dtype": "F32", "shape": [2, 4], "data_offsets": list(b_offsets)}}, data)


def test_a_well_formed_file_loads_exactly(tmp_path):
    path = str(tmp_path / "m.safetensors")
    _file(path)
    msg, full = simulate(2, ub.load, path, timeout=QUICK)[0]
    assert msg == "ok" and all(torch.equal(full[k], v) for k, v in ub.P.items())


@pytest.mark.parametrize("a, b, extra, says", [
    ((4, 16), (16, 48), b"\0" * 4, "'a' starts at byte 4 of the data, but the tensors before "
                                    "it end at byte 0"),          # shifted by 4 bytes
    ((0, 12), (8, 40), b"", "'b' starts at byte 8 of the data, but the tensors before it end "
                            "at byte 12 ('a')"),                   # overlapping
    ((0, 8), (8, 40), b"", "'a' has data_offsets [0, 8] (8 bytes), but its shape [3] of F32 "
                           "needs 12 bytes"),                      # shorter than shape x dtype
    ((0, 12), (16, 48), b"\0" * 4, "'b' starts at byte 16 of the data, but the tensors before "
                                   "it end at byte 12 ('a')"),   # a gap
    ((0, 12), (12, 44), b"\0" * 4, "4 bytes after its last tensor"),
])
def test_offsets_that_break_the_format_are_refused_naming_the_tensor(tmp_path, a, b, extra, says):
    path = str(tmp_path / "m.safetensors")
    _file(path, a, b, extra)
    with pytest.raises(CheckpointError, match=r"m\.safetensors") as info:
        read_header(path)
    assert says in str(info.value)
    msg, _ = simulate(2, ub.load, path, timeout=QUICK)[0]   # and load refuses it on every rank
    assert msg.startswith("CheckpointError") and says in msg
    st = pytest.importorskip("safetensors.torch")
    with pytest.raises(Exception):                          # as the safetensors package does
        st.load_file(path)


def test_a_malformed_record_and_an_unknown_dtype_are_refused(tmp_path):
    path = str(tmp_path / "m.safetensors")
    _write(path, {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"")
    with pytest.raises(CheckpointError, match="tensor 'a' has a malformed header record"):
        read_header(path)
    _write(path, {"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(CheckpointError, match="tensor 'a' has dtype 'Q4'"):
        read_header(path)
    _write(path, [1, 2], b"")
    with pytest.raises(CheckpointError, match="is a list, not a JSON object"):
        read_header(path)


def test_a_save_replaces_the_other_form_in_its_directory(tmp_path):
    d = str(tmp_path / "hf")
    assert simulate(2, ub.save, d, 1.0, 16, timeout=QUICK) == ["ok", "ok"]   # 2 files
    assert len([n for n in os.listdir(d) if n.startswith("model-")]) == 2
    single = os.path.join(d, "model.safetensors")
    assert simulate(2, ub.save, single, 2.0, timeout=QUICK) == ["ok", "ok"]
    assert os.listdir(d) == ["model.safetensors"]           # the index and shards are gone
    msg, full = simulate(2, ub.load, d, timeout=QUICK)[0]
    assert msg == "ok" and torch.equal(full["b"], 2 * ub.P["b"])
    assert simulate(2, ub.save, d, 3.0, 1 << 20, timeout=QUICK) == ["ok", "ok"]   # 1 file
    assert sorted(os.listdir(d)) == ["model-00001-of-00001.safetensors",
                                     "model.safetensors.index.json"]
    msg, full = simulate(2, ub.load, d, timeout=QUICK)[0]
    assert msg == "ok" and torch.equal(full["b"], 3 * ub.P["b"])


def test_a_dead_saves_partial_file_is_removed_by_the_next_save(tmp_path):
    single = str(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.partial-0123456789ab").write_bytes(b"half a file")
    (tmp_path / "notes.txt").write_text("keep me")
    assert simulate(2, ub.save, single, timeout=QUICK) == ["ok", "ok"]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "notes.txt"]


def test_two_forms_in_one_directory_or_an_index_that_lies_are_refused(tmp_path):
    d = str(tmp_path / "hf")
    simulate(2, ub.save, d, 1.0, 16, timeout=QUICK)
    _file(os.path.join(d, "model.safetensors"))             # another writer's single file
    msg, _ = simulate(2, ub.load, d, timeout=QUICK)[0]
    assert "holds two checkpoints: model.safetensors and a sharded one" in msg
    os.remove(os.path.join(d, "model.safetensors"))
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        body = json.load(f)
    first = sorted(body["weight_map"])[0]
    body["weight_map"][first] = "model-00002-of-00002.safetensors"
    with open(index, "w") as f:
        json.dump(body, f)
    msg, _ = simulate(2, ub.load, d, timeout=QUICK)[0]
    assert f"puts tensor '{first}' in model-00002-of-00002.safetensors, but it is in" in msg


def test_an_overwrite_that_died_between_its_renames_leaves_nothing_after_the_next_save(tmp_path):
    path = str(tmp_path / "c")
    assert simulate(2, ub.save_checkpoint, path, timeout=QUICK) == ["ok", "ok"]
    run = subprocess.run([sys.executable, ub.__file__, path], capture_output=True, text=True,
                         timeout=QUICK, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert run.returncode == 3, run.stderr
    left = sorted(n.split("-")[0] for n in os.listdir(tmp_path))
    assert left == ["c.old", "c.partial"]                   # the crash's leftovers
    assert simulate(2, ub.save_checkpoint, path, True, 5.0, timeout=QUICK) == ["ok", "ok"]
    assert os.listdir(tmp_path) == ["c"]
    full = simulate(2, ub.load_checkpoint, path, timeout=QUICK)[0]
    assert torch.equal(full["b"], 5 * ub.P["b"])
