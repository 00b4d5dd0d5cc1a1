"""Atomic checkpoint directories: write under a temporary name, appear complete or not at all.

A save writes into ``<path>.partial-<id>/`` (rank 0 picks the name, creates it with a lock file
naming its process and host, and every rank learns it); :func:`commit` makes it visible as
``<path>`` with one rename, or two when replacing an existing checkpoint (the old one is moved
to ``<path>.old-<id>`` first and deleted after). A crash between those two renames leaves the
old checkpoint at ``<path>.old-<id>``, which the next :func:`prepare` puts back, and the new one
in ``<path>.partial-<id>``, whose lock (removed only once it is in place) lets that
:func:`prepare` delete it. ``overwrite=True`` replaces only vfsdp checkpoints (directories
holding a manifest), never another directory. A save removes another save's unfinished
directory only when its lock proves that save dead (same host, process gone), so two jobs
saving to one path never delete each other's work.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid

import torch.distributed as dist

from vfsdp.checkpoint.storage import MANIFEST, CheckpointError


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def prepare(path: str, overwrite: bool, group) -> str:
    """Rank 0 picks the temporary directory (and refuses to overwrite); all ranks learn it."""
    box: list = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", _prepare_rank0(path, overwrite))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            box[0] = ("exists" if isinstance(exc, _Exists) else type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, group=group, group_src=0)
    status, value = box[0]
    if status == "exists":
        raise FileExistsError(value)
    if status != "ok":
        raise CheckpointError(f"vfsdp.checkpoint.save: preparing {path} failed on rank 0: "
                              f"{status}: {value}")
    return value


class _Exists(FileExistsError):
    """The target exists and may not be replaced."""


def _prepare_rank0(path: str, overwrite: bool) -> str:
    path = os.path.abspath(path)
    parent, base = os.path.dirname(path), os.path.basename(path)
    os.makedirs(parent, exist_ok=True)
    _recover_interrupted_overwrite(path)
    if os.path.exists(path):
        if not overwrite:
            raise _Exists(f"vfsdp.checkpoint.save: {path} exists; pass overwrite=True to "
                          f"replace it")
        if not os.path.isdir(path) or (os.listdir(path) and
                                       not os.path.exists(os.path.join(path, MANIFEST))):
            raise _Exists(f"vfsdp.checkpoint.save: {path} exists and is not a vfsdp "
                          f"checkpoint; overwrite=True only replaces checkpoints")
    for stale in os.listdir(parent):  # leftovers of saves that provably died
        if stale.startswith(base + ".partial-") and _dead(os.path.join(parent, stale)):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    os.makedirs(tmp)
    with open(os.path.join(tmp, LOCK), "w") as f:  # who is writing it, to tell a dead save
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
    return tmp


LOCK = "vfsdp.lock"


def _dead(partial: str) -> bool:
    """Whether an unfinished save's directory provably belongs to a process that died: its
    lock names this host and a process id that no longer runs. Anything else (another host,
    a live process, no readable lock) may be a save in progress and is left alone."""
    try:
        with open(os.path.join(partial, LOCK)) as f:
            lock = json.load(f)
        if str(lock["host"]) == socket.gethostname():
            os.kill(int(lock["pid"]), 0)
    except ProcessLookupError:  # the process is gone
        return True
    except (OSError, ValueError, KeyError, TypeError):  # e.g. another user's live process
        return False
    return False


def _recover_interrupted_overwrite(path: str) -> None:
    """An overwrite that died between its two renames left ``<path>.old-*`` and no ``<path>``:
    put the previous checkpoint back. One that died after them left ``<path>.old-*`` beside
    the new ``<path>``: delete it."""
    parent, base = os.path.dirname(path), os.path.basename(path)
    old = sorted(n for n in os.listdir(parent) if n.startswith(base + ".old-")
                 and os.path.exists(os.path.join(parent, n, MANIFEST)))
    if old and not os.path.exists(path):
        os.rename(os.path.join(parent, old.pop()), path)
    for name in old:
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def commit(tmp: str, path: str) -> None:
    """Make ``tmp`` visible as ``path``: one rename (two when replacing a checkpoint). The
    lock goes last, from ``path``: a save that dies between the renames leaves a ``.partial``
    whose lock names a dead process, which the next save removes."""
    fsync_dir(tmp)
    path = os.path.abspath(path)
    if os.path.exists(path):
        aside = f"{path}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, aside)
        try:
            os.rename(tmp, path)
        except OSError:
            os.rename(aside, path)  # put the old checkpoint back
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, LOCK))
    fsync_dir(path)
    fsync_dir(os.path.dirname(path))
