"""Count what actually runs: tensor copies (at the dispatcher) and collectives (per rank).

``CopyCounter`` is a ``TorchDispatchMode`` that records every aten op and, for copy-like ops
(``copy_``, ``cat``, ``clone``, ``_to_copy``, ``stack``, ``split_with_sizes_copy``, ...), the
bytes they write. Zero-copy claims are asserted with it instead of assumed::

    with CopyCounter() as c:
        full = vfsdp.gather(shards, spec)
    assert c.copies == 0
"""

from __future__ import annotations

from collections import Counter

import optree
import torch

from vfsdp._torch_private import TorchDispatchMode
from vfsdp.collectives.comm import in_collective

COPY_OPS = frozenset({
    "copy_", "copy", "cat", "clone", "_to_copy", "stack", "split_with_sizes_copy",
    "_chunk_cat", "index_copy", "index_copy_", "as_strided_copy", "slice_copy", "view_copy",
    "contiguous", "_foreach_copy_", "narrow_copy", "expand_copy",
})


ALLOC_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


class CopyCounter(TorchDispatchMode):
    """Records aten ops run under it (on this thread), outside vfsdp's collective calls.

    Attributes:
        ops: ``Counter`` of op names (``"copy_"``, ``"cat"``, ...).
        copy_bytes: Bytes written by copy-like ops.
        copies: Number of copy-like ops.
        collectives: Number of c10d collective ops dispatched (vfsdp's and anyone else's).
        collective_bytes: Per collective, the bytes of its largest tensor argument (an
            all-gather's or reduce-scatter's full buffer, an all-to-all's or all-reduce's
            input), summed: what it moves, counted the same way for any system.
        views: Number of aten ops that only make or change a view (``view``, ``as_strided_``,
            ``slice``, ``detach``...): metadata, no kernel and no copy on any device.
        allocations: Number of aten ops that only allocate (``empty``, ``empty_strided``...).
        kernels: Every other op counted (``sum(ops.values())`` less views and allocations):
            the ones that launch work on a GPU.

    Example:
        >>> with CopyCounter() as counter:
        ...     a = torch.zeros(4)
        ...     _ = a.copy_(torch.ones(4))             # 16 bytes
        ...     _ = torch.cat([a, a])                  # 32 bytes
        >>> counter.copies, counter.copy_bytes, counter.ops["cat"]
        (2, 48, 1)
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.copy_bytes = self.copies = self.collectives = self.collective_bytes = 0
        self.views = self.allocations = 0

    @property
    def kernels(self) -> int:
        """Ops that launch work: all counted ops less views and allocations."""
        return sum(self.ops.values()) - self.views - self.allocations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        namespace = getattr(func, "namespace", "aten")
        if namespace in ("c10d", "_c10d_functional"):
            self.collectives += 1  # any system's collectives, counted the same way
            self.ops[f"{namespace}::{name}"] += 1
            self.collective_bytes += max(_sizes((args, kwargs)), default=0)
            return out
        if in_collective():
            return out  # the collective's own work, not work around it
        if namespace != "aten":
            # Custom ops (FSDP2's fsdp::all_gather_copy_in, fsdp::split_with_sizes_copy,
            # fsdp::chunk_cat) run their aten kernels below this mode: count them here.
            self.ops[f"{namespace}::{name}"] += 1
            if name == "all_gather_copy_in":
                self._copied(args[0])
            elif ("copy" in name or "cat" in name) and "out" in kwargs:
                self._copied(kwargs["out"])
            return out
        self.ops[name] += 1
        if func.is_view or torch.Tag.inplace_view in func.tags:
            self.views += 1
        elif name in ALLOC_OPS:
            self.allocations += 1
        if name in COPY_OPS:  # what it writes: out=, the tensor an in-place op mutates, or its result
            self._copied(kwargs["out"] if "out" in kwargs else args[0] if name.endswith("_") else out)
        return out

    def _copied(self, written) -> None:
        self.copies += 1
        self.copy_bytes += sum(_sizes(written))


def _sizes(tree) -> list[int]:
    """The bytes of each tensor in ``tree``."""
    return [t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
