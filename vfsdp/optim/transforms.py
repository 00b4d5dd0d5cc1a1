"""Composition, optax-style (``partition`` tensors between optimizers, ``chain`` transforms),
and the optimizer pieces in optax's vocabulary that :func:`chain` composes.

A *transform* turns the updates (at first, the gradients) into new updates; the last one,
:func:`scale_by_learning_rate`, applies them to the parameters (``p -= lr * u``, optax's
``scale_by_learning_rate`` then ``apply_updates``)::

    chain(scale_by_adam(b1, b2, eps), add_decayed_weights(wd), scale_by_learning_rate(lr))

is ``adamw(lr, (b1, b2), eps, wd)``, bit for bit: ``chain`` recognises that sequence (with or
without the decay) and runs AdamW's own fused implementation. Any other run of transforms
runs them one after another over every unit's flat shard as lists (:func:`run`): each
transform is a few multi-tensor ops over the whole rank, so a user's own chain (Lion, say,
from a small :func:`transform`) costs a few ops per step whatever the number of tensors or
units. The matrix preconditioners (:func:`scale_by_soap`, :func:`scale_by_shampoo`,
:func:`scale_by_muon`) need whole matrices on owner ranks: ``chain`` runs one followed by
``add_decayed_weights`` and ``scale_by_learning_rate`` as its optimizer, and refuses other
sequences with them. Gradient transforms that are whole optimizers (``clip_by_global_norm``) go before the
transforms: they change the gradients, which the first transform reads.

``partition`` and ``chain`` both pass a ``mask`` down (see :mod:`vfsdp.optim.base`), so they
nest in any order::

    partition({"hidden": chain(clip_by_global_norm(1.0), muon()),
               "rest": chain(clip_by_global_norm(1.0), adamw())}, labels)
    chain(clip_by_global_norm(1.0), partition({...}, labels))

Inside a ``partition``, a ``clip_by_global_norm`` clips the global norm of its own subset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives.dbuffer import Role
from vfsdp.functional.state import param_tree
from vfsdp.optim.adamw import adamw, masked_plan, segments, trainable_runs
from vfsdp.optim.base import (
    CountedState,
    Mask,
    Optimizer,
    Schedule,
    adam_,
    as_schedule,
    atomic,
    begin,
    both,
    check_hyper,
    cuts_of,
    descend_,
    flat_grads,
    grad_leaves,
    init_masked,
    init_units,
    learning_rate,
    member,
    pieces_of,
    runs,
    same_at_ties,
    selected,
    settle,
    state_dtype,
    step_scalars,
    trained,
)
from vfsdp.optim.muon import muon
from vfsdp.optim.shampoo import shampoo
from vfsdp.optim.soap import soap
from vfsdp.planner.granularity import combine, format_path
from vfsdp.planner.spec import ShardSpec


@dataclass(frozen=True, eq=False)
class Transform:
    """A transform of the updates: ``apply(updates, buffers)`` changes ``updates.updates``
    in place (:class:`Updates`); ``buffers`` names the state it keeps per parameter (zeros,
    in the state dtype, saved by checkpoints), handed to ``apply`` as ``{name: slices}``
    matching ``updates.updates``. ``hyper`` lets :func:`fuse` recognise the common chains."""

    name: str
    apply: Optional[Callable[[Any, dict], None]]  # None: a matrix preconditioner (fuse runs it)
    buffers: tuple = ()
    hyper: tuple = ()

    def init(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a transform alone changes updates that nothing applies.

        Raises:
            TypeError: always, naming the fix.
        """
        raise TypeError(f"{self.name} is a transform of the updates, not an optimizer: use it "
                        f"inside vfsdp.optim.chain(..., scale_by_learning_rate(lr)), which "
                        f"applies the updates to the parameters")

    update = init

    def optimizer(self) -> Optimizer:
        """This transform as a member of a :func:`~vfsdp.optim.chain`."""
        return Optimizer(self.init, self.update)


def _of(opt: Any) -> Optional[Transform]:
    found = getattr(opt.init, "__self__", None)
    return found if isinstance(found, Transform) else None


