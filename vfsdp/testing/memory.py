"""Memory probes at the dispatcher: how many units are gathered, and how many bytes are live.

``GatheredProbe`` learns of this rank's parameter buffers (``Role.PARAM`` and
``Role.COMPUTE``) from their events while it is active (:mod:`vfsdp.collectives.dbuffer`) and
samples, before and after every aten op run under it and at every allocation, which of them
have their global buffer allocated: the storage's actual size, not an assumption.
``peak_units`` is the most units gathered at once. It sees units gathered while it is active.

``LiveBytes`` tracks every storage produced by an op (and the DBuffers' global buffers and
shards created or allocated under it, and the tensors passed to ``track``) and re-reads their
sizes before every op, so storage resizes (how FSDP2 and vfsdp release unsharded parameters)
are seen too; ``peak`` is the high-water mark of their sum. The same tracker is used for
vfsdp and for FSDP2 in the benchmarks.
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch

from vfsdp._torch_private import TorchDispatchMode, storage_id
from vfsdp.collectives.dbuffer import observe, slot_of


def _unit_buffers(trees) -> list:
    """Every buffer of the units the vfsdp tensors in ``trees`` belong to."""
    units = {id(slot.unit): slot.unit for slot in map(slot_of, optree.tree_leaves(list(trees)))
             if slot is not None and slot.unit is not None}
    return [db for u in units.values() for db in u.buffers()]


class _Observing(TorchDispatchMode):
    """A dispatch mode that also observes DBuffer events while it is active, and samples before
    and after every op (``_adds_outputs``: and counts the op's outputs with ``_add``).
    Subclasses define ``on_event(event, db)`` and ``sample()``."""

    _adds_outputs = False

    def __enter__(self):
        self._events = observe(self.on_event)
        self._events.__enter__()
        out = super().__enter__()
        self.sample()
        return out

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._events.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sample()
        out = func(*args, **(kwargs or {}))
        if self._adds_outputs:
            self._add(*(out if isinstance(out, (list, tuple)) else (out,)))
        self.sample()
        return out


class GatheredProbe(_Observing):
    """Peak number (and bytes) of this rank's units whose parameters are gathered at once.

    It counts the units gathered while it is active; pass the shards (any trees of vfsdp
    tensors) to count units already gathered when it starts too.

    Args:
        trees: Shards trees whose units are watched from the start.

    Example:
        >>> def body():
        ...     params = {"layers": [{"w": torch.ones(4, 4)} for _ in range(4)]}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     with GatheredProbe() as probe:
        ...         h = vfsdp.run_layers(lambda p, x: x @ p["w"], shards["layers"],
        ...                              spec["layers"], torch.ones(1, 4))
        ...         h.sum().backward()
        ...     return probe.peak_units
        >>> vfsdp.testing.simulate(2, body)
        [2, 2]
    """

    def __init__(self, *trees: Any) -> None:
        super().__init__()
        self.peak_units = self.peak_bytes = 0
        self._buffers = {id(db): weakref.ref(db) for db in _unit_buffers(trees) if db.role.holds_params}

    def on_event(self, event: str, db) -> None:
        if event == "alloc" and db.role.holds_params:
            self._buffers[id(db)] = weakref.ref(db)
            self.sample()

    def sample(self) -> None:
        self._buffers = {key: ref for key, ref in self._buffers.items() if ref() is not None}
        live = [db for db in (ref() for ref in self._buffers.values())
                if db is not None and db.is_allocated]
        units = {id(db.unit) if db.unit is not None else id(db) for db in live}
        self.peak_units = max(self.peak_units, len(units))
        self.peak_bytes = max(self.peak_bytes,
                              sum(db.global_buffer.untyped_storage().nbytes() for db in live))



class LiveBytes(_Observing):
    """Peak bytes of live storages created under it (plus existing tensors passed to ``track``).

    Example:
        >>> with LiveBytes() as live:
        ...     x = torch.zeros(256)                   # 1 KiB
        ...     y = torch.zeros(512)                   # 2 KiB
        ...     del x
        ...     z = y + 1                              # 2 KiB more, x is gone
        >>> live.peak, live.current
        (4096, 4096)
    """

    _adds_outputs = True

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, list] = {}
        self.peak = self.current = 0

    def on_event(self, event: str, db) -> None:
        if event in ("create", "alloc"):
            self._add(db.shard, db.global_buffer)

    def track(self, *items: Any) -> LiveBytes:
        """Count these tensors' storages too; a vfsdp shard (or any tree of them) brings
        every buffer of its unit (parameters, copies, gradients, staging)."""
        self._add(*optree.tree_leaves(list(items)))
        self._add(*(t for db in _unit_buffers(items) for t in (db.shard, db.global_buffer)))
        return self

    def _add(self, *tensors: Any) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                refs = self._storages.setdefault(storage_id(t), [])
            except (RuntimeError, NotImplementedError):
                continue
            if len(refs) < 4:  # a few views suffice to see whether the storage lives
                refs.append(weakref.ref(t))

    def sample(self) -> None:
        alive = {key: t for key, refs in self._storages.items()
                 if (t := next((x for x in (r() for r in refs) if x is not None), None)) is not None}
        self._storages = {key: self._storages[key] for key in alive}
        # by the storage each lives in now (a resized one may be another's)
        self.current = sum({storage_id(t): t.untyped_storage().nbytes()
                            for t in alive.values()}.values())
        self.peak = max(self.peak, self.current)


class BufferBytes(LiveBytes):
    """Peak bytes of vfsdp's own buffers: the DBuffers' shards and global buffers (parameters,
    compute copies, gradients, staging, optimizer state) created, allocated or tracked under
    it, and nothing else (no activations, no temporaries). What ``vfsdp.estimate`` predicts
    exactly.

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     with BufferBytes().track(shards) as live:
        ...         full = vfsdp.gather(shards, spec)             # 8 floats gathered
        ...         y = full["w"] * 2                              # not a buffer
        ...     return live.peak
        >>> vfsdp.testing.simulate(2, body)[0]         # the 16 B shard, the 32 B gathered
        48
    """

    _adds_outputs = False
