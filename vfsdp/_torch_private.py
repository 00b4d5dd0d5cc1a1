"""The one place vfsdp touches private torch APIs. Checked against torch 2.13 (and 2.11).

* :func:`functorch_active`: whether a ``torch.func`` transform is running
  (``torch._C._are_functorch_transforms_active``). Inside one, the gather's backward must not
  mutate tensors created outside the transform, so it returns fresh gradients instead of
  writing into the persistent gradient DBuffer.
* :func:`storage_id`: an identity for a tensor's storage object (``StorageImpl`` address,
  ``untyped_storage()._cdata``) that survives resizes of its memory, for the memory probes.
* :class:`TorchDispatchMode` (``torch.utils._python_dispatch``): the dispatcher hook the
  op counters and memory probes are built on.
* :func:`threaded_world`: ``torch.testing._internal.distributed.multi_threaded_pg`` provides a
  ``"threaded"`` backend whose collectives run between threads of one process, on real
  tensors; ``vfsdp.testing.simulate`` runs one thread per rank on it.
* :func:`groups_are_per_thread`: whether process groups are private to the thread that made
  them: true while :func:`threaded_world` has c10d's thread isolation mode on (``simulate``),
  where a background thread cannot use a rank's group.
* The autograd engine, inside a backward: :func:`graph_task_id`
  (``torch._C._current_graph_task_id``), :func:`keep_graph`
  (``torch._C._autograd._get_current_graph_task_keep_graph``: ``retain_graph=True``),
  :func:`will_execute` (``torch._C._will_engine_execute_node``) and
  :func:`queue_final_callback` (``Variable._execution_engine.queue_callback``: run once the
  backward pass is over).
* :func:`functorch_paused`: ``torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack``,
  so a collective inside a ``torch.func`` backward may write its own output buffer (gloo copies
  into it, which functorch would refuse as mutating a captured tensor).
* :func:`checkpoint_wrapped`: ``torch.utils.checkpoint``'s function, as its recompute calls it,
  is wrapped on this thread: the module's ``_checkpoint_without_reentrant_generator`` and
  ``CheckpointFunction`` (names ``checkpoint`` looks up when called, so imports of it made
  before are covered) are replaced once by wrappers that read this thread's innermost wrap
  (with none, torch's own run). Checked by name and signature on a torch not in
  :data:`TESTED_TORCH` (a warning; an error naming what moved if they differ).
* :func:`saved_hooks_top`: the innermost saved-tensor hooks
  (``torch._C._autograd._top_saved_tensors_default_hooks``: a checkpoint's, ``save_on_cpu``),
  which ``run_layers``' own hooks hand what is not a gathered parameter.
* :func:`version`: a tensor's in-place version counter (``t._version``).
* :func:`set_data`: ``t.data = src`` past a subclass's ``__torch_function__``
  (``torch._C.DisableTorchFunctionSubclass``), to point a released view at no memory.
* Multi-tensor kernels: :func:`foreach` (``torch._foreach_*``) and
  :func:`fused_adamw` (``torch._fused_adamw_``, the kernel of ``torch.optim.AdamW(fused=True)``).

* The compiled path: :func:`compiling` (``torch.compiler.is_dynamo_compiling``), the functional
  collectives ``torch.ops._c10d_functional`` (:func:`traced_all_gather`,
  :func:`traced_all_reduce`, :func:`traced_reduce_scatter`), dynamo's
  ``trace_autograd_ops`` switch (:func:`trace_autograd_ops`) and the
  ``assume_constant_result`` mark (:func:`untraced`) on :func:`enable_compiled_backward` and on
  the compiled clip's group lookup; the former also gives dynamo's
  ``TensorVariable.method_attr_grad`` a fresh ``ConstantVariable(None)`` where it returned the
  shared one (:func:`_own_none_grads`).

Other torch versions may move or change these, so they are guarded and versioned here.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # for the probes

TESTED_TORCH = ((2, 11), (2, 13))
_LOCK = threading.Lock()
_ISOLATED = threading.Event()  # set while threaded_world() has thread isolation on


def _torch_version() -> tuple[int, int]:
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, vmap, ...) is active on this thread."""
    return bool(torch._C._are_functorch_transforms_active())