def transform(apply: Callable[[Any, dict], None], buffers: tuple = (),
              name: str = "transform") -> Optimizer:
    """Your own transform of the updates, for :func:`~vfsdp.optim.chain`.

    Args:
        apply: ``apply(u, state)``: change ``u.updates`` (a list of flat tensors in the state
            dtype, every unit's updated slices of this rank) in place with multi-tensor ops
            (``torch._foreach_*``), reading ``u.params``, ``u.count`` (the step, a tensor) and
            ``state[name]`` (this transform's buffers, slices matching ``u.updates``), which
            it may change in place. Zeros (padding) must stay zeros.
        buffers: Names of the per-parameter buffers it keeps (zeros at ``init``).
        name: For messages.

    Returns:
        An :class:`~vfsdp.optim.Optimizer` to place in a ``chain`` before
        :func:`scale_by_learning_rate` (alone, its ``init`` and ``update`` raise).

    Raises:
        TypeError: ``apply`` is not callable, or a buffer name is not a string.

    Example:
        >>> sign = transform(lambda u, state: torch._foreach_sign_(u.updates), name="sign")
        >>> opt = vfsdp.optim.chain(sign, scale_by_learning_rate(0.1))
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.zeros(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.zeros(8)}, spec)
        ...     grads = vfsdp.grads(shards, spec)
        ...     grads["w"].fill_(-3.0)
        ...     opt.update(grads, opt.init(shards, spec), shards, spec)
        ...     return [round(x, 4) for x in shards["w"].tolist()]
        >>> vfsdp.testing.simulate(2, body)
        [[0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]]
    """
    if not callable(apply) or not all(isinstance(b, str) for b in buffers):
        raise TypeError(f"transform({name!r}): takes apply(u, state), a callable, and buffer "
                        f"names as strings, got {type(apply).__name__} and {buffers!r}")
    return Transform(name, apply, tuple(buffers)).optimizer()


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Optimizer:
    """Adam's direction, ``m_hat / (sqrt(v_hat) + eps)``, with moments ``mu`` and ``nu``
    (:func:`~vfsdp.optim.base.adam_`'s arithmetic, optax's ``scale_by_adam``).

    Args:
        b1: The first moment's decay rate, in [0, 1).
        b2: The second moment's decay rate, in [0, 1).
        eps: Added to the denominator, >= 0.

    Returns:
        A transform for :func:`~vfsdp.optim.chain`.

    Raises:
        ValueError: betas outside [0, 1) or a negative ``eps``.

    Example:
        >>> opt = vfsdp.optim.chain(scale_by_adam(), scale_by_learning_rate(0.1))
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(0.5)
        ...     opt.update(vfsdp.grads(shards, spec), opt.init(shards, spec), shards, spec)
        ...     return [round(x, 4) for x in shards["w"].tolist()]
        >>> vfsdp.testing.simulate(2, body)      # the first step moves p by -lr
        [[0.9, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]]
    """
    check_hyper("scale_by_adam", 0.0, 0.0, betas=(b1, b2), eps=eps)

    def apply(u: Updates, state: dict) -> None:
        g = u.scratch("scale_by_adam")
        tp.foreach("copy_", g, u.updates)
        tp.foreach("zero_", u.updates)  # adam_ adds the step to it: the direction alone
        adam_(u.updates, g, state["mu"], state["nu"], b1, b2, eps, -1.0, *step_scalars(u.count, (b1, b2)))

    return Transform("scale_by_adam", apply, ("mu", "nu"), ("adam", (b1, b2), eps)).optimizer()


