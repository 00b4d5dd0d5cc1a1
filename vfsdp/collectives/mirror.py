"""A host copy of a unit's gradient shard, made by the unit's reduce transition.

``vfsdp.optim.offload`` gives each unit it updates a :class:`HostMirror` (``unit.grad_mirror``,
held weakly: it goes with the optimizer state). Each reduce-scatter into the unit's gradient
buffer then ends with one device-to-host copy of the shard into the mirror (on a GPU, on the
mirror's stream, asynchronously into pinned memory), so the copies of the units reduced first
run while the backward of the others goes on.

Whether the copy still holds what the buffer holds when the optimizer reads it is decided by
content, not by bookkeeping: :func:`fingerprint` of the buffer taken on the mirror's stream
just before the copy, against the buffer's fingerprint when the optimizer reads it (both on
the device). No write hides from that, whether or not a version counter sees it (``.data``,
``torch.distributed`` collectives, ``GradScaler.unscale_``, a custom kernel): a write after
the fingerprint was taken (even one racing with the copy) changes what the optimizer sees,
and it copies again. What a fingerprint cannot tell is a write that only permutes values, or
one whose changes cancel in both of its sums (see :func:`fingerprint`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostMirror", "fingerprint"]

_LANE = 0xFFFFFFFF


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Two int64s on ``x``'s device that change when ``x``'s bits do: over the 32-bit lanes
    of its bytes (read as unsigned little-endian values ``v``, a last partial lane as its
    bytes), the exact sum of ``v`` and the sum of ``v**2`` (wrapping at 2**64; the high
    lane's squares weighted 3). A plain sum misses changes that cancel, such as one value's
    sign set and another's cleared (``neg_()`` of as many negatives as positives); for
    those to cancel in the squares too, the values must match to within one part in 2**32.
    Exact integer arithmetic: the same bits give the same value on every device and in every
    reduction order. About ten ops and two temporaries of ``x``'s size when the bytes start on
    a 64-bit word and fill whole words, as shards do.

    Args:
        x: A contiguous tensor.

    Returns:
        A 2-element int64 tensor (zeros for an empty tensor).

    Raises:
        ValueError: ``x`` is not contiguous.

    Example:
        >>> a = torch.tensor([1.0, -1.0, 1.0, -1.0])
        >>> fingerprint(a).tolist() == fingerprint(a.clone()).tolist()
        True
        >>> fingerprint(a).tolist() == fingerprint(-a).tolist()     # a plain sum misses this
        False
    """
    if not x.is_contiguous():
        raise ValueError("fingerprint: the tensor is not contiguous; pass a contiguous shard")
    nbytes = x.nbytes
    if nbytes % 8 == 0 and (x.storage_offset() * x.element_size()) % 8 == 0 and x.dim() == 1:
        return _lanes(x.view(torch.int64))
    raw = x.reshape(-1).view(torch.uint8)
    whole = nbytes - nbytes % 8
    head = raw[:whole]
    if raw.storage_offset() % 8 != 0:
        head = head.clone()  # a word view needs an aligned start: rare (odd alignments)
    total = _lanes(head.view(torch.int64))
    if whole < nbytes:
        tail = raw[whole:].to(torch.int64)
        total = total + torch.stack([tail.sum(), (tail * tail).sum()])
    return total


def _lanes(words: torch.Tensor) -> torch.Tensor:
    low = words & _LANE
    high = words >> 32
    high &= _LANE
    linear = (low + high).sum()
    low.mul_(low).add_(high.mul_(high).mul_(3))
    return torch.stack([linear, low.sum()])


class HostMirror:
    """A host tensor that receives a unit's gradient shard after each reduction.

    Args:
        host: The host tensor (``S`` elements, pinned for asynchronous copies from a GPU).
        stream: The CUDA stream the copies run on (``None`` on the CPU: plain copies).

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     unit = slot_of(shards["w"]).unit
        ...     mirror = HostMirror(torch.zeros(4), None)
        ...     unit.mirror_grads(mirror)
        ...     (vfsdp.gather(shards, spec, grads="buffer")["w"] * 3).sum().backward()
        ...     return mirror.host.tolist(), mirror.copies
        >>> vfsdp.testing.simulate(2, body)[0]
        ([3.0, 3.0, 3.0, 3.0], 1)
    """

    def __init__(self, host: torch.Tensor, stream: Any) -> None:
        self.host = host
        self.stream = stream
        self.copies = 0  # how many reductions it followed
        self.holds = False  # whether a copy was made since the last forget()
        self.seen: Any = None  # the shard's fingerprint (on its device) when it was copied
        self._event: Any = None

    def refresh(self, unit: Any) -> None:
        """Copy the unit's gradient shard into the host tensor (its reduction is done, or
        ordered before on the device), its :func:`fingerprint` taken just before (so a
        write that lands after it, or during the copy, shows as a different fingerprint)."""
        shard = unit.grads().shard  # (its reduction is done: nothing to wait for)
        if self.stream is not None:  # after the reduction, which the compute stream is ordered after
            self.stream.wait_stream(torch.cuda.current_stream(shard.device))
        with torch.cuda.stream(self.stream):  # None (the CPU): plain copies, here
            self.seen = fingerprint(shard)
            self.host.copy_(shard, non_blocking=self.stream is not None)
            if self.stream is not None:
                self._event = self.stream.record_event()
        self.copies += 1
        self.holds = True

    def forget(self) -> None:
        """Drop the copy (the next reader copies the buffer itself)."""
        self.holds, self.seen = False, None

    def wait(self) -> None:
        """Wait for the last copy to land (before the host reads the tensor)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
