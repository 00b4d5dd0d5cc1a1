"""Memory probes at the dispatcher: how many units are gathered, and how many bytes are live.

``GatheredProbe`` samples, before every aten op run under it, which of this rank's parameter
DBuffers (roles ``param*`` and ``compute``) have their global buffer allocated: the storage's
actual size, not an assumption. ``peak_units`` is the most gathered at once.

``LiveBytes`` tracks every storage produced by an op (and the DBuffers' global buffers and
shards) and re-reads their sizes before every op, so storage resizes (how FSDP2 and vfsdp
release unsharded parameters) are seen too; ``peak`` is the high-water mark of their sum.
The same tracker is used for vfsdp and for FSDP2 in the benchmarks.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vfsdp.collectives.dbuffer import live_dbuffers

__all__ = ["GatheredProbe", "LiveBytes"]

_PARAM_ROLES = ("param", "compute")


class GatheredProbe(TorchDispatchMode):
    """Peak number (and bytes) of this rank's units whose parameters are gathered at once."""

    def __init__(self) -> None:
        super().__init__()
        self.peak_units = 0
        self.peak_bytes = 0

    def sample(self) -> None:
        units, nbytes = set(), 0
        for db in live_dbuffers():
            if db.role.startswith(_PARAM_ROLES) and db.is_allocated:
                units.add(db.key)
                nbytes += db.global_buffer.untyped_storage().nbytes()
        self.peak_units = max(self.peak_units, len(units))
        self.peak_bytes = max(self.peak_bytes, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sample()
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live storages created under it (plus existing tensors passed to ``track``)."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, list] = {}
        self.peak = 0
        self.current = 0

    def track(self, *tensors: torch.Tensor) -> "LiveBytes":
        for t in tensors:
            self._add(t)
        return self

    def _add(self, t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return
            refs = self._storages.setdefault(st._cdata, [])
            if len(refs) < 4:  # a few views suffice to see whether the storage lives
                refs.append(weakref.ref(t))

    def sample(self) -> None:
        total, dead = 0, []
        seen = set()
        for key, refs in self._storages.items():
            t = next((x for x in (r() for r in refs) if x is not None), None)
            if t is None:
                dead.append(key)
                continue
            st = t.untyped_storage()
            if st._cdata in seen:
                continue
            seen.add(st._cdata)
            total += st.nbytes()
        for key in dead:
            del self._storages[key]
        self.current = total
        self.peak = max(self.peak, total)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sample()
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            self._add(t)
        self.sample()
        return out
