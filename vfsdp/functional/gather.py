"""``vfsdp.gather`` (differentiable) and ``gather_async`` over pytrees.

One all-gather per unit, in place: each unit's shard is the collective's input as it is, the
unit's global buffer its output, and every full tensor a view of that buffer. No copy runs
before or after the collective. The call reads straight down the layers: the tree's leaves
name their units (:mod:`vfsdp.functional.units`), each unit gathers itself
(:class:`vfsdp.collectives.Unit`), and the backward reduce-scatters
(:mod:`vfsdp.functional.reduce`).

With ``grads="return"`` the backward hands autograd fresh tensors holding this rank's reduced
pieces (nothing vfsdp later overwrites or frees); with ``grads="buffer"`` the pieces stay in
the unit's gradient DBuffer, which later backwards add to until it is zeroed, and whose views
``backward()`` makes the shards' ``.grad``.
"""

from __future__ import annotations

from typing import Any, Optional

import optree
import torch
from torch.autograd.graph import get_gradient_edge

from vfsdp import _torch_private as tp
from vfsdp._torch_private import functorch_active
from vfsdp.collectives.handle import Handle
from vfsdp.functional.backward import pending
from vfsdp.functional.options import GatherOptions, GradOptions, Policy, merge, refuse, resolve
from vfsdp.functional.reduce import reduce_unit
from vfsdp.functional.traced import traced_gather
from vfsdp.functional.tree import match_tree
from vfsdp.functional.units import own_mesh, unit_for, units_of
from vfsdp.functional.vma import mark_gathered
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["gather", "gather_async", "start_gather", "GatherHandle", "writes_leaf_grads"]


class _Call:
    """One unit's gather: its arguments, and (once known) its unit and gathered buffer.

    An object that pytree utilities and ``torch.func`` leave alone.
    """

    __slots__ = ("spec", "key", "index", "mesh", "what", "gopts", "ropts",
                 "unit", "db", "locals", "versions", "flat_version", "needs", "entry",
                 "recording")

    def __init__(self, spec, key, index, mesh, what, gopts, ropts) -> None:
        self.spec, self.key, self.index, self.mesh, self.what = spec, key, index, mesh, what
        self.gopts, self.ropts = gopts, ropts
        self.unit = None
        self.db = None
        self.locals: tuple = ()   # the shards (to check their versions, to write .grad)
        self.versions: tuple = ()
        self.flat_version = -1    # the unit's flat parameter shard's (optimizers write that)
        self.needs: tuple = ()    # which of them require grad
        self.entry = None         # this gather's place in the rank's RankGathers
        self.recording = True     # autograd records the gather (grad mode was on at apply)

    def check_versions(self) -> None:
        """Raise if a shard was changed in place since the forward gathered it.

        Raises:
            RuntimeError: naming the tensor.
        """
        for x, v, k in zip(self.locals, self.versions, self.index):
            if tp.version(x) != v:
                path = ".".join(map(str, self.spec.units[self.key].paths[k]))
                raise RuntimeError(
                    f"{path} was modified in place after vfsdp.gather used it for the forward; "
                    f"the backward would mix old and new values (torch raises the same for a "
                    f"tensor saved for backward). Change shards only after the backward, e.g. "
                    f"in the optimizer step")
        if self.flat_version >= 0 and tp.version(self.unit.params.shard) != self.flat_version:
            raise RuntimeError(
                f"the parameters of unit {unit_name(self.key)} were updated in place (an "
                f"optimizer update, vfsdp.scatter or a checkpoint load) after {self.what} used "
                f"them for the forward, before its backward; the backward would mix old and "
                f"new values. Run the backward first, then update (for several micro-batches, "
                f"update once after the last backward)")

    def reduce_zeros(self, accumulates: bool) -> None:
        """This rank's loss did not reach the unit: take part in its reduce-scatter with
        zeros (the other ranks' backward runs it).

        With ``grads="return"`` the result (the other ranks' contributions) goes into the
        shards' ``.grad`` when the pass accumulates into leaves (``backward()``), as FSDP2
        does."""
        self.unit.prepare_backward(self.db)  # as where the backward runs: same collectives
        if self.gopts.free_after_backward:
            self.db.release(at_once=False)  # as after a backward that ran (kept while read)
        if self.ropts.grads == "buffer":
            unlink_stale(self.unit, self.locals, self.index, self.needs)
        pieces = reduce_unit(self.unit, self.index, [None] * len(self.index), self.ropts,
                             views=self.ropts.grads == "return")
        if self.ropts.grads == "buffer" and self.ropts.grad_sync:
            grads_to_buffer(self, accumulates)
        if self.ropts.grads != "return" or pieces is None or not accumulates:
            return
        with torch.no_grad():
            for x, p, need in zip(self.locals, pieces, self.needs):
                if need and p is not None:
                    if x.grad is None:
                        x.grad = p
                    else:
                        x.grad.add_(p)

    def orphaned(self) -> None:
        """The unit's autograd node died before any backward reached it: with
        ``free_after_backward``, its gathered memory can go now (the next backward reduces
        its zeros if another rank's runs the unit; a resharded unit is gathered again
        then)."""
        if self.gopts.free_after_backward:
            self.db.release(at_once=False)

    def resolve(self, local) -> None:
        """Find the unit from the shards (unwrapped here under ``torch.func``), or pack them."""
        self.unit = unit_for(local, self.spec, self.key, self.index, self.mesh, self.what)