def functorch_unwrapped(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor a ``torch.func`` wrapper (vmap's batched, grad's tracking tensor) wraps, one
    level down; ``None`` for a plain tensor."""
    f = torch._C._functorch
    return f.get_unwrapped(t) if f.is_functorch_wrapped_tensor(t) else None


def storage_id(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage object, stable across resizes of its memory.

    Raises:
        RuntimeError: ``t`` has no storage (e.g. a functorch wrapper).
    """
    return t.untyped_storage()._cdata


def set_data(t: torch.Tensor, src: torch.Tensor) -> None:
    """``t.data = src`` on any tensor, a subclass (whose ``__torch_function__`` would see the
    setter) included: ``t`` takes ``src``'s storage and layout, keeping its own identity,
    autograd metadata and version counter; no op is dispatched."""
    with torch._C.DisableTorchFunctionSubclass():
        t.data = src


def graph_task_id() -> int:
    """The running backward pass's id (``-1`` outside a backward)."""
    return int(torch._C._current_graph_task_id())


def node_seq(node: Any) -> int:
    """An autograd node's sequence number (its creation order on its thread: a backward runs
    later nodes first)."""
    return int(node._sequence_nr())


def running_node_seq() -> Optional[int]:
    """Inside a backward: the sequence number of the autograd node running now (``None``
    outside one)."""
    node = torch._C._current_autograd_node()
    return None if node is None else node_seq(node)


def is_own_output(t: torch.Tensor) -> bool:
    """In a saved-tensor pack hook: whether ``t`` is an output of the op saving it (its
    ``grad_fn`` is the node just made: the newest sequence number on this thread). Such a
    tensor, kept as it is by the hook, would hold its own node: a cycle through C++."""
    node = t.grad_fn
    return node is not None and int(node._sequence_nr()) == torch._C._autograd._get_sequence_nr() - 1


def keep_graph() -> bool:
    """Inside a backward: whether it runs with ``retain_graph=True`` (the graph runs again)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def will_execute(node) -> bool:
    """Inside a backward: whether the engine runs ``node`` in this pass. ``False`` when the
    question cannot be asked (a leaf's node during ``autograd.grad``)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def queue_final_callback(fn) -> None:
    """Inside a backward: call ``fn()`` once the whole backward pass is done."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def foreach(op: str, *lists: list, scalar=None, **kwargs):
    """``torch._foreach_<op>(*lists[, scalar], **kwargs)``: one multi-tensor op (one launch
    per few hundred tensors on a GPU).

    Returns:
        What the op returns (a list for out-of-place ops, ``None`` for in-place ones).
    """
    if not lists or not lists[0]:
        return None if op.endswith("_") else []  # torch refuses empty lists
    return getattr(torch, f"_foreach_{op}")(*lists, *(() if scalar is None else (scalar,)), **kwargs)


def fused_adamw(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, *,
                lr: float, beta1: float, beta2: float, weight_decay: float, eps: float) -> None:
    """torch's fused AdamW kernel, as ``torch.optim.AdamW(fused=True)`` calls it (no amsgrad,
    no maximize, no grad scaler); ``steps`` are float32 tensors on the parameters' device
    holding the 1-based step; a tensor ``lr`` (a schedule's) is read as float32, as the
    kernel takes it on CUDA."""
    if not params:
        return
    lr = lr.to(torch.float32) if isinstance(lr, torch.Tensor) else lr
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr,
                        beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        maximize=False, grad_scale=None, found_inf=None)


def functorch_paused():
    """A context in which ``torch.func`` transforms are inactive (for collectives)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: bumped by every in-place change."""
    return int(t._version)


def groups_are_per_thread() -> bool:
    """Whether c10d process groups belong to the thread that created them (``simulate``)."""
    return _ISOLATED.is_set()


def _untested(message: str, stacklevel: int) -> None:
    """``message`` as a ``RuntimeWarning`` on a torch not in :data:`TESTED_TORCH`."""
    if _torch_version() not in TESTED_TORCH:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def threaded_world() -> Iterator[object]:
    """Install a thread-local c10d world for the ``"threaded"`` backend; one at a time."""
    _untested(f"vfsdp.testing.simulate was tested with torch {TESTED_TORCH}; torch "
              f"{torch.__version__} may have changed its threaded process group", 2)
    try:
        from torch.testing._internal.distributed import multi_threaded_pg as mtp
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            "vfsdp.testing.simulate needs torch's threaded process group "
            "(torch.testing._internal.distributed.multi_threaded_pg), which this torch build "
            "lacks; use vfsdp.testing.spawn instead"
        ) from exc
    world = getattr(mtp, "ThreadLocalWorld", None)
    if world is not None and not hasattr(world, "comms"):
        # torch 2.11: destroy_process_group() iterates and clears _world.comms, which the
        # threaded world lacks; it holds no communicators, so an empty list is exact.
        world.comms = property(lambda self: [])
    if not _LOCK.acquire(blocking=False):
        raise RuntimeError("vfsdp.testing.simulate cannot nest or run concurrently")
    try:
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _ISOLATED.set()
        mtp.ProcessLocalGroup.reset()  # a run that failed or timed out may have left it set
        mtp._install_threaded_pg()
        try:
            yield mtp
        finally:
            mtp.ProcessLocalGroup.reset()
            mtp._uninstall_threaded_pg()
            _ISOLATED.clear()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
    finally:
        _LOCK.release()


def report_failure(mtp, exc: BaseException) -> None:
    """Wake the other rank threads blocked in a collective after one rank failed."""
    mtp.ProcessLocalGroup.exception_handle(exc)


# ------------------------------------------------------------------ compiled (traced) path


def compiling() -> bool:
    """Whether dynamo is tracing the running code (``torch.compiler.is_dynamo_compiling``,
    which dynamo folds to ``True`` and which is ``False`` when run for real; not
    ``is_compiling``, whose process-wide flag other threads see while one compiles)."""
    return torch.compiler.is_dynamo_compiling()


def _waited(out: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(out)


def traced_all_gather(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """Every rank's 1-D ``x`` concatenated (``size`` ranks of the group named ``group_name``),
    as a traceable, differentiable functional collective: its backward reduce-scatters (sum).
    ``torch.ops._c10d_functional.all_gather_into_tensor`` with its registered autograd (torch
    2.13; 2.11 keeps it in ``_c10d_functional_autograd``)."""
    ops = torch.ops._c10d_functional_autograd if _torch_version() < (2, 12) else \
        torch.ops._c10d_functional
    return _waited(ops.all_gather_into_tensor(x.contiguous(), size, group_name))


def traced_all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """``x`` reduced over the group named ``group_name``: a traceable functional collective
    (not differentiable: for norms and for gradients inside a backward)."""
    return _waited(torch.ops._c10d_functional.all_reduce(x.contiguous(), op, group_name))


def traced_sum_autograd(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """``x`` summed over the group (``size`` ranks), differentiable: the backward sums the
    gradient over the group too. torch 2.13: the functional all-reduce's own autograd; 2.11
    has none, so there every rank's ``x`` is all-gathered (whose backward reduce-scatters the
    same gradient to every rank: their sum) and added up."""
    if _torch_version() < (2, 12):
        return traced_all_gather(x.reshape(-1), group_name, size).view(size, -1).sum(0).view(x.shape)
    return traced_all_reduce(x, "sum", group_name)


def traced_reduce_scatter(x: torch.Tensor, op: str, group_name: str, size: int) -> torch.Tensor:
    """``x`` (1-D, ``size * n`` elements) reduced over the group, this rank's ``n``: traceable."""
    return _waited(torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), op, size,
                                                                     group_name))