def add_decayed_weights(weight_decay: float = 0.0, mask: Mask = None) -> Optimizer:
    """``u += weight_decay * p`` for the tensors ``mask(path)`` selects (all when ``None``):
    decoupled weight decay once the learning rate scales it (optax's ``add_decayed_weights``).

    Args:
        weight_decay: The rate, >= 0.
        mask: ``path -> bool``; tensors for which it is false take no decay.

    Returns:
        A transform for :func:`~vfsdp.optim.chain`.

    Raises:
        ValueError: a negative ``weight_decay``.

    Example:
        >>> opt = vfsdp.optim.chain(add_decayed_weights(0.5), scale_by_learning_rate(0.1))
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     grads = vfsdp.grads(shards, spec)       # zeros: only the decay moves p
        ...     opt.update(grads, opt.init(shards, spec), shards, spec)
        ...     return [round(x, 4) for x in shards["w"].tolist()]
        >>> vfsdp.testing.simulate(2, body)                # p * (1 - 0.1 * 0.5)
        [[0.95, 0.95, 0.95, 0.95], [0.95, 0.95, 0.95, 0.95]]
    """
    check_hyper("add_decayed_weights", 0.0, weight_decay)

    def apply(u: Updates, state: dict) -> None:
        if weight_decay:
            ps, us = u.where(mask)
            tp.foreach("add_", us, ps, alpha=weight_decay)

    return Transform("add_decayed_weights", apply, (), ("decay", weight_decay, mask)).optimizer()


def scale_by_learning_rate(lr: Schedule = 1e-3) -> Optimizer:
    """The last transform of a chain: ``p -= lr * u``, the updates applied to the parameters.

    Args:
        lr: A float or a schedule ``step -> lr`` (steps count from 1).

    Returns:
        A transform for :func:`~vfsdp.optim.chain`, which must end its transforms.

    Raises:
        ValueError: a negative ``lr``.

    Example:
        >>> opt = vfsdp.optim.chain(scale_by_learning_rate(lambda step: 0.5 * step))
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.zeros(2)}, 1)
        ...     shards = vfsdp.shard({"w": torch.zeros(2)}, spec)
        ...     grads = vfsdp.grads(shards, spec)
        ...     grads["w"].fill_(1.0)
        ...     state = opt.init(shards, spec)
        ...     for _ in range(2):
        ...         state = opt.update(grads, state, shards, spec)
        ...     return shards["w"].tolist()
        >>> vfsdp.testing.simulate(1, body)           # -0.5, then -1.0
        [[-1.5, -1.5]]
    """
    check_hyper("scale_by_learning_rate", lr, 0.0)
    schedule = as_schedule(lr)

    def apply(u: Updates, state: dict) -> None:
        descend_(u.params, u.updates, learning_rate(schedule, u.count), scratch=True)

    return Transform("scale_by_learning_rate", apply, (), ("lr", lr)).optimizer()


def _owner(name: str, factory: Callable, options: dict) -> Optimizer:
    """A matrix preconditioner as a transform: the optimizer ``factory``'s direction, run by
    :func:`fuse` as that optimizer with the chain's decay and rate."""
    for key, home in (("lr", "scale_by_learning_rate"), ("weight_decay", "add_decayed_weights")):
        if key in options:
            raise ValueError(f"{name}: {key}= belongs to {home} in the chain, not to {name}")
    factory(**options)  # refuses bad options now, by name
    return Transform(name, None, (), ("owner", factory, options)).optimizer()  # run refuses it: no apply


def scale_by_soap(**options: Any) -> Optimizer:
    """SOAP's direction (:func:`~vfsdp.optim.soap`: Adam in the eigenbases of Shampoo's
    preconditioners, each matrix on its owner rank), bias corrections included.

    ``chain(scale_by_soap(**options), add_decayed_weights(wd), scale_by_learning_rate(lr))``
    runs ``soap(lr, weight_decay=wd, weight_decay_first=True, **options)``: the decay
    scales the parameters before the step, as the chain says (``u + wd * p`` with ``p``
    before the update); ``soap(...)`` itself decays after the step, as the reference.
    Without a decay the two are the same, bit for bit.

    Args:
        options: :func:`~vfsdp.optim.soap`'s keyword arguments but ``lr`` and
            ``weight_decay`` (the chain's other transforms say those).

    Returns:
        A transform for :func:`~vfsdp.optim.chain`, followed only by
        ``add_decayed_weights`` (without a mask) and ``scale_by_learning_rate``.

    Raises:
        ValueError: ``lr`` or ``weight_decay`` among ``options``, or an option soap refuses.
        TypeError: an option soap does not take.

    Example:
        >>> opt = vfsdp.optim.chain(scale_by_soap(precondition_frequency=5),
        ...                         scale_by_learning_rate(3e-3))
        >>> def body():
        ...     params = {"w": torch.ones(4, 6)}
        ...     spec = vfsdp.plan(params, 2)
        ...     return type(opt.init(vfsdp.shard(params, spec), spec)[0]).__name__
        >>> vfsdp.testing.simulate(2, body)      # SOAP's own state: chain runs soap
        ['OwnedState', 'OwnedState']
    """
    return _owner("scale_by_soap", soap, options)


