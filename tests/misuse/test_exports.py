"""Misuse of exports: each refused on every rank, naming what is wrong and the fix."""

import os

import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt
from vfsdp.testing import simulate

P = {"w": torch.arange(6.0), "experts": {"gate_up_proj": torch.zeros(2, 4, 3)}}


def _outcome(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _export(path, **kwargs) -> str:
    spec = vfsdp.plan(P, dist.get_world_size())
    return _outcome(ckpt.save_safetensors, path, vfsdp.shard(P, spec), spec, **kwargs)


def _save(path) -> None:
    spec = vfsdp.plan(P, dist.get_world_size())
    ckpt.save(path, {"p": vfsdp.shard(P, spec)}, spec)


def test_an_export_into_a_vfsdp_checkpoint_directory_is_refused(tmp_path):
    path = str(tmp_path / "c")
    simulate(2, _save, path)
    before = sorted(os.listdir(path))
    dst, other = simulate(2, _export, os.path.join(path, "model.safetensors"))
    assert dst.startswith("CheckpointError") and "holds a vfsdp checkpoint (vfsdp.json)" in dst
    assert other.startswith("CheckpointError: rank 0 failed")
    assert sorted(os.listdir(path)) == before                # nothing written there


def test_an_unknown_hf_layout_is_refused_naming_the_choices(tmp_path):
    for msg in simulate(2, _export, str(tmp_path / "m.safetensors"), hf_layout="qwen"):
        assert "hf_layout must be one of ('fused', 'per_expert', 'mixtral') or None, got 'qwen'" \
            in msg
    assert not os.listdir(tmp_path)


def test_a_layout_that_maps_two_tensors_to_one_name_is_refused(tmp_path):
    tree = {"model": {"mlp": {"w": torch.ones(2)}, "block_sparse_moe": {"w": torch.ones(2)}}}

    def body(path, **kw):
        spec = vfsdp.plan(tree, dist.get_world_size())
        return _outcome(ckpt.save_safetensors, path, vfsdp.shard(tree, spec), spec,
                        hf_layout="mixtral", **kw)

    for msg in simulate(2, body, str(tmp_path / "m.safetensors")):
        assert "two tensors are both stored as 'model.block_sparse_moe.w'" in msg, msg
    # the same two names in two files (8 bytes a file): refused at save too, nothing written
    for msg in simulate(2, body, str(tmp_path / "sharded"), max_shard_size=8):
        assert "two tensors are both stored as 'model.block_sparse_moe.w'" in msg, msg
    assert not os.path.exists(tmp_path / "sharded") or not os.listdir(tmp_path / "sharded")