def traced_all_to_all(x: torch.Tensor, recv_sizes: list, send_sizes: list,
                      group_name: str) -> torch.Tensor:
    """``all_to_all_single`` of the 1-D ``x`` with uneven splits (elements per rank) over the
    group named ``group_name``: a traceable functional collective (not differentiable)."""
    return _waited(torch.ops._c10d_functional.all_to_all_single(x.contiguous(), list(recv_sizes),
                                                                 list(send_sizes), group_name))


def traced_gather_ops() -> tuple:
    """The ops of a traced all-gather (the collective and its wait)."""
    return (torch.ops._c10d_functional.all_gather_into_tensor.default,
            torch.ops._c10d_functional.wait_tensor.default)


def trace_autograd_ops() -> contextlib.AbstractContextManager:
    """``torch._dynamo.config.patch(trace_autograd_ops=True)``: lets dynamo trace
    ``loss.backward()`` and ``torch.autograd.grad`` inside a compiled function (torch 2.13)."""
    return torch._dynamo.config.patch(trace_autograd_ops=True)


def enable_compiled_backward() -> bool:
    """Turn dynamo's ``trace_autograd_ops`` on for the process, so that
    ``torch.compile(step, fullgraph=True)`` traces the ``backward()`` / ``autograd.grad`` in a
    training step (otherwise it stops there, and ``fullgraph=True`` refuses).

    vfsdp calls it while dynamo traces its first vfsdp call of a step (a gather comes before
    any backward): it runs then, not traced (``assume_constant_result``), and dynamo reads the
    switch when it meets the backward. Importing vfsdp does not load dynamo (1 s).
    ``VFSDP_TRACE_AUTOGRAD=0`` leaves dynamo's setting alone. A process-wide switch, not a
    ``patch``: the threads of one process (``simulate``) share dynamo's config."""
    import os

    if os.environ.get("VFSDP_TRACE_AUTOGRAD", "1") != "0" and hasattr(torch._dynamo.config,
                                                                      "trace_autograd_ops"):
        torch._dynamo.config.trace_autograd_ops = True
    _own_none_grads()
    return True


