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
  ``feature_alpha_dropout``, their ``torch.*`` ops and the modules calling them), which takes
  no generator, draws its mask from the rank's generator with the same formula as torch's
  kernel (the values differ from the process generator's draw, the distribution does not);
* attention dropout (``torch.nn.functional.scaled_dot_product_attention`` with
  ``dropout_p > 0``, Hugging Face's default attention in training) runs as torch's documented
  reference computation, its dropout mask drawn from the rank's generator;
* ``torch.manual_seed``, ``torch.seed``, ``torch.initial_seed``, ``torch.get_rng_state`` and
  ``torch.set_rng_state`` act on the calling rank's generator.

What still shares the process generator: CUDA generators (``simulate(device="cuda")``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
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
_LOCK = threading.Lock()
_PATCHED: dict = {}


# Dropout ops (no generator argument): function -> (spatial dims the mask is shared over,
# alpha dropout). 0: an element-wise mask; "feature": every dim past (N, C).
_DROPOUTS = {
    F.dropout: (0, False), torch.dropout: (0, False),
    F.alpha_dropout: (0, True), torch.alpha_dropout: (0, True),
    F.dropout1d: (1, False), F.dropout2d: (2, False), F.dropout3d: (3, False),
    torch.feature_dropout: ("feature", False),
    F.feature_alpha_dropout: ("feature", True), torch.feature_alpha_dropout: ("feature", True),
}
_ALPHA = 1.7580993408473766  # SELU's -alpha' (torch's alpha dropout constant)


@functools.cache
def _takes_generator(func) -> bool:
    """Whether a ``torch.nn.init`` function has a ``generator`` parameter."""
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def _dropout(func, g: torch.Generator, args, kwargs):
    """``func`` (a dropout) with its mask drawn from ``g``; ``None`` when it would not draw
    (not training, ``p == 0``, or a bad ``p``, which torch itself then refuses)."""
    dims, alpha = _DROPOUTS[func]
    names = ("input", "p", "train" if func.__module__ != "torch.nn.functional" else "training",
             "inplace")
    bound = dict(zip(names, args), **kwargs)
    x = bound["input"]
    p = bound.get("p", 0.5)
    default_train = func not in (F.alpha_dropout, F.feature_alpha_dropout)
    training = bound.get("training", bound.get("train", default_train))
    if not training or not 0.0 < p <= 1.0 or not isinstance(x, torch.Tensor):
        return None
    if dims == "feature":
        dims = max(x.dim() - 2, 0)
    elif func is F.dropout2d and x.dim() == 3:
        dims = 1  # torch's dropout2d treats a 3-D input as (N, C, L)
    shape = tuple(x.shape[:x.dim() - dims]) + (1,) * dims if dims else tuple(x.shape)
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p, generator=g)
    inplace = bound.get("inplace", False)
    if alpha:  # as torch's kernel: x * a * keep + alpha * a * (keep - 1 + p)
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1.0) * (1.0 - p))
        shift = (keep - 1.0).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        keep.mul_(a)
        return (x.mul_(keep) if inplace else x * keep).add_(shift)
    keep = keep.div_(1.0 - p) if p < 1.0 else keep
    return x.mul_(keep) if inplace else x * keep


def _sdpa(g: torch.Generator, query, key, value, attn_mask=None, dropout_p=0.0,
          is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` with dropout, its mask drawn from ``g`` (torch's
    reference computation: the kernels draw from the process generator)."""
    n, m = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    w = query @ key.transpose(-2, -1) * scale
    if is_causal:
        w = w.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=w.device).tril(),
                          float("-inf"))
    if attn_mask is not None:
        w = w.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else w + attn_mask
    w = torch.softmax(w, dim=-1)
    keep = torch.empty_like(w).bernoulli_(1.0 - dropout_p, generator=g)
    w = w * keep / (1.0 - dropout_p) if dropout_p < 1.0 else w * keep
    return w @ value


class RankRNG(TorchFunctionMode):
    """Routes torch's random draws on this thread to ``generator``: samplers and
    ``torch.nn.init`` functions called without ``generator=``, and dropout."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("generator") is None and (
                func in _SAMPLERS or (getattr(func, "__module__", None) == "torch.nn.init"
                                      and _takes_generator(func))):
            kwargs = dict(kwargs, generator=self.generator)
        elif func is F.scaled_dot_product_attention and (
                kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) > 0.0):
            return _sdpa(self.generator, *args, **kwargs)
        elif func in _DROPOUTS:
            out = _dropout(func, self.generator, args, kwargs)
            if out is not None:
                return out
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
    g = torch.Generator().set_state(state)
    _GENERATORS[threading.get_ident()] = g
    try:
        with RankRNG(g):
            yield g
    finally:
        _GENERATORS.pop(threading.get_ident(), None)