def scale_by_shampoo(**options: Any) -> Optimizer:
    """Shampoo's direction ``L^(-1/4) G R^(-1/4)`` (:func:`~vfsdp.optim.shampoo`, each matrix
    or block on its owner rank): ``chain(scale_by_shampoo(**options),
    add_decayed_weights(wd), scale_by_learning_rate(lr))`` runs ``shampoo(lr,
    weight_decay=wd, **options)``, which decays before the step as the chain says.

    Args:
        options: :func:`~vfsdp.optim.shampoo`'s keyword arguments but ``lr`` and
            ``weight_decay``.

    Returns:
        A transform for :func:`~vfsdp.optim.chain`, followed only by
        ``add_decayed_weights`` (without a mask) and ``scale_by_learning_rate``.

    Raises:
        ValueError: ``lr`` or ``weight_decay`` among ``options``, or an option shampoo refuses.
        TypeError: an option shampoo does not take.

    Example:
        >>> scale_by_shampoo(block_size=0)
        Traceback (most recent call last):
        ...
        ValueError: shampoo: block_size must be >= 1 (or None: whole matrices), got 0
    """
    return _owner("scale_by_shampoo", shampoo, options)


def scale_by_muon(**options: Any) -> Optimizer:
    """Muon's direction (:func:`~vfsdp.optim.muon`: momentum, then Newton-Schulz on each
    matrix's owner): ``chain(scale_by_muon(**options), add_decayed_weights(wd),
    scale_by_learning_rate(lr))`` runs ``muon(lr, weight_decay=wd, **options)``, which
    decays before the step as the chain says.

    Args:
        options: :func:`~vfsdp.optim.muon`'s keyword arguments but ``lr`` and
            ``weight_decay``.

    Returns:
        A transform for :func:`~vfsdp.optim.chain`, followed only by
        ``add_decayed_weights`` (without a mask) and ``scale_by_learning_rate``.

    Raises:
        ValueError: ``lr`` or ``weight_decay`` among ``options``, or an option muon refuses.
        TypeError: an option muon does not take.

    Example:
        >>> scale_by_muon(lr=0.02)
        Traceback (most recent call last):
        ...
        ValueError: scale_by_muon: lr= belongs to scale_by_learning_rate in the chain, not to scale_by_muon
    """
    return _owner("scale_by_muon", muon, options)


