"""Tensor parallelism on the named-axis collectives: TP-local parameters and Megatron's two
matmul patterns.

* :func:`tp_local`: each rank's piece of every tensor over a TP axis, from a rule
  ``path -> Shard(dim) | Replicate()`` (torch's placement types). Plan and shard the result
  with FSDP over the data axes as any tree (``vfsdp.plan(local, dp)``,
  ``vfsdp.shard(local, spec, mesh=mesh["dp"])``): TP x FSDP.
* :func:`column_parallel` / :func:`row_parallel`: ``x @ W`` with ``W`` split by columns (the
  output stays split) or by rows (the partial products are summed), with the gradients that
  make the pair exact: ``pvary`` on the replicated input, ``psum`` on the output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import optree
import torch
from torch.distributed.tensor import Replicate, Shard

from vfsdp.planner.granularity import format_path
from vfsdp.spmd import lax


def tp_local(tree: Any, rule: Callable[[tuple], Any], axis: str, *,
             mesh: Optional[Any] = None) -> Any:
    """This rank's TP-local piece of every tensor of ``tree``.

    Args:
        tree: Full tensors (the same on every rank).
        rule: ``path -> Shard(dim) | Replicate()``: how the ``axis`` ranks split each tensor
            (``Shard`` cuts as ``torch.tensor_split``: uneven sizes allowed).
        axis: The tensor-parallel mesh axis.
        mesh: The mesh (default: the innermost ``use_mesh``).

    Returns:
        The tree of local pieces (new tensors).

    Raises:
        ValueError: the rule returns something else, or a dim out of range, naming the path.

    Example:
        >>> def body():
        ...     m = vfsdp.mesh(("tp", 2))
        ...     local = tp_local({"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)},
        ...                      lambda p: Shard(1) if p == ("w",) else Replicate(), "tp",
        ...                      mesh=m)
        ...     return local["w"].tolist(), local["b"].tolist()
        >>> vfsdp.testing.simulate(2, body)
        [([[0.0, 1.0], [3.0, 4.0]], [1.0, 1.0]), ([[2.0], [5.0]], [1.0, 1.0])]
    """
    n, i = lax.axis_size(axis, mesh=mesh), lax.axis_index(axis, mesh=mesh)

    def local(path: tuple, t: torch.Tensor) -> torch.Tensor:
        place = rule(path)
        if isinstance(place, Replicate):
            return t.detach().clone()
        if not isinstance(place, Shard):
            raise ValueError(f"tp_local: the rule returned {place!r} for {format_path(path)}; "
                             f"return torch.distributed.tensor.Shard(dim) or Replicate()")
        if not -t.dim() <= place.dim < t.dim():
            raise ValueError(f"tp_local: {format_path(path)} {tuple(t.shape)} has no dim "
                             f"{place.dim}")
        return t.detach().tensor_split(n, place.dim)[i].clone()

    return optree.tree_map_with_path(local, tree)


def column_parallel(x: torch.Tensor, w: torch.Tensor, axis: str, *,
                    mesh: Optional[Any] = None) -> torch.Tensor:
    """``x @ w`` for ``w`` split by columns over ``axis``: the output is this rank's columns.
    ``x`` is replicated over ``axis``; its gradient sums every rank's (``pvary``).

    Args:
        x: The input, the same on every rank of ``axis``.
        w: This rank's columns of the weight.
        axis: The tensor-parallel mesh axis.
        mesh: The mesh.

    Returns:
        This rank's columns of ``x @ W``.

    Raises:
        ValueError: no mesh, or no such axis.

    Example:
        >>> def body():
        ...     m = vfsdp.mesh(("tp", 2))
        ...     w = torch.eye(2)[:, dist.get_rank():dist.get_rank() + 1]   # one column each
        ...     return column_parallel(torch.tensor([[3.0, 4.0]]), w, "tp", mesh=m).tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[[3.0]], [[4.0]]]
    """
    return lax.pvary(x, axis, mesh=mesh) @ w


def row_parallel(h: torch.Tensor, w: torch.Tensor, axis: str, *,
                 mesh: Optional[Any] = None) -> torch.Tensor:
    """``h @ W`` for ``W`` split by rows over ``axis`` and ``h`` split by the matching
    columns: the partial products are summed (``psum``); the output is replicated.

    Args:
        h: This rank's columns of the input (a :func:`column_parallel` output).
        w: This rank's rows of the weight.
        axis: The tensor-parallel mesh axis.
        mesh: The mesh.

    Returns:
        ``H @ W``, the same on every rank of ``axis``.

    Raises:
        ValueError: no mesh, or no such axis.

    Example:
        >>> def body():
        ...     m = vfsdp.mesh(("tp", 2))
        ...     h = torch.tensor([[float(dist.get_rank() + 1)]])          # columns 1 and 2
        ...     return row_parallel(h, torch.ones(1, 2), "tp", mesh=m).tolist()
        >>> vfsdp.testing.simulate(2, body)
        [[[3.0, 3.0]], [[3.0, 3.0]]]
    """
    return lax.psum(h @ w, axis, mesh=mesh)
