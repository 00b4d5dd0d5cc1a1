"""Differentiable collectives over a named mesh axis, as JAX's ``lax.psum`` & co.

Inside a training step every rank runs the same code on its own piece; these functions are
the communication, and autograd turns each into its transpose (Megatron's conventions):

==============================  =====================================  ======================
function                        forward, over the ranks of ``axis``    backward
==============================  =====================================  ======================
``psum(x, axis)``               sum (every rank gets it)               identity
``pmean(x, axis)``              mean                                   ``/ size``
``pvary(x, axis)``              identity                               ``psum``
``all_gather(x, axis, dim)``    concatenate along ``dim``              ``psum_scatter``
``psum_scatter(x, axis, dim)``  sum, rank ``i`` keeps chunk ``i``      ``all_gather``
``all_to_all(x, axis, s, c)``   chunk ``j`` of ``dim s`` to rank ``j``,  ``all_to_all(c, s)``
                                concatenated along ``dim c``
``axis_index(axis)``            this rank's index along ``axis``       (an int, varying)
``axis_size(axis)``             the number of ranks along ``axis``     (an int)
==============================  =====================================  ======================

The two conventions that matter: a ``psum`` result is replicated and so is the code after it,
so its cotangent is the same on every rank and counts once (backward: identity); a value that
is replicated but feeds *different* code on each rank (the input of a column-parallel matmul)
is marked with ``pvary``, whose backward sums the ranks' cotangents. ``all_gather``,
``psum_scatter`` and ``all_to_all`` move data, and their backwards move cotangents back.

``axis`` may be a tuple of names, in the mesh's order: ``psum(x, ("dp", "tp"))`` sums over
every rank that differs from this one only along ``dp`` and ``tp``, as one axis whose index is
row-major over them (``all_gather`` concatenates in that order, ``psum_scatter`` gives the
rank of combined index ``i`` chunk ``i``); the backward is the same transposed collective over
the same ranks. ``axis_index``/``axis_size`` of a tuple are the combined index and size.

Sizes may be uneven: ranks may hold different sizes along the gathered dim; ``psum_scatter``
cuts like ``torch.tensor_split`` (the first ``len % size`` chunks one longer); ``all_to_all``
takes ``split_sizes`` per rank. Every function works with ``loss.backward()``,
``torch.autograd.grad`` and ``torch.func`` (``jvp``: the collective of the tangent), on gloo,
NCCL and ``vfsdp.testing.simulate``. Each backward is made of these differentiable functions
(psum's of pvary, pvary's of psum, all_gather's of psum_scatter and back, all_to_all's of
all_to_all), so double backward (``create_graph=True``) differentiates through them. The mesh
is ``mesh=`` or the innermost ``with use_mesh(m):``. Reference semantics (a loop over ranks):
``tests/spmd/lax_reference.py``. In a :func:`vfsdp.shard_map` body (``check_vma``) a
collective of a value invariant over its axes ``pvary``-s it first, as JAX's (``"strict"``:
an error); a ``pvary`` of a varying value is refused (:mod:`vfsdp.spmd.vma`).

Every rank must run the same collectives, the backward's included. Autograd runs a
collective's backward only where its result reaches the loss: if it does on some ranks only
(an expert-parallel rank none of whose experts got a token leaves the tokens it received
unused), the others wait in that backward for ever. Keep the result in the loss on every
rank, with an empty term where nothing else uses it (``out + received[:0].sum()``, as
:func:`vfsdp.testing.moe.moe_ep` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from vfsdp import _torch_private as tp
from vfsdp.collectives import comm
from vfsdp.collectives.comm import control_device
from vfsdp.collectives.mesh import Axis, axis_names, axis_of, current_mesh, use_mesh
from vfsdp.placements.strided import split_lengths
from vfsdp.spmd import vma

__all__ = ["psum", "pmean", "pvary", "all_gather", "psum_scatter", "all_to_all", "axis_index",
           "axis_size", "use_mesh", "current_mesh"]

_MAX_DIMS = 8
Axes = Union[str, tuple]  # one mesh axis name, or a tuple of them in the mesh's order


# ---------------------------------------------------------------- raw collectives (no autograd)

def _psum(x: torch.Tensor, ax: Axis, scale: float, what: str = "psum") -> torch.Tensor:
    """Sum ``x`` over the axis, times ``scale``. An all-reduce of tensors whose sizes differ
    gives some ranks a result and others a transport error or a hang, so off CUDA the ranks
    first agree on its shape (one small all-gather, :func:`_shapes`) and all raise the same
    error. On CUDA that would be a host sync in every sum (four per tensor-parallel layer and
    step): there torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every collective's shapes
    instead."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    if ax.size > 1:
        shapes = _shapes(x, ax, what) if x.device.type != "cuda" else [tuple(x.shape)]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(f"{what} over {ax.name!r}: the ranks' shapes {shapes} differ; "
                             f"every rank of the axis must pass a tensor of the same shape "
                             f"(pad it, or all_gather pieces of different sizes)")
        with tp.functorch_paused():
            comm.all_reduce_(out, "sum", ax.group)
    return out if scale == 1 else out.mul_(scale)