class Updates:
    """What a transform's ``apply`` works on, this step, over every unit it updates on this
    rank: ``params`` (the parameter shards' flat slices), ``updates`` (matching slices in
    the state dtype: the gradients, as the transforms before it left them) and ``count``
    (the step counter, already counting this step). Whole units are whole shards (padding
    included, zeros throughout). Made once per set of units and update runs and kept (the
    shards and buffers are fixed tensors, so their views are too); ``buffers``: per
    transform, its buffers' slices matching ``updates``."""

    def __init__(self, units: list, state: TransformsState) -> None:
        self.key, self.count = [(u.key, rs) for u, rs in units], state.count  # (unit, runs)
        self.dbs, self.shards = [u.db for u, _ in units], [u.db.shard for u, _ in units]
        self.cuts = [None if rs == runs(u.db, None) else cuts_of(rs, u.db.shard.numel())
                     for u, rs in units]
        self.flats = [torch.zeros_like(p, dtype=state_dtype(p.dtype)) for p in self.shards]
        self.params, self.updates = self.cut(self.shards), self.cut(self.flats)
        self.buffers = [{k: self.cut([dbs[key].shard for key, _ in self.key])
                         for k, dbs in named.items()} for named in state.buffers]
        self._kept: dict = {}

    def cut(self, flats: list) -> list:
        """The units' flat tensors ``flats`` (one per unit) cut as ``updates``: one op per unit
        cut by a mask or freezing (the units' gradients are cut each step: gradient slices are
        never kept, the buffer may be freed)."""
        return [x for f, cuts in zip(flats, self.cuts) for x in pieces_of(f, cuts)]

    def scratch(self, name: str) -> list:
        """A list of tensors matching ``updates`` for a temporary, kept between steps
        (made at the first call; its values are whatever the last step left)."""
        if name not in self._kept:
            self._kept[name] = self.cut([torch.zeros_like(f) for f in self.flats])
        return self._kept[name]

    def where(self, mask: Mask) -> tuple[list, list]:
        """``(params, updates)`` restricted to the tensors ``mask(path)`` selects."""
        if mask is None:
            return self.params, self.updates
        if mask not in self._kept:
            cuts = [[(lo, hi) for lo, hi, d in segments(rs, runs(db, mask)) if d]
                    for db, (_, rs) in zip(self.dbs, self.key)]
            self._kept[mask] = tuple([x[lo:hi] for x, cut in zip(xs, cuts) for lo, hi in cut]
                                     for xs in (self.shards, self.flats))
        return self._kept[mask]


@dataclass
class TransformsState(CountedState):
    """A run of transforms' state: the step counter and, per transform, its buffers
    (``{name: {unit key: DBuffer}}``, the parameters' layout).

    Example:
        >>> opt = vfsdp.optim.chain(transform(lambda u, s: None, ("m",)),
        ...                         scale_by_learning_rate(0.1))
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        ...     state = opt.init(vfsdp.shard({"w": torch.ones(4)}, spec), spec)[0]
        ...     return state.checkpoint_tree(spec)["transforms"][0]["m"]["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)      # zeros, shaped like each rank's piece
        [[0.0, 0.0, 0.0, 0.0], []]
    """

    buffers: list
    updates: Optional[Updates] = field(default=None, repr=False, compare=False)

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        """The step, and each transform's buffers shaped like the parameters."""
        return {**super().checkpoint_tree(spec), "transforms": [
            {k: param_tree(dbs, spec, self.plan.local) for k, dbs in named.items()}
            for named in self.buffers]}


