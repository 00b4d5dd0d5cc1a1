"""The optimizer protocol (optax-style, in place on DBuffers) and the flat views it works on.

An optimizer is an :class:`Optimizer`:

* ``state = opt.init(shards, spec, mask=None)``: builds the state for the tensors
  ``mask(path)`` selects (all when ``mask`` is ``None``). What ``init`` derives from the spec
  and the mask (ranges, tiles, roots) is a separate frozen *plan* object the state refers
  to; it is never saved and ``init`` rebuilds it under any other plan. The state holds its
  step counter, a tensor on the parameters' device (``state.count``,
  :func:`~vfsdp.optim.base.new_count`; ``state.step`` reads it back, for logs).
* ``state = opt.update(grads, state, shards, spec)``, the one update form: in place, as a few
  fused ops over each unit's flat buffer, it updates the selected parameter shards (an
  optimizer), or the selected gradients (a gradient transform, e.g.
  :func:`~vfsdp.optim.clip_by_global_norm`: the next member of a :func:`~vfsdp.optim.chain`
  reads the same gradient tree); other tensors are left alone, and so are frozen ones (a
  shard with ``requires_grad=False``: no update, no weight decay, :func:`frozen_of`).
* ``opt.granularity``: which blocks it needs whole on one rank (``None``: any), for
  ``vfsdp.plan(..., granularity=opt.granularity)``.
* ``opt.local_state``: ``True`` declares that ``init(shards, spec)`` gives each rank state made
  from that rank's pieces alone (per unit, buffers of the shard's ``S`` elements; per tensor,
  what its piece there needs), so a count of one rank's state (``vfsdp.estimate``) may read
  only the tensors with a piece on it. AdamW and 8-bit AdamW declare it; Muon does not (a
  unit's momentum is on every rank if it has a matrix anywhere), nor do combinators
  (``False``: the count reads all).

An update is a transaction (:func:`atomic`): if it fails on any rank before it writes, every
rank raises and every rank's parameters and state, step count included, are as they were.

``mask`` is how :func:`~vfsdp.optim.partition` hands each optimizer its subset, and
:func:`~vfsdp.optim.chain` passes it on to every member, so they nest in any order. A state
that implements :class:`vfsdp.functional.Checkpointable` is saved by ``vfsdp.checkpoint``.

Helpers for writing one: :func:`unit_buffers` (each unit's parameter DBuffer),
:func:`grad_leaves` and :func:`flat_grads` (each unit's gradient as one flat tensor).

The AdamW arithmetic over lists of flat slices: a constant number of ops per step.

Optimizers hand this module one list per operand (parameter, gradient and moment slices of
every unit they update) and it runs the update as multi-tensor ops, so the number of ops
(kernel launches on a GPU) does not grow with the number of parameters, tensors or units.

Two kernels, chosen by :func:`use_fused`:

* **foreach** (default off CUDA): ``torch._foreach_*`` ops, the same element-wise ops in the
  same order as ``torch.optim.AdamW``'s single-tensor and foreach paths, so the result is, on
  the CPU, **bitwise equal** to ``torch.optim.AdamW()`` (on a GPU and in a compiled graph the
  step size divides the denominator first, as ``capturable=True`` does: :func:`adam_`). Its
  one temporary (the denominator) is bounded: the slices are taken in batches of at most
  :data:`TEMP_ELEMS` elements, so a step runs 3 ops on the moments, 4 per batch and 1 for the
  weight decay (8 for up to 32M elements per rank), and one that adds to the step counter, a
  tensor in the state (:func:`new_count`). On the CPU the bias corrections and the step size
  are Python floats read from it (host memory, as ``torch.optim.AdamW``'s foreach path reads
  its step); on a device they take 6 tiny ops more, so that no step reads the counter back
  to the host.
* **fused** (default on CUDA, where the parameters, gradients and moments share a dtype):
  torch's fused AdamW kernel (``torch._fused_adamw_``), one pass over the memory and no
  temporary; **bitwise equal to** ``torch.optim.AdamW(fused=True)``, whose rounding differs
  from the foreach path's in the last bits (it computes the bias corrections in the kernel's
  float arithmetic).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Optional, Union

import optree
import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp._warnings import warn_user
from vfsdp.collectives.agree import agree
from vfsdp.collectives.comm import collective_scope, side_group
from vfsdp.collectives.dbuffer import DBuffer, View, slot_of
from vfsdp.functional.gather import gradient_leaves
from vfsdp.functional.state import param_tree
from vfsdp.functional.tree import UnitLeaves, match_tree, units_of
from vfsdp.optim.schedules import constant
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec

TEMP_ELEMS = 1 << 25
"""Largest temporary of the foreach path, in elements (128 MiB in fp32)."""


def use_fused(fused: Optional[bool], device: torch.device, dtypes: set, what: str = "") -> bool:
    """Whether the fused kernel runs: ``fused`` if given, else on CUDA; it needs one dtype
    for parameters, gradients and moments (``dtypes``).

    Raises:
        ValueError: ``fused=True`` where the kernel cannot run (naming why).
    """
    if fused and len(dtypes) != 1:
        raise ValueError(f"adamw(fused=True){f': {what}' if what else ''}: parameters, gradients and moments "
                         f"must share one dtype, got {sorted(map(str, dtypes))}; use fused=False (the "
                         f"foreach path), or fp32 master parameters (param_dtype= for the compute dtype)")
    return len(dtypes) == 1 and device.type == "cuda" if fused is None else bool(fused)


def batches(lists: tuple, limit: int = TEMP_ELEMS) -> list[tuple]:
    """Cut parallel lists of flat slices into batches of at most ``limit`` elements each,
    splitting slices larger than that (element-wise ops give the same bits either way).

    Example:
        >>> a = torch.arange(10.0)
        >>> [[t.tolist() for t in b[0]] for b in batches(([a[:3], a[3:]],), limit=4)]
        [[[0.0, 1.0, 2.0], [3.0]], [[4.0, 5.0, 6.0, 7.0]], [[8.0, 9.0]]]
    """
    out, cur, size = [], [[] for _ in lists], 0
    for parts in zip(*lists):
        n, lo = parts[0].numel(), 0
        while lo < n:
            take = min(n - lo, limit - size)
            for acc, t in zip(cur, parts):
                acc.append(t if (lo, take) == (0, n) else t[lo:lo + take])
            size, lo = size + take, lo + take
            if size == limit:
                out.append(tuple(cur))
                cur, size = [[] for _ in lists], 0
    if size:
        out.append(tuple(cur))
    return out


def scale_(tensors: list, factor: float) -> None:
    """``t.mul_(factor)`` for every tensor, one multi-tensor op per dtype, rounded as the
    single-tensor op rounds: torch's CPU multi-tensor kernel would first round a Python scalar
    to a bf16/fp16 list's dtype (0.998 -> 0.996 in bf16), so those lists get it as an fp32
    tensor, whose product is taken in fp32.

    Example:
        >>> t = torch.full((2,), 1.5, dtype=torch.bfloat16)
        >>> scale_([t], 0.998); t.tolist()
        [1.5, 1.5]
    """
    for dtype, ts in by_dtype(tensors).items():  # a tensor factor: the moments' dtype
        wide = dtype in (torch.float32, torch.float64) or isinstance(factor, torch.Tensor)
        tp.foreach("mul_", ts, scalar=factor if wide else torch.tensor(
            factor, dtype=torch.float32, device=ts[0].device))


def by_dtype(tensors: list) -> dict:
    """``{dtype: its tensors}``, in order: one multi-tensor op per dtype."""
    out: dict = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


def new_count(device: Any) -> torch.Tensor:
    """An optimizer state's step counter: a one-element float32 tensor on the parameters'
    ``device`` (``torch.optim``'s ``state_steps``: the fused kernel reads it as it is), 0
    before the first update. An update adds one to it (an op on the device, no host sync) and
    takes every per-step scalar from it (:func:`learning_rate`, :func:`step_scalars`); a
    compiled update counts in it as the eager one does: one counter on every path. (One
    element, not 0-d: dynamo would take a 0-d CPU tensor for a constant.)

    Example:
        >>> new_count("cpu")
        tensor([0.])
    """
    return torch.zeros(1, dtype=torch.float32, device=device)


def learning_rate(schedule: Callable, count: torch.Tensor) -> Any:
    """The learning rate at the step ``count`` holds: a constant schedule's float (no op), or
    ``schedule(step)``, which then takes the step as a 0-d float64 tensor (see
    :mod:`vfsdp.optim.schedules`).

    Example:
        >>> learning_rate(lambda step: 0.1 / step, torch.full((1,), 2.0))
        tensor(0.0500, dtype=torch.float64)
    """
    value = getattr(schedule, "constant", None)
    return value if value is not None else schedule(count.double().reshape(()))


@functools.cache
def _betas(betas: tuple, device: str) -> torch.Tensor:
    """The betas as a float64 tensor on ``device``, made once."""
    return torch.tensor(betas, dtype=torch.float64, device=device)


def step_scalars(count: torch.Tensor, betas: tuple) -> tuple:
    """``(1 - beta1 ** step, sqrt(1 - beta2 ** step))``, the bias corrections of the step
    ``count`` holds: Python floats where the counter is in host memory
    (:func:`host_counter`, as ``torch.optim.AdamW``'s foreach path reads its step), else 0-d
    float64 tensors on its device, the double-precision scalars ``torch.optim.AdamW`` takes,
    in four ops on two elements (no host sync).

    Example:
        >>> bc1, bc2_sqrt = step_scalars(torch.ones(1), (0.9, 0.99))
        >>> round(bc1, 4), round(bc2_sqrt, 4)
        (0.1, 0.1)
    """
    b1, b2 = betas
    if host_counter(count):
        step = float(count)
        return 1 - b1 ** step, (1 - b2 ** step) ** 0.5
    if tp.compiling():  # no module-level cache in a graph (a new entry would recompile)
        step = count.double().reshape(())  # in double precision, as the cached betas give
        return 1 - b1 ** step, (1 - b2 ** step).sqrt()
    bc1, bc2 = (1 - _betas(tuple(betas), str(count.device)) ** count).unbind()
    return bc1, bc2.sqrt()


def decay_(tensors: list, lr, weight_decay: float) -> None:
    """Decoupled weight decay in place, ``p.mul_(1 - lr * weight_decay)`` for every tensor: the
    one implementation every optimizer runs (:func:`scale_`: one op per dtype)."""
    if weight_decay and tensors:
        scale_(tensors, 1 - lr * weight_decay)


def descend_(params: list, updates: list, rate, scratch: bool = False) -> None:
    """``p -= rate * u`` over the lists: a float ``rate`` as ``add_``'s ``alpha``, a schedule's
    tensor (no tensor ``alpha`` in ``add_``) cast to the updates' dtype and multiplied in,
    into ``updates`` themselves where they are ``scratch``. The one implementation of the
    step every owned optimizer, Muon and ``scale_by_learning_rate`` take."""
    if not params:
        return
    if not isinstance(rate, torch.Tensor):
        tp.foreach("add_", params, updates, alpha=-rate)
        return
    factor = -rate.to(updates[0].dtype)
    if scratch:
        tp.foreach("mul_", updates, scalar=factor)
    tp.foreach("add_", params, updates if scratch else tp.foreach("mul", updates, scalar=factor))


def adam_(ps: list, gs: list, ms: list, vs: list, b1: float, b2: float, eps: float,
          lr: Any, bc1: Any, bc2_sqrt: Any, limit: Optional[int] = None) -> None:
    """The Adam moments and the parameter step, in place over parallel lists of flat tensors:
    ``m.lerp_(g, 1 - b1)``, ``v = b2 * v + (1 - b2) * g * g``, ``p += size * m / (sqrt(v) /
    bc2_sqrt + eps)`` with ``size = -lr / bc1``. The one implementation of Adam's arithmetic:
    AdamW's foreach path runs it over every unit's slices, 8-bit AdamW over its dequantized
    span (lists of one tensor), and a compiled update traces it.

    With bias corrections in host memory (floats, or CPU tensors outside ``torch.compile``)
    the step size is a Python float, so the ops and their rounding are ``torch.optim.AdamW``'s;
    elsewhere (a GPU, a compiled graph, where a float would be read back to the host)
    the denominator is divided by the step size first, as torch's ``capturable`` path does, a
    rounding apart in the last bit.

    Args:
        ps, gs, ms, vs: Parameters, gradients and moments (matching flat tensors).
        b1, b2, eps: The hyperparameters.
        lr: The learning rate (a float or a tensor).
        bc1, bc2_sqrt: The bias correction and the square root of the second
            (:func:`step_scalars`: floats, or tensors).
        limit: Largest temporary, in elements (default :data:`TEMP_ELEMS`): the slices are
            taken in batches of at most that (the same bits either way).

    Example:
        >>> p, g, m, v = torch.ones(2), torch.full((2,), 0.5), torch.zeros(2), torch.zeros(2)
        >>> adam_([p], [g], [m], [v], 0.9, 0.999, 1e-8, 0.1, 1 - 0.9, (1 - 0.999) ** 0.5)
        >>> [round(x, 4) for x in p.tolist()]           # the first step moves p by -lr
        [0.9, 0.9]
    """
    if not ps:
        return
    tp.foreach("lerp_", ms, gs, scalar=1 - b1)
    tp.foreach("mul_", vs, scalar=b2)
    tp.foreach("addcmul_", vs, gs, gs, scalar=1 - b2)
    if not isinstance(bc1, torch.Tensor) or host_counter(bc1):  # host scalars: a float step
        size = -float(lr) / float(bc1)
    else:  # the scalars in the moments' dtype, as torch's capturable path takes them
        size, bc2_sqrt = torch.div(-lr, bc1).to(ms[0].dtype), bc2_sqrt.to(ms[0].dtype)
    for bp, bm, bv in batches((ps, ms, vs), limit or TEMP_ELEMS):
        denom = tp.foreach("sqrt", bv)
        tp.foreach("div_", denom, scalar=bc2_sqrt)
        tp.foreach("add_", denom, scalar=eps)
        if isinstance(size, torch.Tensor):  # dynamo takes no tensor `value` in addcdiv_
            tp.foreach("div_", denom, scalar=size)
            tp.foreach("addcdiv_", bp, bm, denom)
        else:
            tp.foreach("addcdiv_", bp, bm, denom, scalar=size)


def host_counter(count: torch.Tensor) -> bool:
    """Whether an update may read the step counter as a Python number: it is in host memory
    (a CPU counter, outside ``torch.compile``), so reading it waits for no device."""
    return count.device.type == "cpu" and not tp.compiling()


def adamw_step(ps: list, gs: list, ms: list, vs: list, decay: list, *, count: torch.Tensor,
               lr: Any, betas: tuple, eps: float, weight_decay: float, fused: bool,
               scalars: Optional[tuple] = None) -> None:
    """One AdamW step in place over parallel lists of flat slices.

    Args:
        ps, gs, ms, vs: Parameters, gradients, first and second moments (matching slices).
        decay: For the foreach path, the parameter slices that take weight decay (a subset
            of ``ps``); for the fused path, one bool per slice of ``ps``.
        count: The state's step counter (:func:`new_count`), already counting this step.
        lr: The learning rate of this step (:func:`learning_rate`: a float or a tensor).
        betas, eps, weight_decay: The hyperparameters.
        fused: Run torch's fused kernel (see :func:`use_fused`).
        scalars: This step's :func:`step_scalars`, where the caller has them already.

    Example:
        >>> p, g, m, v = torch.ones(2), torch.full((2,), 0.5), torch.zeros(2), torch.zeros(2)
        >>> adamw_step([p], [g], [m], [v], [], count=new_count("cpu").add_(1), lr=0.1,
        ...            betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=False)
        >>> [round(x, 4) for x in p.tolist()]
        [0.9, 0.9]
    """
    if not ps:
        return
    b1, b2 = betas
    if fused:
        for wd, sel in ((weight_decay, True), (0.0, False)):
            if idx := [i for i, d in enumerate(decay) if bool(d) is sel]:
                tp.fused_adamw(*([xs[i] for i in idx] for xs in (ps, gs, ms, vs)), [count] * len(idx),
                               lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps)
        return
    bc1, bc2_sqrt = scalars or step_scalars(count, betas)
    if not isinstance(bc1, torch.Tensor):  # host memory: a schedule's rate as a float too
        lr = float(lr)
    decay_(decay, lr, weight_decay)
    adam_(ps, gs, ms, vs, b1, b2, eps, lr, bc1, bc2_sqrt)


Schedule = Union[float, Callable[[int], float]]
Mask = Optional[Callable[[tuple], bool]]


class Optimizer(NamedTuple):
    """``init(shards, spec, mask=None) -> state``, ``update(grads, state, shards, spec) ->
    state`` and the ``granularity`` it needs (see the module docstring).

    Example:
        >>> def init(shards, spec, mask=None):
        ...     return 0                                   # the state: a step count
        >>> def update(grads, state, shards, spec):
        ...     return state + 1                           # a real one also steps shards
        >>> counter = Optimizer(init, update)
        >>> counter.update(None, counter.init(None, None), None, None), counter.granularity
        (1, None)
    """

    init: Callable[..., Any]
    update: Callable[..., Any]
    granularity: Any = None
    local_state: bool = False


class PartialUpdateError(RuntimeError):
    """An update failed after it began writing (its arithmetic, a collective of its own, or
    a user's code it runs after the ranks agreed): this rank's parameters and optimizer
    state are partly updated. Load both from a checkpoint.

    Example:
        >>> def update(grads, state, shards, spec):
        ...     begin(state["count"])                   # the ranks agreed: writes follow
        ...     raise ArithmeticError("overflow")
        >>> try:
        ...     atomic(update)(None, {"count": torch.zeros(1)}, None, None)
        ... except PartialUpdateError as exc:
        ...     str(exc).split(":")[0]
        'update failed after the ranks agreed to write (ArithmeticError'
    """


class _Dry(Exception):
    """Ends an optimizer's update in a composition's checking pass, before it writes."""


class _Txn:
    """The open update of this thread (a rank): ``dry`` in a composition's checking pass;
    ``agreed`` once the ranks agreed that every one's checks passed; ``settled`` once they
    agreed that one failed (and every rank restored what it wrote); ``writers``: the updates
    past ``begin(count)`` in the writing pass."""

    def __init__(self, dry: bool, agreed: bool = False) -> None:
        self.dry, self.agreed, self.settled, self.writers = dry, agreed, False, 0


_OPEN = threading.local()  # .txn: the open _Txn (simulate runs a rank per thread)


def _open() -> Optional[_Txn]:
    return None if tp.compiling() else getattr(_OPEN, "txn", None)


def agree_all(error: Optional[BaseException]) -> None:
    """Collective over every rank: raise ``error`` here, or a ``RuntimeError`` naming the
    rank that failed, if any rank had one. One 1-element all-reduce over a gloo group no
    other exchange uses (:func:`~vfsdp.collectives.comm.side_group`: it never pairs with a
    collective another rank is still in, and reads no device) when all went well; the
    messages are exchanged only on a failure.

    Raises:
        BaseException: ``error``, on its rank; ``RuntimeError`` on the others.

    Example:
        >>> def body():
        ...     try:
        ...         agree_all(ValueError("lr") if dist.get_rank() == 1 else None)
        ...     except Exception as exc:
        ...         return type(exc).__name__
        >>> vfsdp.testing.simulate(2, body)
        ['RuntimeError', 'ValueError']
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        agree(error)  # raises it, if any
        return
    group = side_group()
    with collective_scope():  # op counters count the exchange, not its host-side ops
        flag = torch.tensor([0.0 if error is None else 1.0])  # cpu: the side group is gloo
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = flag.item() != 0  # a host tensor: no device sync
    if failed:
        agree(error, group)


def atomic(update: Callable, compose: bool = False) -> Callable:
    """An optimizer's ``update`` as a transaction: if it fails on any rank before it writes,
    every rank raises and every rank's parameters and state, step count included, are as they
    were (see docs/optimizers.md, "When an update fails").

    The update calls :func:`begin` once its checks (the gradient tree) are done, before its
    first write: ``begin`` counts the step, evaluates the schedule, and the ranks agree
    (:func:`agree_all`) that all got there. A composition (``compose=True``: ``chain``,
    ``partition``, ``offload``) first runs its members up to their ``begin`` (a pass that
    writes nothing, so every member's schedule is evaluated before any member writes), the
    ranks agree once, then it runs for real. Nested, the outermost update agrees for all;
    under ``torch.compile`` the update runs as it is. A failure after the agreement raises
    :class:`PartialUpdateError` (naming the cause) on the ranks where it happened.

    Args:
        update: ``update(grads, state, shards, spec) -> state``.
        compose: It runs other optimizers' updates (through :func:`member`).

    Returns:
        The update, wrapped.

    Raises:
        RuntimeError: from the update, on the ranks where it did not fail, naming the rank
            that did; :class:`PartialUpdateError` as above.

    Example:
        >>> def lr(step):
        ...     raise ValueError("no schedule")
        >>> def update(grads, state, shards, spec):
        ...     state["w"].add_(grads["w"] * begin(state["count"], lr))
        ...     return state
        >>> state = {"w": torch.zeros(1), "count": torch.zeros(1)}
        >>> try:
        ...     atomic(update)({"w": torch.ones(1)}, state, None, None)
        ... except ValueError:
        ...     state                                  # as it was
        {'w': tensor([0.]), 'count': tensor([0.])}
    """

    @functools.wraps(update)
    def run(grads: Any, state: Any, shards: Any, spec: Any) -> Any:
        txn = _open()
        if tp.compiling() or (txn is not None and not txn.dry):  # compiled, or a member
            return update(grads, state, shards, spec)
        if txn is not None:  # a member in the checking pass: up to its begin()
            with contextlib.suppress(_Dry):
                update(grads, state, shards, spec)
            return state
        if compose:  # the checking pass: every member up to its begin()
            _OPEN.txn, error = _Txn(dry=True), None
            try:
                update(grads, state, shards, spec)
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                error = exc
            finally:
                _OPEN.txn = None
            agree_all(error)
        _OPEN.txn = txn = _Txn(dry=False, agreed=compose)
        try:
            out = update(grads, state, shards, spec)
        except Exception as exc:
            if txn.agreed and not txn.settled and not isinstance(exc, PartialUpdateError):
                raise PartialUpdateError(f"{getattr(update, '__qualname__', 'update')} failed after "
                                         f"the ranks agreed to write ({type(exc).__name__}: {exc}): the "
                                         f"parameters and the optimizer state on this rank are "
                                         f"partly updated; load both from a checkpoint") from exc
            if not (txn.agreed or txn.settled):
                agree_all(exc)
            raise
        finally:
            _OPEN.txn = None
        if not txn.agreed:  # it wrote nothing (returned before begin): pair with the others
            agree_all(None)
        return out

    run.atomic = True
    return run


def begin(count: Optional[torch.Tensor] = None, schedule: Optional[Callable] = None) -> Any:
    """The last step of an update before it writes (see :func:`atomic`): adds one to the step
    counter ``count`` and returns the learning rate ``schedule`` gives for it
    (:func:`learning_rate`), then, in an update of its own, the ranks agree. If the schedule
    raises, or another rank failed, the counter is as it was. In a composition's checking
    pass it evaluates the schedule at the next step and ends the member's update there.

    Args:
        count: The state's step counter, or ``None`` (a gradient transform).
        schedule: The learning-rate schedule, or ``None``.

    Returns:
        The learning rate (``None`` without a schedule).

    Raises:
        Exception: what the schedule raised; ``RuntimeError`` where another rank failed.

    Example:
        >>> count = new_count("cpu")
        >>> begin(count, lambda step: 0.1 * step), count
        (tensor(0.1000, dtype=torch.float64), tensor([1.]))
    """
    txn = _open()
    if txn is not None and txn.dry:
        if schedule is not None and getattr(schedule, "constant", None) is None:
            learning_rate(schedule, count + 1)
        raise _Dry
    if count is not None:
        count.add_(1)
        if txn is not None:
            txn.writers += 1
    try:
        rate = None if schedule is None else learning_rate(schedule, count)
        if txn is not None and not txn.agreed:
            txn.settled = True
            agree_all(None)
            txn.agreed, txn.settled = True, False
    except BaseException:
        if count is not None:
            count.sub_(1)  # an integer in float32: exact
        raise
    return rate


def settle(error: Optional[BaseException], undo: Callable[[], Any]) -> None:
    """Past :func:`begin`, where an update runs a user's code that writes (a
    :func:`~vfsdp.optim.transform`'s ``apply``): the ranks agree whether it failed on any
    (:func:`agree_all`); if so every rank runs ``undo`` (restores what it wrote) and raises,
    as before ``begin``, where no other update of the transaction wrote yet, else
    :class:`PartialUpdateError`.

    Raises:
        Exception: ``error`` on its rank, ``RuntimeError`` on the others.

    Example:
        >>> settle(None, lambda: None)                 # no failure: nothing to undo
    """
    txn = _open()
    try:
        agree_all(error)
    except BaseException:
        undo()
        if txn is not None:
            txn.settled = txn.writers <= 1
        raise


def checking() -> bool:
    """Whether this is a composition's checking pass (see :func:`atomic`), in which an
    update writes nothing.

    Example:
        >>> checking()
        False
    """
    return getattr(_open(), "dry", False)


def member(opt: Optimizer, grads: Any, state: Any, shards: Any, spec: Any) -> Any:
    """``opt.update(grads, state, shards, spec)`` as a composition runs a member: skipped in
    the checking pass when the member is not :func:`atomic` (an ``Optimizer`` of your own:
    it runs once, in the pass that writes, and is not part of the transaction)."""
    if checking() and not getattr(opt.update, "atomic", False):
        return state
    return opt.update(grads, state, shards, spec)


@dataclass
class TransformState:
    """A deprecated :func:`gradient_transform`'s state: its transform's own (``inner``, what a
    checkpoint saves) and the mask ``init`` was given (the gradients it may write)."""

    inner: Any
    mask: Mask = None

    def checkpoint_tree(self, spec: ShardSpec) -> Any:
        return self.inner

    def restore_checkpoint(self, tree: Any) -> TransformState:
        self.inner = tree
        return self


def gradient_transform(init: Callable[..., Any], transform: Callable[..., tuple],
                       granularity: Any = None) -> Optimizer:
    """Deprecated (a ``FutureWarning``; gone in the next release): an :class:`Optimizer` from
    an optax-style ``transform(grads, state, shards, spec) -> (grads, state)``. Every
    optimizer now has one update form, ``update(grads, state, shards, spec) -> state``, and a
    gradient transform writes the gradients in place, where the next member of a
    :func:`~vfsdp.optim.chain` reads them: write ``Optimizer(init, update)`` with an
    in-place ``update``. Meanwhile this one copies the gradients ``transform`` returns into
    ``grads`` in place (the tensors ``init``'s mask selects), so the caller's gradient tree
    holds them after the update, where it kept its old values before.

    Args:
        init: ``init(shards, spec, mask=None) -> state``.
        transform: ``transform(grads, state, shards, spec) -> (grads, state)``.
        granularity: The blocks it needs whole (``None``: any).

    Returns:
        An :class:`Optimizer` whose state is a :class:`TransformState`.

    Raises:
        ValueError: from ``update``, returned gradients that do not match ``grads``' tree,
            or a gradient where ``grads`` holds ``None``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     double = gradient_transform(lambda shards, spec, mask=None: None,
        ...                                 lambda g, state, shards, spec: ({"w": 2 * g["w"]}, state))
        >>> grads = {"w": torch.ones(2)}
        >>> state = double.update(grads, double.init(None, None), None, None)
        >>> grads
        {'w': tensor([2., 2.])}
    """
    warn_user("vfsdp.optim.gradient_transform is deprecated and goes in the next release: "
              "every optimizer has one update form, update(grads, state, shards, spec) -> "
              "state, and a gradient transform changes grads in place (the next member of a "
              "chain reads them there); write Optimizer(init, update) with an in-place update. "
              "Until then, the gradients its transform returns are copied into grads in place",
              FutureWarning)

    def init_(shards: Any, spec: ShardSpec, mask: Mask = None) -> TransformState:
        return TransformState(init_masked(Optimizer(init, None), shards, spec, mask,
                                          "gradient_transform"), mask)

    def update(grads: Any, state: TransformState, shards: Any, spec: ShardSpec
               ) -> TransformState:
        new, state.inner = transform(grads, state.inner, shards, spec)
        if new is grads:
            return state
        old, treespec = optree.tree_flatten(grads, none_is_leaf=True)
        got, other = optree.tree_flatten(new, none_is_leaf=True)
        if other != treespec:
            raise ValueError(f"gradient_transform: the transform returned gradients shaped "
                             f"{other}, not like grads ({treespec}); return the same tree")
        paths = [getattr(t, "path", None) for t in spec.leaves()] if spec is not None else None
        with torch.no_grad():
            for i, (g, n) in enumerate(zip(old, got)):
                if n is g or n is None or (paths and not selected(state.mask, paths[i])):
                    continue
                if g is None:
                    raise ValueError(f"gradient_transform: the transform returned a gradient "
                                     f"at leaf {i}, where grads holds None; it writes in place")
                g.copy_(n)
        return state

    return Optimizer(init_, update, granularity)


def as_schedule(value: Schedule) -> Callable[[int], float]:
    """A learning-rate schedule: a plain callable of the (1-based) step, or a constant.

    Args:
        value: A float, or a callable ``step -> float`` (returned as it is).

    Returns:
        A callable ``step -> float``.

    Raises:
        TypeError, ValueError: ``value`` is neither callable nor convertible to float.

    Example:
        >>> as_schedule(0.5)(3), as_schedule(lambda step: step / 10)(3)
        (0.5, 0.3)
    """
    return value if callable(value) else constant(float(value))


def check_hyper(what: str, lr: Schedule, weight_decay: float, betas: Optional[tuple] = None,
                eps: Optional[float] = None, momentum: Optional[float] = None,
                **counts: int) -> None:
    """Refuse hyperparameters no optimizer can use (a schedule ``lr`` is checked when called).

    Raises:
        ValueError: a negative ``lr``, ``eps`` or ``weight_decay``, betas or momentum
            outside [0, 1), or one of ``counts`` (by name) below 1, naming the
            optimizer and the value.

    Example:
        >>> check_hyper("adamw", 1e-3, 0.0, betas=(0.9, 1.0))
        Traceback (most recent call last):
        ...
        ValueError: adamw: betas must be in [0, 1), got (0.9, 1.0)
    """
    if betas is not None and not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{what}: betas must be in [0, 1), got {betas}")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"{what}: momentum must be in [0, 1), got {momentum}")
    for name, value in (("lr", None if callable(lr) else lr), ("eps", eps),
                        ("weight_decay", weight_decay)):
        if value is not None and not value >= 0:  # also refuses NaN
            raise ValueError(f"{what}: {name} must be >= 0, got {value}")
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{what}: {name} must be >= 1, got {value}")


def both(a: Mask, b: Mask) -> Mask:
    """The mask selecting what both select (``None`` selects everything).

    Example:
        >>> m = both(lambda p: p[0] == "a", lambda p: p[-1] == "w")
        >>> m(("a", "w")), m(("a", "b")), both(None, None) is None
        (True, False, True)
    """
    if a is None or b is None:
        return b if a is None else a
    return lambda path: bool(a(path)) and bool(b(path))


def selected(mask: Mask, path: tuple) -> bool:
    """Whether ``mask`` selects ``path`` (``None`` selects everything)."""
    return mask is None or bool(mask(path))


def same_at_ties(fn: Optional[Callable[[tuple], Any]], spec: ShardSpec, what: str,
                 name: str) -> None:
    """Refuse a per-path choice (a label, a mask) that differs between a tied tensor's places.

    A tied tensor (``spec.ties``) is one tensor, planned, stored and updated once, and the
    optimizer asks about it at its first place in the tree; a different answer at a repeat
    would be ignored silently.

    Args:
        fn: ``path -> value`` (``None``: nothing to check).
        spec: The spec.
        what: The entry point, for the message.
        name: What ``fn`` is (``"labels"``, ``"mask"``, ``"weight_decay_mask"``).

    Raises:
        ValueError: naming both places and both values.

    Example:
        >>> w = torch.empty(8, 4)
        >>> spec = vfsdp.plan({"embed": w, "head": w}, 1)
        >>> same_at_ties(lambda p: p[-1] == "embed", spec, "adamw.init", "weight_decay_mask")
        Traceback (most recent call last):
        ...
        ValueError: adamw.init: weight_decay_mask gives True at embed but False at head, ...
    """
    if fn is None:
        return
    for repeat, first in spec.ties.items():
        if (a := fn(first)) != (b := fn(repeat)):
            raise ValueError(f"{what}: {name} gives {a!r} at {format_path(first)} but {b!r} at "
                             f"{format_path(repeat)}, the same (tied) tensor, which is updated "
                             f"once: give both places the same answer")


def init_masked(opt: Optimizer, shards: Any, spec: ShardSpec, mask: Mask, what: str) -> Any:
    """``opt.init(shards, spec, mask=mask)``; ``opt.init(shards, spec)`` when ``mask`` is None.

    Raises:
        TypeError: ``mask`` is given but ``opt.init`` takes no ``mask`` parameter.
    """
    if mask is None:
        return opt.init(shards, spec)
    try:
        params = inspect.signature(opt.init).parameters
    except (TypeError, ValueError):  # builtins: let the call decide
        params = {"mask": None}
    if "mask" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise TypeError(f"{what}: {getattr(opt.init, '__qualname__', opt.init)} takes no mask=, "
                        f"which {what} needs to hand it a subset of the tensors; give init a "
                        f"mask=None parameter (see vfsdp.optim.Optimizer)")
    return opt.init(shards, spec, mask=mask)


def runs(db: Any, mask: Mask) -> tuple[tuple[int, int], ...]:
    """Flat ranges of this rank's shard holding the tensors ``mask`` selects, merged.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"a": torch.ones(4), "b": torch.ones(4)}, 1)
        ...     shards = vfsdp.shard({"a": torch.ones(4), "b": torch.ones(4)}, spec)
        ...     db = slot_of(shards["a"]).buffer
        ...     return runs(db, None), runs(db, lambda p: p == ("b",))
        >>> vfsdp.testing.simulate(1, body)
        [(((0, 8),), ((4, 8),))]
    """
    out: list = []
    for t in db.tensors:
        lo, hi = t.shard_range(db.rank)
        if hi > lo and selected(mask, t.path):
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
    return tuple(out)


def frozen_of(u: UnitLeaves, owned: frozenset) -> frozenset:
    """Buffer indices of unit ``u``'s tensors among ``owned`` (paths) whose shard does not
    require grad now. The one rule every optimizer follows, as ``torch.optim`` skips a
    parameter without a gradient: a frozen tensor gets no update and no weight decay, and
    its state stays as it is until it is unfrozen.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"a": torch.ones(4), "b": torch.ones(4)}, 1)
        ...     shards = vfsdp.shard({"a": torch.ones(4), "b": torch.ones(4)}, spec)
        ...     shards["a"].requires_grad_(False)
        ...     u = unit_buffers(shards, spec, "example")[0]
        ...     return frozen_of(u, frozenset({("a",), ("b",)})), frozen_of(u, frozenset())
        >>> vfsdp.testing.simulate(1, body)
        [(frozenset({0}), frozenset())]
    """
    return frozenset(k for k in u.frozen() if u.db.tensors[k].path in owned)


def trained(shards: Any, spec: ShardSpec, plan: OwnedPlan, what: str) -> list:
    """``(unit, frozen)`` for every unit of ``shards`` (:func:`unit_buffers`) that ``plan``
    updates and where not every tensor of it is frozen: ``frozen`` its :func:`frozen_of`."""
    return [(u, frozen) for u in unit_buffers(shards, spec, what) if u.key in plan.paths
            for frozen in [frozen_of(u, plan.paths[u.key])] if len(frozen) < len(plan.paths[u.key])]


def read_step(state: Any) -> int:
    """The number of updates ``state`` has counted (``state.count``, read back to the host:
    for logs and checkpoints, not for the step's path).

    Example:
        >>> from types import SimpleNamespace
        >>> read_step(SimpleNamespace(count=torch.full((1,), 3.0)))
        3
    """
    return int(state.count.item())


def write_step(state: Any, step: int) -> None:
    """Set the number of updates ``state`` has counted (``state.step = n``: the counter is
    filled in place, on its device).

    Example:
        >>> from types import SimpleNamespace
        >>> state = SimpleNamespace(count=torch.zeros(1))
        >>> write_step(state, 4); state.count
        tensor([4.])
    """
    state.count.fill_(step)


def sync_step(state: Any) -> int:
    """Deprecated (a ``FutureWarning``; gone in the next release): the state has one step
    counter, ``state.count``, which eager and compiled updates both advance, so there is
    nothing to catch up. Returns ``state.step``.

    Example:
        >>> import warnings
        >>> from types import SimpleNamespace
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     sync_step(SimpleNamespace(step=2))
        2
    """
    warn_user("state.sync_step() is deprecated and does nothing: the state has one step "
              "counter (state.count, a tensor) for eager and compiled updates; read "
              "state.step", FutureWarning)
    return state.step


@dataclass(frozen=True)
class OwnedPlan:
    """The base of what an optimizer's ``init`` derives from the spec and the mask (never
    saved; ``init`` rebuilds it under any plan): per unit key, the paths of the tensors it
    updates."""

    paths: Mapping[Any, frozenset] = field(default_factory=dict)

    def owns(self, db: Any, k: int) -> bool:
        """Whether the plan updates tensor ``k`` of ``db``'s unit."""
        return db.tensors[k].path in self.paths.get(db.key, ())

    def local(self, db: Any, k: int) -> Any:
        """A ``param_tree`` leaf rule: tensor ``k``'s local view when the plan owns it."""
        return db.local(k) if self.owns(db, k) else None


@dataclass
class CountedState:
    """The base of an optimizer state: the step counter (``count``, :func:`new_count`;
    ``step`` reads and sets it), the plan (an :class:`OwnedPlan`), what the updates keep
    (``kept``: :meth:`cached`), and a checkpoint of the step and of the per-unit DBuffers
    named in ``saved``, shaped like the parameters (the tensors the plan updates)."""

    count: torch.Tensor
    plan: OwnedPlan = field(default_factory=OwnedPlan, repr=False, compare=False, kw_only=True)
    kept: dict = field(default_factory=dict, repr=False, compare=False, kw_only=True)
    saved: ClassVar[tuple] = ()

    step = property(read_step, write_step, doc=read_step.__doc__)
    sync_step = sync_step

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step, and the state of the tensors it updates, shaped like the parameters."""
        return {"step": self.step, **{name: param_tree(getattr(self, name), spec, self.plan.local)
                                      for name in self.saved}}

    def restore_checkpoint(self, tree: dict) -> Any:
        self.step = tree["step"]
        return self

    def cached(self, key: Any, shards: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` (views of the state and of ``shards``), kept under ``key`` while
        ``shards`` are the same tensors: another shards tree of the same spec has other
        buffers, whose views are never reused."""
        found = self.kept.get(key)
        if found is None or any(a is not b for a, b in zip(found[0], shards)):
            found = self.kept[key] = (shards, make())
        return found[1]


def init_units(shards: Any, spec: ShardSpec, what: str, **masks: Mask) -> tuple[list, torch.Tensor]:
    """``(units, count)``: :func:`unit_buffers` and a new step counter on their device, for an
    optimizer's ``init``, after refusing ``masks`` (by name) that differ between a tied
    tensor's places (:func:`same_at_ties`)."""
    for name, mask in masks.items():
        same_at_ties(mask and (lambda p, mask=mask: selected(mask, p)), spec, what, name)
    units = unit_buffers(shards, spec, what)
    return units, new_count(units[0].db.device if units else "cpu")


def cuts_of(ranges: list, total: int) -> tuple[tuple, list]:
    """``(sizes, index)``: the cuts of ``[0, total)`` at every boundary of ``ranges`` (disjoint
    ``(lo, hi)``), and the cut each range is (one ``split_with_sizes`` takes them all).

    Example:
        >>> cuts_of([(4, 6), (0, 2)], 8)
        ((2, 2, 2, 2), [2, 0])
    """
    edges = sorted({0, total, *(x for r in ranges for x in r)})
    sizes = tuple(b - a for a, b in itertools.pairwise(edges))
    return sizes, [bisect.bisect_left(edges, lo) for lo, _ in ranges]


def pieces_of(x: torch.Tensor, cuts: Optional[tuple]) -> list:
    """The pieces of flat ``x`` that :func:`cuts_of`'s ``(sizes, index)`` names, cut by one
    ``split_with_sizes``; ``[x]`` for ``cuts=None``.

    Example:
        >>> pieces_of(torch.arange(8), cuts_of([(4, 6), (0, 2)], 8))
        [tensor([4, 5]), tensor([0, 1])]
    """
    if cuts is None:
        return [x]
    parts = x.split_with_sizes(cuts[0])
    return [parts[i] for i in cuts[1]]


def unit_buffers(shards: Any, spec: ShardSpec, what: str) -> list[UnitLeaves]:
    """Every unit of ``shards``: its :class:`~vfsdp.collectives.Unit`, parameter DBuffer
    (``.db``) and leaves (``.leaves``: ``(leaf index, buffer index)`` pairs).

    Raises:
        ValueError: the tree does not match the spec, or a unit's leaves are not shards.
    """
    return units_of(match_tree(shards, spec, what), spec, what)


grad_leaves = gradient_leaves  # the gradient tree's leaves in spec order (once per update)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype optimizer state (and its arithmetic) takes for parameters of ``dtype``:
    float32, or the parameters' own dtype where it is wider (float64).

    Example:
        >>> state_dtype(torch.bfloat16), state_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(dtype, torch.float32)


def flat_grads(leaves: list, unit: UnitLeaves, what: str,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The unit's gradient as one flat ``S``-element tensor in the parameter layout.

    ``leaves`` come from :func:`grad_leaves`. Zero-copy when they are the unit's gradient
    buffer's views (``vfsdp.grads``), after any reduction still writing it; otherwise the
    pieces are copied (one contiguous copy per tensor) into a zeroed flat tensor. ``dtype``:
    cast to it (one op over the unit) where it differs.

    Raises:
        ValueError: a gradient piece of the wrong size (naming the path).
    """
    gdb = unit.unit.grads() if unit.unit.has_grads else None
    if gdb is not None and all((s := slot_of(g := leaves[i])) is not None and s.buffer is gdb
                               and s.view is View.LOCAL and s.index == k and gdb.is_local_view(k, g)
                               for i, k in unit.leaves):  # its views: zero-copy
        flat = gdb.shard
    else:
        flat = torch.zeros_like(unit.db.shard)
        for i, k in unit.leaves:
            if (g := leaves[i]) is None:
                continue
            if (slot := slot_of(g)) is not None:
                slot.buffer.wait()
            t = unit.db.tensors[k]
            lo, hi = t.shard_range(unit.db.rank)
            if g.numel() != hi - lo:
                raise ValueError(f"{what}: gradient of {format_path(t.path)} has {g.numel()} "
                                 f"elements, this rank's shard has {hi - lo}")
            flat[lo:hi].copy_(g.reshape(-1))
    return flat if dtype is None or flat.dtype == dtype else flat.to(dtype)


def state_tensors(state: Any) -> list:
    """Every tensor an optimizer state holds (its DBuffers' shards, its attributes' and
    containers' tensors), found by walking it (for byte counts: offload's host bytes, the
    estimate's optimizer memory).

    Args:
        state: Any optimizer state.

    Returns:
        The tensors, each once.

    Raises:
        RecursionError: never: the walk is iterative and visits each object once.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     state = vfsdp.optim.adamw().init(shards, spec)
        ...     storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        ...                 for t in state_tensors(state)}
        ...     return sum(storages.values())
        >>> vfsdp.testing.simulate(2, body)[0]      # two moments of 4 floats, the step count
        36
    """
    out, todo, visited = [], [state], set()
    while todo:
        x = todo.pop()
        if id(x) in visited or isinstance(x, (str, int, float, bool, type(None))):
            continue
        visited.add(id(x))
        if isinstance(x, DBuffer):
            todo.append(x.shard)
        elif isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (dict, list, tuple)):
            todo.extend(x.values() if isinstance(x, dict) else x)
        elif hasattr(x, "__dict__"):
            todo.extend(vars(x).values())
    return out
