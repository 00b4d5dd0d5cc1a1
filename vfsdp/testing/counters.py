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

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vfsdp.collectives.comm import in_collective

__all__ = ["CopyCounter", "COPY_OPS"]

COPY_OPS = frozenset({
    "copy_", "copy", "cat", "clone", "_to_copy", "stack", "split_with_sizes_copy",
    "_chunk_cat", "index_copy", "index_copy_", "as_strided_copy", "slice_copy", "view_copy",
    "contiguous", "_foreach_copy_", "narrow_copy", "expand_copy",
})


class CopyCounter(TorchDispatchMode):
    """Records aten ops run under it (on this thread), outside vfsdp's collective calls.

    Attributes:
        ops: ``Counter`` of op names (``"copy_"``, ``"cat"``, ...).
        copy_bytes: Bytes written by copy-like ops.
        copies: Number of copy-like ops.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.copy_bytes = 0
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if in_collective():
            return out  # work done by the collective's implementation, not around it
        name = func.__name__.split(".")[0]
        self.ops[name] += 1
        if name in COPY_OPS:
            self.copies += 1
            for t in (out if isinstance(out, (list, tuple)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.copy_bytes += t.numel() * t.element_size()
        return out