def run(*members: Optimizer) -> Optimizer:
    """The transforms ``members`` (ending with :func:`scale_by_learning_rate`) run one after
    another, each a few multi-tensor ops over every unit's slices of this rank: what
    :func:`~vfsdp.optim.chain` runs for a sequence it has no fused implementation of.

    Args:
        members: Transforms, the last :func:`scale_by_learning_rate`.

    Returns:
        An :class:`~vfsdp.optim.Optimizer` whose state is a :class:`TransformsState`.

    Raises:
        ValueError, TypeError: members out of order (see :func:`fuse`), or a matrix
            preconditioner (``scale_by_soap``, ...), which only ``chain`` runs.

    Example:
        >>> opt = run(scale_by_adam(), scale_by_learning_rate(0.1))  # chain would fuse it
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     vfsdp.grads(shards, spec)["w"].fill_(0.5)
        ...     opt.update(vfsdp.grads(shards, spec), opt.init(shards, spec), shards, spec)
        ...     return [round(x, 4) for x in shards["w"].tolist()]
        >>> vfsdp.testing.simulate(2, body)
        [[0.9, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]]
    """
    ts = [_of(m) for m in members]
    if not ts or not all(ts):
        raise TypeError("run takes transforms (scale_by_adam, transform(...), ...), the last "
                        "scale_by_learning_rate; put other optimizers in a chain around it")
    ts = _check(ts)
    if owner := next((t.name for t in ts if t.hyper[:1] == ("owner",)), None):
        raise ValueError(f"chain: {owner} preconditions whole matrices on their owner ranks and "
                         f"runs only as chain({owner}(...), add_decayed_weights(wd), "
                         f"scale_by_learning_rate(lr)), the decay optional and without a mask; "
                         f"give other tensors other optimizers with vfsdp.optim.partition")
    lr = as_schedule(ts[-1].hyper[1])  # begin evaluates it before anything is written

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> TransformsState:
        units, count = init_units(shards, spec, "chain.init", mask=mask, **{
            f"add_decayed_weights' mask (transform {i})": t.hyper[2]
            for i, t in enumerate(ts) if t.hyper[:1] == ("decay",)})
        plan = masked_plan(units, mask, None)  # (decay: per transform)
        return TransformsState(count, [{k: {u.key: u.db.like(state_dtype(u.db.dtype), Role.STATE, k)
                                            for u in units if u.key in plan.paths}
                                        for k in t.buffers} for t in ts], plan=plan)

    def update(grads: Any, state: TransformsState, shards: Any, spec: ShardSpec
               ) -> TransformsState:
        leaves = grad_leaves(grads, spec, "chain.update")
        with torch.no_grad():
            units = [(u, rs) for u, frozen in trained(shards, spec, state.plan, "chain.update")
                     for rs in [trainable_runs(u, state.plan, frozen, None)[0]] if rs]
            todo = state.updates
            # Another shards tree for the same spec has other buffers: never reuse its slices.
            if todo is None or todo.key != [(u.key, rs) for u, rs in units] or any(
                    p is not u.db.shard for p, (u, _) in zip(todo.shards, units)):
                todo = state.updates = Updates(units, state)
            gs = todo.cut([flat_grads(leaves, u, "chain.update", f.dtype)
                           for (u, _), f in zip(units, todo.flats)])
            begin(state.count, lr)  # the checks are done: nothing written yet
            named = todo.buffers
            # A user's apply may raise: what the transforms up to the last of them write is
            # copied first (one op per buffer), restored on every rank if one fails.
            last = max((i for i, t in enumerate(ts) if not t.hyper), default=-1)
            saved = [(todo.scratch(f"saved {i} {k}"), xs) for i in range(last + 1)
                     for k, xs in named[i].items() if todo.updates]
            error = None
            if todo.updates:
                tp.foreach("copy_", todo.updates, gs)
                for keep, xs in saved:
                    tp.foreach("copy_", keep, xs)
                try:
                    for i in range(last + 1):
                        ts[i].apply(todo, named[i])
                except Exception as exc:  # noqa: BLE001 - raised by settle, on every rank
                    error = exc
            if last >= 0:
                settle(error, lambda: [state.count.sub_(1), *(
                    tp.foreach("copy_", xs, keep) for keep, xs in saved)])
            for i in range(last + 1, len(ts) if todo.updates else 0):
                ts[i].apply(todo, named[i])
        return state

    return Optimizer(init, atomic(update))


def _check(ts: list, offset: int = 0) -> list[Transform]:
    """The run of transforms ``ts`` starts (``None`` for another member), refused where out of
    order; ``offset``: the chain's index of ``ts[0]``, for messages."""
    last = next((i for i, t in enumerate(ts) if t and t.hyper[:1] == ("lr",)), None)
    if last is None:
        raise ValueError(f"chain: the transforms {[t.name for t in ts if t]} do not end with "
                         f"scale_by_learning_rate(lr), so their updates would never reach the "
                         f"parameters; end them with it")
    if after := [t.name for t in ts[last + 1:] if t]:
        raise ValueError(f"chain: {after[0]} comes after scale_by_learning_rate, which applies "
                         f"the updates to the parameters: it would change updates already "
                         f"applied; put every transform before scale_by_learning_rate")
    if stray := [i for i in range(last) if ts[i] is None]:
        raise ValueError(f"chain: member {offset + stray[0]} sits between transforms: it reads "
                         f"the gradients, not the updates the transforms before it made; put "
                         f"it before the first transform ({ts[0].name})")
    return ts[:last + 1]


