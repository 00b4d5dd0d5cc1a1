"""Optimizer state and master parameters in host memory: ``offload(opt)``.

``offload(opt)`` runs any optimizer (``adamw``, ``adamw8bit``, ``muon``, a ``chain`` or
``partition`` of them, or a member of one) on host copies of the units' shards:

* ``init`` makes, per unit, a host copy of this rank's shard (the *master*, in
  ``master_dtype``: float32 for bf16 and fp32 parameters) and the wrapped optimizer's state
  over those copies, all in host memory (the master and gradient copies pinned when the
  parameters are on a GPU). The device keeps the parameters and their gradients only.
* The backward copies each unit's reduced gradient shard to the host as soon as its
  reduction is done (the unit's :class:`~vfsdp.collectives.HostMirror`, one copy per unit; on
  a GPU on a stream of its own, into pinned memory, while the backward of the other units
  goes on).
* ``update``, per unit: the gradient copy again only where the backward's no longer holds
  what the device holds (something wrote the gradients after the reduction, e.g. a clip or
  ``GradScaler.unscale_`` on the device: ``state.grad_copies`` counts these), the wrapped
  optimizer's update on the host (torch's CPU kernels; ``adamw(fused=True)`` takes torch's
  fused CPU AdamW), and one host-to-device copy per run of updated tensors back into the
  shard, cast to its dtype; on a GPU on the same stream, and the compute stream waits for the
  last one before anything reads the parameters. There is no per-parameter loop.
* Parameters written on the device by anything else (a checkpoint load, another member of a
  ``partition`` over the same unit, a user's in-place write, ``.data``, a broadcast) are read
  back into the master before the update (``state.resyncs`` counts it).
* Both are decided by content: a :func:`~vfsdp.collectives.mirror.fingerprint` (two sums
  over the bits' 32-bit lanes, of the values and of their squares) per unit of the parameter
  shard (against the one taken after the last copy back) and of the gradient shard (against
  the one taken when the backward copied it), all read in one device-to-host copy. So no
  write is missed, whether or not a version counter sees it; what a fingerprint cannot tell
  is a write that only permutes values. On a CPU-only machine, where host and device are
  the same memory, the fingerprints cost more than the copies they spare.
* An update is a transaction (:func:`~vfsdp.optim.base.atomic`): the wrapped optimizer's
  checks and schedule run first, on every rank, and a failure there raises on every rank
  before anything is written. A failure of the host update past that raises on every rank
  too (one more small exchange, after it), as :class:`~vfsdp.optim.base.PartialUpdateError`, and
  no rank copies back. A failure between two of the wrapped optimizer's own collectives (a
  global-norm clip's all-reduce, Muon's exchange) leaves the other ranks waiting in that
  collective, as it does without offload (until the process group's timeout); the exchanges
  never pair with it. Their group spans every rank: every rank calls ``update``, as every
  rank runs the wrapped optimizer's collectives.
* A checkpoint of the state holds what the wrapped optimizer's state holds, under the same
  names: a checkpoint saved offloaded loads without offload, and back, at any world size. The
  masters are not saved (the parameters are): after a load they are read back from them.

With parameters in the masters' dtype (fp32 shards) the result is bitwise that of the same
optimizer on the host without offload, and on the device where torch's kernels round alike
(see the optimizer docs). With narrower parameters (bf16 shards) the masters keep float32
values between steps, which the device shards alone cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import optree
import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.comm import host_groups
from vfsdp.collectives.mirror import HostMirror, fingerprint
from vfsdp.collectives.unit import Unit
from vfsdp.optim.base import (
    Mask,
    Optimizer,
    agree_all,
    atomic,
    checking,
    flat_grads,
    grad_leaves,
    init_masked,
    member,
    runs,
    state_dtype,
    state_tensors,
    unit_buffers,
)
from vfsdp.planner.spec import ShardSpec


@dataclass(frozen=True)
class HostUnit:
    """One unit's host side: the device unit, its host copy (``host.params`` holds the
    master, ``host.grads()`` the gradient copy) and the flat ranges of this rank's shard the
    wrapped optimizer updates (``runs``: copied back after each update); ``views``: the
    masters' tensor views, by buffer index; ``mirror``: the unit's
    :class:`~vfsdp.collectives.HostMirror`, which each reduction of the backward copies the
    gradient shard into (``None`` where the wrapped optimizer updates none of the unit)."""

    device: Unit
    host: Unit
    runs: tuple
    views: dict = field(default_factory=dict, repr=False)  # buffer index -> master view
    mirror: Optional[HostMirror] = field(default=None, repr=False)  # what backward copies into


@dataclass
class OffloadState:
    """The wrapped optimizer's state (``inner``, over host memory) and the host copies.

    Attributes:
        inner: The wrapped optimizer's state.
        units: One :class:`HostUnit` per unit, in the spec's unit order.
        shards: The masters, as a tree like the parameters (what ``inner`` updates).
        grads: The host gradient copies, as a tree like the parameters.
        resyncs: How many times a unit's master was read back from its device shard because
            something else wrote the shard.
        grad_copies: How many gradient shards ``update`` copied itself, because the copy the
            backward made was stale or missing (something wrote the gradients after the
            reduction, or they were not the unit's gradient buffer).

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     state = vfsdp.optim.offload(vfsdp.optim.adamw()).init(shards, spec)
        ...     return type(state.inner).__name__, state.host_bytes(), state.resyncs
        >>> vfsdp.testing.simulate(2, body)[0]   # master, gradient, two moments: 4 x 16 B, + 4
        ('AdamWState', 68, 0)
    """

    inner: Any
    units: tuple = field(repr=False)
    shards: Any = field(repr=False)
    grads: Any = field(repr=False)
    resyncs: int = 0
    grad_copies: int = 0
    seen: dict = field(default_factory=dict, repr=False)  # key -> fingerprint of what we wrote
    stream: Any = field(default=None, repr=False)  # the copies' CUDA stream (None on the CPU)
    pending: Any = field(default=None, repr=False)  # the event of the last copy to the device

    def host_bytes(self) -> int:
        """Bytes of host memory the masters, gradient copies and the wrapped optimizer's
        state (every tensor of it: moments, scales, its step count) hold on this rank."""
        tensors = [db.shard for hu in self.units for db in hu.host.buffers()]
        storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
                    for x in tensors + state_tensors(self.inner)}
        return sum(storages.values())

    def wait(self) -> None:
        """Wait until the last copy to the device has read the masters (before the host
        writes them again)."""
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None

    def checkpoint_tree(self, spec: ShardSpec) -> Any:
        """What the wrapped optimizer's state saves, under the same names."""
        return self.inner

    def restore_checkpoint(self, tree: Any) -> OffloadState:
        self.inner = tree
        self.seen.clear()  # the parameters were loaded too: read the masters back from them
        return self


def offload(opt: Optimizer, master_dtype: Optional[torch.dtype] = None) -> Optimizer:
    """``opt`` with its state and the master parameters in host memory (see the module
    docstring): the device holds no optimizer state and no master copy.

    Args:
        opt: Any optimizer: ``adamw``, ``adamw8bit``, ``muon``, a ``chain`` or
            ``partition``, and it may be a member of one. It must be the member that
            updates parameters: a gradient transform inside it changes the host copies of
            the gradients, not the device's.
        master_dtype: The masters' dtype (default: float32, or the parameters' own dtype
            where it is wider).

    Returns:
        An :class:`vfsdp.optim.Optimizer` whose state is an :class:`OffloadState`.

    Raises:
        TypeError: ``opt`` is not an Optimizer, or ``master_dtype`` is not floating point.
        ValueError: from ``init``, parameters on ``meta``, or a GPU spec with a model axis
            (see :func:`vfsdp.collectives.host_groups`); from ``update``, under
            ``torch.compile``, or for other shards than ``init`` was given.
        RuntimeError: from ``update``, on every rank but the one where the wrapped
            optimizer's checks or schedule failed (which raises its own error), naming that
            rank; :class:`~vfsdp.optim.base.PartialUpdateError` on every rank where the host
            update failed past them.

    Example:
        >>> def body():
        ...     params = {"w": torch.ones(8)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     opt = vfsdp.optim.offload(vfsdp.optim.adamw(lr=0.1, weight_decay=0.0))
        ...     state = opt.init(shards, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(1.0)
        ...     state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        ...     return [round(x, 4) for x in shards["w"].tolist()], state.inner.step
        >>> vfsdp.testing.simulate(2, body)
        [([0.9, 0.9, 0.9, 0.9], 1), ([0.9, 0.9, 0.9, 0.9], 1)]
    """
    if not isinstance(opt, Optimizer):
        raise TypeError(f"offload(opt) takes a vfsdp.optim.Optimizer, got {type(opt).__name__}")
    if master_dtype is not None and not (isinstance(master_dtype, torch.dtype)
                                         and master_dtype.is_floating_point):
        raise TypeError(f"offload: master_dtype must be a floating-point torch.dtype, got "
                        f"{master_dtype!r}")

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> OffloadState:
        units = unit_buffers(shards, spec, "offload.init")
        host_leaves, grad_leaves_ = ([None] * spec.treespec.num_leaves for _ in "hg")
        made = []
        on_gpu = bool(units) and units[0].db.device.type == "cuda"
        stream = torch.cuda.Stream(units[0].db.device) if on_gpu else None
        with torch.no_grad():
            for u in units:
                host = Unit(u.unit.layout, host_groups(u.unit.groups),
                            master_dtype or state_dtype(u.db.dtype))
                gdb = host.grads()
                for db in (host.params, gdb) if on_gpu else ():
                    db.pin_shard()
                chosen = runs(u.db, mask)
                # The newest state's mirror: an older state copies for itself.
                mirror = HostMirror(gdb.shard, stream) if chosen else None
                if mirror is not None:
                    u.unit.mirror_grads(mirror)
                for lo, hi in chosen:
                    host.params.shard[lo:hi].copy_(u.db.shard[lo:hi])
                views = {k: host.params.local(k) for _, k in u.leaves}  # update syncs their
                for i, k in u.leaves:                                  # requires_grad
                    host_leaves[i], grad_leaves_[i] = views[k], host.grad_view(k)
                made.append(HostUnit(u.unit, host, chosen, views, mirror))
        host_shards = optree.tree_unflatten(spec.treespec, host_leaves)
        inner = init_masked(opt, host_shards, spec, mask, "offload")
        return OffloadState(inner, tuple(made), host_shards,
                            optree.tree_unflatten(spec.treespec, grad_leaves_), stream=stream,
                            seen={u.key: fingerprint(hu.device.params.shard)
                                  for u, hu in zip(units, made)})

    def update(grads: Any, state: OffloadState, shards: Any, spec: ShardSpec) -> OffloadState:
        what = "offload.update"
        if tp.compiling():
            raise ValueError("offload.update under torch.compile is not supported (the host "
                             "update runs eagerly); call it after the compiled step")
        leaves = grad_leaves(grads, spec, what)
        units = unit_buffers(shards, spec, what)
        if len(units) != len(state.units) or any(
                u.unit is not hu.device for u, hu in zip(units, state.units)):
            raise ValueError("offload.update: these shards are not the ones offload.init was "
                             "given (the state holds host copies of those); init a state for "
                             "them")
        for u, hu in zip(units, state.units):
            for (_, k), x in zip(u.leaves, u.values):  # frozen: no update, as without
                hu.views[k].requires_grad_(x.requires_grad)  # offload
        if checking():  # the checking pass: the gradients' sizes, the wrapped update's checks
            for u in (u for u, hu in zip(units, state.units) if hu.runs):
                flat_grads(leaves, u, what)
            return member(opt, state.grads, state.inner, state.shards, spec)
        state.wait()
        blocking = state.stream is None
        rows, checks = [], []
        if not blocking:  # the mirrors' fingerprints were taken on the copy stream
            torch.cuda.current_stream(state.stream.device).wait_stream(state.stream)
        with torch.no_grad():  # on the compute stream: waits for reductions still in flight
            for u, hu in ((u, hu) for u, hu in zip(units, state.units) if hu.runs):
                g = flat_grads(leaves, u, what)
                mirrored = (hu.mirror.holds and u.unit.grad_mirror is hu.mirror
                            and g.numel() == hu.mirror.host.numel())
                now, saved = fingerprint(hu.device.params.shard), state.seen.get(u.key)
                checks += [now, now if saved is None else saved] + (
                    [fingerprint(g), hu.mirror.seen] if mirrored else [])
                rows.append((hu, g, mirrored, saved is None))
            read = iter(torch.stack(checks).tolist() if checks else ())  # one copy to the host
        if not blocking:  # the copies read what the compute stream wrote
            state.stream.wait_stream(torch.cuda.current_stream(state.stream.device))
        with torch.no_grad(), torch.cuda.stream(state.stream):  # None: no-op on the CPU
            for hu, g, mirrored, unseen in rows:
                now, saved = next(read), next(read)
                fresh = mirrored and next(read) == next(read)  # the fingerprints: lists of two
                if fresh:
                    hu.mirror.wait()  # its copy has landed before the host reads it
                if unseen or now != saved:
                    _read_back(hu, blocking)
                    state.resyncs += 1
                if not fresh:
                    hu.host.grads().shard.copy_(g, non_blocking=not blocking)
                    state.grad_copies += 1
        if state.stream is not None:
            state.stream.synchronize()
        error = None
        try:
            state.inner = opt.update(state.grads, state.inner, state.shards, spec)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
        # the host update may have changed them (a clip, in place)
        for mirror in (hu.mirror for hu in state.units if hu.mirror is not None):
            mirror.forget()
        try:  # a failure past the checks (atomic): every rank raises, none copies back
            agree_all(error)
        except BaseException:
            state.seen.clear()  # a failed update may have left the masters half written:
            raise               # the next one reads them all back from the device
        with torch.no_grad(), torch.cuda.stream(state.stream):  # None: no-op on the CPU
            for u, hu in zip(units, state.units):
                dev, master = hu.device.params.shard, hu.host.params.shard
                for lo, hi in hu.runs:
                    dev[lo:hi].copy_(master[lo:hi], non_blocking=not blocking)
                state.seen[u.key] = fingerprint(dev)  # what we wrote (ordered after it)
        if state.stream is not None:
            state.pending = state.stream.record_event()
            torch.cuda.current_stream(state.stream.device).wait_event(state.pending)
        return state

    return Optimizer(init, atomic(update, compose=True), opt.granularity)


def _read_back(hu: HostUnit, blocking: bool) -> None:
    """Read the device shard's runs into the master: where the master's value, cast to the
    parameters' dtype, is what the device holds, the master keeps its extra precision."""
    for lo, hi in hu.runs:
        now, part = hu.device.params.shard[lo:hi], hu.host.params.shard[lo:hi]
        if now.dtype == part.dtype:
            part.copy_(now, non_blocking=not blocking)
        else:
            now = now.to("cpu")
            part.copy_(torch.where(part.to(now.dtype) == now, part, now.to(part.dtype)))
