"""A default random generator per simulated rank, so per-rank seeding works as under torchrun.

Under :func:`vfsdp.testing.simulate` every rank is a thread of one process, and torch's default
generator is one object for the whole process: ``torch.manual_seed(rank)`` in one rank would
reseed the others, and ``torch.randn`` calls of all ranks would interleave. While ``simulate``
runs, each rank thread gets its own ``torch.Generator``, started from the caller's default
generator state (as every torchrun process starts from the same script):

* torch's sampling functions and in-place samplers called without ``generator=`` draw from the
  rank's generator (a :class:`~torch.overrides.TorchFunctionMode` on the rank thread);
* ``torch.manual_seed``, ``torch.seed``, ``torch.initial_seed``, ``torch.get_rng_state`` and
  ``torch.set_rng_state`` act on the calling rank's generator.

What still shares the process generator: ops without a ``generator`` argument (dropout), and
CUDA generators.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["rank_generators", "RankRNG"]

_SAMPLERS = {
    torch.randn, torch.rand, torch.randint, torch.randperm, torch.normal, torch.bernoulli,
    torch.multinomial, torch.rand_like, torch.randn_like, torch.randint_like, torch.poisson,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
}
_GENERATORS: dict[int, torch.Generator] = {}  # rank thread id -> its generator (while running)
_LOCK = threading.Lock()
_PATCHED: dict = {}


class RankRNG(TorchFunctionMode):
    """Routes samplers called without ``generator=`` to ``generator`` (this thread only)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SAMPLERS and kwargs.get("generator") is None:
            kwargs = dict(kwargs, generator=self.generator)
        return func(*args, **kwargs)


def _mine():
    return _GENERATORS.get(threading.get_ident())


def _manual_seed(seed):
    g = _mine()
    if g is None:
        return _PATCHED["manual_seed"](seed)
    g.manual_seed(int(seed))
    return g


def _seed():
    g = _mine()
    return _PATCHED["seed"]() if g is None else g.seed()


def _initial_seed():
    g = _mine()
    return _PATCHED["initial_seed"]() if g is None else g.initial_seed()


def _get_rng_state():
    g = _mine()
    return _PATCHED["get_rng_state"]() if g is None else g.get_state()


def _set_rng_state(state):
    g = _mine()
    return _PATCHED["set_rng_state"](state) if g is None else g.set_state(state)


_REPLACEMENTS = {"manual_seed": _manual_seed, "seed": _seed, "initial_seed": _initial_seed,
                 "get_rng_state": _get_rng_state, "set_rng_state": _set_rng_state}


@contextlib.contextmanager
def rank_generators() -> Iterator[torch.Tensor]:
    """While active, the seeding functions act per rank thread (see the module docstring).

    Yields the caller's default generator state, from which each rank starts.
    """
    with _LOCK:
        for name, fn in _REPLACEMENTS.items():
            _PATCHED[name] = getattr(torch, name)
            setattr(torch, name, fn)
            setattr(torch.random, name, fn)
    try:
        yield torch.default_generator.get_state()
    finally:
        with _LOCK:
            for name in _REPLACEMENTS:
                setattr(torch, name, _PATCHED[name])
                setattr(torch.random, name, _PATCHED[name])
            _PATCHED.clear()


@contextlib.contextmanager
def on_this_thread(state: torch.Tensor) -> Iterator[torch.Generator]:
    """Give the calling (rank) thread its own generator, started from ``state``."""
    g = torch.Generator()
    g.set_state(state)
    _GENERATORS[threading.get_ident()] = g
    try:
        with RankRNG(g):
            yield g
    finally:
        _GENERATORS.pop(threading.get_ident(), None)