def fuse(members: tuple) -> tuple:
    """``chain``'s members with their run of transforms replaced by one optimizer: AdamW's
    own implementation for ``scale_by_adam``, ``add_decayed_weights`` (optional) and
    ``scale_by_learning_rate`` in that order; SOAP's, Shampoo's or Muon's for
    ``scale_by_soap``/``scale_by_shampoo``/``scale_by_muon`` in its place (the decay without
    a mask); else :func:`run`.

    Raises:
        ValueError: transforms that do not end with one :func:`scale_by_learning_rate`,
            one after it, or another member between them; a matrix preconditioner in any
            other sequence.

    Example:
        >>> fuse((scale_by_adam(), scale_by_learning_rate(0.1)))[0].local_state  # AdamW's
        True
    """
    ts = [_of(m) for m in members]
    if not any(ts):
        return members
    first = next(i for i, t in enumerate(ts) if t)
    found = _check(ts[first:], first)
    end = first + len(found)
    kinds = [t.hyper[:1] for t in found]
    lr = found[-1].hyper[1]
    _, wd, mask = found[1].hyper if kinds[1:] == [("decay",), ("lr",)] else (None, 0.0, None)
    if kinds in ([("adam",), ("lr",)], [("adam",), ("decay",), ("lr",)]):
        one = adamw(lr, *found[0].hyper[1:], wd, mask, fused=None)  # hyper: ("adam", betas, eps)
    elif kinds[0] == ("owner",) and kinds[1:] in ([("lr",)], [("decay",), ("lr",)]) and mask is None:
        _, make, options = found[0].hyper
        order = {"weight_decay_first": True} if make is soap and wd else {}
        one = make(lr=lr, weight_decay=wd, **options, **order)
    else:
        one = run(*members[first:end])
    return (*members[:first], one, *members[end:])


def partition(transforms: dict, labels: Callable[[tuple], str]) -> Optimizer:
    """Each tensor is updated by ``transforms[labels(path)]`` (and only by it).

    Args:
        transforms: ``label -> optimizer`` (any optimizer, ``chain`` or ``partition``).
        labels: ``path -> label``.

    Returns:
        An :class:`Optimizer` whose state is ``{label: state}`` and whose granularity is,
            per tensor, that of its label's optimizer.

    Raises:
        ValueError: from ``init``, a selected tensor whose label has no transform.
        TypeError: from ``init``, a member whose ``init`` takes no ``mask``.

    Example:
        >>> opt = vfsdp.optim.partition(
        ...     {"8bit": vfsdp.optim.adamw8bit(), "fp32": vfsdp.optim.adamw()},
        ...     lambda path: "8bit" if path[-1] == "w" else "fp32")
        >>> opt.granularity(("w",), torch.empty(64, 64)), opt.granularity(("b",), torch.empty(64))
        (rows(32), None)
    """
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError("partition(transforms, labels) takes a non-empty dict of optimizers")

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> dict:
        same_at_ties(labels, spec, "partition", "labels")
        for t in spec.tensors():
            if selected(mask, t.path) and labels(t.path) not in transforms:
                raise ValueError(f"partition: {format_path(t.path)} is labelled "
                                 f"{labels(t.path)!r}, which has no transform (have "
                                 f"{sorted(transforms)})")
        return {name: init_masked(opt, shards, spec,
                                  both(mask, lambda p, n=name: labels(p) == n), "partition")
                for name, opt in transforms.items()}

    def update(grads: Any, state: dict, shards: Any, spec: ShardSpec) -> dict:
        # Each member writes its own label's tensors (parameters, or gradients in place).
        return {name: member(opt, grads, state[name], shards, spec)
                for name, opt in transforms.items()}

    def granularity(path, tensor):
        g = getattr(transforms.get(labels(path)), "granularity", None)  # None: an unknown label
        return g(path, tensor) if callable(g) else g

    return Optimizer(init, atomic(update, compose=True), granularity)


