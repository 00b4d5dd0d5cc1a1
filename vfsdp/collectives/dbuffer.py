"""DBuffer: one unit's persistent flat shard on this rank, plus its on-demand global buffer.

::

    global buffer (m*S, on demand)   | rank 0 | rank 1 | rank 2 |   full views: [off, off+numel)
                                              ^^^^^^^^
    shard (S, persistent)                    | rank 1 |           local views: shard_range(r)

Every tensor of the unit is a **fixed view**: its local piece aliases the shard, its full tensor
aliases the global buffer, for the whole run. The all-gather takes the shard as its input and
the global buffer as its output, with nothing packed before or unpacked after: the shard already
has the layout of this rank's slice. The global buffer is released by resizing its storage to
zero bytes and re-allocated by resizing it back, so views (and autograd's saved views) survive.

Collectives write through ``tensor.data`` aliases, which do not share the autograd version
counter: regathering the same values does not invalidate views autograd saved earlier.
"""

from __future__ import annotations

import threading
import weakref
from typing import Hashable, Optional, Union

import torch

from vfsdp.collectives import comm
from vfsdp.collectives.groups import MeshGroups
from vfsdp.collectives.handle import Handle, comm_context
from vfsdp.placements.ragged import local_shape
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["DBuffer", "owner_of", "global_owner", "live_dbuffers"]

_OWNERS: "weakref.WeakValueDictionary[int, DBuffer]" = weakref.WeakValueDictionary()
_GLOBAL_OWNERS: "weakref.WeakValueDictionary[int, DBuffer]" = weakref.WeakValueDictionary()
_ATTR = "_vfsdp_dbuffer"
_INDEX = "_vfsdp_index"  # on local views: which tensor of the unit (exact even when empty)


def owner_of(t: torch.Tensor) -> Optional["DBuffer"]:
    """The DBuffer whose shard (or, for the views it hands out, global buffer) ``t`` aliases."""
    db = getattr(t, _ATTR, None)
    if db is not None:
        return db
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return _OWNERS.get(ptr)


_TOKEN = threading.local()


def _thread_token() -> object:
    """An identity for this thread that, unlike its ident, is never reused by a later thread."""
    token = getattr(_TOKEN, "token", None)
    if token is None:
        token = _TOKEN.token = object()
    return token


def live_dbuffers() -> list["DBuffer"]:
    """DBuffers created by this thread (this rank) that are still alive."""
    me = _thread_token()
    return [db for db in list(_GLOBAL_OWNERS.values()) if db.thread is me]


