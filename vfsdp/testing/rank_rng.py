"""A default random generator per simulated rank, so per-rank seeding works as under torchrun.

Under :func:`vfsdp.testing.simulate` every rank is a thread of one process, and torch's default
generator is one object for the whole process: ``torch.manual_seed(rank)`` in one rank would
reseed the others, and ``torch.randn`` calls of all ranks would interleave. While ``simulate``
runs, each rank thread gets its own ``torch.Generator``, started from the caller's default
generator state (as every torchrun process starts from the same script):

* torch's sampling functions and in-place samplers called without ``generator=`` draw from the
  rank's generator (a :class:`~torch.overrides.TorchFunctionMode` on the rank thread), and so
  do ``torch.nn.init``'s initialisers (the layers' ``reset_parameters``: an ``nn.Module``
  built inside a rank after ``torch.manual_seed(s)`` gets the same weights on every rank, as
  under torchrun);
* dropout (``torch.nn.functional.dropout``, ``dropout1d/2d/3d``, ``alpha_dropout``,
  ``feature_alpha_dropout``, their ``torch.*`` ops and the modules calling them) and attention
  dropout (``torch.nn.functional.scaled_dot_product_attention``, Hugging Face's default
  attention in training), which take no generator, run torch's own kernels with the process
  generator set to the rank's state for the call (one rank at a time), and the rank's
  generator advanced by what they drew;
* ``torch.manual_seed``, ``torch.seed``, ``torch.initial_seed``, ``torch.get_rng_state`` and
  ``torch.set_rng_state`` act on the calling rank's generator.

What still shares the process generator: CUDA generators (``simulate(device="cuda")``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SAMPLERS = {
    torch.randn, torch.rand, torch.randint, torch.randperm, torch.normal, torch.bernoulli,
    torch.multinomial, torch.rand_like, torch.randn_like, torch.randint_like, torch.poisson,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
}
_GENERATORS: dict[int, torch.Generator] = {}  # rank thread id -> its generator (while running)
_LOCK = threading.RLock()
_PATCHED: dict = {}


# Ops that take no generator and draw from the process's default one: dropout
# (``F.dropout`` & co., their ``torch.*`` ops) and attention's dropout (and torch.nn.init's
# functions, called without generator=).
_DEFAULT_DRAWS = {
    F.dropout, torch.dropout, F.alpha_dropout, torch.alpha_dropout, F.dropout1d, F.dropout2d,
    F.dropout3d, torch.feature_dropout, F.feature_alpha_dropout, torch.feature_alpha_dropout,
    F.scaled_dot_product_attention,
}


def _drawing_from(g: torch.Generator, func, args, kwargs):
    """``func`` run by torch's own kernel on the process's default generator set to ``g``'s
    state (under a lock: one rank at a time), ``g`` advanced by what it drew."""
    default = torch.default_generator
    with _LOCK:
        saved = default.get_state()
        default.set_state(g.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            g.set_state(default.get_state())
            default.set_state(saved)


class RankRNG(TorchFunctionMode):
    """Routes torch's random draws on this thread to ``generator``: samplers and
    ``torch.nn.init`` functions called without ``generator=``, and dropout."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SAMPLERS and kwargs.get("generator") is None:
            kwargs = dict(kwargs, generator=self.generator)
        elif kwargs.get("generator") is None and (
                func in _DEFAULT_DRAWS or getattr(func, "__module__", None) == "torch.nn.init") and (
                func is not F.scaled_dot_product_attention  # attention: with dropout only
                or kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) > 0.0):
            return _drawing_from(self.generator, func, args, kwargs)
        elif func is torch.Tensor.backward:
            # As a method call: dynamo traces `loss.backward()` (trace_autograd_ops), but not
            # torch.autograd.backward, which Tensor.backward's body calls.
            return args[0].backward(*args[1:], **kwargs)
        return func(*args, **kwargs)


def _per_rank(name: str, method):
    """torch's ``name`` acting on the calling rank thread's generator (torch's own elsewhere)."""
    def per_rank(*args, **kwargs):
        g = _GENERATORS.get(threading.get_ident())
        return _PATCHED[name](*args, **kwargs) if g is None else method(g, *args, **kwargs)

    return per_rank


_REPLACEMENTS = {name: _per_rank(name, method) for name, method in {
    "manual_seed": lambda g, seed: g.manual_seed(int(seed)), "seed": torch.Generator.seed,
    "initial_seed": torch.Generator.initial_seed, "get_rng_state": torch.Generator.get_state,
    "set_rng_state": torch.Generator.set_state}.items()}


@contextlib.contextmanager
def rank_generators() -> Iterator[torch.Tensor]:
    """While active, the seeding functions act per rank thread (see the module docstring).

    Yields the caller's default generator state, from which each rank starts.
    """
    with _LOCK:
        _PATCHED.update((name, getattr(torch, name)) for name in _REPLACEMENTS)
        for module in (torch, torch.random):
            vars(module).update(_REPLACEMENTS)
    try:
        yield torch.default_generator.get_state()
    finally:
        with _LOCK:
            for module in (torch, torch.random):
                vars(module).update(_PATCHED)
            _PATCHED.clear()


@contextlib.contextmanager
def on_this_thread(state: torch.Tensor) -> Iterator[torch.Generator]:
    """Give the calling (rank) thread its own generator, started from ``state``."""
    g = torch.Generator().set_state(state)
    _GENERATORS[threading.get_ident()] = g
    try:
        with RankRNG(g):
            yield g
    finally:
        _GENERATORS.pop(threading.get_ident(), None)
