"""Thin wrappers over the ``torch.distributed`` tensor collectives vfsdp uses.

A group of one rank runs no collective: the wrappers copy locally (or do nothing), as
FSDP2 does, and still count the call. Only collectives that work on gloo, NCCL and the
in-process threaded backend are used: the
equal-segment ``all_gather_single`` / ``reduce_scatter_single`` (2.13's names for
``all_gather_into_tensor`` / ``reduce_scatter_tensor``), ``all_reduce``, ``broadcast``,
equal-size ``scatter`` and ``all_to_all_single`` (uneven splits work there). Every call counts
itself in :data:`COUNTS` (per thread), which tests and benchmarks read to assert "one
collective per unit".
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp

__all__ = ["all_gather_into", "reduce_scatter_into", "all_reduce_", "all_reduce_max_",
           "scatter_into", "broadcast_", "all_to_all_into", "check_op",
           "counts", "reset_counts", "in_collective", "collective_scope", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg")
_TLS = threading.local()

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _InCollective:
    """Marks this thread as inside a collective (so op counters can leave it out)."""

    def __enter__(self):
        _TLS.depth = getattr(_TLS, "depth", 0) + 1

    def __exit__(self, *exc):
        _TLS.depth -= 1


class _Collective(_InCollective):
    """One collective call: marked (see :class:`_InCollective`); on CUDA tensors under
    ``vfsdp.testing.simulate`` (rank threads sharing one GPU through the threaded group, whose
    collectives copy between the threads' tensors on the host's schedule, not the streams'),
    the device is synchronized before and after, so every rank's writes are complete when
    another rank's thread reads them."""

    def __init__(self, t: torch.Tensor) -> None:
        self.sync = t.is_cuda and tp.groups_are_per_thread()
        self.device = t.device

    def __enter__(self):
        super().__enter__()
        if self.sync:
            torch.cuda.synchronize(self.device)

    def __exit__(self, *exc):
        if self.sync:
            torch.cuda.synchronize(self.device)
        super().__exit__(*exc)


def collective_scope() -> _InCollective:
    """Marks the enclosed work as part of a collective (e.g. waiting on an async one)."""
    return _InCollective()


def in_collective() -> bool:
    """Whether this thread is inside a vfsdp collective call right now."""
    return getattr(_TLS, "depth", 0) > 0


def counts() -> Counter:
    """Collectives issued by this thread (rank) since the last :func:`reset_counts`.

    Returns:
        A ``Counter``: per collective name, calls, and under ``"<name>_bytes"`` the bytes
            they moved. It is the live counter, not a copy.

    Raises:
        KeyError: never for a name not issued: a ``Counter`` gives 0 for it. (Counting
            needs no process group.)

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     reset_counts()
        ...     vfsdp.gather(shards, spec)
        ...     return dict(counts()), counts()["reduce_scatter"]
        >>> vfsdp.testing.simulate(2, body)[0]
        ({'all_gather': 1, 'all_gather_bytes': 32}, 0)
    """
    if not hasattr(_TLS, "counts"):
        _TLS.counts = Counter()
    return _TLS.counts


def reset_counts() -> None:
    """Zero this thread's (rank's) :func:`counts`.

    Raises:
        RuntimeError: never: it clears a thread-local counter, with or without a process
            group, and touches no other rank's.

    Example:
        >>> def body():
        ...     t = torch.ones(2)
        ...     all_reduce_(t, "sum")
        ...     before = counts()["all_reduce"]
        ...     reset_counts()
        ...     return before, counts()["all_reduce"]
        >>> vfsdp.testing.simulate(2, body)
        [(1, 0), (1, 0)]
    """
    counts().clear()


def _count(name: str, nbytes: int) -> None:
    c = counts()
    c[name] += 1
    c[f"{name}_bytes"] += nbytes


def check_op(op: str) -> str:
    """``op`` if it is a reduce op vfsdp supports (``"sum"``, ``"avg"``).

    Raises:
        ValueError: any other value.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
    return op


def _op(op: str):
    return dist.ReduceOp.SUM if check_op(op) == "sum" else dist.ReduceOp.AVG


class _Done:
    """The work of a collective a single rank performs locally: already complete."""

    @staticmethod
    def wait() -> bool:
        return True


def _alone(group) -> bool:
    """Whether the group is this rank alone: its collectives are local copies (or nothing),
    without a call into the backend (FSDP2 skips them the same way)."""
    return dist.get_world_size(group) == 1


def _local_copy(out: torch.Tensor, inp: torch.Tensor) -> None:
    """The one-rank collective's own work (so op counters leave it out, as the backend's)."""
    if out.data_ptr() != inp.data_ptr() or out.dtype != inp.dtype:
        with torch.no_grad(), _InCollective():
            out.copy_(inp.reshape(out.shape))


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False,
                    count: str = "all_gather"):
    """``out`` (m*S) <- every rank's ``inp`` (S), in rank order (counted under ``count``)."""
    _count(count, out.numel() * out.element_size())
    if _alone(group):
        _local_copy(out, inp)
        return _Done() if async_op else None
    with _Collective(out):
        return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, op: str = "sum", group=None,
                        async_op: bool = False):
    """``out`` (S) <- ``op`` over ranks of their ``inp[r*S:(r+1)*S]``."""
    _count("reduce_scatter", inp.numel() * inp.element_size())
    if _alone(group):
        _op(op)
        _local_copy(out, inp)
        return _Done() if async_op else None
    with _Collective(out):
        return _reduce_scatter(out, inp, op=_op(op), group=group, async_op=async_op)


def all_reduce_(t: torch.Tensor, op: str = "sum", group=None):
    """In-place all-reduce; ``avg`` is SUM then a division (gloo has no AVG all-reduce)."""
    _op(op)
    _count("all_reduce", t.numel() * t.element_size())
    if _alone(group):
        return t
    with _Collective(t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    if op == "avg":
        t.div_(dist.get_world_size(group))
    return t


def all_reduce_max_(t: torch.Tensor, group=None, count: str = "all_reduce_max",
                    async_op: bool = False):
    """In-place element-wise MAX over ranks (counted under ``count``); ``async_op``: return
    the work (``wait()`` it before reading ``t``)."""
    _count(count, t.numel() * t.element_size())
    if _alone(group):
        return _Done() if async_op else t
    with _Collective(t):
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=async_op)
    return work if async_op else t


def scatter_into(out: torch.Tensor, chunks: Optional[list], group=None, group_src: int = 0):
    """Equal-size scatter from ``group_src`` (``chunks`` there, ``None`` elsewhere)."""
    _count("scatter", out.numel() * out.element_size())
    with _Collective(out):
        dist.scatter(out, chunks, group=group, group_src=group_src)
    return out


def all_to_all_into(out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list,
                    group=None, async_op: bool = False, count: str = "all_to_all"):
    """``all_to_all_single`` with uneven splits (element counts per rank; counted under
    ``count``).

    Returns:
        ``out``, or the work object when ``async_op``.
    """
    _count(count, inp.numel() * inp.element_size())
    if _alone(group):
        _local_copy(out, inp)
        return _Done() if async_op else out
    with _Collective(out):
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                      async_op=async_op)
    return work if async_op else out


def broadcast_(t: torch.Tensor, group=None, group_src: int = 0):
    _count("broadcast", t.numel() * t.element_size())
    if _alone(group):
        return t
    with _Collective(t):
        dist.broadcast(t, group=group, group_src=group_src)
    return t