def _shapes(x: torch.Tensor, ax: Axis, what: str) -> list[tuple]:
    """Every rank's shape of ``x`` along the axis (one small all-gather)."""
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"{what}: tensors of up to {_MAX_DIMS} dims, got {x.dim()}")
    if ax.size == 1:
        return [tuple(x.shape)]
    mine = torch.tensor([x.dim(), *x.shape] + [-1] * (_MAX_DIMS - x.dim()), dtype=torch.int64,
                        device=control_device(x.device))
    every = mine.new_empty(ax.size * (_MAX_DIMS + 1))
    with tp.functorch_paused():
        comm.all_gather_into(every, mine, ax.group, count="shape_exchange")
    return [tuple(r[1:1 + r[0]]) for r in every.view(ax.size, -1).tolist()]


def _gather(x: torch.Tensor, ax: Axis, dim: int, shapes: Sequence[tuple]) -> torch.Tensor:
    """Concatenate every rank's ``x`` (of ``shapes``) along ``dim``: one all-gather, padded to
    the largest piece where they differ."""
    if ax.size == 1:
        return x.detach().clone(memory_format=torch.contiguous_format)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    width = max(numels)
    flat = x.detach().movedim(dim, 0).reshape(-1)
    send = flat if flat.numel() == width else torch.cat(
        [flat, flat.new_zeros(width - flat.numel())])
    recv = flat.new_empty(ax.size * width)
    with tp.functorch_paused():
        comm.all_gather_into(recv, send.contiguous(), ax.group)
    pieces = [recv[r * width:r * width + numels[r]].view(s[dim], *s[:dim], *s[dim + 1:])
              for r, s in enumerate(shapes)]
    return torch.cat(pieces, 0).movedim(0, dim)


