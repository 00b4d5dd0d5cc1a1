"""Named meshes: ``vfsdp.mesh(("dp", 2), ("tp", 2))`` and what one rank sees of an axis.

A mesh is torch's ``DeviceMesh`` with dim names, over the default process group (under
``torchrun``, ``vfsdp.testing.spawn`` or ``vfsdp.testing.simulate``): ranks are laid out in
row-major order, so with ``(("dp", 2), ("tp", 2))`` ranks 0 and 1 form a ``tp`` group, ranks 0
and 2 a ``dp`` group. Any axis may have size 1.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.distributed as dist

from vfsdp.collectives.comm import _TLS, _cached, world_mesh

__all__ = ["mesh", "Axis", "axis_of", "axis_names", "use_mesh", "current_mesh"]


def mesh(*axes: tuple[str, int]) -> Any:
    """A ``DeviceMesh`` with named axes over the default process group.

    Args:
        axes: ``(name, size)`` pairs, outermost first; their sizes multiply to the world size.

    Returns:
        A ``torch.distributed.device_mesh.DeviceMesh`` whose ``mesh_dim_names`` are the names
            (the same object when called again with the same axes on the same group).

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: no axes, a repeated or empty name, a size below 1, or sizes whose product
            is not the world size (naming both).

    Example:
        >>> def body():
        ...     m = vfsdp.mesh(("dp", 2), ("tp", 2))
        ...     return axis_of("dp", m).index, axis_of("tp", m).index
        >>> vfsdp.testing.simulate(4, body)
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    """
    if not axes:
        raise ValueError("vfsdp.mesh: give at least one (name, size) axis")
    names = [a[0] if isinstance(a, tuple) and len(a) == 2 else None for a in axes]
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"vfsdp.mesh: axes are (name, size) pairs with a non-empty name, got "
                         f"{axes!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"vfsdp.mesh: axis names must differ, got {names}")
    sizes = [a[1] for a in axes]
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"vfsdp.mesh: axis sizes must be integers >= 1, got {sizes}")
    if not dist.is_initialized():
        raise RuntimeError("vfsdp.mesh needs an initialised process group (torchrun, "
                           "vfsdp.testing.spawn or vfsdp.testing.simulate)")
    world = dist.get_world_size()
    if math.prod(sizes) != world:
        raise ValueError(f"vfsdp.mesh: axes {dict(zip(names, sizes))} hold {math.prod(sizes)} "
                         f"ranks, the process group has {world}")
    return world_mesh(tuple(sizes), tuple(names))  # one per group and axes: called again, kept


@dataclass(frozen=True)
class Axis:
    """One mesh axis as this rank sees it: its name, size, this rank's index along it, and
    the process group of the ranks that differ from this one only along it."""

    name: Union[str, tuple]
    size: int
    index: int
    group: Any


def axis_names(axis: Union[str, tuple, list]) -> tuple:
    """The axis names of ``axis``: one name, or a tuple of them, as a tuple.

    Raises:
        TypeError: not a string nor a tuple/list of strings.

    Example:
        >>> axis_names("tp"), axis_names(("dp", "tp"))
        (('tp',), ('dp', 'tp'))
    """
    names = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(
        axis, (tuple, list)) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(f"a mesh axis is named by a string or a tuple of strings, got {axis!r}")
    return names


def axis_of(axis: Union[str, tuple], device_mesh: Optional[Any] = None) -> Axis:
    """This rank's view of ``axis`` of ``device_mesh`` (default: the mesh of the innermost
    :func:`use_mesh`).

    ``axis`` may be a tuple of names, in the mesh's order: the ranks that differ from this one
    only along those axes, as one axis whose index is row-major over them (JAX's
    ``psum(x, ("dp", "tp"))``). Its process group is built on first use by every rank (each
    group of the tuple, in the same order on every rank: SPMD code does) and kept.

    Raises:
        TypeError: ``axis`` is not a string nor a tuple of strings.
        ValueError: no mesh is given or current, it has no axis of that name (listing
            those it has), a name repeats, or a tuple is not in the mesh's order.

    Example:
        >>> def body():
        ...     with use_mesh(vfsdp.mesh(("dp", 1), ("tp", 2))):
        ...         a = axis_of("tp")
        ...     return a.name, a.size, a.index
        >>> vfsdp.testing.simulate(2, body)
        [('tp', 2, 0), ('tp', 2, 1)]
    """
    wanted = axis_names(axis)
    m = device_mesh if device_mesh is not None else current_mesh()
    if m is None:
        raise ValueError(f"axis {axis!r}: no mesh; pass mesh=vfsdp.mesh(...) or enter "
                         f"`with vfsdp.lax.use_mesh(mesh):`")
    names = tuple(m.mesh_dim_names or ())
    for a in wanted:
        if a not in names:
            raise ValueError(f"the mesh has no axis {a!r}; its axes are {names}")
    if len(wanted) == 1:
        (a,) = wanted
        return Axis(axis, int(m.mesh.shape[names.index(a)]), int(m.get_local_rank(a)),
                    m.get_group(a))
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"axes {wanted}: a name repeats; name each axis once")
    dims = [names.index(a) for a in wanted]
    if dims != sorted(dims):
        raise ValueError(f"axes {wanted} are not in the mesh's order {names}; name them as "
                         f"{tuple(sorted(wanted, key=names.index))}")
    return _several(m, wanted, dims)


def _several(m: Any, wanted: tuple, dims: list) -> Axis:
    """The :class:`Axis` of several axes of ``m`` (their groups built once, on every rank)."""
    def make() -> Axis:
        rest = [d for d in range(m.mesh.dim()) if d not in dims]
        rows = m.mesh.permute(*rest, *dims).reshape(-1, math.prod(int(m.mesh.shape[d])
                                                                  for d in dims)).tolist()
        me = dist.get_rank()
        groups = [dist.new_group(row) for row in rows]  # every rank builds every group, in order
        k = next((k for k, row in enumerate(rows) if me in row), None)
        if k is None:
            raise ValueError(f"rank {me} is not in the mesh {m.mesh.tolist()}")
        return Axis(wanted, len(rows[k]), rows[k].index(me), groups[k])

    return _cached(("axes", id(m), wanted), make, m)


@contextlib.contextmanager
def use_mesh(device_mesh: Any) -> Iterator[Any]:
    """Make ``device_mesh`` the default mesh of the named-axis functions on this thread (rank).

    Uses nest: the innermost wins, and leaving a block restores the mesh outside it.

    Args:
        device_mesh: A named ``DeviceMesh`` (e.g. from :func:`vfsdp.mesh`).

    Returns:
        A context manager; entering it yields ``device_mesh``.

    Raises:
        ValueError: not on entry (any object is accepted); inside the block, from a
            named-axis function asked for an axis ``device_mesh`` does not have.

    Example:
        >>> def body():
        ...     with use_mesh(vfsdp.mesh(("x", 2))) as m:
        ...         return current_mesh() is m
        >>> vfsdp.testing.simulate(2, body)
        [True, True]
    """
    _TLS.stack.append(device_mesh)
    try:
        yield device_mesh
    finally:
        _TLS.stack.pop()


def current_mesh() -> Optional[Any]:
    """The mesh of the innermost :func:`use_mesh` on this thread, or ``None``.

    Returns:
        The mesh ``use_mesh`` made current, or ``None`` outside every ``use_mesh`` block.

    Raises:
        ValueError: not from ``current_mesh`` (it returns ``None`` when there is no mesh);
            the named-axis functions raise it when neither a mesh nor ``mesh=`` is given.

    Example:
        >>> def body():
        ...     with use_mesh(vfsdp.mesh(("x", 2))) as outer:
        ...         with use_mesh(vfsdp.mesh(("x", 1), ("y", 2))) as inner:
        ...             nested = current_mesh() is inner
        ...         return nested, current_mesh() is outer
        >>> vfsdp.testing.simulate(2, body)
        [(True, True), (True, True)]
        >>> current_mesh() is None                   # outside every block
        True
    """
    return _TLS.stack[-1] if _TLS.stack else None
