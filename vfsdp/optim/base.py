"""The optimizer protocol (optax-style, in place on DBuffers) and the flat views it works on.

An optimizer is an :class:`Optimizer`:

* ``state = opt.init(shards, spec, mask=None)``: builds the state for the tensors
  ``mask(path)`` selects (all when ``mask`` is ``None``). What ``init`` derives from the spec
  and the mask (ranges, tiles, roots) is a separate frozen *plan* object the state refers
  to; it is never saved and ``init`` rebuilds it under any other plan. The state holds its
  step counter, a tensor on the parameters' device (``state.count``,
  :func:`~vfsdp.optim.fused.new_count`; ``state.step`` reads it back, for logs).
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

``mask`` is how :func:`~vfsdp.optim.partition` hands each optimizer its subset, and
:func:`~vfsdp.optim.chain` passes it on to every member, so they nest in any order. A state
that implements :class:`vfsdp.functional.Checkpointable` is saved by ``vfsdp.checkpoint``.

Helpers for writing one: :func:`unit_buffers` (each unit's parameter DBuffer),
:func:`grad_leaves` and :func:`flat_grads` (each unit's gradient as one flat tensor).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

import optree
import torch

from vfsdp._warnings import warn_user
from vfsdp.collectives.dbuffer import View, slot_of
from vfsdp.functional.gather import gradient_leaves
from vfsdp.functional.tree import UnitLeaves, match_tree, units_of
from vfsdp.optim.schedules import constant
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec

__all__ = ["Optimizer", "gradient_transform", "TransformState", "Schedule", "Mask", "as_schedule",
           "unit_buffers", "grad_leaves", "state_dtype", "check_hyper", "flat_grads",
           "UnitTensors", "init_masked", "both", "selected", "state_tensors", "runs",
           "frozen_of", "read_step", "write_step", "sync_step"]

Schedule = Union[float, Callable[[int], float]]
Mask = Optional[Callable[[tuple], bool]]
UnitTensors = UnitLeaves  # each unit's Unit, parameter DBuffer (.db) and leaves


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
                eps: Optional[float] = None, momentum: Optional[float] = None) -> None:
    """Refuse hyperparameters no optimizer can use (a schedule ``lr`` is checked when called).

    Raises:
        ValueError: a negative ``lr``, ``eps`` or ``weight_decay``, or betas or momentum
            outside [0, 1), naming the optimizer and the value.

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


def both(a: Mask, b: Mask) -> Mask:
    """The mask selecting what both select (``None`` selects everything).

    Example:
        >>> m = both(lambda p: p[0] == "a", lambda p: p[-1] == "w")
        >>> m(("a", "w")), m(("a", "b")), both(None, None) is None
        (True, False, True)
    """
    if a is None:
        return b
    if b is None:
        return a
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
        a, b = fn(first), fn(repeat)
        if a != b:
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
        if not selected(mask, t.path):
            continue
        lo, hi = t.shard_range(db.rank)
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def frozen_of(u: UnitTensors, owned: frozenset) -> frozenset:
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


def unit_buffers(shards: Any, spec: ShardSpec, what: str) -> list[UnitTensors]:
    """Every unit of ``shards``: its :class:`~vfsdp.collectives.Unit`, parameter DBuffer
    (``.db``) and leaves (``.leaves``: ``(leaf index, buffer index)`` pairs).

    Raises:
        ValueError: the tree does not match the spec, or a unit's leaves are not shards.
    """
    return units_of(match_tree(shards, spec, what), spec, what)


def grad_leaves(grads: Any, spec: ShardSpec, what: str) -> list:
    """The gradient tree's leaves in spec order (match it once per update).

    Raises:
        ValueError: the tree does not match the spec.
    """
    return gradient_leaves(grads, spec, what)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype optimizer state (and its arithmetic) takes for parameters of ``dtype``:
    float32, or the parameters' own dtype where it is wider (float64).

    Example:
        >>> state_dtype(torch.bfloat16), state_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(dtype, torch.float32)


def flat_grads(leaves: list, unit: UnitTensors, what: str,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The unit's gradient as one flat ``S``-element tensor in the parameter layout.

    ``leaves`` come from :func:`grad_leaves`. Zero-copy when they are the unit's gradient
    buffer's views (``vfsdp.grads``), after any reduction still writing it; otherwise the
    pieces are copied (one contiguous copy per tensor) into a zeroed flat tensor. ``dtype``:
    cast to it (one op over the unit) where it differs.

    Raises:
        ValueError: a gradient piece of the wrong size (naming the path).
    """
    flat = _flat_grads(leaves, unit, what)
    return flat if dtype is None or flat.dtype == dtype else flat.to(dtype)


def _flat_grads(leaves: list, unit: UnitTensors, what: str) -> torch.Tensor:
    gdb = unit.unit.grads() if unit.unit.has_grads else None
    if gdb is not None and all(_is_view(leaves[i], gdb, k) for i, k in unit.leaves):
        return gdb.shard
    db = unit.db
    flat = torch.zeros_like(db.shard)
    for i, k in unit.leaves:
        g = leaves[i]
        if g is None:
            continue
        slot = slot_of(g)
        if slot is not None:
            slot.buffer.wait()
        t = db.tensors[k]
        lo, hi = t.shard_range(db.rank)
        if g.numel() != hi - lo:
            raise ValueError(f"{what}: gradient of {format_path(t.path)} has {g.numel()} "
                             f"elements, this rank's shard has {hi - lo}")
        flat[lo:hi].copy_(g.reshape(-1))
    return flat


def _is_view(g: Any, gdb, k: int) -> bool:
    slot = slot_of(g)
    return (slot is not None and slot.buffer is gdb and slot.view is View.LOCAL
            and slot.index == k and gdb.is_local_view(k, g))


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
    from vfsdp.collectives.dbuffer import DBuffer

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
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif hasattr(x, "__dict__"):
            todo.extend(vars(x).values())
    return out
