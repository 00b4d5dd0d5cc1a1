"""Layer-by-layer execution with FSDP memory behaviour, and no module wrapping.

``run_layers(layer_fn, shards["layers"], spec["layers"], h)`` runs ``h = layer_fn(full_i, h)``
for each unit ``i`` and, like FSDP2's ``fully_shard`` on every block:

* **forward**: gathers unit ``i+1`` (async) while unit ``i`` computes, and releases unit ``i``'s
  gathered parameters right after its forward (``reshard_after_forward=True``; the last unit
  stays gathered, its backward comes first);
* **backward**: autograd's saved references to gathered parameters are kept as (buffer, offset)
  records by ``torch.autograd.graph.saved_tensors_hooks``; when backward needs them the unit
  is gathered again (and unit ``i-1`` is prefetched), activations are *not* recomputed;
* as soon as a unit's backward is done its gradients are reduce-scattered (async, overlapping
  the next unit's backward) into its gradient DBuffer and its gathered buffer is released.

So at most two units' full parameters are gathered at once in forward and in backward.

A layer may come from several plans: with ``specs=None`` each layer is a dict of pieces,
``{"dense": (shards, spec), "experts": (shards, spec)}`` (an MoE layer: dense on every rank,
experts on the expert-data mesh; :mod:`vfsdp.functional.pieces`). Its pieces are gathered
together as one step, prefetched, resharded and regathered like one unit each, and each
reduce-scatters over its own groups; ``layer_fn`` gets ``{name: full tree}``.
``reshard_after_forward=False`` keeps every unit gathered until its backward (no regather).
Gradients land in the gradient DBuffers only; read them with :func:`vfsdp.grads`.

A saved tensor is recognised as a gathered parameter by its :class:`~vfsdp.collectives.Slot`
(or its view base's): the run keeps its own table of the buffers it gathered, nothing global.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import optree
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from vfsdp import _torch_private as tp
from vfsdp.collectives.comm import Handle
from vfsdp.collectives.dbuffer import SLOT, DBuffer, ReleasedTensor, View, slot_of
from vfsdp.functional.gather import pending, start_gather, writes_leaf_grads
from vfsdp.functional.options import Policy, merge, refuse, resolve
from vfsdp.functional.pieces import assemble_layer, layer_pieces
from vfsdp.functional.traced import traced_run_layers
from vfsdp.planner.spec import ShardSpec

__all__ = ["run_layers", "LayerRun", "checkpointed", "SAVED_OPS"]


class _Saved:
    """A saved gathered parameter, kept as a record instead of a tensor."""

    __slots__ = ("db", "offset", "shape", "stride")

    def __init__(self, db: DBuffer, t: torch.Tensor) -> None:
        self.db, self.offset, self.shape, self.stride = db, t.storage_offset(), t.shape, t.stride()


def run_layers(
    layer_fn: Callable[[Any, Any], Any],
    shards: Sequence[Any],
    specs: Optional[Sequence[ShardSpec]],
    h: Any,
    policy: Optional[Policy] = None,
    *,
    mesh: Any = None,
    **options: Any,
) -> Any:
    """Run ``h = layer_fn(full_i, h)`` over units with FSDP prefetch, release and regather.

    Args:
        layer_fn: ``(full parameters of one unit, h) -> h``; with pieces, ``({name: full
            tree of that piece}, h) -> h``.
        shards: One shards subtree per unit, in execution order (e.g. ``shards["layers"]``);
            or, with ``specs=None``, one dict of pieces per layer, each ``(shards, spec)`` or
            ``(shards, spec, mesh)`` (the mesh as ``mesh=`` below, for that piece).
        specs: The matching sub-specs: ``spec["layers"]`` itself, or a list of them; ``None``
            with pieces.
        h: The input of the first unit.
        mesh: As for :func:`vfsdp.gather` (refused with shards of ``vfsdp.shard``); with
            pieces, in each piece's tuple.
        policy: A :class:`vfsdp.Policy`, as for :func:`vfsdp.gather` (the same object
            serves both). Its ``None`` fields take ``run_layers``' defaults: ``grads`` is
            ``"buffer"`` (the only value accepted eagerly), and ``free_after_backward`` and
            ``async_reduce`` are ``True`` (vfsdp alone holds the full tensors and runs the
            backward unit by unit). With ``all_gather=`` hooks each unit is gathered by the
            functional path, its gathers recomputed in backward, its gradients to ``.grad``.
        options: Any :class:`vfsdp.Policy` field as a keyword, overriding the policy's;
            here also ``prefetch`` (default ``True``: gather unit ``i+1`` while unit ``i``
            computes, and ``i-1`` in backward) and ``reshard_after_forward`` (default
            ``True``: release each unit but the last after its forward and gather it again
            in backward; ``False`` keeps them gathered until their backward).

    Returns:
        The last unit's output.

    Raises:
        ValueError: ``shards`` and ``specs`` differ in length, ``grads="return"``, an
            option :func:`vfsdp.gather` refuses, or a piece's shards that do not match its
            spec (naming the layer and the piece).
        TypeError: an unknown option, or a layer or piece of the wrong form (naming them).

    Example:
        >>> def body():
        ...     params = {"layers": [{"w": torch.full((4, 2), 0.5)} for _ in range(3)]}
        ...     spec = vfsdp.plan(params, 2, granularity=vfsdp.rows(1))
        ...     shards = vfsdp.shard(params, spec)
        ...     h = vfsdp.run_layers(lambda p, x: x @ p["w"] @ p["w"].T, shards["layers"],
        ...                          spec["layers"], torch.ones(1, 4))
        ...     h.sum().backward()                 # each rank: its mean gradient, its rows
        ...     return h.tolist(), vfsdp.grads(shards, spec)["layers"][0]["w"].tolist()
        >>> for h, grad in vfsdp.testing.simulate(2, body):
        ...     print(h, grad)
        [[8.0, 8.0, 8.0, 8.0]] [[16.0, 16.0], [16.0, 16.0]]
        [[8.0, 8.0, 8.0, 8.0]] [[16.0, 16.0], [16.0, 16.0]]

        Two plans per layer, gathered as one step: ``a`` sharded over both ranks, ``b``
        over ``"dp"`` of a (dp=1, ep=2) mesh (each rank holds it whole, as an expert-parallel
        rank holds its experts):

        >>> def pieces():
        ...     a = {"layers": [{"w": torch.full((4, 2), 0.5)} for _ in range(3)]}
        ...     b = {"layers": [{"v": torch.full((2, 4), 0.25)} for _ in range(3)]}
        ...     mesh = vfsdp.mesh(("dp", 1), ("ep", 2))
        ...     a_spec = vfsdp.plan(a, 2)
        ...     b_spec = vfsdp.plan(b, mesh, tp=lambda path: Replicate(), tp_axis="ep")
        ...     a_shards, b_shards = vfsdp.shard(a, a_spec), vfsdp.shard(b, b_spec, mesh=mesh)
        ...     layers = [{"a": (a_shards["layers"][i], a_spec["layers"][i]),
        ...                "b": (b_shards["layers"][i], b_spec["layers"][i])} for i in range(3)]
        ...     h = vfsdp.run_layers(lambda p, x: x @ p["a"]["w"] @ p["b"]["v"], layers, None,
        ...                          torch.ones(1, 4))
        ...     return h.tolist()
        >>> vfsdp.testing.simulate(2, pieces)[0]
        [[1.0, 1.0, 1.0, 1.0]]
    """
    what = "vfsdp.run_layers"
    if tp.functorch_active():
        raise ValueError(f"{what} cannot run inside torch.func transforms: it keeps each unit's "
                         f"gradients in its gradient buffer; use vfsdp.gather (grads='return') "
                         f"there")
    policy = merge(policy, options, what)
    if tp.compiling() or policy.all_gather is not None:  # the functional path: to .grad
        refuse(policy, "compiled" if tp.compiling() else "all_gather", what)
        return traced_run_layers(layer_fn, layer_pieces(shards, specs, mesh, what), h, policy)
    run = LayerRun(layer_pieces(shards, specs, mesh, what), policy, what)
    n = len(run.layers)
    for i in range(n):
        full, dbs = run.enter(i, i + 1 if i + 1 < n else None)
        h = run.call(layer_fn, full, (h,), {})
        run.exit(dbs, last=i + 1 == n)
    run.finish()
    return h


class LayerRun:
    """One ``run_layers`` call, step by step: :meth:`enter` gathers a layer (prefetching the
    next), :meth:`call` runs it under the saved-tensor hooks (checkpointed with
    ``recompute``), :meth:`exit` reshards it. :func:`run_layers` steps through the layers in
    order; ``apply.run_layers`` (:mod:`vfsdp.interop.module`) steps as the module's forward
    calls its blocks.

    Raises:
        ValueError: ``grads="return"`` (the eager path honours every other option).
    """

    def __init__(self, layers: list, policy: Policy, what: str) -> None:
        if policy.grads == "return":
            raise ValueError(f"{what}: grads='return' is not supported: each unit's gradients "
                             f"are reduce-scattered into its gradient buffer as its backward "
                             f"ends; read them with vfsdp.grads (use vfsdp.gather for "
                             f"grads='return')")
        self.policy = resolve(policy, layers=True)
        self.layers = layers
        # recompute's context_fn for torch.utils.checkpoint: None (no checkpointing), "full"
        # (nothing kept), "selective" (SAVED_OPS' outputs kept) or a SAC policy
        recompute = policy.recompute
        self.context_fn = None if recompute is None else noop_context_fn if recompute == "full" \
            else functools.partial(create_selective_checkpoint_contexts,
                                   list(SAVED_OPS) if recompute == "selective" else recompute)
        self.ahead: dict[int, list[Handle]] = {}  # layer -> its gathers in flight
        self.held: list[DBuffer] = []  # what regathered() gathered, until the next call
        # The run's gathered buffers, for its saved-tensor hooks: which saved tensors are its
        # gathered parameters, and the gathers whose shards a regather re-reads. The regather
        # and the prefetch themselves are the units' transitions (Unit.pre_backward).
        self.last: Optional[DBuffer] = None  # the buffer gathered before (for the prefetch)
        self.calls: dict[int, list] = {}  # buffer id -> its gathers in this run
        self.packed: set = set()  # buffer ids saved by the layer running now

    def hooks(self) -> tuple[torch.autograd.graph.saved_tensors_hooks, Optional[tuple]]:
        """A layer call's saved-tensor hooks: a gathered parameter as a record; anything else
        handed to the hooks active around the call (a ``torch.utils.checkpoint`` around several
        layers: its recompute then replays them, ``save_on_cpu``), or kept; and those."""
        outer = tp.saved_hooks_top()

        def pack(t: torch.Tensor) -> Any:
            slot = slot_of(t) or slot_of(t._base)
            if slot is not None and slot.view is View.FULL and id(slot.buffer) in self.calls:
                self.packed.add(id(slot.buffer))
                return _Saved(slot.buffer, t)
            if outer is not None:
                return outer[0](t)
            # An op that saves its own output (tanh, relu) must not get that output back as
            # it is: its grad_fn would hold this record, a cycle through C++ that Python's
            # collector cannot break, so a graph dropped without its backward (an evaluation
            # with grad mode on, an exception) would never be freed. A detached alias (no
            # kernel, no copy, the same version counter) is what autograd keeps of its outputs
            # without hooks, too.
            return t.detach() if tp.is_own_output(t) else t

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, _Saved):
                return self.unpack(saved)
            return saved if outer is None else outer[1](saved)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack), outer

    def join(self, db: DBuffer) -> None:
        """In a backward, before ``db``'s unit is regathered: units created after the running
        node that did not run reduce (zeros) first, as they do on a rank whose backward
        reaches one of their nodes before this."""
        seq = tp.running_node_seq()
        calls = self.calls.get(id(db), ())
        if seq is not None and calls:
            pending().backward(lambda: writes_leaf_grads(calls[0])).reach(seq)

    def unpack(self, saved: _Saved, prefetch: bool = True) -> torch.Tensor:
        self.join(saved.db)
        for call in self.calls.get(id(saved.db), ()):
            call.check_versions()  # a shard changed since the forward: refuse to regather it
        saved.db.unit.pre_backward(saved.db, prefetch)
        buf = saved.db.global_buffer
        return saved.db.saved_view(saved.offset - buf.storage_offset(), saved.shape, saved.stride)

    def _start(self, i: int) -> list[Handle]:  # every piece's gathers: one step
        return [start_gather(p.tree, p.spec, p.mesh, self.policy, p.what, regathers=True)
                for p in self.layers[i]]

    def enter(self, i: int, nxt: Optional[int]) -> tuple[Any, list[DBuffer]]:
        """Layer ``i``'s full tensors (gathered now, or the prefetch waited), and their
        buffers; the gather of layer ``nxt`` starts (``prefetch``)."""
        handles = self.ahead.pop(i, None) or self._start(i)
        full = assemble_layer(self.layers[i], [handle.wait() for handle in handles])
        for call in (call for handle in handles for call in handle.calls.values()):
            if id(call.db) not in self.calls:  # its backward prefetches the one gathered before
                call.db.unit.link_prefetch(self.last if self.policy.prefetch else None)
                self.last = call.db
            self.calls.setdefault(id(call.db), []).append(call)
        if nxt is not None and self.policy.prefetch and nxt != i and nxt not in self.ahead:
            self.ahead[nxt] = self._start(nxt)
        return full, _gathered_buffers(full)

    def call(self, fn: Callable, full: Any, args: tuple, kwargs: dict) -> Any:
        """``fn(full, *args, **kwargs)`` under the run's saved-tensor hooks; with
        ``recompute``, checkpointed (:func:`checkpointed`)."""
        self.packed = set()
        hooks, outer = self.hooks()
        with hooks:
            if self.context_fn is not None:
                out = checkpointed(fn, full, args, kwargs, self.context_fn)
            else:
                with tp.checkpoint_wrapped(lambda f: f):  # a reentrant checkpoint in fn: as non-reentrant
                    out = fn(full, *args, **kwargs)
        if torch.is_grad_enabled():
            if self.context_fn is not None:
                # its recompute, which regathers, runs only on ranks where the layer saved
                # something: every rank joins the backward pass at the output (and reduces
                # zeros where it does not run the unit's backward)
                dbs = _gathered_buffers(full)
                _watch(out, (args, kwargs), lambda grad: dbs and self.join(dbs[0]))
            elif not self.packed:
                # the forward saved none of the gathered tensors: a checkpoint of its own did
                # (or the layer did not use them: what it returns as it was given is not
                # watched, so a rank that skips a layer issues no regather the others do not)
                refresh = self.refresher(full)
                if refresh.args[0]:  # (spots to fill)
                    _watch(out, (args, kwargs), refresh)
            _trigger(outer, out, (args, kwargs))
        return out

    def regathered(self, full: Any) -> Any:
        """In a backward, a layer's ``full`` tree of its forward again, for a recompute of its
        call (a checkpoint around several layers): each unit gathered now, without the
        backward's prefetch, as new tensors requiring grad as the forward's did (so the
        recompute saves what the forward saved) and read as gathered parameters by
        :meth:`call`'s hooks. What the previous call gathered is released first (resharded)
        unless this layer reads it; :attr:`held` is what it gathered."""
        mine = _gathered_buffers(full)
        for db in self.held:
            if db not in mine:
                db.unit.reshard(db)
        self.held = [db for db in mine if db in self.held or not db.is_allocated]

        def fresh(v: Any) -> Any:
            slot = slot_of(v)
            if slot is None or slot.view is not View.FULL:
                return v
            t = self.unpack(_Saved(slot.buffer, v), prefetch=False).detach()
            setattr(t.requires_grad_(v.requires_grad), SLOT, slot)
            return t

        return optree.tree_map(fresh, full)

    def refresher(self, full: Any) -> Callable[[Any], None]:
        """Called in a backward (once), it replaces ``full``'s tensors released since, in
        place, by views of the regathered unit: what a recompute of the layer reads.

        A ``torch.utils.checkpoint`` of the user's inside a layer reads the full tensors when
        the backward recomputes the layer, from the tree it was given (``checkpoint(f, full,
        h)``: the dict is kept as it is, its tensors released since): the replacements are
        the views the saved-tensor hooks hand out. ``refresher(full).args[0]``: the spots it
        fills."""
        return functools.partial(self._refresh, list(_spots(full)))

    def _refresh(self, spots: list, grad: Any) -> None:
        todo, spots[:] = list(spots), []
        for node, k, saved, wants in todo:
            if type(node[k]) is ReleasedTensor:
                fresh = self.unpack(saved).detach().requires_grad_(wants)
                if wants:  # a recompute differentiated through: a reentrant checkpoint
                    fresh.register_hook(_reentrant)
                node[k] = fresh

    def exit(self, dbs: list[DBuffer], last: bool) -> None:
        """After a layer's forward: reshard it (``reshard_after_forward``; not the last). A
        layer left gathered is read by its backward as a plain gather's is: its gathers hold
        the memory until then (a later forward's gather of the unit, dropped, cannot free it)."""
        for db in dbs:
            if self.policy.reshard_after_forward and not last:
                db.unit.reshard(db)
                continue
            for call in self.calls.get(id(db), ()):
                if call.regathers and call.holds_graph:
                    call.regathers = False
                    db.unit.keep_gathered(db)

    def finish(self) -> None:
        """Prefetches no layer used (a forward that stopped early): finished and resharded
        (a unit an earlier call used is gathered again for its backward)."""
        for handles in self.ahead.values():
            for handle in handles:
                handle.wait()
                for call in handle.calls.values():
                    call.db.unit.reshard(call.db)
        self.ahead.clear()
        if torch.is_grad_enabled():
            # Frozen units (no gather of theirs records a backward, so no post-backward
            # releases them) may be regathered or prefetched for the inputs' gradients: the
            # next backward pass releases them as it ends.
            for calls in self.calls.values():
                if not any(c.recorded for c in calls):
                    pending().frozen[id(calls[0].unit)] = calls[0].unit


def _trigger(outer: Optional[tuple], out: Any, inputs: Any) -> None:
    """Inside a ``torch.utils.checkpoint`` (any ``outer`` hooks): one empty tensor saved
    through them after the layer, unpacked as the backward reaches the layer's output.
    Whether a checkpoint recomputes, and up to where (torch stops a recompute once it has
    what was saved), then does not depend on what the layer saved on this rank: its
    recompute, which gathers the layer again, runs as far on every rank."""
    outs = _outputs(out, inputs)
    if outer is None or not outs:
        return
    holder, done = outer[0](outs[0].new_empty(0)), set()

    def hook(grad: torch.Tensor) -> None:
        if tp.graph_task_id() not in done:  # once per backward pass
            done.add(tp.graph_task_id())
            outer[1](holder)

    _watch(out, inputs, hook)


def _outputs(out: Any, inputs: Any) -> list[torch.Tensor]:
    """The tensors of ``out`` requiring grad that are not ``inputs`` (given back as they
    were)."""
    given = {id(t) for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    return [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)
            and t.requires_grad and id(t) not in given]


def _watch(out: Any, inputs: Any, hook: Callable) -> None:
    """``hook`` on the gradient of each of :func:`_outputs`."""
    for t in _outputs(out, inputs):
        t.register_hook(hook)


def _spots(node: Any) -> Iterator[tuple]:
    """``(container, key, record, requires_grad)`` of each gathered full tensor in the dicts
    and lists of ``node``."""
    for k, v in node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ():
        if not isinstance(v, torch.Tensor):
            yield from _spots(v)
        elif (slot := slot_of(v)) is not None and slot.view is View.FULL:
            yield node, k, _Saved(slot.buffer, v), v.requires_grad


def _reentrant(grad: torch.Tensor) -> None:
    raise RuntimeError(
        "vfsdp.run_layers: torch.utils.checkpoint(use_reentrant=True) inside layer_fn is not "
        "supported: its recompute differentiates the regathered tensors, which are not the "
        "gather's outputs, so the unit's gradients would be lost; pass use_reentrant=False, "
        "or run_layers(..., recompute='full')")


#: ``recompute="selective"``'s policy: the matmuls' and attention's outputs are kept, the rest
#: (norms, activations, elementwise work) recomputed.
SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default)


