"""Rank bodies for tests/checkpoint/test_untrusted.py."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt

P = {"a": torch.arange(3.0), "b": torch.arange(8.0).reshape(2, 4)}


def save(path: str, scale: float = 1.0, max_shard_size=None) -> str:
    """``P * scale`` saved with save_safetensors; the outcome."""
    params = {k: v * scale for k, v in P.items()}
    spec = vfsdp.plan(params, dist.get_world_size())
    try:
        ckpt.save_safetensors(path, vfsdp.shard(params, spec), spec, max_shard_size=max_shard_size)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def load(path: str):
    """``(outcome, full tensors)`` of load_safetensors into zeroed shards of P's shapes."""
    spec = vfsdp.plan(P, dist.get_world_size())
    sh = vfsdp.shard({k: torch.zeros_like(v) for k, v in P.items()}, spec)
    try:
        ckpt.load_safetensors(path, sh, spec)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}", None
    return "ok", ckpt.to_state_dict(sh, spec)


def save_checkpoint(path: str, overwrite: bool = False, scale: float = 1.0) -> str:
    params = {k: v * scale for k, v in P.items()}
    spec = vfsdp.plan(params, dist.get_world_size())
    ckpt.save(path, {"p": vfsdp.shard(params, spec)}, spec, overwrite=overwrite)
    return "ok"


def load_checkpoint(path: str) -> dict:
    spec = vfsdp.plan(P, dist.get_world_size())
    sh = vfsdp.shard({k: torch.zeros_like(v) for k, v in P.items()}, spec)
    ckpt.load(path, {"p": sh}, spec)
    return ckpt.to_state_dict(sh, spec)


def _die_between_renames(path: str) -> None:
    """An overwrite whose process dies after moving the old checkpoint aside, before putting
    the new one in place (run as a script: ``python untrusted_bodies.py PATH``)."""
    real = os.rename

    def rename(src, dst):
        if ".partial-" in os.fspath(src) and os.fspath(dst) == os.path.abspath(path):
            os._exit(3)  # the crash: the old checkpoint is aside, the new one not in place
        real(src, dst)

    def body():
        os.rename = rename
        save_checkpoint(path, overwrite=True, scale=2.0)

    vfsdp.testing.simulate(1, body)


if __name__ == "__main__":
    _die_between_renames(sys.argv[1])