class _GatherUnit(torch.autograd.Function):
    """Forward: full views of one gathered unit. Backward: reduce-scatter into its gradients.

    The unit is resolved inside ``forward``, where ``torch.func`` transforms hand over the
    plain (unwrapped) shard tensors, so the same code serves ``backward()``,
    ``autograd.grad`` and ``torch.func.grad``.
    """

    @staticmethod
    def forward(call: _Call, *local):
        if call.unit is None:
            call.resolve(local)
        if call.db is None:  # not prefetched by gather_async
            call.db, _ = call.unit.gather(call.gopts.param_dtype)
        return tuple(call.db.full(i) for i in call.index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call = inputs[0]
        ctx.call = call
        ctx.set_materialize_grads(False)
        needs = tuple(ctx.needs_input_grad[1:])
        if any(needs) and call.recording and not functorch_active():
            call.locals, call.needs = tuple(inputs[1:]), needs
            call.versions = tuple(tp.version(x) for x in call.locals)
            call.flat_version = tp.version(call.unit.params.shard)
            call.entry = pending().add(ctx, call)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        needs = ctx.needs_input_grad[1:]
        keep = False
        if call.entry is not None:
            call.check_versions()
            keep = tp.keep_graph()
            record = pending().backward(lambda: writes_leaf_grads(call), call.db.device,
                                        running=call.entry)
            record.reach(call.entry.seq)  # the units after it that do not run here: zeros
            record.ran(call.entry)
        call.unit.prepare_backward(call.db)  # run_layers: gathered again, the previous one
        if call.gopts.free_after_backward and not keep:
            # The unit's backward is done, its gathered parameters are no longer read by it:
            # release them before the gradient staging buffer is allocated, so the two never
            # coexist. The memory goes now, or when the last other graph still reading it (the
            # same unit gathered again, e.g. for a second micro-batch) is done with it. (With
            # retain_graph=True the graph runs again and reads them: they stay.)
            call.db.release(at_once=False)
        grads = [g if need else None for g, need in zip(grads, needs)]  # frozen: no gradient
        if call.ropts.grads == "buffer":
            unlink_stale(call.unit, call.locals, call.index, call.needs)
        pieces = reduce_unit(call.unit, call.index, grads, call.ropts,
                             views=call.ropts.grads != "buffer")
        if call.ropts.grads == "buffer" and call.ropts.grad_sync and call.entry is not None:
            grads_to_buffer(call)
        if call.ropts.grads == "buffer" or pieces is None:
            return (None,) * (1 + len(call.index))
        return (None, *[p if need else None for p, need in zip(pieces, needs)])


def unlink_stale(unit: Any, locals_: tuple, index: tuple, needs: tuple) -> None:
    """The shards' ``.grad`` were the unit's gradient buffer's views, and something other than
    vfsdp replaced them (a compiled ``zero_grads`` or backward, ``x.grad = None``): the
    ``.grad`` is the truth, so the buffer's values are stale. Drop them; what ``.grad`` holds
    now is added back when it is linked again (:func:`grads_to_buffer`)."""
    if unit.grad_linked and not all(x.grad is unit.grad_view(k)
                                    for x, k, need in zip(locals_, index, needs) if need):
        unit.grad_linked = False
        with torch.no_grad():  # a .grad still linked keeps its values (a copy of its own):
            # grads_to_buffer adds it into the buffer when it links the .grad again
            for x, k, need in zip(locals_, index, needs):
                if need and x.grad is unit.grad_view(k):
                    x.grad = x.grad.clone()
        unit.grads().release_shard()


def grads_to_buffer(call: _Call, accumulates: Optional[bool] = None) -> None:
    """``grads="buffer"`` in a pass that writes leaves' ``.grad`` (``backward()``): each
    shard's ``.grad`` is its piece of the unit's gradient buffer, a view (no memory of its
    own), so whoever reads ``.grad`` (torch, a compiled step, a later ``grads="return"``
    backward adding into it) reads and writes the buffer. Gradients autograd put in ``.grad``
    before (a ``grads="return"`` backward) are added into the buffer first. ``accumulates``:
    whether the pass writes ``.grad``, when known (else asked of the engine)."""
    if not (writes_leaf_grads(call) if accumulates is None else accumulates):
        return
    unit = call.unit
    with torch.no_grad():
        for x, k, need in zip(call.locals, call.index, call.needs):
            if not need:
                continue
            view = unit.grad_view(k)
            old = x.grad
            if old is view:
                continue
            if old is not None:
                unit.grads()  # the reduction in flight into the buffer lands first
                view.add_(old.view(view.shape))
            x.grad = view
    unit.grad_linked = True


def writes_leaf_grads(call: _Call) -> bool:
    """Whether the running backward writes leaves' ``.grad`` (``backward()``, not
    ``autograd.grad``): the engine will run a gathered shard's AccumulateGrad node."""
    x = next((x for x, need in zip(call.locals, call.needs) if need), None)
    if x is None:
        return False
    try:
        with torch.enable_grad():
            node = get_gradient_edge(x).node
    except (AttributeError, RuntimeError):  # e.g. inside torch.func: not a plain leaf
        return False
    return tp.will_execute(node)


def _assemble(leaves: list, spec: ShardSpec, calls: dict, make) -> Any:
    out = list(leaves)
    for key, members in spec.unit_leaves().items():
        call = calls.get(key) or make(key, tuple(k for _, k in members))
        call.recording = torch.is_grad_enabled()
        fulls = _GatherUnit.apply(call, *(leaves[i] for i, _ in members))
        mark_gathered(fulls, spec, members)  # under shard_map's check_vma (else nothing)
        for (i, _), f in zip(members, fulls):
            out[i] = f
    return optree.tree_unflatten(spec.treespec, out)


def _caller(spec, mesh, what, gopts, ropts):
    return lambda key, index: _Call(spec, key, index, mesh, what, gopts, ropts)


def gather(shards: Any, spec: ShardSpec, policy: Optional[Policy] = None, *,
           mesh: Any = None, **options: Any) -> Any:
    """Full tensors from this rank's shards: one in-place all-gather per unit. Differentiable.

    Works on the whole tree or any subtree with its sub-spec (``spec["layers"][3]``). The
    result's tensors are views into each unit's global buffer; they stay valid until
    :func:`vfsdp.release` (or a later gather refreshes them: gathering a gathered unit again
    is allowed and re-runs its all-gather). Non-tensor leaves pass through.

    Args:
        shards: The tree returned by :func:`vfsdp.shard` (or plain tensors of the right local
            shapes; those are copied into a temporary unit, one copy per tensor).
        spec: The plan (or the sub-spec of the subtree).
        policy: A :class:`vfsdp.Policy`: every option below at once, the same object for
            ``gather``, ``gather_async`` and ``run_layers``, eager and compiled.
        mesh: For plain-tensor shards: a ``DeviceMesh`` matching the spec (default: the
            default group). Shards from ``vfsdp.shard`` carry the mesh they were made on:
            passing one with them is deprecated (a ``FutureWarning``; it goes in 0.4).
        options: Any :class:`vfsdp.Policy` field as a keyword, overriding the policy's:

            * ``param_dtype``: gather in this dtype (e.g. ``torch.bfloat16`` for fp32 master
              shards): one cast over the unit's shard (a group op) into the all-gather input.
            * ``grad_reduce``: ``"avg"`` (default) or ``"sum"``: how the backward reduces
              across ranks.
            * ``reduce_dtype``: dtype of the backward's reduce-scatter (default: the gradient
              dtype).
            * ``accumulate_grads``: ``None`` (default) or ``True``: the reduced gradients add
              up across backwards until they are zeroed (:func:`vfsdp.zero_grads`), in the
              gradient DBuffer as in ``.grad``, as torch does (``True`` also silences the
              warning that this differs from 0.2). ``False`` is deprecated: it keeps 0.2's
              overwrite of the gradient buffer.
            * ``grad_sync``: ``False`` accumulates this backward's gradients unsharded (in
              ``reduce_dtype``) without communicating; the next backward with ``True`` adds
              its own and reduce-scatters the sum.
            * ``grads``: ``"return"`` (the default here) hands the gradient pieces to autograd
              (``.grad``, ``autograd.grad``, ``torch.func``); ``"buffer"`` leaves them in the
              gradient DBuffer (read them with :func:`vfsdp.grads`); ``backward()`` makes the
              shards' ``.grad`` its views, so ``.grad`` costs no memory.
            * ``free_after_backward``: release the unit's gathered buffer once its backward
              is done (default here: no, you hold the full tensors).
            * ``async_reduce``: with ``grads="buffer"``, start each unit's reduce-scatter and
              go on with the backward; readers of the gradients wait for it (default here:
              no).
            * ``all_gather``: low-precision all-gather hooks, e.g.
              ``vfsdp.functional.lowp.Float8()`` (float8 with per-tensor scales, half a bf16
              gather's bytes): each unit's shard goes through ``pre_all_gather`` /
              ``post_all_gather`` (:mod:`vfsdp.functional.lowp`); the backward
              reduce-scatters in ``reduce_dtype`` (float32 by default) into ``.grad``. A
              functional gather (no persistent buffers), eager and compiled alike.

    Returns:
        A tree like ``shards`` with full tensors.

    Raises:
        ValueError: structure, shape or dtype mismatch (naming the path), shards made for
            another spec or world size, a bad option value, or an option this path cannot
            honour (see :mod:`vfsdp.functional.options`).

    Example:
        >>> def step():
        ...     params = {"w": torch.arange(6.0).reshape(3, 2)}
        ...     spec = vfsdp.plan(params, 2, granularity=vfsdp.rows(1))
        ...     shards = vfsdp.shard(params, spec)
        ...     full = vfsdp.gather(shards, spec)
        ...     (full["w"] * (dist.get_rank() + 1)).sum().backward()
        ...     return full["w"].tolist(), shards["w"].grad.tolist()
        >>> for full, grad in vfsdp.testing.simulate(2, step):
        ...     print(full, grad)
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] [[1.5, 1.5], [1.5, 1.5]]
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] [[1.5, 1.5]]
    """
    what = "vfsdp.gather"
    values = merge(policy, options, what)
    if tp.compiling() or values["all_gather"] is not None:  # the functional path (traced)
        return _functional(shards, spec, mesh, values, what)
    gopts, ropts = _eager(values, what)
    leaves = match_tree(shards, spec, what)
    pending().settle()
    return _assemble(leaves, spec, {}, _caller(spec, own_mesh(leaves, mesh, what), what, gopts,
                                                ropts))


def _eager(values: dict, what: str, layers: bool = False) -> tuple:
    """The resolved eager options of a call, after refusing what the path cannot honour."""
    refuse(values, "torch.func" if functorch_active() else "eager", what)
    return resolve(values, layers)


def _functional(shards: Any, spec: ShardSpec, mesh: Any, values: dict, what: str) -> Any:
    """The functional gather: while compiling, or with ``all_gather=`` hooks (of shards
    made by ``vfsdp.shard`` only: ``mesh`` is ignored, as on the eager path)."""
    refuse(values, "compiled" if tp.compiling() else "all_gather", what)  # values checked too
    if not tp.compiling():
        own_mesh(shards, mesh, what)  # only vfsdp.shard's shards get here
    return traced_gather(shards, spec, values["param_dtype"], values["grad_reduce"],
                         values["reduce_dtype"], values["all_gather"], values["grad_sync"])


def start_gather(shards: Any, spec: ShardSpec, mesh: Any, gopts: GatherOptions,
                 ropts: GradOptions, what: str) -> Handle:
    """Start a tree's all-gathers; ``wait()`` returns what :func:`gather` would.

    The building block of :func:`gather_async` and :func:`vfsdp.run_layers`.
    """
    leaves = match_tree(shards, spec, what)
    pending().settle()
    make = _caller(spec, mesh, what, gopts, ropts)
    calls, handles = {}, []
    if not functorch_active():  # under torch.func the shards are wrapped until forward
        for u in units_of(leaves, spec, what, mesh=mesh, pack=True):
            call = make(u.key, u.index)
            call.unit = u.unit
            call.db, handle = u.unit.gather(gopts.param_dtype, async_op=True)
            calls[u.key] = call
            handles.append(handle)
    return GatherHandle(handles, leaves, spec, calls, make)


class GatherHandle(Handle):
    """The result of :func:`gather_async`: ``wait()`` finishes the unit's all-gathers and
    returns the full tree (what :func:`gather` returns, differentiable)."""

    def __init__(self, handles: list, leaves: list, spec: ShardSpec, calls: dict, make) -> None:
        super().__init__()
        self._handles, self._args = handles, (leaves, spec, calls, make)
        self.calls = calls  # unit key -> its gather (its unit, gathered buffer, shards)

    @classmethod
    def done_with(cls, result: Any) -> GatherHandle:
        """A handle whose gathers are done: ``wait()`` returns ``result``."""
        handle = cls([], [], None, {}, None)
        handle._result, handle._done = result, True
        return handle

    def wait(self) -> Any:
        if not self._done:
            for h in self._handles:
                h.wait()
            self._result = _assemble(*self._args)
            self._handles, self._args, self._done = [], None, True
        return self._result


def gather_async(shards: Any, spec: ShardSpec, policy: Optional[Policy] = None, *,
                 mesh: Any = None, **options: Any) -> Handle:
    """Start the all-gathers now; ``handle.wait()`` returns what :func:`gather` would.

    Takes the same policy and options as :func:`gather`. Use it to overlap the next unit's
    gather with the current unit's compute::

        nxt = vfsdp.gather_async(shards["layers"][i + 1], spec["layers"][i + 1])
        x = layer(full_i, x)
        full_next = nxt.wait()

    With ``all_gather=`` hooks the functional gather runs at once, and ``wait()`` returns
    its result.

    Args:
        shards: As for :func:`gather`.
        spec: As for :func:`gather`.
        policy: As for :func:`gather`.
        mesh: As for :func:`gather`.
        options: The keyword options of :func:`gather`.

    Returns:
        A :class:`GatherHandle` (a :class:`vfsdp.collectives.Handle`).

    Raises:
        TypeError: an unknown option.
        ValueError: as :func:`gather`; and under ``torch.compile`` (use :func:`gather`).

    Example:
        >>> def body():
        ...     params = {"layers": [{"w": torch.full((2,), float(i))} for i in range(2)]}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     nxt = vfsdp.gather_async(shards["layers"][1], spec["layers"][1])
        ...     return nxt.wait()["w"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[1.0, 1.0], [1.0, 1.0]]
    """
    what = "vfsdp.gather_async"
    if tp.compiling():
        raise ValueError("vfsdp.gather_async under torch.compile is not supported: its handle "
                         "is eager state the compiler cannot trace; call vfsdp.gather, whose "
                         "all-gathers the compiler schedules (and overlaps) itself")
    values = merge(policy, options, what)
    if values["all_gather"] is not None:
        return GatherHandle.done_with(_functional(shards, spec, mesh, values, what))
    gopts, ropts = _eager(values, what)
    return start_gather(shards, spec, own_mesh(shards, mesh, what), gopts, ropts, what)
