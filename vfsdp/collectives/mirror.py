"""A host copy of a unit's gradient shard, kept current by the unit's reduce transition.

``vfsdp.optim.offload`` gives each unit it updates a :class:`HostMirror` (``unit.grad_mirror``,
held weakly: it goes with the optimizer state). Each reduce-scatter into the unit's gradient
buffer then ends with one device-to-host copy of the shard into the mirror (on a GPU, on the
mirror's stream, asynchronously into pinned memory), so the copies of the units reduced first
run while the backward of the others goes on. The mirror records what the buffer was when it
copied it (the shard's identity and the version counters of the shard and of the gradient
views vfsdp handed out); anything that writes the buffer afterwards (clipping, a zeroing, an
in-place change of ``vfsdp.grads``' views) makes it stale, and the optimizer copies again.
Writes through ``.data``, which no version counter sees (autograd does not see them either),
are the one thing it cannot tell.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp

__all__ = ["HostMirror"]


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
        ...     fresh = mirror.current(unit)
        ...     vfsdp.grads(shards, spec)["w"].mul_(2)        # clipping, say: stale now
        ...     return mirror.host.tolist(), fresh, mirror.current(unit)
        >>> vfsdp.testing.simulate(2, body)[0]
        ([3.0, 3.0, 3.0, 3.0], True, False)
    """

    def __init__(self, host: torch.Tensor, stream: Any) -> None:
        self.host = host
        self.stream = stream
        self.copies = 0  # how many reductions it followed
        self._mark: Optional[tuple] = None
        self._event: Any = None

    def refresh(self, unit: Any) -> None:
        """Copy the unit's gradient shard into the host tensor (its reduction is done, or
        ordered before on the device) and remember what the buffer was."""
        shard = unit.grads_shard()
        if self.stream is None:
            self.host.copy_(shard)
        else:  # after the reduction, which the compute stream is ordered after
            self.stream.wait_stream(torch.cuda.current_stream(shard.device))
            with torch.cuda.stream(self.stream):
                self.host.copy_(shard, non_blocking=True)
                self._event = self.stream.record_event()
        self.copies += 1
        self._mark = _mark(unit)

    def current(self, unit: Any) -> bool:
        """Whether the host tensor holds what the unit's gradient buffer holds now."""
        return self._mark is not None and self._mark == _mark(unit)

    def forget(self) -> None:
        """Make it stale (the next reader copies the buffer itself)."""
        self._mark = None

    def wait(self) -> None:
        """Wait for the last copy to land (before the host reads the tensor)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def _mark(unit: Any) -> tuple:
    shard = unit.grads_shard()
    return id(shard), tp.version(shard), unit.grad_writes()