def checkpointed(fn: Callable, full: Any, args: tuple, kwargs: dict, context_fn: Callable) -> Any:
    """``fn(full, *args, **kwargs)`` under non-reentrant ``torch.utils.checkpoint``, the
    full tensors passed as its inputs: saved by the hooks around the call (a run's records of
    gathered parameters), so the recompute reads what the backward regathered, not the
    released tensors of the forward."""
    leaves, treespec = optree.tree_flatten(full)
    wants = [t.requires_grad for t in leaves]
    n = len(leaves)

    def inner(*flat: Any, **kw: Any) -> Any:
        # A regathered parameter comes back as a plain view: it requires grad as the forward's
        # did, so the recompute saves the same tensors (its gradient flows by the forward's
        # graph, to the gather)
        ts = [t.detach().requires_grad_() if want and not t.requires_grad else t
              for t, want in zip(flat[:n], wants)]
        return fn(optree.tree_unflatten(treespec, ts), *flat[n:], **kw)

    with tp.checkpoint_wrapped(None):  # its recompute reads ``full`` itself
        return checkpoint(inner, *leaves, *args, use_reentrant=False,
                          context_fn=context_fn, **kwargs)


def _gathered_buffers(full: Any) -> list[DBuffer]:
    slots = (slot_of(t) for t in optree.tree_leaves(full))
    return list({id(s.buffer): s.buffer for s in slots if s is not None and s.view is View.FULL}.values())
