"""Matching user pytrees against a spec, with errors that name the offending path.

Unit lookup: from the tensors of a tree to the :class:`~vfsdp.collectives.Unit` behind them.

Every shard ``vfsdp.shard`` returns carries a :class:`~vfsdp.collectives.Slot` naming its
unit and its index there. So finding a unit's buffers is reading the slots of its leaves and
checking they agree: no registry, no address lookup. Tensors that carry no slot (plain
tensors of the right local shapes) are copied into a fresh, temporary unit where an entry
point accepts them (``gather``, ``reduce_scatter``); elsewhere they are refused.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

import optree
import torch

from vfsdp._warnings import refuse_mesh
from vfsdp.collectives.comm import resolve_groups
from vfsdp.collectives.dbuffer import Role, View, slot_of
from vfsdp.collectives.unit import Unit
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec, UnitLayout, refuse_non_tree, unit_name

__all__ = ["match_tree", "refuse_structure", "UnitLeaves", "find_unit",
           "units_of", "unit_for", "own_mesh"]


@dataclass(frozen=True)
class UnitLeaves:
    """One unit of a tree: its :class:`Unit` and where its tensors sit.

    Attributes:
        key: The unit key.
        unit: The unit's buffers on this rank.
        leaves: ``(leaf index in the tree, buffer index in the unit)`` per tensor present.
        values: The tree's leaves themselves, in the same order.

    Example:
        >>> def body():
        ...     params = {"layers": [{"w": torch.ones(4)}], "head": torch.ones(2)}
        ...     spec = vfsdp.plan(params, 2)
        ...     shards = vfsdp.shard(params, spec)
        ...     leaves = vfsdp.functional.match_tree(shards, spec, "example")
        ...     u = units_of(leaves, spec, "example")[1]
        ...     return u.key, u.leaves, u.db is u.unit.params
        >>> vfsdp.testing.simulate(2, body)[0]      # leaf 1 of the tree is tensor 0 of the unit
        (('layers', 0), ((1, 0),), True)
    """

    key: Hashable
    unit: Unit
    leaves: tuple[tuple[int, int], ...]
    values: tuple = ()

    def frozen(self) -> frozenset:
        """Buffer indices of the tensors present whose shard does not require grad."""
        return frozenset(k for (_, k), x in zip(self.leaves, self.values)
                         if isinstance(x, torch.Tensor) and not x.requires_grad)

    @property
    def db(self):
        """The unit's parameter DBuffer (``unit.params``)."""
        return self.unit.params


def find_unit(local: Sequence[Any], layout: UnitLayout, index: Sequence[int],
              what: str) -> Optional[Unit]:
    """The unit whose parameter shards ``local`` are (tensor ``k`` of it at ``index[k]``).

    Returns:
        The :class:`Unit`, or ``None`` when no leaf carries a slot (plain tensors).

    Raises:
        ValueError: leaves of different units or kinds (gathered views, gradients), shards
            made for another plan, or a view at the wrong place; naming the tensor path.
    """
    at = lambda k: format_path(layout.paths[k])  # for messages only
    found, plain = None, None
    for x, k in zip(local, index):
        slot = slot_of(x)
        if slot is None or (slot.buffer.role is Role.GRAD and slot.view is View.LOCAL):
            # vfsdp.grads' views of a gradient buffer are values, as a plain tensor is
            plain = layout.paths[k]
            continue
        if slot.view is View.FULL:
            raise ValueError(f"{what}: {at(k)} is a gathered full view (vfsdp.gather's output); "
                             f"pass the shards vfsdp.shard returned")
        if not slot.buffer.role.holds_params or slot.unit is None:
            raise ValueError(f"{what}: {at(k)} is a view of a {slot.buffer.name} buffer, not a "
                             f"parameter shard; pass the tree vfsdp.shard returned")
        unit = slot.unit
        if unit is not found and unit.layout != layout:  # (the next shard of the same unit: as it)
            got = unit.layout
            raise ValueError(
                f"{what}: the shards of unit {unit_name(layout.key)} were made for another plan "
                f"(unit {unit_name(got.key)}, m={got.world_size}, S={got.shard_numel}) than this "
                f"spec (m={layout.world_size}, S={layout.shard_numel}); use the spec they were "
                f"sharded with")
        if found is not None and unit is not found:
            raise ValueError(f"{what}: {at(k)} belongs to another vfsdp.shard call than the other "
                             f"tensors of unit {unit_name(layout.key)}; pass one shards tree")
        if slot.index != k or not unit.params.is_local_view(k, x):
            raise ValueError(f"{what}: {at(k)} is a view of unit {unit_name(layout.key)}'s shard "
                             f"at the wrong place; pass the shards tree returned by vfsdp.shard")
        found = unit
    if found is not None and plain is not None:
        raise ValueError(f"{what}: {format_path(plain)} is a plain tensor but the other tensors of unit "
                         f"{unit_name(layout.key)} are vfsdp shards; pass one shards tree")
    return found


