"""Layer-by-layer execution with FSDP memory behaviour, and no module wrapping.

``run_layers(layer_fn, shards["layers"], spec["layers"], h)`` runs ``h = layer_fn(full_i, h)``
for each unit ``i`` and, like FSDP2's ``fully_shard`` on every block:

* **forward**: gathers unit ``i+1`` (async) while unit ``i`` computes, and releases unit ``i``'s
  gathered parameters right after its forward (``reshard_after_forward=True``; the last unit
  stays gathered, its backward comes first);
* **backward**: autograd's saved references to gathered parameters are kept as (buffer, offset)
  records by ``torch.autograd.graph.saved_tensors_hooks``; when backward needs them the unit
  is gathered again (and unit ``i-1`` is prefetched), activations are *not* recomputed;
* as soon as a unit's backward is done its gradients are reduce-scattered (async, overlapping
  the next unit's backward) into its gradient DBuffer and its gathered buffer is released.

So at most two units' full parameters are gathered at once in forward and in backward.
``reshard_after_forward=False`` keeps every unit gathered until its backward (no regather).
Gradients land in the gradient DBuffers only; read them with :func:`vfsdp.grads`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import optree
import torch

from vfsdp.collectives.dbuffer import DBuffer, global_owner
from vfsdp.collectives.handle import Handle
from vfsdp.functional.gather import gather_async, wait_reductions
from vfsdp.planner.spec import ShardSpec

__all__ = ["run_layers"]


class _Saved:
    """A saved gathered parameter, kept as a record instead of a tensor."""

    __slots__ = ("db", "offset", "shape", "stride")

    def __init__(self, db: DBuffer, t: torch.Tensor) -> None:
        self.db, self.offset, self.shape, self.stride = db, t.storage_offset(), t.shape, t.stride()


class _Regather:
    """Regathers released units when backward needs them, prefetching the previous unit."""

    def __init__(self, prefetch: bool) -> None:
        self.order: list[DBuffer] = []
        self.index: dict[int, int] = {}
        self.pending: dict[int, Handle] = {}
        self.prefetch = prefetch

    def add(self, db: DBuffer) -> None:
        self.index[id(db)] = len(self.order)
        self.order.append(db)

    def _start(self, db: DBuffer, async_op: bool) -> Optional[Handle]:
        master = db.parent
        if master is not None:  # low-precision compute copy: cast again, then gather
            db.copy_(master)
        return db.all_gather(async_op=async_op)

    def ensure(self, db: DBuffer) -> None:
        i = self.index.get(id(db))
        handle = self.pending.pop(id(db), None)
        if handle is not None:
            handle.wait()
        elif not db.is_allocated:
            self._start(db, async_op=False)
        if self.prefetch and i is not None and i > 0:
            prev = self.order[i - 1]
            if not prev.is_allocated and id(prev) not in self.pending:
                self.pending[id(prev)] = self._start(prev, async_op=True)

    def pack(self, t: torch.Tensor) -> Any:
        db = global_owner(t)
        if db is not None and id(db) in self.index:
            return _Saved(db, t)
        return t

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        self.ensure(saved.db)
        buf = saved.db.global_buffer
        out = torch.empty(0, dtype=buf.dtype, device=buf.device)
        return out.set_(buf.untyped_storage(), saved.offset, saved.shape, saved.stride)


def run_layers(
    layer_fn: Callable[[Any, Any], Any],
    shards: Sequence[Any],
    specs: Sequence[ShardSpec],
    h: Any,
    *,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
    **gather_options: Any,
) -> Any:
    """Run ``h = layer_fn(full_i, h)`` over units with FSDP prefetch, release and regather.

    Args:
        layer_fn: ``(full parameters of one unit, h) -> h``.
        shards: One shards subtree per unit, in execution order (e.g. ``shards["layers"]``).
        specs: The matching sub-specs (e.g. ``spec["layers"]``).
        h: The input of the first unit.
        prefetch: Gather unit ``i+1`` while unit ``i`` computes (and ``i-1`` in backward).
        reshard_after_forward: Release each unit (but the last) after its forward and gather
            it again in backward; ``False`` keeps them gathered until their backward.
        gather_options: Passed to :func:`vfsdp.gather` (``param_dtype``, ``reduce_dtype``,
            ``grad_reduce``, ``accumulate_grads``, ``grad_sync``).

    Returns:
        The last unit's output.

    Raises:
        ValueError: ``shards`` and ``specs`` differ in length.

    Example:
        >>> h = vfsdp.run_layers(block, shards["layers"], spec["layers"], h)   # doctest: +SKIP
        >>> loss_fn(h).backward(); g = vfsdp.grads(shards, spec)                # doctest: +SKIP
    """
    if len(shards) != len(specs):
        raise ValueError(f"run_layers: {len(shards)} shard subtrees but {len(specs)} specs")
    options = dict(gather_options, grads="buffer", free_after_backward=True)
    options.setdefault("async_reduce", True)
    regather = _Regather(prefetch)
    n = len(shards)
    wait_reductions()
    pending = gather_async(shards[0], specs[0], **options) if n else None
    for i in range(n):
        full = pending.wait()
        dbs = _gathered_buffers(full)
        for db in dbs:
            regather.add(db)
        nxt = i + 1 < n
        pending = gather_async(shards[i + 1], specs[i + 1], **options) if nxt and prefetch else None
        with torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack):
            h = layer_fn(full, h)
        if reshard_after_forward and nxt:
            for db in dbs:
                db.free_global()
        if nxt and pending is None:
            pending = gather_async(shards[i + 1], specs[i + 1], **options)
    return h


def _gathered_buffers(full: Any) -> list[DBuffer]:
    seen: dict[int, DBuffer] = {}
    for t in optree.tree_leaves(full):
        if isinstance(t, torch.Tensor):
            db = global_owner(t)
            if db is not None:
                seen[id(db)] = db
    return list(seen.values())