def _scatter(x: torch.Tensor, ax: Axis, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Sum ``x`` over the axis; this rank keeps its chunk (``sizes`` along ``dim``): one
    reduce-scatter, each chunk padded to the largest."""
    if ax.size == 1:
        return x.detach().clone(memory_format=torch.contiguous_format)
    moved = x.detach().movedim(dim, 0)
    rest = moved.shape[1:]
    inner = int(rest.numel())
    send = torch.nn.utils.rnn.pad_sequence(list(moved.split(list(sizes), 0)), batch_first=True)
    out = moved.new_empty(max(sizes) * inner)
    with tp.functorch_paused():
        comm.reduce_scatter_into(out, send.view(-1), "sum", ax.group)
    mine = sizes[ax.index]
    return out[:mine * inner].view(mine, *rest).movedim(0, dim)


def _chunk_shapes(shape: tuple, split_dim: int, split_sizes: Sequence[int]) -> list[tuple]:
    return [(*shape[:split_dim], n, *shape[split_dim + 1:]) for n in split_sizes]


def _a2a_shapes(x: torch.Tensor, ax: Axis, split_dim: int,
                split_sizes: Sequence[int]) -> list[tuple]:
    """The shapes of the chunks this rank will receive, in rank order (one small
    all-to-all of each chunk's shape)."""
    mine = _chunk_shapes(tuple(x.shape), split_dim, split_sizes)
    if ax.size == 1:
        return mine
    meta = torch.tensor([list(s) + [-1] * (_MAX_DIMS - len(s)) for s in mine],
                        dtype=torch.int64, device=control_device(x.device))
    got = torch.empty_like(meta)
    with tp.functorch_paused():
        comm.all_to_all_into(got.view(-1), meta.view(-1), [_MAX_DIMS] * ax.size,
                             [_MAX_DIMS] * ax.size, ax.group, count="shape_exchange")
    return [tuple(int(v) for v in row[:x.dim()]) for row in got.tolist()]


def _a2a(x: torch.Tensor, ax: Axis, split_dim: int, concat_dim: int,
         split_sizes: Sequence[int], shapes: Sequence[tuple]) -> torch.Tensor:
    """Chunk ``j`` (``split_sizes``) of ``x`` along ``split_dim`` goes to rank ``j``; the
    chunks received (of ``shapes``) are concatenated along ``concat_dim``: one
    ``all_to_all_single`` with uneven splits."""
    chunks = x.detach().split(list(split_sizes), split_dim)
    if ax.size == 1:
        return chunks[0].clone(memory_format=torch.contiguous_format)
    send = torch.cat([c.reshape(-1) for c in chunks])
    out_sizes = [int(torch.Size(s).numel()) for s in shapes]
    recv = x.new_empty(sum(out_sizes))
    with tp.functorch_paused():
        comm.all_to_all_into(recv, send.contiguous(), out_sizes, [c.numel() for c in chunks], ax.group)
    return torch.cat([p.view(s) for p, s in zip(recv.split(out_sizes), shapes)], concat_dim)


# ---------------------------------------------------------------- autograd


class _Op(torch.autograd.Function):
    """A raw collective (``forward``, also the tangent's, under ``jvp``) whose backward is
    its transpose, itself one of these: double backward differentiates through it."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.shape, ctx.args = tuple(inputs[0].shape), inputs[1:]

    @classmethod
    def jvp(cls, ctx, gx, *_):  # the tangent's: the same collective (of the primal's shapes)
        return cls.forward(gx, *ctx.args)


class _Batched(_Op):
    """A collective that ``torch.func.vmap`` runs on the batched tensor as it is (elementwise
    over the ranks: every rank batches alike)."""

    @classmethod
    def vmap(cls, info, in_dims, x, *args):
        return cls.apply(x, *args), in_dims[0]


class _PSum(_Batched):
    forward = staticmethod(_psum)

    @staticmethod
    def backward(ctx, g):
        # The cotangent (replicated) feeds each rank's own input: pvary, whose backward is
        # psum; so double backward (create_graph=True) sees the collective.
        ax, scale, _ = ctx.args
        g = _PVary.apply(g, ax)
        return (g if scale == 1 else g * scale), None, None, None


class _PVary(_Batched):
    @staticmethod
    def forward(x, ax):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _PSum.apply(g, ctx.args[0], 1, "pvary's backward (psum)"), None


class _AllGather(_Op):
    forward = staticmethod(_gather)

    @staticmethod
    def backward(ctx, g):
        ax, dim, shapes = ctx.args
        return _PSumScatter.apply(g, ax, dim, [s[dim] for s in shapes]), None, None, None


class _PSumScatter(_Op):
    forward = staticmethod(_scatter)

    @staticmethod
    def backward(ctx, g):
        ax, dim, sizes = ctx.args
        return _AllGather.apply(g, ax, dim, _chunk_shapes(ctx.shape, dim, sizes)), None, None, None


class _AllToAll(_Op):
    forward = staticmethod(_a2a)

    @staticmethod
    def backward(ctx, g):
        # The reverse exchange: each rank's piece of the cotangent goes back to its sender,
        # which gets the shapes of the chunks it sent (no shape exchange needed).
        ax, split_dim, concat_dim, split_sizes, shapes = ctx.args
        return _AllToAll.apply(g, ax, concat_dim, split_dim, [s[concat_dim] for s in shapes], tuple(
            _chunk_shapes(ctx.shape, split_dim, split_sizes))), None, None, None, None, None


# ---------------------------------------------------------------- public functions

def _tracked(op: str, x: torch.Tensor, axis: Axes, mesh: Any, run) -> torch.Tensor:
    """``run(x, the Axis)`` under the ``shard_map`` body's replication tracking, if any (implicit pvary
    of ``x`` first where it is invariant over some of the axes; the result marked)."""
    ax = axis_of(axis, mesh)
    tracker = vma.current()
    if tracker is None:
        return run(x, ax)
    missing, after = tracker.check_collective(op, x, axis_names(axis))
    with tracker.pause():
        if missing:
            x = _PVary.apply(x, tracker.axis(missing, mesh))
        out = run(x, ax)
    return vma.mark(out, after, tracker)


def _dim(x: torch.Tensor, dim: int, what: str) -> int:
    if x.dim() == 0:
        raise ValueError(f"{what}: a 0-d tensor has no dim to cut or join; reshape it to (1,)")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim {dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def psum(x: torch.Tensor, axis: Axes, *, mesh: Optional[Any] = None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``axis``; every rank gets the sum. Backward: identity
    (the result and the code after it are replicated: its cotangent counts once).

    Args:
        x: This rank's tensor (same shape on every rank of the axis).
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        The sum, a new tensor.

    Raises:
        ValueError: no mesh, or no such axis; or ranks whose shapes differ (the same error
            on every rank: off CUDA, before the sum, one all-gather of each rank's shape,
            nine int64s, checks it; on CUDA, where that would be a host sync per sum, run
            with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for torch's own check).

    Example:
        >>> def body():
        ...     with use_mesh(vfsdp.mesh(("dp", 2), ("tp", 2))):
        ...         return psum(torch.tensor([float(dist.get_rank())]), "tp").item()
        >>> vfsdp.testing.simulate(4, body)
        [1.0, 1.0, 5.0, 5.0]
    """
    return _tracked("psum", x, axis, mesh, lambda x, ax: _PSum.apply(x, ax, 1))


def pmean(x: torch.Tensor, axis: Axes, *, mesh: Optional[Any] = None) -> torch.Tensor:
    """The mean of ``x`` over the ranks of ``axis``. Backward: the cotangent over the size.

    Args:
        x: This rank's tensor (same shape on every rank of the axis).
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        The mean, a new tensor.

    Raises:
        ValueError: no mesh, or no such axis; or ranks whose shapes differ (on every rank,
            as :func:`psum`).

    Example:
        >>> def body():
        ...     return pmean(torch.tensor([float(dist.get_rank())]), "x",
        ...                  mesh=vfsdp.mesh(("x", 4))).item()
        >>> vfsdp.testing.simulate(4, body)
        [1.5, 1.5, 1.5, 1.5]
    """
    return _tracked("pmean", x, axis, mesh,
                    lambda x, ax: _PSum.apply(x, ax, 1.0 / ax.size, "pmean"))


def pvary(x: torch.Tensor, axis: Axes, *, mesh: Optional[Any] = None) -> torch.Tensor:
    """Identity on a value replicated over ``axis`` that feeds different code on each rank
    (e.g. the input of a column-parallel matmul). Backward: ``psum`` of the cotangents.

    Args:
        x: The replicated value.
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        ``x`` (a view of it), whose gradient sums every rank's.

    Raises:
        ValueError: no mesh, or no such axis; in the backward, cotangents whose shapes differ
            between ranks (on every rank, as :func:`psum`).

    Example:
        >>> def body():
        ...     x = torch.ones(2, requires_grad=True)
        ...     w = float(dist.get_rank() + 1)        # a different weight per rank
        ...     (pvary(x, "tp", mesh=vfsdp.mesh(("tp", 2))) * w).sum().backward()
        ...     return x.grad.tolist()                # 1 + 2 on both ranks
        >>> vfsdp.testing.simulate(2, body)
        [[3.0, 3.0], [3.0, 3.0]]
    """
    return _tracked("pvary", x, axis, mesh, _PVary.apply)


def all_gather(x: torch.Tensor, axis: Axes, dim: int = 0, *,
               mesh: Optional[Any] = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in axis order; sizes along ``dim`` may
    differ between ranks (the other dims must agree). Backward: ``psum_scatter`` back into
    each rank's piece.

    Args:
        x: This rank's piece (at least 1-d).
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        dim: The dim to concatenate along.
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        The concatenation, the same on every rank of the axis.

    Raises:
        ValueError: ``dim`` out of range, or ranks' shapes that differ off ``dim`` (naming
            them).

    Example:
        >>> def body():
        ...     r = dist.get_rank()
        ...     return all_gather(torch.full((r + 1,), float(r)), "x",
        ...                       mesh=vfsdp.mesh(("x", 2))).tolist()
        >>> vfsdp.testing.simulate(2, body)[0]
        [0.0, 1.0, 1.0]
    """
    def run(x, ax):
        d = _dim(x, dim, "all_gather")
        shapes = _shapes(x, ax, "all_gather")
        off = [s[:d] + s[d + 1:] for s in shapes]
        if any(len(s) != x.dim() for s in shapes) or any(o != off[0] for o in off):
            raise ValueError(f"all_gather over {axis!r} along dim {dim}: the ranks' shapes "
                             f"{shapes} differ off that dim")
        return _AllGather.apply(x, ax, d, shapes)
    return _tracked("all_gather", x, axis, mesh, run)


def psum_scatter(x: torch.Tensor, axis: Axes, dim: int = 0, *,
                 mesh: Optional[Any] = None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``axis``; rank ``i`` keeps chunk ``i`` of the sum along
    ``dim``, cut as ``torch.tensor_split`` cuts (the first ``len % size`` chunks one longer).
    Backward: ``all_gather`` of the cotangents.

    Args:
        x: This rank's tensor (same shape on every rank of the axis, at least 1-d).
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        dim: The dim to cut.
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        This rank's chunk of the sum.

    Raises:
        ValueError: no mesh, no such axis, or ``dim`` out of range.

    Example:
        >>> def body():
        ...     x = torch.arange(5.0)                     # the same on both ranks
        ...     return psum_scatter(x, "x", mesh=vfsdp.mesh(("x", 2))).tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 2.0, 4.0], [6.0, 8.0]]
    """
    d = _dim(x, dim, "psum_scatter")
    return _tracked("psum_scatter", x, axis, mesh,
                    lambda x, ax: _PSumScatter.apply(x, ax, d, split_lengths(x.shape[d], ax.size)))


def all_to_all(x: torch.Tensor, axis: Axes, split_dim: int, concat_dim: int, *,
               split_sizes: Optional[Sequence[int]] = None,
               mesh: Optional[Any] = None) -> torch.Tensor:
    """Send chunk ``j`` of ``x`` along ``split_dim`` to rank ``j`` of ``axis`` and
    concatenate the chunks received, in rank order, along ``concat_dim``. Backward: the
    reverse exchange.

    Args:
        x: This rank's tensor.
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        split_dim: The dim to cut into one chunk per rank.
        concat_dim: The dim to join the received chunks along.
        split_sizes: This rank's chunk sizes along ``split_dim`` (one per rank; they may
            differ between ranks, e.g. tokens per expert). Default: ``torch.tensor_split``.
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        The chunks received, concatenated.

    Raises:
        ValueError: ``split_sizes`` of the wrong length or sum, chunks that do not
            concatenate, or a tensor of more than 8 dims.

    Example:
        >>> def body():
        ...     r = dist.get_rank()
        ...     x = torch.tensor([10.0 * r, 10.0 * r + 1, 10.0 * r + 2])
        ...     sizes = [1, 2] if r == 0 else [2, 1]
        ...     return all_to_all(x, "ep", 0, 0, split_sizes=sizes,
        ...                       mesh=vfsdp.mesh(("ep", 2))).tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]]
    """
    s = _dim(x, split_dim, "all_to_all split_dim")
    c = _dim(x, concat_dim, "all_to_all concat_dim")
    if x.dim() > _MAX_DIMS:  # the shape exchange carries that many
        raise ValueError(f"all_to_all: tensors of up to {_MAX_DIMS} dims, got {x.dim()}")

    def run(x, ax):
        length = x.shape[s]
        sizes = split_lengths(length, ax.size) if split_sizes is None else [int(v) for v in split_sizes]
        if len(sizes) != ax.size or sum(sizes) != length or min(sizes, default=0) < 0:
            raise ValueError(f"all_to_all over {axis!r}: split_sizes {list(split_sizes)} must "
                             f"be {ax.size} sizes >= 0 adding up to {length}")
        shapes = _a2a_shapes(x, ax, s, sizes)
        off = [sh[:c] + sh[c + 1:] for sh in shapes]
        if any(o != off[0] for o in off):
            raise ValueError(f"all_to_all over {axis!r}: the chunks this rank would receive "
                             f"have shapes {shapes}, which do not concatenate along dim "
                             f"{concat_dim}: every dim but {concat_dim} must agree")
        return _AllToAll.apply(x, ax, s, c, sizes, tuple(shapes))
    return _tracked("all_to_all", x, axis, mesh, run)


def axis_index(axis: Axes, *, mesh: Optional[Any] = None) -> int:
    """This rank's index along ``axis`` (``mesh``: default the innermost :func:`use_mesh`).

    Args:
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        An int in ``[0, axis_size(axis))`` (in a checked ``shard_map`` body, one varying over
        ``axis``, as JAX's: :class:`vfsdp.spmd.vma.AxisIndex`).

    Raises:
        ValueError: no mesh, or no such axis.

    Example:
        >>> vfsdp.testing.simulate(4, lambda: axis_index("tp", mesh=vfsdp.mesh(("dp", 2),
        ...                                                                  ("tp", 2))))
        [0, 1, 0, 1]
    """
    i = axis_of(axis, mesh).index
    return i if vma.current() is None else vma.AxisIndex(i, axis_names(axis))


def axis_size(axis: Axes, *, mesh: Optional[Any] = None) -> int:
    """The number of ranks along ``axis`` (``mesh``: default the innermost
    :func:`use_mesh`).

    Args:
        axis: A mesh axis name, or a tuple of names in the mesh's order (their ranks as
            one axis, row-major).
        mesh: The mesh (default: the innermost :func:`use_mesh`).

    Returns:
        An int >= 1.

    Raises:
        ValueError: no mesh, or no such axis.

    Example:
        >>> vfsdp.testing.simulate(4, lambda: axis_size("dp", mesh=vfsdp.mesh(("dp", 4))))
        [4, 4, 4, 4]
    """
    return axis_of(axis, mesh).size


# Tensor-parallel helpers written on the functions above, in the same namespace
# (vfsdp.lax.tp_local, vfsdp.lax.column_parallel, vfsdp.lax.row_parallel).
from vfsdp.spmd.tp import column_parallel, row_parallel, tp_local  # noqa: E402

__all__ += ["tp_local", "column_parallel", "row_parallel"]
