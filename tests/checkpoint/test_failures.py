"""Nothing lost, nothing silently wrong: interrupted saves, corrupt files, mismatched trees."""

import glob
import json
import os
import shutil

import pytest
import torch

from tests.checkpoint import bodies
from vfsdp.testing import simulate, spawn
from vfsdp.testing.runners import RankError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fail") / "good")
    simulate(2, bodies.save_params, path)
    return path


def _copy(saved, tmp_path, name="copy"):
    dst = str(tmp_path / name)
    shutil.copytree(saved, dst)
    return dst


def _load_error(path, variant="same", world=2):
    out = simulate(world, bodies.try_load, path, variant)
    assert all(isinstance(o, str) for o in out), "the load should have failed on every rank"
    return out[0]


def test_a_good_checkpoint_loads(saved):
    full = simulate(3, bodies.try_load, saved)[0]
    assert torch.equal(full["params.embed"], bodies.params()["embed"])


def test_truncated_file_is_refused_naming_its_tensors(saved, tmp_path):
    path = _copy(saved, tmp_path)
    f = os.path.join(path, "__1_0.distcp")
    os.truncate(f, os.path.getsize(f) - 100)
    msg = _load_error(path)
    assert "__1_0.distcp" in msg and "truncated" in msg and "params." in msg


def test_flipped_byte_is_caught_by_the_checksum(saved, tmp_path):
    path = _copy(saved, tmp_path)
    with open(os.path.join(path, "vfsdp.json")) as f:
        items = json.load(f)["items"]
    _key, (rel, offset, length, _) = next((k, v) for k, v in sorted(items.items())
                                         if k.startswith("params.layers.1.w1@"))
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(offset + length - 64)   # inside the tensor's bytes, near the item's end
        byte = f.read(1)
        f.seek(offset + length - 64)
        f.write(bytes([byte[0] ^ 0x10]))
    msg = _load_error(path, world=3)
    assert "params.layers.1.w1 is corrupt" in msg and "CRC-32" in msg and rel in msg


def test_missing_manifest_or_corrupt_metadata_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path, "no_manifest")
    os.remove(os.path.join(path, "vfsdp.json"))
    assert "not a complete vfsdp checkpoint" in _load_error(path)
    path = _copy(saved, tmp_path, "bad_metadata")
    with open(os.path.join(path, ".metadata"), "r+b") as f:
        f.seek(40)
        f.write(b"\\x00\\x01")
    assert ".metadata is corrupt" in _load_error(path)
    path = _copy(saved, tmp_path, "lost_file")
    os.remove(os.path.join(path, "__0_0.distcp"))
    assert "__0_0.distcp is missing" in _load_error(path)


@pytest.mark.parametrize("variant, words", [
    ("shape", ["params.embed", "(40, 24)", "(41, 24)"]),
    ("dtype", ["params.embed", "float32", "bfloat16"]),
    ("extra_in_tree", ["no entry 'step'"]),
    ("subset_strict", ["holds entries the tree does not", "strict=False"]),
])
def test_a_different_tree_is_refused_naming_the_path(saved, variant, words):
    msg = _load_error(saved, variant)
    for w in words:
        assert w in msg, msg


def test_non_strict_load_takes_a_subset(saved):
    full = simulate(2, bodies.try_load, saved, "subset")[0]
    assert torch.equal(full["params.embed"], bodies.params()["embed"])


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    good, broken = str(tmp_path / "a"), str(tmp_path / "b")
    spawn(bodies.save_params, 2, good)
    with pytest.raises(RankError):
        spawn(bodies.save_dying, 2, broken, "exit", timeout=120)
    assert not os.path.exists(broken)
    partial = glob.glob(broken + ".partial-*")
    assert partial and not os.path.exists(os.path.join(partial[0], "vfsdp.json"))
    msg = _load_error(broken)
    assert msg.startswith("FileNotFoundError") and "unfinished save" in msg
    full = simulate(2, bodies.try_load, good)[0]
    assert torch.equal(full["params.head"], bodies.params(0)["head"])


def test_a_failed_overwrite_keeps_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "a")
    spawn(bodies.save_params, 2, path)
    msgs = spawn(bodies.save_dying, 2, path, "raise", True)
    assert all("injected: disk full" in m for m in msgs), msgs
    full = simulate(3, bodies.try_load, path)[0]
    assert torch.equal(full["params.head"], bodies.params(0)["head"])   # not seed 1's
    assert not glob.glob(path + ".old-*")


def test_overwrite_must_be_asked_for(saved):
    out = simulate(2, _save_again, saved)
    assert all("exists; pass overwrite=True" in o for o in out)


def _save_again(path):
    try:
        bodies.save_params(path)
    except FileExistsError as exc:
        return str(exc)
    return "saved"


@pytest.mark.parametrize("what, words", [("paths", ["rank 1 saves other entries", "extra"]),
                                         ("value", ["step differs between rank 0 and rank 1"]),
                                         ("tensor", ["rng differs", "different tensors"])])
def test_ranks_saving_different_trees_or_values_are_refused(tmp_path, what, words):
    path = str(tmp_path / "c")
    for msg in simulate(2, bodies.inconsistent, path, what):
        for w in words:
            assert w in msg, msg
    assert not os.path.exists(path)