def _own_none_grads() -> None:
    """Dynamo (torch 2.13) answers a read of ``t.grad`` that the traced frame set to ``None``
    (``_flush``, ``zero_grads``, then the traced backward reads it) with its one shared
    ``ConstantVariable(None)``, and then writes ``t``'s source onto that shared object: every
    later compiled function that returns ``None`` reloads it from a variable of that earlier
    frame, and fails (``AssertionError: shards_ missing``). A fresh ``ConstantVariable`` for
    that read keeps the source on its own object. Installed once; where dynamo has no shared
    ``None`` (other versions), nothing is replaced."""
    from torch._dynamo.variables import constant, tensor

    shared = getattr(constant, "CONSTANT_VARIABLE_NONE", None)
    read = getattr(tensor.TensorVariable, "method_attr_grad", None)
    if shared is None or read is None or getattr(read, "vfsdp_own_none", False):
        return
    _untested(f"vfsdp: dynamo's .grad read is patched as tested on torch {TESTED_TORCH}; torch "
              f"{torch.__version__} may have changed it", 2)

    def method_attr_grad(self, tx):
        found = read(self, tx)
        return constant.ConstantVariable(None) if found is shared else found

    method_attr_grad.vfsdp_own_none = True
    tensor.TensorVariable.method_attr_grad = method_attr_grad



def untraced(fn):
    """Mark ``fn`` as ``torch._dynamo.assume_constant_result`` does (that decorator only sets
    this attribute, and importing dynamo to call it would cost a second): while tracing,
    dynamo runs it for real and keeps its result as a constant, guarding the objects it was
    given by identity. Returns ``fn``."""
    fn._dynamo_marked_constant = True
    return fn


untraced(enable_compiled_backward)


_WRAPS = threading.local()
_WRAP_LOCK = threading.Lock()


