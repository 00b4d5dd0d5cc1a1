"""DBuffer: one unit's persistent flat shard on this rank, plus its on-demand global buffer.

::

    global buffer (m*S, on demand)   | rank 0 | rank 1 | rank 2 |   full views: [off, off+numel)
                                              ^^^^^^^^
    shard (S, persistent*)                   | rank 1 |           local views: shard_range(r)

(*) A compute copy (``Role.COMPUTE``, the ``param_dtype`` cast of the parameters) has no
persistent shard: its shard is its rank's slice of the global buffer, so it holds memory only
while gathered.

A DBuffer is built from a :class:`~vfsdp.planner.UnitLayout` (what the unit holds, where)
and the :class:`~vfsdp.collectives.MeshGroups` it communicates over. Every tensor of the unit
is a **fixed view**: its local piece aliases the shard, its full tensor aliases the global
buffer, for the whole run. Each view carries a :class:`Slot` (``slot_of(t)``) naming the
buffer, the tensor's index and the kind of view, so code that receives it finds its buffer
from the tensor itself: there is no lookup by address and no registry.

The all-gather takes the shard as its input and the global buffer as its output, with
nothing packed before or unpacked after. **Memory rule:** a release lets go of memory whose
views are handed out (the full parameters and optimizer states, the gradient pieces): those views
read as released and point at a zero-byte storage, so the memory goes with the last tensor
anyone made from them, and the next gather gets fresh memory. Memory only vfsdp reads (staging,
accumulators) is resized in place. Nothing counts references, nothing can point at freed
memory. Collectives write through ``tensor.data`` aliases, which do not share the autograd
version counter: a gather does not invalidate what autograd saved.

Storage aliases: new leaf tensors over a buffer's memory, made with one op.

DBuffer hands out views of its shard and global buffer that are *not* autograd views of them:
each has its own version counter (a collective writing the buffer does not invalidate what
autograd saved) and survives the buffer's storage being resized to zero and back.

Views of released memory raise instead of crashing.

Releasing a buffer lets go of its memory: the views handed out earlier (the full tensors
``vfsdp.gather`` returned, the gradient pieces ``vfsdp.grads`` returned) are pointed at a
zero-byte storage, and reading them would crash the process. Instead, on
release every view a DBuffer handed out turns into a :class:`ReleasedTensor`: any torch
operation on it raises a ``RuntimeError`` that names the tensor, the unit and what to do. The
next gather (or backward) hands out new views of fresh memory; the released ones stay released.
Only released views pay anything: live ones are ordinary ``torch.Tensor`` s.

Metadata that does not read memory (shape, dtype, device, ``requires_grad``, ``repr``, where
the memory is: ``untyped_storage``, ``stride``, ``data_ptr``) stays available, so debuggers,
memory probes and error messages still work.

Tensors made *from* those views (``x.T``, ``x.view(...)``, slices, ``x.detach()``) are not
vfsdp's to change; they keep the memory they were made from, as torch views do, for as long as
they live, and read the values it held. They never point at freed memory.

What a tensor handed out by vfsdp carries: its :class:`Slot` (buffer, index, view, unit).

Every view a :class:`~vfsdp.collectives.DBuffer` hands out (a shard, a gathered full tensor, a
gradient piece) carries a ``Slot`` attribute naming the buffer, the tensor's index in the unit,
the kind of view, and the :class:`~vfsdp.collectives.Unit`. Code that receives the tensor finds
its buffers from it (:func:`slot_of`): no registry, no lookup by address. :class:`Role` says
what a buffer holds.

Buffer events for observers (the memory probes in ``vfsdp.testing``).

A DBuffer reports ``"create"`` when it is made, ``"alloc"`` when its global buffer gets memory
and ``"free"`` when it gives it back. Observers are callables ``(event, dbuffer)`` installed
for a block of code on the current thread (one rank under ``simulate``) with :func:`observe`;
no DBuffer is recorded anywhere unless an observer keeps it. Outside an ``observe`` block an
event costs one thread-local attribute read.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import optree
import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives import comm
from vfsdp.collectives.comm import Handle, MeshGroups
from vfsdp.planner.spec import TensorSpec, UnitLayout, unit_name

__all__ = ["DBuffer", "alias", "contiguous_strides", "view_of", "ReleasedTensor", "poison",
           "Role", "View", "Slot", "slot_of", "SLOT", "observe", "emit"]


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple) -> tuple:
    """Row-major strides of ``shape`` (computed, no tensor made).

    Example:
        >>> contiguous_strides((2, 3, 4)), contiguous_strides(())
        ((12, 4, 1), ())
    """
    return tuple(math.prod(max(n, 1) for n in shape[d + 1:]) for d in range(len(shape)))


def alias(storage_tensor: torch.Tensor, offset: int, shape: tuple) -> torch.Tensor:
    """A leaf tensor sharing ``storage_tensor``'s storage at ``offset`` (elements, from its
    own offset): not an autograd view of it, with its own version counter. One op
    (``as_strided_`` on a ``.data`` alias).

    Example:
        >>> x = torch.arange(6.0)
        >>> a = alias(x, 2, (2, 2))
        >>> a.tolist(), a._base is None, a.untyped_storage().data_ptr() == x.data_ptr()
        ([[2.0, 3.0], [4.0, 5.0]], True, True)
    """
    out = storage_tensor.data
    out.as_strided_(shape, contiguous_strides(shape), storage_tensor.storage_offset() + offset)
    return out


def view_of(base: torch.Tensor, offset: int, shape: tuple,
            stride: Optional[tuple] = None) -> torch.Tensor:
    """An autograd view of ``base`` at ``offset`` (elements, from its own offset): one op
    (``as_strided``), sharing ``base``'s version counter and keeping ``base`` alive. For
    vfsdp's own views of a buffer that no autograd check reads the version of and that it
    drops at release (the saved parameters ``run_layers`` hands its backward, a compute
    copy's shard); :func:`alias` for views handed out.

    Example:
        >>> x = torch.arange(6.0)
        >>> v = view_of(x, 2, (2, 2))
        >>> v.tolist(), v._base is x
        ([[2.0, 3.0], [4.0, 5.0]], True)
    """
    return base.as_strided(shape, contiguous_strides(shape) if stride is None else stride,
                           base.storage_offset() + offset)


_WHY = "_vfsdp_released"  # on a released view: the sentence explaining what happened

_METADATA = {  # what reads no memory (memory probes ask where it is), by name: properties, methods
    *(getattr(torch.Tensor, n).__get__ for n in ("shape", "dtype", "device", "requires_grad", "is_leaf",
      "grad_fn", "ndim", "_base", "grad", "layout", "is_cuda", "nbytes", "itemsize")),
    *(getattr(torch.Tensor, n) for n in ("size", "dim", "numel", "untyped_storage", "storage_offset",
      "stride", "element_size", "is_contiguous", "data_ptr")),
}


class ReleasedTensor(torch.Tensor):
    """A view of memory vfsdp released: torch operations on it raise ``RuntimeError``.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     full = vfsdp.gather(shards, spec)
        ...     vfsdp.release(shards, spec)
        ...     try:
        ...         full["w"].sum()
        ...     except RuntimeError as exc:
        ...         return type(full["w"]).__name__, str(exc).split(";")[0]
        >>> vfsdp.testing.simulate(2, body)[0]
        ('ReleasedTensor', 'w (unit <root>) was released')
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.__repr__:
            t = args[0]
            return (f"ReleasedTensor(shape={tuple(t.shape)}, dtype={t.dtype}: "
                    f"{getattr(t, _WHY, 'released')})")
        why = next((getattr(a, _WHY) for a in optree.tree_leaves((args, kwargs))
                    if isinstance(a, ReleasedTensor) and hasattr(a, _WHY)),
                   "this tensor's memory was released by vfsdp; it cannot be read")
        raise RuntimeError(why)


def poison(views: Iterable[torch.Tensor], why: str) -> None:
    """Turn live views into :class:`ReleasedTensor` s that raise ``why`` when used."""
    for v in views:
        if type(v) is torch.Tensor:
            v.__class__ = ReleasedTensor
        if type(v) is ReleasedTensor:
            setattr(v, _WHY, why)


SLOT = "_vfsdp_slot"  # the attribute name on views


class Role(enum.Enum):
    """What a DBuffer holds.

    Example:
        >>> Role.PARAM.holds_params, Role.GRAD.holds_params
        (True, False)
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     return slot_of(shards["w"]).buffer.role, slot_of(vfsdp.grads(shards, spec)["w"]).buffer.role
        >>> vfsdp.testing.simulate(2, body)[0]
        (<Role.PARAM: 'param'>, <Role.GRAD: 'grad'>)
    """

    PARAM = "param"      #: the parameters' master shard; gathered: the full parameters
    COMPUTE = "compute"  #: a low-precision copy of the parameters, gathered for compute
    GRAD = "grad"        #: the sharded gradients (persistent between backward and update)
    ACCUM = "accum"      #: unsharded gradients accumulated without reducing (grad_sync=False)
    STAGE = "stage"      #: the reduce-scatter input, in the reduction dtype
    STATE = "state"      #: optimizer state with the parameters' layout

    @property
    def holds_params(self) -> bool:
        """``PARAM`` and ``COMPUTE``: gathering one of them gathers parameters."""
        return self in (Role.PARAM, Role.COMPUTE)


class View(enum.Enum):
    """Which memory a view aliases.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     shard, full = slot_of(shards["w"]), slot_of(vfsdp.gather(shards, spec)["w"])
        ...     return shard.view, full.view
        >>> vfsdp.testing.simulate(2, body)[0]
        (<View.LOCAL: 'local'>, <View.FULL: 'full'>)
    """

    LOCAL = "local"  #: the rank's shard
    FULL = "full"    #: the gathered global buffer


@dataclass(frozen=True, eq=False)
class Slot:
    """Where a tensor handed out by a DBuffer lives. Read it with :func:`slot_of`.

    Attributes:
        buffer: The DBuffer.
        index: The tensor's position in the unit's buffer order.
        view: :attr:`View.LOCAL` or :attr:`View.FULL`.
        unit: The :class:`~vfsdp.collectives.Unit` the buffer belongs to, if any.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     shard, full = slot_of(shards["w"]), slot_of(vfsdp.gather(shards, spec)["w"])
        ...     return shard.index, shard.buffer is full.buffer, shard.unit is full.unit
        >>> vfsdp.testing.simulate(2, body)[0]         # one buffer: its shard and its gathered view
        (0, True, True)
    """

    buffer: Any  # the DBuffer
    index: int
    view: View
    owner: Any = None  # the Unit, or a weak reference to it (views the unit itself keeps)

    @property
    def unit(self) -> Any:
        """The :class:`~vfsdp.collectives.Unit` (``None`` if none, or if it is gone)."""
        owner = self.owner
        return owner() if isinstance(owner, weakref.ref) else owner

    def __reduce__(self):
        # A pickled tensor (torch.save, spawn results) is plain data: it carries no buffer.
        return (type(None), ())


def slot_of(t: Any) -> Optional[Slot]:
    """The :class:`Slot` of a tensor a DBuffer handed out, or ``None`` for any other value.

    Args:
        t: Any value: a shard, a gathered view, a gradient piece, a plain tensor, ...

    Returns:
        The tensor's :class:`Slot`; ``None`` for a plain tensor or a non-tensor.

    Raises:
        TypeError: never: any value is accepted (a non-tensor has no slot).

    Example:
        >>> slot_of(torch.zeros(2)) is None, slot_of("w") is None
        (True, True)
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     return slot_of(vfsdp.shard({"w": torch.ones(8)}, spec)["w"]).view
        >>> vfsdp.testing.simulate(2, body)
        [<View.LOCAL: 'local'>, <View.LOCAL: 'local'>]
    """
    return getattr(t, SLOT, None) if isinstance(t, torch.Tensor) else None


@contextlib.contextmanager
def observe(observer: Callable[[str, Any], None]) -> Iterator[None]:
    """Call ``observer(event, dbuffer)`` for every buffer event on this thread inside the block.

    Example:
        >>> seen = []
        >>> with observe(lambda event, db: seen.append(event)):
        ...     emit("alloc", None)
        >>> seen
        ['alloc']
    """
    comm._TLS.observers.append(observer)
    try:
        yield
    finally:
        comm._TLS.observers.remove(observer)


def emit(event: str, db: Any) -> None:
    """Report ``event`` about ``db`` to this thread's observers (none: nothing happens)."""
    stack = comm._TLS.observers
    if stack:
        for observer in list(stack):
            observer(event, db)


class DBuffer:
    """One unit's buffers for one role (params, grads, an optimizer state) on this rank.

    Args:
        layout: The unit's layout (``spec.units[key]``).
        groups: Where the unit's collectives run (see ``resolve_groups``); the shard group's
            size must be the layout's world size.
        dtype: Buffer dtype (default: the unit's dtype).
        role: What the buffer holds (a :class:`Role`).
        name: A label for errors and reprs (e.g. ``"exp_avg"``); default: the role's name.
        unit: The :class:`~vfsdp.collectives.Unit` that owns this buffer (kept as a weak
            reference; views carry it in their :class:`Slot`).

    Attributes:
        shard: This rank's ``S`` elements (the local views alias it).
        global_buffer: The ``m*S`` buffer (the full views alias it); zero bytes of storage
            while released.

    Raises:
        ValueError: the shard group's size is not the layout's world size.
        TypeError: ``role`` is not a :class:`Role`.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(3, 2)}, 2)
        ...     db = DBuffer(spec.units[()], resolve_groups(spec))
        ...     db.local(0).data.fill_(dist.get_rank() + 1.0)
        ...     db.all_gather()
        ...     return db.full(0).tolist()
        >>> vfsdp.testing.simulate(2, body)[0]
        [[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]
    """

    def __init__(self, layout: UnitLayout, groups: MeshGroups, dtype: Optional[torch.dtype] = None,
                 role: Role = Role.PARAM, name: Optional[str] = None, unit: Any = None) -> None:
        if not isinstance(layout, UnitLayout):
            raise TypeError(f"DBuffer(layout, groups): layout must be a UnitLayout "
                            f"(spec.units[key]), got {type(layout).__name__}")
        if not isinstance(role, Role):
            raise TypeError(f"role must be a vfsdp.collectives.Role, got {role!r}")
        if groups.shard_size != layout.world_size:
            raise ValueError(f"unit {unit_name(layout.key)} was planned for {layout.world_size} "
                             f"ranks, the shard group has {groups.shard_size}")
        self.layout = layout
        self.groups = groups
        self.role = role
        self.name = name or role.value
        self.rank = groups.shard_rank
        self.dtype = dtype or layout.dtype
        self.device = groups.device
        self._unit_ref = weakref.ref(unit) if unit is not None else None
        s, m = layout.shard_numel, layout.world_size
        # Memory vfsdp hands out (full parameters and optimizer states, gradient pieces) is only
        # ever let go of: a release points vfsdp's views at a zero-byte storage (made here,
        # with one view per tensor) and drops its reference, so the memory goes with the last
        # tensor anyone made from it; the next gather or gradient write gets fresh memory.
        # Memory only vfsdp reads (staging, accumulators) is resized in place.
        self._fresh = role not in (Role.GRAD, Role.STAGE, Role.ACCUM)  # else: only vfsdp reads it
        # the m*S buffer (zero bytes of storage while released)
        self.global_buffer = torch.empty(m * s, dtype=self.dtype, device=self.device)
        self._dead = self.global_buffer  # stays zero bytes when fresh: the released state's storage
        self._dead_full = ([alias(self._dead, t.offset, tuple(t.shape)) for t in self.tensors]
                           if self._fresh else None)
        # A compute copy (param_dtype) keeps no memory of its own: its shard is this rank's
        # slice of the global buffer, written by the cast and all-gathered in place. Staging
        # buffers and accumulators use only their global buffer: their shard is that slice
        # too (no S elements of their own, held for the unit's life).
        self._in_global = role in (Role.COMPUTE, Role.STAGE, Role.ACCUM)
        self._local_spec = layout.pieces(self.rank)
        self._dead_shard = alias(self._dead, self.rank * s, (s,)) if self._in_global else None
        self._dead_local: Optional[list] = None
        if role is Role.GRAD:  # released with set_to_none: its pieces are handed out
            self._dead_shard = torch.empty(s, dtype=self.dtype, device=self.device)
            self._dead_local = [alias(self._dead_shard, lo, shape)
                                for lo, shape in self._local_spec]
            self._dead_shard.untyped_storage().resize_(0)
        self.shard = (self._dead_shard if self._in_global
                      else torch.zeros(s, dtype=self.dtype, device=self.device))
        self._pending: Optional[Handle] = None
        # Views are made on demand and point back at this DBuffer, which keeps only weak
        # references to those whose memory it may release (to turn them into ReleasedTensors):
        # no reference cycle, so dropping the shards frees the memory at once.
        self._views: list = []
        self._internal: Optional[list] = None  # internal_views(), made on first use
        self._saved: dict = {}  # saved_view()s, made on first use
        self.global_buffer.untyped_storage().resize_(0)  # released until the first gather
        emit("create", self)

    # ------------------------------------------------------------------ identity

    @property
    def key(self) -> Any:
        """The unit key."""
        return self.layout.key

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The unit's tensors in buffer order."""
        return self.layout.tensors

    @property
    def unit(self) -> Any:
        """The :class:`~vfsdp.collectives.Unit` this buffer belongs to, or ``None``."""
        return self._unit_ref() if self._unit_ref is not None else None

    def __len__(self) -> int:
        return len(self.layout.paths)

    def index(self, path: tuple) -> int:
        """Position of a tensor path in the unit's buffer order.

        Raises:
            KeyError: the path is not in this unit.
        """
        return self.layout.index(path)

    # ------------------------------------------------------------------ views

    def _tag(self, t: torch.Tensor, k: int, view: View, weak_unit: bool = False) -> torch.Tensor:
        unit = self.unit
        setattr(t, SLOT, Slot(self, k, view, weakref.ref(unit) if weak_unit and unit is not None else unit))
        if view is View.FULL or self.role is Role.GRAD:  # memory this buffer may release
            if len(self._views) > 2 * len(self) + 16:
                self._views = [r for r in self._views if r() is not None]
            self._views.append(weakref.ref(t))
        return t

    def _handed_out(self, view: View) -> list:
        return [t for r in self._views if (t := r()) is not None and getattr(t, SLOT).view is view]

    def _poison(self, view: View, why: str, dead: Optional[list] = None) -> None:
        """The views handed out read as released; ``dead`` (one zero-byte view per tensor):
        they also let go of the memory (point at it) and are forgotten."""
        for t in self._handed_out(view):
            k = getattr(t, SLOT).index
            path = ".".join(map(str, self.tensors[k].path))
            if dead is not None:  # no longer holds its memory (tensors made from it keep it)
                tp.set_data(t, dead[k])
            poison([t], f"{path} (unit {unit_name(self.key)}) was released; {why}")
        if dead is not None:
            self._views = [r for r in self._views
                           if (t := r()) is not None and getattr(t, SLOT).view is not view]

    def _release_views(self, dead: Optional[list] = None) -> None:
        self._poison(View.FULL, "gather the unit again (vfsdp.gather) and read the full tensors "
                                "it returns", dead)

    def local(self, i: Union[int, tuple], weak_unit: bool = False) -> torch.Tensor:
        """Tensor ``i``'s local piece: a leaf tensor aliasing the shard (its local shape).
        ``weak_unit``: its slot refers to the unit weakly (for views the unit itself keeps,
        which must not keep it alive)."""
        k = i if isinstance(i, int) else self.index(i)
        lo, shape = self._local_spec[k]
        return self._tag(alias(self.shard, lo, shape), k, View.LOCAL, weak_unit)

    def full(self, i: Union[int, tuple]) -> torch.Tensor:
        """Tensor ``i``'s full view into the global buffer: a new tensor object aliasing it
        (no autograd link), valid until the buffer is released.

        Raises:
            TypeError: a staging, accumulator or gradient buffer (vfsdp's own, freed in place).
            RuntimeError: the global buffer is released (``set_`` would silently re-allocate
                it with garbage); gather first.
        """
        k = i if isinstance(i, int) else self.index(i)
        if not self._fresh:
            raise TypeError(f"unit {unit_name(self.key)} ({self.name}): the full buffer of a "
                            f"{self.role.value} buffer is vfsdp's own (it is freed in place); "
                            f"take full views of parameters or optimizer states")
        if not self.is_allocated:
            raise RuntimeError(f"unit {unit_name(self.key)} ({self.name}) is not gathered; "
                               f"call all_gather() (or vfsdp.gather) before taking full views")
        t = self.tensors[k]
        return self._tag(alias(self.global_buffer, t.offset, tuple(t.shape)), k, View.FULL)

    def internal_views(self) -> list[torch.Tensor]:
        """Every tensor's full-shape view into the global buffer, made once and kept, for
        vfsdp's own writes (gradient staging, accumulation); never handed to users, so they
        are neither tagged nor released with the buffer. Valid while it is allocated."""
        if self._internal is None:
            self._internal = [alias(self.global_buffer, t.offset, tuple(t.shape))
                              for t in self.tensors]
        return self._internal

    def saved_view(self, offset: int, shape: tuple, stride: tuple) -> torch.Tensor:
        """A view into the global buffer for autograd to read in a backward (``run_layers``'
        saved parameters), made once per ``(offset, shape, stride)`` and gather, and kept
        until the release (valid while gathered)."""
        key = (offset, tuple(shape), tuple(stride))
        if key not in self._saved:
            self._saved[key] = view_of(self.global_buffer, *key)
        return self._saved[key]

    @property
    def is_allocated(self) -> bool:
        """Whether the global buffer holds memory (gathered, or being gathered)."""
        return self.global_buffer.untyped_storage().nbytes() > 0

    def is_local_view(self, i: int, t: torch.Tensor) -> bool:
        """Whether ``t`` is exactly tensor ``i``'s local piece (same memory, shape, strides)."""
        lo, shape = self._local_spec[i]
        # (a released shard has no memory: none of its pieces is a piece of it)
        return tuple(t.shape) == tuple(shape) and (t.numel() == 0 or (
            self.holds_shard and t.untyped_storage().data_ptr() == self.shard.untyped_storage().data_ptr()
            and t.storage_offset() == self.shard.storage_offset() + lo and t.is_contiguous()))

    # ------------------------------------------------------------------ global buffer

    def alloc_global(self) -> torch.Tensor:
        """Allocate the global buffer (contents undefined): fresh memory for a buffer whose
        views are handed out, its own storage resized back for one only vfsdp reads. Views
        handed out since the last release (kept for a graph) read as live again."""
        if not self.is_allocated:
            if self._fresh:
                self.global_buffer = torch.empty(self._dead.numel(), dtype=self.dtype,
                                           device=self.device)
                if self._in_global:  # a view: nothing checks the global buffer's version
                    self.shard = view_of(self.global_buffer, self.rank * self.shard.numel(),
                                         tuple(self.shard.shape))
            else:
                self.global_buffer.untyped_storage().resize_(self.global_buffer.nbytes)
            emit("alloc", self)
        for t in self._handed_out(View.FULL):  # kept (a graph read them), gathered again
            if type(t) is ReleasedTensor:
                t.__class__ = torch.Tensor
        return self.global_buffer

    def free_global(self, wait: bool = True) -> None:
        """Release the global buffer's memory; views stay valid objects until re-allocated.

        Args:
            wait: First wait for this buffer's pending collective (``False`` only from that
                collective's own completion).
        """
        if wait:
            self.wait()
        if not self.is_allocated:
            return
        if self._fresh:  # let go: the memory goes with the last tensor made from it
            self._release_views(self._dead_full)
            self._saved.clear()
            self.global_buffer = self._dead
            if self._in_global:
                self.shard = self._dead_shard
        else:  # only vfsdp's own views read it: freed in place
            self.global_buffer.untyped_storage().resize_(0)
        emit("free", self)

    # ------------------------------------------------------------------ collectives

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous collective writing this buffer was started and not
        waited for."""
        return self._pending is not None and not self._pending.done

    def wait(self) -> None:
        """Wait for this buffer's pending asynchronous collective, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def _launch(self, fn: Callable[[bool], Any], async_op: bool,
                finish: Optional[Callable[[], Any]] = None) -> Handle:
        self.wait()  # one collective at a time writes this buffer
        handle = comm.launch(self.device, fn, async_op, finish)
        if async_op:
            self._pending = handle
        return handle

    def all_gather(self, async_op: bool = False) -> Handle:
        """Gather every rank's shard into the global buffer, in place; one collective.

        A ``COMPUTE`` buffer's shard is this rank's slice of the global buffer (allocate it
        with :meth:`alloc_global` and write the shard first): the collective reads and writes
        the same memory, as NCCL's in-place all-gather does.

        Args:
            async_op: Return at once; ``handle.wait()`` before using the full views.

        Returns:
            A :class:`Handle`.
        """
        self.wait()
        self.alloc_global()
        src, out = self.shard, self.global_buffer.data  # (a compute copy's shard: in fresh memory)
        return self._launch(lambda a: comm.all_gather_into(out, src, self.groups.shard, a), async_op)

    def reduce_scatter(self, source: Optional[torch.Tensor] = None, op: str = "avg",
                       reduce_dtype: Optional[torch.dtype] = None, accumulate: bool = False,
                       async_op: bool = False, release: Optional[DBuffer] = None,
                       then: Optional[Callable[[], Any]] = None, new: bool = False) -> Handle:
        """Reduce-scatter ``source`` (default: this buffer's global buffer) into the shard.

        Over HSDP's replicate dim the result is then all-reduced, so ``op="avg"`` averages
        over every rank of the mesh and ``"sum"`` sums over them.

        Args:
            source: An ``m*S`` tensor laid out like the unit's buffer.
            op: ``"sum"`` or ``"avg"``.
            reduce_dtype: Reduce in this dtype (e.g. fp32 for bf16 gradients); the result is
                cast back into the shard's dtype.
            accumulate: Add into the shard instead of overwriting it.
            async_op: Return at once; :meth:`wait` (or ``handle.wait()``) before reading the
                shard.
            release: A DBuffer whose global buffer is ``source``: released once the result
                is in the shard (the staging buffer of an asynchronous reduction).
            then: Called once the result is in the shard (the unit's ``on_reduced`` hooks).
            new: Into a new ``S``-element tensor of this buffer's dtype, which the handle's
                ``wait()`` returns (the gradients handed to autograd): this buffer is not
                touched, nor waited for.

        Returns:
            A :class:`Handle`.

        Raises:
            ValueError: ``source`` has the wrong size, or ``op`` is unknown.
        """
        source = self.global_buffer if source is None else source
        if source.numel() != self.global_buffer.numel():
            raise ValueError(f"reduce_scatter source must have {self.global_buffer.numel()} elements, "
                             f"got {source.numel()}")
        comm.check_op(op)
        rdt = reduce_dtype or source.dtype
        src = source.detach().to(rdt)  # (no copy when it has the reduce dtype)
        if not new:
            self.wait()
            self.ensure_shard(zero=accumulate)
        direct = rdt == self.dtype and not accumulate and not new
        out = self.shard.data if direct else torch.empty(self.shard.numel(), dtype=rdt,
                                                          device=self.device)
        keep = [src]  # a cast copy is read by the collective until it is done: keep it alive

        def done():
            keep.clear()
            if self.groups.replicate is not None:
                comm.all_reduce_(out, op, self.groups.replicate)
            if new:
                return out.to(self.dtype)
            if accumulate:
                self.shard.data.add_(out.to(self.dtype))
            elif not direct:
                self.shard.data.copy_(out)
            if release is not None:
                release.free_global(wait=release is not self)
            if then is not None:
                then()
            return self

        fn = lambda a: comm.reduce_scatter_into(out, src, op, self.groups.shard, a)
        return comm.launch(self.device, fn, False, done) if new else self._launch(fn, async_op, done)

    def local_shape(self, i: int) -> tuple:
        """Tensor ``i``'s local shape on this rank."""
        return tuple(self._local_spec[i][1])

    # ------------------------------------------------------------------ group ops

    @property
    def holds_shard(self) -> bool:
        """Whether the shard holds memory (see :meth:`release_shard`)."""
        return self.shard.untyped_storage().nbytes() > 0

    def release_shard(self) -> None:
        """Let go of a gradient shard's memory ("set to none"): the pieces handed out read as
        released and point at no memory; the memory goes with the last tensor made from them.
        :meth:`ensure_shard` brings fresh memory (and :meth:`local` new pieces).

        Raises:
            TypeError: not a gradient buffer (only those are released).
        """
        if self._dead_local is None:
            raise TypeError(f"release_shard: {self.name} of unit {unit_name(self.key)} is not a "
                            f"gradient buffer; only gradient shards are released")
        self.wait()
        self._poison(View.LOCAL, "its gradients were zeroed with set_to_none (vfsdp.zero_grads); "
                                 "read them again with vfsdp.grads after the next backward",
                     self._dead_local)
        self.shard = self._dead_shard

    def ensure_shard(self, zero: bool = True) -> torch.Tensor:
        """Fresh memory for a released shard (zero-filled unless ``zero=False``); return it."""
        if not self.holds_shard:
            self.shard = (torch.zeros if zero else torch.empty)(
                self.shard.numel(), dtype=self.dtype, device=self.device)
        return self.shard

    def pin_shard(self) -> DBuffer:
        """Move a host shard into pinned (page-locked) memory, so that copies between it and
        a GPU run asynchronously (``vfsdp.optim.offload``); its values are kept. Call it
        before any of its views are handed out: they would keep the old memory.

        Raises:
            ValueError: the shard is not in CPU memory.
        """
        if self.shard.device.type != "cpu":
            raise ValueError(f"pin_shard: the {self.name} shard of unit {unit_name(self.key)} is "
                             f"on {self.shard.device}, not in host memory")
        if not self.shard.is_pinned():
            self.shard = self.shard.pin_memory()
        return self

    def _inplace(self, op: str, *args: Any, **kwargs: Any) -> DBuffer:
        """One in-place kernel ``op`` over the whole shard (a leaf that may require grad)."""
        with torch.no_grad():
            getattr(self.shard, op)(*args, **kwargs)
        return self

    def zero_(self) -> DBuffer:
        """One kernel over the whole shard."""
        return self._inplace("zero_")

    def add_(self, other: Union[DBuffer, torch.Tensor], alpha: float = 1.0) -> DBuffer:
        """Add another buffer of the same layout (or a flat ``S``-element tensor)."""
        return self._inplace("add_", self._flat(other), alpha=alpha)

    def copy_(self, other: Union[DBuffer, torch.Tensor]) -> DBuffer:
        """Copy (and cast) another buffer of the same layout into this shard."""
        return self._inplace("copy_", self._flat(other))

    def like(self, dtype: Optional[torch.dtype] = None, role: Role = Role.STATE,
             name: Optional[str] = None) -> DBuffer:
        """A new zeroed DBuffer with the same layout and groups (e.g. an optimizer state).

        Args:
            dtype: Its dtype (default: this buffer's).
            role: A :class:`Role` (default ``Role.STATE``).
            name: A label (e.g. ``"exp_avg"``).
        """
        return DBuffer(self.layout, self.groups, dtype or self.dtype, role, name, self.unit)

    def _flat(self, other) -> torch.Tensor:
        flat = other.shard if isinstance(other, DBuffer) else other
        if flat.numel() != self.shard.numel():
            raise ValueError(f"expected {self.shard.numel()} elements (unit {unit_name(self.key)}),"
                             f" got {flat.numel()}")
        return flat

    def __repr__(self) -> str:
        return (f"DBuffer({self.name}, unit {unit_name(self.key)}, rank {self.rank}/"
                f"{self.layout.world_size}, S={self.layout.shard_numel}, {self.dtype}, "
                f"{'gathered' if self.is_allocated else 'released'})")
