"""Rank bodies of test_transaction: an update that fails leaves every rank as it was."""

from __future__ import annotations

import torch
import torch.distributed as dist

import vfsdp
from vfsdp import optim as O


class Flaky:
    """A schedule (0.01, 0.02, ...) that raises once, at step ``at``, on the ``ranks``."""

    def __init__(self, ranks: tuple = (), at: int = 2) -> None:
        self.ranks, self.at = ranks, at

    def __call__(self, step) -> float:
        step = int(step)
        if step == self.at and dist.get_rank() in self.ranks:
            self.ranks = ()  # once: the next try succeeds
            raise ValueError(f"schedule failed at step {step}")
        return 0.01 * step


class FlakyApply:
    """A user transform's apply (a momentum kept in ``m``) that raises once, at its
    ``at``-th call, on the ``ranks``, after it wrote its buffer."""

    def __init__(self, ranks: tuple = (), at: int = 2) -> None:
        self.ranks, self.at, self.calls = ranks, at, 0

    def __call__(self, u, state) -> None:
        self.calls += 1
        torch._foreach_lerp_(state["m"], u.updates, 0.1)
        if self.calls == self.at and dist.get_rank() in self.ranks:
            self.ranks = ()
            raise ArithmeticError("user transform failed")
        torch._foreach_copy_(u.updates, state["m"])


def optimizer(kind: str, ranks: tuple) -> O.Optimizer:
    """``kind`` (``offload(...)`` for offloaded) whose schedule (or user transform) fails at
    step 2 on ``ranks``."""
    if kind.startswith("offload("):
        return O.offload(optimizer(kind[len("offload("):-1], ranks))
    lr = Flaky(ranks)
    vector = lambda p: "m" if p == ("w",) else "a"  # matrices: the matrix optimizer
    return {
        "adamw": lambda: O.adamw(lr=lr),
        "adamw(fused)": lambda: O.adamw(lr=lr, fused=True),
        "adamw8bit": lambda: O.adamw8bit(lr=lr, min_8bit_numel=8),
        "muon": lambda: O.partition({"m": O.muon(lr=lr), "a": O.adamw(lr=0.01)}, vector),
        "soap": lambda: O.soap(lr=lr),
        "shampoo": lambda: O.partition({"m": O.shampoo(lr=lr), "a": O.adamw(lr=0.01)}, vector),
        "clip+adamw": lambda: O.chain(O.clip_by_global_norm(1.0), O.adamw(lr=lr)),
        "user": lambda: O.chain(O.clip_by_global_norm(1.0), O.transform(FlakyApply(ranks), ("m",)),
                                O.scale_by_adam(), O.scale_by_learning_rate(0.01)),
        "adamw+user": lambda: O.partition(
            {"a": O.adamw(lr=0.01), "u": O.chain(O.transform(FlakyApply(ranks), ("m",)),
                                                 O.scale_by_learning_rate(0.01))},
            lambda p: "a" if p == ("w",) else "u"),
    }[kind]()


def _snapshot(x, spec) -> list:
    """Every value an update may change: the state's checkpoint tree (moments, statistics,
    the step), offload's masters, the step counters, cloned."""
    out = []
    if isinstance(getattr(x, "count", None), torch.Tensor):
        out.append(x.count.clone())
    if isinstance(getattr(x, "step", None), int):  # as the owned optimizers' next update reads it
        out.append(torch.tensor(float(x.step)))
    if hasattr(x, "inner") and hasattr(x, "shards"):  # offload: the masters too
        out += _snapshot(x.shards, spec)
    while hasattr(x, "checkpoint_tree"):
        x = x.checkpoint_tree(spec)
    if isinstance(x, torch.Tensor):
        return [*out, x.detach().clone()]
    if isinstance(x, dict):
        return out + [y for k in sorted(x, key=str) for y in _snapshot(x[k], spec)]
    if isinstance(x, (list, tuple)):
        return out + [y for v in x for y in _snapshot(v, spec)]
    if isinstance(x, (int, float)):
        return [*out, torch.tensor(float(x))]
    return out


def _grads(shards, spec, step: int):
    grads = vfsdp.grads(shards, spec)
    for g in grads.values():
        g.copy_(torch.linspace(-1.0, 1.0, g.numel()).reshape(g.shape) * step)
    return grads


def run(kind: str, ranks: tuple) -> dict:
    """Three updates, the second failing on ``ranks`` (then tried again): what each rank
    raised, whether its state and parameters were as before the failed call (bit for bit),
    and its state and parameters after the three."""
    params = {"w": torch.linspace(-1, 1, 48).reshape(8, 6), "b": torch.linspace(0, 1, 6)}
    opt = optimizer(kind, ranks)
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    state = opt.init(shards, spec)
    out = {"raised": None, "kept": None}
    for step in (1, 2, 3):
        grads = _grads(shards, spec, step)
        before = _snapshot(state, spec) + [s.clone() for s in shards.values()]
        try:
            state = opt.update(grads, state, shards, spec)
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
            out["raised"] = f"{type(exc).__name__}: {exc}"
            after = _snapshot(state, spec) + [s.clone() for s in shards.values()]
            out["kept"] = len(before) == len(after) and all(
                a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after))
            state = opt.update(_grads(shards, spec, step), state, shards, spec)  # again
    out["after"] = _snapshot(state, spec) + [s.clone() for s in shards.values()]
    return out


def cases(kinds: list, failing: list) -> dict:
    """:func:`run` for every kind and set of failing ranks, and once with no failure."""
    return {(kind, ranks): run(kind, ranks) for kind in kinds for ranks in [(), *failing]}


def bad_tree(kind: str, short: bool = False) -> tuple:
    """Rank 1 passes a gradient tree without ``b`` (``short``: with ``w`` one element short):
    what each rank raised, and whether its state and parameters were kept (bit for bit)."""
    params = {"w": torch.linspace(-1, 1, 48).reshape(8, 6), "b": torch.linspace(0, 1, 6)}
    opt = optimizer(kind, ())
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    state = opt.update(_grads(shards, spec, 1), opt.init(shards, spec), shards, spec)
    grads = _grads(shards, spec, 2)
    if dist.get_rank() == 1:
        grads = {"w": grads["w"][:-1], "b": grads["b"]} if short else {"w": grads["w"]}
    before = _snapshot(state, spec) + [s.clone() for s in shards.values()]
    try:
        opt.update(grads, state, shards, spec)
        raised = None
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        raised = type(exc).__name__
    after = _snapshot(state, spec) + [s.clone() for s in shards.values()]
    return raised, all(torch.equal(a, b) for a, b in zip(before, after))