def units_of(leaves: Sequence[Any], spec: ShardSpec, what: str, *, mesh: Any = None,
             pack: bool = False) -> list[UnitLeaves]:
    """Every unit of ``spec`` with the tree leaves that belong to it.

    Args:
        leaves: The tree's leaves in spec order (``match_tree``).
        spec: The (sub-)spec.
        what: The entry point, for messages.
        mesh: For packed units: the ``DeviceMesh`` (default: the default group).
        pack: Copy units whose leaves are plain tensors into temporary units; otherwise
            such units are refused.

    Returns:
        One :class:`UnitLeaves` per unit of ``spec``, in the spec's unit order.

    Raises:
        ValueError: as :func:`unit_for`.

    Example:
        >>> def body():
        ...     params = {"layers": [{"w": torch.ones(4)}, {"w": torch.ones(4)}], "head": torch.ones(2)}
        ...     spec = vfsdp.plan(params, 2)
        ...     leaves = vfsdp.functional.match_tree(vfsdp.shard(params, spec), spec, "example")
        ...     return [(u.key, u.leaves) for u in units_of(leaves, spec, "example")]
        >>> vfsdp.testing.simulate(2, body)[0]
        [((), ((0, 0),)), (('layers', 0), ((1, 0),)), (('layers', 1), ((2, 0),))]
    """
    out = []
    for key, members in spec.unit_leaves().items():
        local = [leaves[i] for i, _ in members]
        unit = unit_for(local, spec, key, [k for _, k in members], mesh, what, pack)
        out.append(UnitLeaves(key, unit, tuple(members), tuple(local)))
    return out


def unit_for(local: Sequence[Any], spec: ShardSpec, key: Hashable, index: Sequence[int],
             mesh: Any, what: str, pack: bool = True) -> Unit:
    """The unit of shards made by ``vfsdp.shard``, or (``pack``) a temporary one holding copies
    of plain tensors (this rank's pieces, one copy per tensor) on ``mesh``'s groups (default:
    the default group).

    Raises:
        ValueError: as :func:`find_unit`; plain tensors where ``pack`` is off, or a plain leaf of
            the wrong local shape or dtype (naming its path).
    """
    layout = spec.units[key]
    unit = find_unit(local, layout, index, what)
    if unit is not None:
        return unit
    if not pack:
        raise ValueError(f"{what}: the tensors of unit {unit_name(key)} (e.g. "
                         f"{format_path(layout.paths[index[0]])}) are not "
                         f"vfsdp shards; pass the tree returned by vfsdp.shard")
    unit = Unit(layout, resolve_groups(spec, mesh))
    with torch.no_grad():
        for x, k in zip(local, index):
            ref = unit.params.local(k)
            if (not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(ref.shape)
                    or x.dtype != ref.dtype):
                got = (f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor)
                       else type(x).__name__)
                raise ValueError(f"{what}: {format_path(layout.paths[k])} should be this rank's "
                                 f"shard of shape {tuple(ref.shape)} {ref.dtype}, got {got}")
            ref.copy_(x.detach())
    return unit


def own_mesh(tree: Any, mesh: Any, what: str) -> Any:
    """``mesh`` for plain-tensor shards; ``None`` for shards (or gradients) of
    ``vfsdp.shard``, which carry the mesh they were made on (``mesh=`` with them is
    refused). Called once by each entry point that takes ``mesh=``.

    Raises:
        ValueError: ``mesh=`` with the shards of ``vfsdp.shard``."""
    if mesh is not None and any(slot_of(x) is not None for x in optree.tree_leaves(tree)):
        refuse_mesh(what)
    return mesh


def match_tree(tree: Any, spec: ShardSpec, what: str) -> list:
    """Leaves of ``tree`` in spec order, after checking its structure and that the spec's
    tensors are tensors (shapes and dtypes are checked where the leaves are used, e.g. as
    shards of a unit).

    Args:
        tree: A pytree shaped like the spec's (parameters, shards, gradients).
        spec: The (sub-)spec.
        what: The entry point, for messages.

    Returns:
        The leaves of ``tree``, one per leaf of ``spec``, in its order.

    Raises:
        TypeError: swapped arguments, something else than a spec, or a tree vfsdp cannot
            read (a module, a generator), with the fix.
        ValueError: the structure differs (naming the first differing path), or a leaf the
            spec holds a tensor for is not a tensor (naming its path).

    Example:
        >>> spec = vfsdp.plan({"w": torch.ones(8), "b": torch.ones(2)}, 2)
        >>> [tuple(x.shape) for x in match_tree({"w": torch.ones(8), "b": torch.ones(2)}, spec, "f")]
        [(2,), (8,)]
        >>> match_tree({"w": torch.ones(8)}, spec, "f")
        Traceback (most recent call last):
        ...
        ValueError: f: tree structure differs from the spec (missing b); ...
    """
    if isinstance(tree, ShardSpec):
        raise TypeError(f"{what}: got a ShardSpec where the tree goes; the arguments are "
                        f"swapped: call {what}(tree, spec)")
    if not isinstance(spec, ShardSpec):
        raise TypeError(f"{what}: spec must be the ShardSpec vfsdp.plan returned, got "
                        f"{type(spec).__name__}")
    refuse_non_tree(tree, what)
    paths, leaves, treespec = optree.tree_flatten_with_path(tree)
    if not spec.same_structure(treespec, tree):
        refuse_structure(paths, treespec, spec, what)
    for path, leaf, s in zip(paths, leaves, spec.leaves()):
        if isinstance(s, TensorSpec) and not isinstance(leaf, torch.Tensor):
            raise ValueError(f"{what}: {format_path(path)} should be a tensor, got "
                             f"{type(leaf).__name__}")
    return leaves


def refuse_structure(paths: list, treespec: Any, spec: ShardSpec, what: str) -> NoReturn:
    """Raise for a tree (its ``paths`` and ``treespec``) whose structure is not the spec's,
    naming the first path one has and the other lacks."""
    expected = spec.treespec.paths()
    known, have = set(expected), set(paths)
    extra = next((p for p in paths if p not in known), None)
    missing = next((p for p in expected if p not in have), None)
    detail = (f"unexpected {format_path(extra)}" if extra is not None else
              f"missing {format_path(missing)}" if missing is not None else
              f"{treespec} vs {spec.treespec}")
    raise ValueError(f"{what}: tree structure differs from the spec ({detail}); pass the "
                     f"tree the spec was planned for, or a matching sub-spec")