@contextlib.contextmanager
def checkpoint_wrapped(wrap) -> Iterator[None]:
    """While it runs, on this thread, each ``torch.utils.checkpoint`` call runs
    ``wrap(function)`` where it would run ``function``, in the forward and in the backward's
    recompute; a reentrant one runs as a non-reentrant one (the same gradients: no tensor
    input requiring grad gives none, as torch's reentrant form does). ``wrap=None``: torch's
    own (inside an outer wrap)."""
    _install_checkpoint_wrap()
    stack = _WRAPS.__dict__.setdefault("stack", [])
    stack.append(wrap)
    try:
        yield
    finally:
        stack.pop()


def _wrap():
    return (getattr(_WRAPS, "stack", None) or [None])[-1]


def saved_hooks_top() -> Optional[tuple]:
    """The innermost ``(pack, unpack)`` saved-tensor hooks active on this thread (a
    ``torch.utils.checkpoint``'s, ``save_on_cpu``'s), or ``None``."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


#: What :func:`checkpoint_wrapped` replaces: name -> (where its parameters are, their names).
_CHECKPOINT_INTERNALS = {
    "_checkpoint_without_reentrant_generator": (lambda f: f, ["fn", "preserve_rng_state"]),
    "CheckpointFunction": (lambda c: c.forward, ["ctx", "run_function", "preserve_rng_state"]),
    "check_backward_validity": (lambda f: f, ["inputs"]),
}


def checkpoint_internals(ckpt, version: tuple[int, int]) -> tuple:
    """``torch.utils.checkpoint``'s (``ckpt``) non-reentrant generator and reentrant
    ``CheckpointFunction``, as :func:`checkpoint_wrapped` replaces them; on a torch
    ``version`` not in :data:`TESTED_TORCH`, checked by name and leading parameters first.

    Raises:
        RuntimeError: one is missing or takes other parameters (naming it and the tested
            versions).

    Warns:
        RuntimeWarning: ``version`` is untested (and the names match).
    """
    import inspect

    if version not in TESTED_TORCH:
        for name, (where, params) in _CHECKPOINT_INTERNALS.items():
            try:
                got = list(inspect.signature(where(getattr(ckpt, name))).parameters)
            except (AttributeError, TypeError, ValueError):
                got = None
            if got is None or got[:len(params)] != params:
                raise RuntimeError(
                    f"vfsdp: torch {'.'.join(map(str, version))} changed torch.utils.checkpoint."
                    f"{name} (expected parameters {params}, found {got}), which vfsdp wraps so "
                    f"that a checkpoint's recompute in apply / run_layers reads the call's "
                    f"tensors, not the module's own (tested with torch "
                    f"{', '.join('.'.join(map(str, v)) for v in TESTED_TORCH)}); install one "
                    f"of those")
        warnings.warn(f"vfsdp: torch.utils.checkpoint's internals were tested with torch "
                      f"{TESTED_TORCH}; torch {'.'.join(map(str, version))} has the same names "
                      f"and parameters, but may have changed what they do", RuntimeWarning,
                      stacklevel=4)
    return ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction


def _install_checkpoint_wrap() -> None:
    from torch.utils import checkpoint as ckpt

    with _WRAP_LOCK:
        if getattr(ckpt, "_vfsdp_wrapped", False):
            return
        generator, base = checkpoint_internals(ckpt, _torch_version())

        @functools.wraps(generator)  # its signature: what a check on an untested torch reads
        def without_reentrant(fn, *args, **kwargs):
            wrap = _wrap()
            return generator(fn if wrap is None else wrap(fn), *args, **kwargs)

        class CheckpointFunction(base):  # the reentrant form: ``CheckpointFunction.apply``
            @classmethod
            def apply(cls, function, preserve, *args):
                if _wrap() is None:
                    return base.apply(function, preserve, *args)
                ckpt.check_backward_validity(args)  # torch's warning
                if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                    with torch.no_grad():  # as the reentrant form: no gradient at all
                        return function(*args)
                return ckpt.checkpoint(function, *args, use_reentrant=False,
                                       preserve_rng_state=preserve)

        ckpt._checkpoint_without_reentrant_generator = without_reentrant
        ckpt.CheckpointFunction = CheckpointFunction
        ckpt._vfsdp_wrapped = True
