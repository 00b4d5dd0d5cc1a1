"""A host copy of a unit's gradient shard, made by the unit's reduce transition.

``vfsdp.optim.offload`` gives each unit it updates a :class:`HostMirror` (``unit.grad_mirror``,
held weakly: it goes with the optimizer state). Each reduce-scatter into the unit's gradient
buffer then ends with one device-to-host copy of the shard into the mirror (on a GPU, on the
mirror's stream, asynchronously into pinned memory), so the copies of the units reduced first
run while the backward of the others goes on.

Whether the copy still holds what the buffer holds when the optimizer reads it is decided by
content, not by bookkeeping: :func:`fingerprint` of the buffer (on its device) against the
fingerprint of the copy (on the host). No write can hide from that, whether or not a version
counter sees it (``.data``, ``torch.distributed`` collectives, ``GradScaler.unscale_``, a
custom kernel): any write that changes the bits changes the fingerprint, save one that only
permutes values.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostMirror", "fingerprint"]

def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on ``x``'s device: the sum of ``x``'s bytes read as little-endian
    64-bit words (wrapping at 2**64), plus the bytes after the last whole word. Exact integer
    arithmetic, so the same bits give the same value on every device and in every reduction
    order; one vectorised sum (two ops) when the bytes start on a word and fill whole words,
    as shards do.

    Args:
        x: A contiguous tensor.

    Returns:
        The fingerprint (0 for an empty tensor).

    Raises:
        ValueError: ``x`` is not contiguous.

    Example:
        >>> a = torch.tensor([1.0, -2.0, 0.5])
        >>> int(fingerprint(a)) == int(fingerprint(a.clone()))
        True
        >>> int(fingerprint(a)) == int(fingerprint(a * 0.999))      # any change of the bits
        False
    """
    if not x.is_contiguous():
        raise ValueError("fingerprint: the tensor is not contiguous; pass a contiguous shard")
    size = x.element_size()
    nbytes = x.numel() * size
    if nbytes % 8 == 0 and (x.storage_offset() * size) % 8 == 0 and x.dim() == 1:
        return x.view(torch.int64).sum()
    raw = x.reshape(-1).view(torch.uint8)
    whole = nbytes - nbytes % 8
    head = raw[:whole]
    if raw.storage_offset() % 8 != 0:
        head = head.clone()  # a word view needs an aligned start: rare (odd alignments)
    total = head.view(torch.int64).sum()
    if whole < nbytes:
        total = total + raw[whole:].sum(dtype=torch.int64)
    return total


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
        ...     same = mirror.same_as(unit.grads().shard)
        ...     vfsdp.grads(shards, spec)["w"].data.mul_(2)   # no version counter sees this
        ...     return mirror.host.tolist(), same, mirror.same_as(unit.grads().shard)
        >>> vfsdp.testing.simulate(2, body)[0]
        ([3.0, 3.0, 3.0, 3.0], True, False)
    """

    def __init__(self, host: torch.Tensor, stream: Any) -> None:
        self.host = host
        self.stream = stream
        self.copies = 0  # how many reductions it followed
        self.holds = False  # whether a copy was made since the last forget()
        self._event: Any = None

    def refresh(self, unit: Any) -> None:
        """Copy the unit's gradient shard into the host tensor (its reduction is done, or
        ordered before on the device)."""
        shard = unit.grads_shard()
        if self.stream is None:
            self.host.copy_(shard)
        else:  # after the reduction, which the compute stream is ordered after
            self.stream.wait_stream(torch.cuda.current_stream(shard.device))
            with torch.cuda.stream(self.stream):
                self.host.copy_(shard, non_blocking=True)
                self._event = self.stream.record_event()
        self.copies += 1
        self.holds = True

    def same_as(self, source: torch.Tensor, seen: Any = None) -> bool:
        """Whether the host tensor holds what ``source`` (the gradient shard on its device)
        holds now: their fingerprints, compared on the host (``seen``: ``source``'s
        fingerprint, already read back as an int). Waits for the last copy to land."""
        if not self.holds or source.numel() != self.host.numel():
            return False
        self.wait()
        mine = int(fingerprint(self.host))
        return mine == (int(fingerprint(source)) if seen is None else seen)

    def forget(self) -> None:
        """Drop the copy (the next reader copies the buffer itself)."""
        self.holds = False

    def wait(self) -> None:
        """Wait for the last copy to land (before the host reads the tensor)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
