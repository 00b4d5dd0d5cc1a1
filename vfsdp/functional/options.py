"""The gather and gradient options: one frozen :class:`Policy`, one meaning on every path.

:func:`vfsdp.gather`, :func:`vfsdp.gather_async`, :func:`vfsdp.run_layers` and their compiled
forms take a ``policy=`` and the same names as keywords (sugar: a keyword overrides the
policy's field). :func:`vfsdp.reduce_scatter` takes the reduction ones:

=======================  ======================  ===========================================
option                   default                 what it does
=======================  ======================  ===========================================
``param_dtype``          ``None``                gather in this dtype (one cast of the shard)
``free_after_backward``  ``None``                release the gathered unit once its backward
                                                 is done; ``None``: where vfsdp alone holds
                                                 the full tensors (``run_layers``), not where
                                                 you hold them (``gather``)
``grad_reduce``          ``"avg"``               ``"avg"`` or ``"sum"`` over every rank
``reduce_dtype``         ``None`` (grad dtype)   dtype of the reduce-scatter
``grads``                ``None``                ``"return"``: to autograd; ``"buffer"``: only
                                                 into the gradient DBuffer; ``None``: each
                                                 entry point's one way (``gather``:
                                                 ``"return"``, ``run_layers``: ``"buffer"``)
``accumulate_grads``     ``None`` (as torch)     ``None``/``True``: backwards add up until the
                                                 gradients are zeroed, as ``.grad`` does
                                                 (``False`` is refused)
``grad_sync``            ``True``                ``False``: accumulate unsharded, no reduce
``async_reduce``         ``None``                reduce-scatter without waiting (needs
                                                 ``"buffer"``); ``None``: where vfsdp runs the
                                                 backward unit by unit (``run_layers``)
``all_gather``           ``None``                low-precision all-gather hooks
                                                 (:mod:`vfsdp.functional.lowp`)
``prefetch``             ``None`` (yes)          ``run_layers``: gather unit ``i+1`` while
                                                 ``i`` computes (``i-1`` in backward)
``reshard_after_forward`` ``None`` (yes)         ``run_layers``: release each unit but the
                                                 last after its forward, regather it for its
                                                 backward
``recompute``            ``None`` (no)           ``run_layers``: activation checkpointing of
                                                 each layer: ``"full"``, ``"selective"``
                                                 (matmul and attention outputs kept) or a
                                                 SAC policy (``torch.utils.checkpoint.
                                                 create_selective_checkpoint_contexts``'s)
=======================  ======================  ===========================================

:func:`refuse` refuses, in one wording (``<entry point>: <option> is not supported <where>
(<why>); <hint>``), whatever a path cannot honour: inside ``torch.func`` gradients are values
the transform returns, so ``grads="buffer"``, ``accumulate_grads=True``, ``grad_sync=False``
and ``async_reduce=True`` are refused there; compiled and with ``all_gather=`` hooks the
sharded gradients go to autograd, so ``grads="buffer"`` and ``async_reduce=True`` are refused
there. ``recompute`` is honoured by the eager ``run_layers`` only (and ``apply.run_layers``),
and refused in the same wording elsewhere. Compiled, the reduce-scatter runs in the gather
dtype, so a ``reduce_dtype`` other than that is refused in the same wording (by the traced
gather, which knows the dtype).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from vfsdp.collectives.comm import REDUCE_OPS

__all__ = ["Policy", "merge", "refuse", "NAMES", "GRAD_MODES"]

GRAD_MODES = ("return", "buffer")
_FLAGS = ("free_after_backward", "accumulate_grads", "grad_sync", "async_reduce", "prefetch",
          "reshard_after_forward")


@dataclass(frozen=True)
class Policy:
    """Every gather and gradient option, frozen: pass one to :func:`vfsdp.gather`,
    :func:`vfsdp.gather_async` and :func:`vfsdp.run_layers`, eager or compiled (see the
    module for each field). ``None`` fields take the entry point's documented default.

    Raises:
        ValueError: a bad value (naming the option and what it takes).

    Example:
        >>> p = Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> p.param_dtype, dataclasses.replace(p, grad_reduce="sum").grad_reduce
        (torch.bfloat16, 'sum')
        >>> Policy(grad_reduce="max")
        Traceback (most recent call last):
        ...
        ValueError: grad_reduce must be one of ('sum', 'avg'), got 'max'
    """

    param_dtype: Optional[torch.dtype] = None
    free_after_backward: Optional[bool] = None
    grad_reduce: str = "avg"
    reduce_dtype: Optional[torch.dtype] = None
    grads: Optional[str] = None
    accumulate_grads: Optional[bool] = None
    grad_sync: Optional[bool] = True
    async_reduce: Optional[bool] = None
    all_gather: Any = None
    prefetch: Optional[bool] = None
    reshard_after_forward: Optional[bool] = None
    recompute: Any = None

    def __post_init__(self) -> None:  # the one check of option values: where a policy is made
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"{name} must be a floating-point torch.dtype or None, got {value!r}")
        if self.grad_reduce not in REDUCE_OPS:
            raise ValueError(f"grad_reduce must be one of {REDUCE_OPS}, got {self.grad_reduce!r}")
        if self.grads is not None and self.grads not in GRAD_MODES:
            raise ValueError(f"grads must be one of {GRAD_MODES}, got {self.grads!r}")
        recompute = self.recompute
        if not (recompute in (None, "full", "selective") or callable(recompute)
                or isinstance(recompute, (list, tuple))):
            raise ValueError(f"recompute must be None, 'full', 'selective' or a selective "
                             f"checkpointing policy (a callable (ctx, op, *args, **kwargs) -> "
                             f"torch.utils.checkpoint.CheckpointPolicy, or a list of ops to "
                             f"keep), got {recompute!r}")
        for name in _FLAGS:
            if getattr(self, name) is not None and type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be True, False or None (the entry point's "
                                 f"default), got {getattr(self, name)!r}")
        if self.accumulate_grads is False:
            raise ValueError("accumulate_grads=False was removed in vfsdp 0.4: gradients add up "
                             "across backwards until you zero them, as torch's .grad does, on "
                             "every path. Call vfsdp.zero_grads(shards, spec) before a backward "
                             "that should start afresh, and drop accumulate_grads")
        if self.grad_sync is None:  # the default on every path
            object.__setattr__(self, "grad_sync", True)


NAMES = tuple(f.name for f in dataclasses.fields(Policy))
_DEFAULT = Policy()


def merge(policy: Optional[Policy], options: dict, what: str) -> Policy:
    """The options of one call: ``policy`` (or the defaults), its fields overridden by the
    keyword ``options`` (a new :class:`Policy`, which checks them). The compiled path traces
    it too.

    Raises:
        TypeError: an unknown keyword (listing the known ones), or a ``policy`` that is not
            a :class:`Policy`.
        ValueError: a bad keyword value (as a :class:`Policy` refuses it).
    """
    unknown = sorted(set(options) - set(NAMES))
    if unknown:
        raise TypeError(f"{what} got unexpected options {unknown}; it takes {list(NAMES)}")
    if not isinstance(policy, (Policy, type(None))):
        raise TypeError(f"{what}: policy must be a vfsdp.Policy, got {type(policy).__name__}")
    return dataclasses.replace(policy or _DEFAULT, **options) if options else policy or _DEFAULT


_FUNC = ("inside torch.func transforms gradients are the values the transform returns, and "
         "tensors made outside it must not be mutated")
_AUTOGRAD = ("the sharded gradients go to autograd (.grad; vfsdp.grads reads them) and the "
             "compiler schedules the reduce-scatters")
# option, whether the policy asks for it, and per path: (why, what to do instead)
_REFUSED = (
    ("grads='buffer'", lambda p: p.grads == "buffer",
     {"torch.func": (_FUNC, "use grads='return'"),
      "compiled": (_AUTOGRAD, "drop grads='buffer'"),
      "all_gather": (_AUTOGRAD, "drop grads='buffer'")}),
    ("accumulate_grads=True", lambda p: p.accumulate_grads is True,
     {"torch.func": (_FUNC, "add the returned gradients yourself")}),
    ("grad_sync=False", lambda p: p.grad_sync is False,
     {"torch.func": (_FUNC, "sum the returned gradients, or call outside torch.func")}),
    ("all_gather= hooks", lambda p: p.all_gather is not None,
     {"torch.func": ("the hooks' functional gather reads the shards' units, which torch.func "
                     "hides behind its wrappers", "gather in param_dtype, or call outside "
                     "torch.func")}),
    ("async_reduce=True", lambda p: p.async_reduce is True,
     {"torch.func": (_FUNC, "drop it"), "compiled": (_AUTOGRAD, "drop it"),
      "all_gather": (_AUTOGRAD, "drop it")}),
)
_WHERE = {"torch.func": "under torch.func", "compiled": "under torch.compile",
          "all_gather": "with all_gather= hooks", "eager": "by a plain gather"}
_RECOMPUTE = {
    "torch.func": ("the transform runs the backward itself", "drop it"),
    "compiled": ("the compiled path does not checkpoint layers itself",
                 "call torch.utils.checkpoint (use_reentrant=False) inside layer_fn"),
    "all_gather": ("the functional path does not checkpoint layers itself",
                   "call torch.utils.checkpoint (use_reentrant=False) inside layer_fn"),
    "eager": ("only run_layers runs its layers, so only it can checkpoint them",
              "use vfsdp.run_layers, or torch.utils.checkpoint (use_reentrant=False) around "
              "your own function"),
}


def refuse(policy: Policy, path: str, what: str) -> None:
    """Refuse, in one wording on every path, the options ``path`` cannot honour.

    Args:
        policy: The call's options (:func:`merge`).
        path: ``"eager"``, ``"torch.func"``, ``"compiled"`` or ``"all_gather"``.
        what: The entry point, for the message.

    Raises:
        ValueError: ``<what>: <option> is not supported <where> (<why>); <hint>``.
    """
    for name, asked, paths in _REFUSED:
        if path in paths and asked(policy):
            why, hint = paths[path]
            raise ValueError(f"{what}: {name} is not supported {_WHERE[path]} ({why}); {hint}")
    if policy.recompute is not None:  # (the eager run_layers runs its layers: calls no refuse)
        why, hint = _RECOMPUTE[path]
        raise ValueError(f"{what}: recompute={policy.recompute!r} is not supported "
                         f"{_WHERE[path]} ({why}); {hint}")


def resolve(policy: Policy, layers: bool) -> Policy:
    """The eager options of one call (checked by :func:`refuse` first), resolved: ``None``
    fields take the entry point's default (``layers``: :func:`vfsdp.run_layers`, which alone
    holds the full tensors and runs the backward unit by unit: free after it, reduce
    asynchronously, into the buffer); ``prefetch`` and ``reshard_after_forward`` unless
    ``False``. A copy of ``policy`` (whose values were checked where it was made) with those
    fields set, valid by construction: not checked again.

    Raises:
        ValueError: ``async_reduce=True`` without ``grads='buffer'``.

    Example:
        >>> p = resolve(merge(None, {"param_dtype": torch.bfloat16}, "gather"), layers=True)
        >>> p.param_dtype, p.free_after_backward, p.grads, p.async_reduce, p.prefetch
        (torch.bfloat16, True, 'buffer', True, True)
    """
    pick = lambda name, default: default if getattr(policy, name) is None else getattr(policy, name)
    grads = pick("grads", "buffer" if layers else "return")
    if pick("async_reduce", layers) and grads != "buffer":
        raise ValueError("async_reduce=True needs grads='buffer': a gradient returned to "
                         "autograd must be complete when the backward returns it")
    out = copy.copy(policy)  # (frozen: set as its own __init__ does, valid by construction)
    out.__dict__.update(free_after_backward=pick("free_after_backward", layers), grads=grads,
                        async_reduce=pick("async_reduce", layers),
                        prefetch=policy.prefetch is not False,
                        reshard_after_forward=policy.reshard_after_forward is not False)
    return out
