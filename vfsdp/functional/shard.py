"""``vfsdp.shard``: this rank's shards of a parameter tree, and ``vfsdp.release``.

Every unit of the spec gets one :class:`~vfsdp.collectives.Unit` on this rank, and every tensor
leaf of the result is a local view of its parameter buffer that carries the unit with it:
later stages (gather, gradients, clipping, optimizers, checkpoints) take the buffers from the
shards they are given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from vfsdp import _torch_private as tp
from vfsdp.collectives.comm import resolve_groups, side_group
from vfsdp.collectives.dbuffer import slot_of
from vfsdp.functional.gather import pending
from vfsdp.functional.scatter import make_shards, scatter
from vfsdp.functional.tree import find_unit, match_tree
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["shard", "release", "dbuffers", "InitFn"]

InitFn = Callable[[tuple, torch.Tensor, TensorSpec], Optional[torch.Tensor]]


def shard(
    params: Any,
    spec: ShardSpec,
    *,
    mesh: Any = None,
    src: Optional[int] = None,
    init_fn: Optional[InitFn] = None,
    requires_grad: bool = True,
) -> Any:
    """This rank's shards of ``params``: a tree of the same structure, of views into DBuffers.

    Every unit of the spec gets one parameter DBuffer holding this rank's ``S`` elements; each
    tensor leaf of the result is a leaf tensor aliasing its slice (shape: its local shape, 0
    rows on ranks that hold none of it). Non-tensor leaves pass through.

    Three ways to provide the values:

    * ``src=None``, real tensors on every rank: each rank copies its own pieces (no
      communication).
    * ``src=0`` (or another global rank): real tensors on that rank only; other ranks pass a
      tree of the same structure (``meta`` tensors are fine). The source packs one unit at a
      time and scatters it (:func:`vfsdp.scatter`), so it never holds the model twice.
    * ``init_fn``: ``params`` may be ``meta``; each rank calls ``init_fn(path, local, tspec)``
      for each of its pieces, which fills ``local`` in place or returns its values.

    Args:
        params: The parameter tree the spec was planned for.
        spec: The plan.
        mesh: A ``DeviceMesh`` matching ``spec.mesh_shape``; default: the default group.
        src: The rank holding the full tensors (see above).
        init_fn: Per-piece initialiser (exclusive with ``src``).
        requires_grad: Make floating-point shards require grad, except the frozen ones
            (``spec.frozen``: parameters with ``requires_grad=False``, which stay so).

    Returns:
        The tree of local shards.

    Raises:
        ValueError: a tree, shape or dtype mismatch (naming the path), a spec planned for
            another world size or mesh, ``src`` not a rank, or both ``src`` and ``init_fn``.
        RuntimeError: no process group.

    Example:
        >>> def body():
        ...     params = {"w": torch.arange(6.0).reshape(3, 2), "step": "passes through"}
        ...     spec = vfsdp.plan(params, 2, granularity=vfsdp.rows(1))
        ...     shards = vfsdp.shard(params, spec)
        ...     return shards["w"].tolist(), shards["step"]
        >>> vfsdp.testing.simulate(2, body)
        [([[0.0, 1.0], [2.0, 3.0]], 'passes through'), ([[4.0, 5.0]], 'passes through')]
    """
    if src is not None and init_fn is not None:
        raise ValueError("pass either src or init_fn, not both")
    if dist.is_initialized() and dist.get_world_size() > 1:
        side_group()  # made here, by every rank alike: the backward's agreement runs on it
    if init_fn is None:
        return scatter(params, spec, src, mesh=mesh, requires_grad=requires_grad)
    leaves = match_tree(params, spec, "vfsdp.shard")

    def init(db, members):  # each piece filled by init_fn, or from what it returns
        for k in dict.fromkeys(k for _, k in members):  # a tie is initialised once
            t, local = db.tensors[k], db.local(k)
            got = init_fn(t.path, local, t)
            if got is None:
                continue
            got = torch.as_tensor(got, device=local.device)
            if got.numel() != local.numel():
                raise ValueError(f"vfsdp.shard: init_fn returned {got.numel()} values "
                                 f"({tuple(got.shape)}) for {format_path(t.path)}, whose piece on "
                                 f"this rank has {local.numel()} ({tuple(local.shape)}); fill the "
                                 f"piece it is given in place, or return exactly that many values")
            local.copy_(got.reshape(local.shape))

    return make_shards(spec, resolve_groups(spec, mesh), leaves, init, requires_grad)


def release(tree: Any, spec: ShardSpec) -> None:
    """Free the gathered buffers of the units in ``tree``; views stay valid objects.

    ``tree`` may be the shards or the gathered full tree. The full tensors handed out become
    :class:`~vfsdp.collectives.dbuffer.ReleasedTensor` s at once (any torch operation on them
    raises, naming the unit) until the unit is gathered again. The memory is freed at once, or,
    while a backward through them is still pending, as soon as that backward is done or its
    graph is dropped: the backward still reads what it saved.

    Args:
        tree: The shards (``vfsdp.shard``'s tree) or the gathered tree, or a subtree of either.
        spec: Its (sub-)spec.

    Returns:
        ``None``.

    Raises:
        ValueError: the tree does not match the spec, or under ``torch.compile``.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     full = vfsdp.gather(shards, spec)
        ...     loss = full["w"].sum()
        ...     vfsdp.release(shards, spec)     # the backward below still needs the unit
        ...     kept = slot_of(full["w"]).buffer.is_allocated
        ...     loss.backward()                 # ... then it is freed
        ...     return type(full["w"]).__name__, kept, slot_of(full["w"]).buffer.is_allocated
        >>> vfsdp.testing.simulate(2, body)
        [('ReleasedTensor', True, False), ('ReleasedTensor', True, False)]
    """
    if tp.compiling():
        raise ValueError("vfsdp.release under torch.compile is not supported: compiled gathers "
                         "hold no vfsdp buffers (the compiler owns and frees theirs); drop it from "
                         "the compiled function, or call it outside")
    leaves = match_tree(tree, spec, "vfsdp.release")
    pending().settle()  # graphs dropped since: their memory may go now
    units = {id(unit): unit for key, members in spec.unit_leaves().items() for i, _ in members
             if (slot := slot_of(leaves[i])) is not None and (unit := slot.unit) is not None
             and unit.key == key}
    for unit in units.values():
        unit.release()


def dbuffers(tree: Any, spec: ShardSpec) -> dict:
    """``unit key -> parameter DBuffer`` for the units whose leaves in ``tree`` are shards.

    Args:
        tree: The shards :func:`vfsdp.shard` returned (or any tree matching ``spec``).
        spec: Their plan.

    Returns:
        A dict ``unit key -> DBuffer``; units whose leaves are plain tensors are left out.

    Raises:
        TypeError: as :func:`match_tree` (swapped arguments, a module, ...).
        ValueError: the tree does not match the spec, or its shards are inconsistent.

    Example:
        >>> def body():
        ...     params = {"layers": [{"w": torch.ones(4)}], "head": torch.ones(2)}
        ...     spec = vfsdp.plan(params, 2)
        ...     found = dbuffers(vfsdp.shard(params, spec), spec)
        ...     return sorted(found), dbuffers(params, spec)    # plain tensors: no buffers
        >>> vfsdp.testing.simulate(2, body)[0]
        ([(), ('layers', 0)], {})
    """
    leaves = match_tree(tree, spec, "vfsdp.dbuffers")
    return {key: unit.params for key, members in spec.unit_leaves().items()
            if (unit := find_unit([leaves[i] for i, _ in members], spec.units[key],
                                  [k for _, k in members], "vfsdp.dbuffers")) is not None}
