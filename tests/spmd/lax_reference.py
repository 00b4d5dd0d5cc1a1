"""Reference semantics of the named-axis collectives (:mod:`vfsdp.spmd.lax`): plain
loops over the ranks of one axis, in one process; :func:`over_axes` runs one over several
axes of a mesh (each group of ranks, :func:`axis_groups`).

Each takes every rank's input, in axis order, and returns every rank's output. They are
differentiable torch code, so their gradients are the references of the collectives'
backwards: for ``all_gather``, ``psum_scatter``, ``all_to_all`` and ``pvary`` the gradient of
``sum over ranks r of <out[r], cotangent[r]>`` (for ``pvary`` with one tensor as every rank's
input: it is replicated); for ``psum`` and ``pmean``, whose outputs are replicated, the same
with one shared cotangent, counted once (``mean`` over ranks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch

__all__ = ["psum_reference", "pmean_reference", "pvary_reference", "all_gather_reference",
           "psum_scatter_reference", "all_to_all_reference", "axis_groups", "over_axes"]


def psum_reference(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank gets the sum.

    Example:
        >>> [t.tolist() for t in psum_reference([torch.tensor([1.0]), torch.tensor([2.0])])]
        [[3.0], [3.0]]
    """
    total = torch.stack(list(xs)).sum(0)
    return [total for _ in xs]


def pmean_reference(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank gets the mean."""
    total = torch.stack(list(xs)).mean(0)
    return [total for _ in xs]


def pvary_reference(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Identity: ``xs`` are one replicated value (pass the same tensor for every rank; its
    gradient then sums every rank's cotangent, which is pvary's backward)."""
    return list(xs)


def all_gather_reference(xs: Sequence[torch.Tensor], dim: int = 0) -> list[torch.Tensor]:
    """Every rank gets the concatenation along ``dim``.

    Example:
        >>> all_gather_reference([torch.tensor([0.0]), torch.tensor([1.0, 2.0])])[1].tolist()
        [0.0, 1.0, 2.0]
    """
    full = torch.cat(list(xs), dim)
    return [full for _ in xs]


def psum_scatter_reference(xs: Sequence[torch.Tensor], dim: int = 0) -> list[torch.Tensor]:
    """Rank ``i`` gets chunk ``i`` (``torch.tensor_split``) of the sum along ``dim``.

    Example:
        >>> [t.tolist() for t in psum_scatter_reference([torch.arange(5.0)] * 2)]
        [[0.0, 2.0, 4.0], [6.0, 8.0]]
    """
    total = torch.stack(list(xs)).sum(0)
    return list(total.tensor_split(len(xs), dim))


def all_to_all_reference(xs: Sequence[torch.Tensor], split_dim: int, concat_dim: int,
                         split_sizes: Optional[Sequence[Sequence[int]]] = None
                         ) -> list[torch.Tensor]:
    """Rank ``r`` gets chunk ``r`` of every rank's tensor, concatenated along ``concat_dim``
    in rank order; ``split_sizes[s]``: rank ``s``'s chunk sizes (default: tensor_split).

    Example:
        >>> xs = [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([10.0, 11.0, 12.0])]
        >>> [t.tolist() for t in all_to_all_reference(xs, 0, 0, [[1, 2], [2, 1]])]
        [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]]
    """
    n = len(xs)
    chunks = []
    for s, x in enumerate(xs):
        if split_sizes is None:
            chunks.append(x.tensor_split(n, split_dim))
        else:
            chunks.append(x.split(list(split_sizes[s]), split_dim))
    return [torch.cat([chunks[s][r] for s in range(n)], concat_dim) for r in range(n)]


def axis_groups(mesh_shape: Sequence[tuple[str, int]], axes) -> list[list[int]]:
    """The groups of ranks of a collective over ``axes`` (one name or a tuple, in the mesh's
    order) on a row-major mesh of ``(name, size)`` axes: each group in its combined-index
    order (row-major over ``axes``), found by a loop over every rank's coordinates.

    Example:
        >>> axis_groups([("dp", 2), ("tp", 2)], "dp"), axis_groups([("dp", 2), ("tp", 2)],
        ...                                                        ("dp", "tp"))
        ([[0, 2], [1, 3]], [[0, 1, 2, 3]])
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    names = [n for n, _ in mesh_shape]
    sizes = [s for _, s in mesh_shape]
    groups: dict = {}
    for rank in range(math.prod(sizes)):
        coords, rest = [], rank
        for s in reversed(sizes):
            coords.append(rest % s)
            rest //= s
        coords.reverse()
        outside = tuple(c for n, c in zip(names, coords) if n not in axes)
        inside = 0
        for a in axes:  # row-major over the axes, in the tuple's order
            inside = inside * sizes[names.index(a)] + coords[names.index(a)]
        groups.setdefault(outside, {})[inside] = rank
    return [[g[i] for i in sorted(g)] for _, g in sorted(groups.items())]


def over_axes(reference: Callable, xs: Sequence, mesh_shape: Sequence[tuple[str, int]],
              axes, *args, **kwargs) -> list:
    """A one-axis reference (``psum_reference``, ...) over several axes: ``xs`` is every
    rank's input in global rank order; each group of :func:`axis_groups` runs ``reference``
    on its ranks' inputs in combined-index order; returns every rank's output in rank order.

    Example:
        >>> xs = [torch.tensor([float(r)]) for r in range(4)]
        >>> [t.item() for t in over_axes(psum_reference, xs, [("dp", 2), ("tp", 2)], "dp")]
        [2.0, 4.0, 2.0, 4.0]
    """
    out: list = [None] * len(xs)
    for group in axis_groups(mesh_shape, axes):
        for rank, y in zip(group, reference([xs[r] for r in group], *args, **kwargs)):
            out[rank] = y
    return out
