"""Failures on some ranks only raise on every rank (no hang), and other edges of the API."""

import os

import pytest
import torch

import vfsdp.checkpoint as ckpt
from tests.checkpoint import robust_bodies as rb
from vfsdp.testing import simulate, spawn

QUICK = 60  # seconds: a hang fails the test instead of stalling the suite


def test_renamed_trees_with_empty_pieces_save_and_load(tmp_path):
    path = str(tmp_path / "c")
    simulate(2, rb.renamed_tree, path, True, timeout=QUICK)
    assert all(simulate(3, rb.renamed_tree, path, False, timeout=QUICK))


def test_a_bad_leaf_on_one_rank_raises_everywhere(tmp_path):
    rank0, rank1 = simulate(2, rb.one_rank_bad_leaf, str(tmp_path / "c"), timeout=QUICK)
    assert rank0.startswith("CheckpointError: rank 1 failed: TypeError") and "x is a object" in rank0
    assert rank1.startswith("TypeError") and "x is a object" in rank1


def test_rename_collisions_are_refused_on_every_rank(tmp_path):
    for a, b in simulate(2, rb.rename_collision, str(tmp_path / "m.safetensors"), timeout=QUICK):
        assert "rename maps both a and b to 'w'" in a and "rename maps both" in b
    assert not os.listdir(tmp_path)


def test_an_unwritable_safetensors_path_fails_on_every_rank(tmp_path):
    path = str(tmp_path / "missing" / "m.safetensors")
    dst, other = spawn(rb.safetensors_unwritable, 2, path, timeout=QUICK)
    assert dst.startswith("FileNotFoundError") and other.startswith("CheckpointError: rank 0")


def test_a_path_rank_0_cannot_create_fails_on_every_rank(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    for msg in spawn(rb.save_to, 2, str(tmp_path / "afile" / "c"), timeout=QUICK):
        assert msg.startswith("CheckpointError") and "preparing" in msg and "rank 0" in msg


def test_overwrite_only_replaces_checkpoints(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    for msg in simulate(2, rb.save_to, str(tmp_path / "notes"), True, timeout=QUICK):
        assert "is not a vfsdp checkpoint" in msg
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"


def test_an_overwrite_interrupted_between_its_renames_is_recovered(tmp_path):
    path = str(tmp_path / "c")
    assert simulate(2, rb.save_to, path, timeout=QUICK) == ["ok", "ok"]
    os.rename(path, path + ".old-123456789abc")   # the crash: old moved aside, new not in place
    msg, _ = simulate(2, rb.load_from, path, timeout=QUICK)[0]
    assert msg.startswith("FileNotFoundError") and "previous checkpoint is intact" in msg
    assert simulate(2, rb.save_to, path, True, timeout=QUICK) == ["ok", "ok"]
    assert sorted(os.listdir(tmp_path)) == ["c"]
    msg, full = simulate(2, rb.load_from, path, timeout=QUICK)[0]
    assert msg == "ok" and torch.equal(full["a"], rb.P["a"])


def test_plain_values_keep_their_kind(tmp_path):
    path = str(tmp_path / "c")
    simulate(2, rb.values, path, True, None, timeout=QUICK)
    assert simulate(2, rb.values, path, False, 0, timeout=QUICK) == [3, 3]
    msg = simulate(2, rb.values, path, False, 0.0, timeout=QUICK)[0]
    assert "step was saved as the int 3, the tree has a float" in msg


def test_per_rank_state_reloads_on_the_same_world_size_only(tmp_path):
    path = str(tmp_path / "c")
    simulate(3, rb.per_rank_state, path, True, timeout=QUICK)
    assert simulate(3, rb.per_rank_state, path, False, timeout=QUICK) == [
        ("ok", [float(r)] * 4) for r in range(3)]
    msg, _ = simulate(2, rb.per_rank_state, path, False, timeout=QUICK)[0]
    assert "rng was saved as (3, 4)" in msg and "(2, 4)" in msg


def test_a_non_contiguous_piece_is_refused():
    with pytest.raises(ValueError, match="must be contiguous"):
        ckpt.Piece(torch.zeros(4, 3)[:, :2], (4, 2), 0)


def test_a_source_that_cannot_be_read_fails_on_every_rank():
    src, other = simulate(2, rb.source_copy_fails, timeout=QUICK)
    assert "meta" in src.lower() and other.startswith("CheckpointError: rank 0 failed")