def global_owner(t: torch.Tensor) -> Optional["DBuffer"]:
    """The DBuffer whose global buffer ``t`` is a view of (any view, any shape), or ``None``.

    Keyed by the storage object, which survives releases and re-allocations of the memory.
    """
    try:
        return _GLOBAL_OWNERS.get(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def _alias(storage_tensor: torch.Tensor, offset: int, shape: tuple) -> torch.Tensor:
    """A leaf tensor sharing ``storage_tensor``'s storage (not an autograd view of it)."""
    out = torch.empty(0, dtype=storage_tensor.dtype, device=storage_tensor.device)
    stride = torch.empty(shape, device="meta").stride()
    out.set_(storage_tensor.untyped_storage(), storage_tensor.storage_offset() + offset, shape, stride)
    return out


class DBuffer:
    """One unit's buffers for one role (params, grads, an optimizer state) on this rank.

    Args:
        spec: The plan.
        key: The unit key.
        groups: Where the unit's collectives run (see ``resolve_groups``).
        dtype: Buffer dtype (default: the unit's dtype).
        role: A label (``"param"``, ``"grad"``, ...), shown in errors and reprs.

    Raises:
        ValueError: the groups do not match the spec's shard world size.

    Example:
        >>> db = DBuffer(spec, ("layers", 0), resolve_groups(spec))   # doctest: +SKIP
        >>> db.all_gather().wait(); w = db.full(0)                   # doctest: +SKIP
    """

    def __init__(self, spec: ShardSpec, key: Hashable, groups: MeshGroups,
                 dtype: Optional[torch.dtype] = None, role: str = "param") -> None:
        self._setup(key, spec.units[key], spec.unit_tensors(key), groups, dtype, role)

    def _setup(self, key, layout, tensors, groups: MeshGroups, dtype, role: str) -> None:
        if groups.shard_size != layout.world_size:
            raise ValueError(f"unit {unit_name(key)} was planned for {layout.world_size} ranks, "
                             f"the shard group has {groups.shard_size}")
        self.key = key
        self.thread = _thread_token()  # the rank's thread under vfsdp.testing.simulate
        self.layout = layout
        self.tensors = tuple(tensors)
        self.groups = groups
        self.role = role
        self.rank = groups.shard_rank
        self.dtype = dtype or layout.dtype
        self.device = groups.device
        s, m = layout.shard_numel, layout.world_size
        self.shard = torch.zeros(s, dtype=self.dtype, device=self.device)
        self._global = torch.empty(m * s, dtype=self.dtype, device=self.device)
        self._global_bytes = self._global.untyped_storage().nbytes()
        self._pending: Optional[Handle] = None
        # Views are made on demand and point back at this DBuffer; it keeps none itself, so
        # there is no reference cycle: dropping the shards frees the memory at once.
        self._local_spec = [(t.shard_range(self.rank)[0],
                             local_shape(t.placement, t.shape, self.rank)) for t in self.tensors]
        self._grad: Optional[DBuffer] = None
        self._companions: dict = {}
        self._parent_ref = None
        self._global.untyped_storage().resize_(0)  # released until the first gather
        _GLOBAL_OWNERS[self._global.untyped_storage()._cdata] = self
        _OWNERS[self.shard.untyped_storage().data_ptr()] = self

    # ------------------------------------------------------------------ views

    def __len__(self) -> int:
        return len(self.tensors)

    def index(self, path: tuple) -> int:
        """Position of a tensor path in the unit's buffer order."""
        try:
            return self.layout.paths.index(tuple(path))
        except ValueError:
            raise KeyError(f"{format_path(tuple(path))} is not in unit {unit_name(self.key)}") from None

    def local(self, i: Union[int, tuple]) -> torch.Tensor:
        """Tensor ``i``'s local piece: a leaf tensor aliasing the shard (its local shape)."""
        k = i if isinstance(i, int) else self.index(i)
        lo, shape = self._local_spec[k]
        out = _alias(self.shard, lo, shape)
        setattr(out, _ATTR, self)
        setattr(out, _INDEX, k)
        return out

    def full(self, i: Union[int, tuple]) -> torch.Tensor:
        """Tensor ``i``'s full view into the global buffer (create it while gathered; the object
        stays valid across releases and re-gathers)."""
        return self.full_alias(i if isinstance(i, int) else self.index(i))

    def full_alias(self, i: int) -> torch.Tensor:
        """A new tensor object aliasing tensor ``i``'s full view (same memory, no autograd link).

        Raises:
            RuntimeError: the global buffer is released (``set_`` would silently re-allocate
                it with garbage); gather first.
        """
        if not self.is_allocated:
            raise RuntimeError(f"unit {unit_name(self.key)} ({self.role}) is not gathered; "
                               f"call all_gather() (or vfsdp.gather) before taking full views")
        t = self.tensors[i]
        out = _alias(self._global, t.offset, tuple(t.shape))
        setattr(out, _ATTR, self)
        return out

    @property
    def parent(self) -> Optional["DBuffer"]:
        """For a companion (e.g. the bf16 compute copy), the DBuffer it belongs to."""
        return self._parent_ref() if self._parent_ref is not None else None

    def grad_buffer(self, dtype: Optional[torch.dtype] = None) -> "DBuffer":
        """This unit's sharded gradient DBuffer (created zeroed on first use)."""
        if self._grad is None or (dtype is not None and self._grad.dtype != dtype):
            self._grad = self.like(dtype or self.dtype, role="grad")
        return self._grad

    def companion(self, role: str, dtype: torch.dtype) -> "DBuffer":
        """A DBuffer of the same layout kept alongside this one under ``role`` (created once).

        Used for the low-precision compute copy (``"compute"``), the unsharded gradient
        accumulator (``"accum"``) and reduce staging (``"stage"``).
        """
        found = self._companions.get((role, dtype))
        if found is None:
            found = self._companions[(role, dtype)] = self.like(dtype, role=role)
            found._parent_ref = weakref.ref(self)
        return found

    def locals(self) -> list:
        return [self.local(i) for i in range(len(self.tensors))]

    def fulls(self) -> list:
        return [self.full_alias(i) for i in range(len(self.tensors))]

    @property
    def global_buffer(self) -> torch.Tensor:
        """The ``m*S`` buffer (zero bytes of storage while released)."""
        return self._global

    @property
    def is_allocated(self) -> bool:
        return self._global.untyped_storage().nbytes() > 0

    def view_index(self, t: torch.Tensor) -> Optional[int]:
        """Which tensor's local piece ``t`` is, when ``t`` came from :meth:`local`, else ``None``."""
        k = getattr(t, _INDEX, None)
        return k if getattr(t, _ATTR, None) is self and k is not None \
            and self.is_local_view(k, t) else None

    def is_local_view(self, i: int, t: torch.Tensor) -> bool:
        """Whether ``t`` is exactly tensor ``i``'s local piece (same memory, shape, strides)."""
        lo, shape = self._local_spec[i]
        if tuple(t.shape) != tuple(shape):
            return False
        if t.numel() == 0:
            return True
        return (t.untyped_storage().data_ptr() == self.shard.untyped_storage().data_ptr()
                and t.storage_offset() == self.shard.storage_offset() + lo and t.is_contiguous())

    # ------------------------------------------------------------------ global buffer

    def alloc_global(self) -> torch.Tensor:
        """Re-allocate the global buffer's storage (contents undefined); views stay valid."""
        if not self.is_allocated:
            self._global.untyped_storage().resize_(self._global_bytes)
        return self._global

    def free_global(self) -> None:
        """Release the global buffer's memory; views stay valid objects until re-allocated."""
        if self._pending is not None:
            self._pending.wait()
        if self.is_allocated:
            self._global.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ collectives

    def _launch(self, fn, async_op: bool, finish=None) -> Handle:
        with torch.no_grad(), comm_context(self.device) as box:
            works = fn(async_op and self.device.type != "cuda")
        handle = Handle(works if isinstance(works, list) else [works], finish,
                        box[0] if box else None)
        if async_op:
            self._pending = handle
            return handle
        handle.wait()
        return handle

    def all_gather(self, async_op: bool = False, source: Optional[torch.Tensor] = None) -> Handle:
        """Gather every rank's shard into the global buffer, in place; one collective.

        Args:
            async_op: Return at once; ``handle.wait()`` before using the full views.
            source: Send this ``S``-element tensor instead of the shard (e.g. a bf16 cast of
                an fp32 master shard); it must have this buffer's dtype.

        Returns:
            A :class:`Handle`.
        """
        src = self.shard if source is None else source
        if src.numel() != self.shard.numel() or src.dtype != self.dtype:
            raise ValueError(f"all_gather source must be {self.shard.numel()} x {self.dtype}, "
                             f"got {src.numel()} x {src.dtype}")
        self.alloc_global()
        out = self._global.data
        return self._launch(lambda a: comm.all_gather_into(out, src, self.groups.shard, a), async_op)

    def reduce_scatter(self, source: Optional[torch.Tensor] = None, op: str = "avg",
                       reduce_dtype: Optional[torch.dtype] = None, accumulate: bool = False,
                       async_op: bool = False) -> Handle:
        """Reduce-scatter ``source`` (default: this buffer's global buffer) into the shard.

        Over HSDP's replicate dim the result is then all-reduced, so ``op="avg"`` averages
        over every rank of the mesh and ``"sum"`` sums over them.

        Args:
            source: An ``m*S`` tensor laid out like the unit's buffer.
            op: ``"sum"`` or ``"avg"``.
            reduce_dtype: Reduce in this dtype (e.g. fp32 for bf16 gradients); the result is
                cast back into the shard's dtype.
            accumulate: Add into the shard instead of overwriting it.
            async_op: Return at once; ``handle.wait()`` before reading the shard.

        Returns:
            A :class:`Handle`.
        """
        src = self._global if source is None else source
        if src.numel() != self._global.numel():
            raise ValueError(f"reduce_scatter source must have {self._global.numel()} elements, "
                             f"got {src.numel()}")
        src = src.data
        rdt = reduce_dtype or src.dtype
        if src.dtype != rdt:
            src = src.to(rdt)
        self.ensure_shard(zero=accumulate)
        direct = rdt == self.dtype and not accumulate
        out = self.shard.data if direct else torch.empty(self.shard.numel(), dtype=rdt,
                                                          device=self.device)
        replicate = self.groups.replicate

        def launch(a):
            return comm.reduce_scatter_into(out, src, op, self.groups.shard, a)

        def finish():
            if replicate is not None:
                comm.all_reduce_(out, op, replicate)
            if not direct:
                if accumulate:
                    self.shard.data.add_(out.to(self.dtype))
                else:
                    self.shard.data.copy_(out)
            return self

        return self._launch(launch, async_op, finish)

    # ------------------------------------------------------------------ group ops

    @property
    def shard_allocated(self) -> bool:
        return self.shard.untyped_storage().nbytes() > 0

    def release_shard(self) -> None:
        """Free the shard's memory (for gradient buffers between steps: "set to none").

        Views of it stay valid objects; :meth:`ensure_shard` brings the memory back.
        """
        if self._pending is not None:
            self._pending.wait()
        if _OWNERS.get(self.shard.untyped_storage().data_ptr()) is self:
            del _OWNERS[self.shard.untyped_storage().data_ptr()]  # the address may be reused
        self.shard.untyped_storage().resize_(0)

    def ensure_shard(self, zero: bool = True) -> torch.Tensor:
        """Re-allocate a released shard (zero-filled unless ``zero=False``); return it."""
        if not self.shard_allocated:
            self.shard.untyped_storage().resize_(self.shard.numel() * self.shard.element_size())
            _OWNERS[self.shard.untyped_storage().data_ptr()] = self
            if zero:
                with torch.no_grad():
                    self.shard.zero_()
        return self.shard

    def zero_(self) -> "DBuffer":
        """One kernel over the whole shard."""
        with torch.no_grad():
            self.shard.zero_()
        return self

    def scale_(self, factor: float) -> "DBuffer":
        with torch.no_grad():
            self.shard.mul_(factor)
        return self

    def add_(self, other: Union["DBuffer", torch.Tensor], alpha: float = 1.0) -> "DBuffer":
        with torch.no_grad():
            self.shard.add_(self._flat(other), alpha=alpha)
        return self

    def copy_(self, other: Union["DBuffer", torch.Tensor]) -> "DBuffer":
        """Copy (and cast) another buffer of the same layout into this shard."""
        with torch.no_grad():
            self.shard.copy_(self._flat(other))
        return self

    def like(self, dtype: Optional[torch.dtype] = None, role: str = "state") -> "DBuffer":
        """A new zeroed DBuffer with the same layout (e.g. gradients, optimizer states)."""
        new = DBuffer.__new__(DBuffer)
        new._setup(self.key, self.layout, self.tensors, self.groups, dtype or self.dtype, role)
        return new

    def _flat(self, other) -> torch.Tensor:
        flat = other.shard if isinstance(other, DBuffer) else other
        if flat.numel() != self.shard.numel():
            raise ValueError(f"expected {self.shard.numel()} elements (unit {unit_name(self.key)}),"
                             f" got {flat.numel()}")
        return flat

    def __repr__(self) -> str:
        return (f"DBuffer({self.role}, unit {unit_name(self.key)}, rank {self.rank}/"
                f"{self.layout.world_size}, S={self.layout.shard_numel}, {self.dtype}, "
                f"{'gathered' if self.is_allocated else 'released'})")