def chain(*transforms: Optimizer) -> Optimizer:
    """Apply transforms in order, each to the gradients the one before it left (e.g.
    clipping, then an optimizer), as ``optax.chain`` does: a gradient transform changes the
    gradients in place (one update form, see :mod:`vfsdp.optim.base`), and the next member
    reads the same tree.

    A run of transforms (:mod:`vfsdp.optim.transforms`: ``scale_by_adam``, ...,
    ``scale_by_learning_rate``) is one member: AdamW's own implementation for AdamW's
    sequence, else the transforms one after another over the whole rank.

    The chain's granularity keeps whole every block any member needs
    (:func:`vfsdp.planner.granularity.combine`); its ``mask`` goes to every member.

    Args:
        transforms: Optimizers (or gradient transforms), applied in order.

    Returns:
        An :class:`Optimizer` whose state is the list of the members' states.

    Raises:
        TypeError: a member that is not an :class:`Optimizer`.
        ValueError: transforms out of order (see :func:`vfsdp.optim.transforms.fuse`).

    Example:
        >>> opt = vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0),
        ...                         vfsdp.optim.adamw8bit(lr=1e-3))
        >>> opt.granularity(("w",), torch.empty(64, 64))
        rows(32)
    """
    for t in transforms:
        if not isinstance(t, Optimizer):
            raise TypeError(f"chain takes Optimizers, got {type(t).__name__}")
    transforms = fuse(transforms)  # a run of transforms: one member (vfsdp.optim.transforms)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> list:
        return [init_masked(t, shards, spec, mask, "chain") for t in transforms]

    def update(grads: Any, state: list, shards: Any, spec: ShardSpec) -> list:
        return [member(t, grads, s, shards, spec) for t, s in zip(transforms, state)]

    return Optimizer(init, atomic(update, compose=True), combine(*(t.granularity for t in transforms)))


@dataclass
class ClipState:
    """``clip_by_global_norm``'s state: nothing to save, only the mask ``init`` was given.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        ...     state = vfsdp.optim.clip_by_global_norm(1.0).init(shards, spec)
        ...     return state, state.checkpoint_tree(spec)
        >>> vfsdp.testing.simulate(2, body)
        [(ClipState(mask=None), {}), (ClipState(mask=None), {})]
    """

    mask: Optional[Callable[[tuple], bool]] = None

    def checkpoint_tree(self, spec: ShardSpec) -> dict:
        return {}

    def restore_checkpoint(self, tree: Any) -> ClipState:
        return self


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """A gradient transform: clip the gradients' global norm in place (for :func:`chain`).

    Under a ``partition`` mask, the norm and the scaling cover the selected tensors only.

    Args:
        max_norm: The largest allowed global norm.

    Returns:
        An :class:`Optimizer` whose ``update`` scales the gradients in place (no parameters
            change) and whose state is a :class:`ClipState`.

    Raises:
        ValueError: ``max_norm`` is negative or not finite.

    Example:
        >>> opt = vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0), vfsdp.optim.adamw())
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     grads = vfsdp.grads(shards, spec)
        ...     grads["w"].fill_(3.0)
        ...     opt.update(grads, opt.init(shards, spec), shards, spec)
        ...     return round(float(vfsdp.optim.global_norm(grads, spec)), 4)
        >>> vfsdp.testing.simulate(2, body)
        [1.0, 1.0]
    """
    from vfsdp.optim.clip import check_max_norm, clip_grad_norm

    check_max_norm(max_norm)

    def init(shards: Any, spec: ShardSpec, mask: Mask = None) -> ClipState:
        return ClipState(mask)

    def update(grads: Any, state: ClipState, shards: Any, spec: ShardSpec) -> ClipState:
        grad_leaves(grads, spec, "clip_by_global_norm")  # the checks, before the ranks agree
        begin()
        clip_grad_norm(grads, spec, max_norm, mask=state.mask)
        return state

    return Optimizer(init, atomic(update))
