"""Matching user pytrees against a spec, with errors that name the offending path."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import optree
import torch

from vfsdp.planner.abstract import refuse_non_tree
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["match_tree", "group_by_unit", "check_tree_arg"]


def check_tree_arg(tree: Any, what: str, spec: Any = None) -> None:
    """Refuse, with the fix, what is not a pytree of tensors, or a spec in the wrong place.

    Raises:
        TypeError: naming what was passed and what to pass instead.
    """
    if isinstance(tree, ShardSpec):
        raise TypeError(f"{what}: got a ShardSpec where the tree goes; the arguments are "
                        f"swapped: call {what}(tree, spec)")
    if spec is not None and not isinstance(spec, ShardSpec):
        raise TypeError(f"{what}: spec must be the ShardSpec vfsdp.plan returned, got "
                        f"{type(spec).__name__}")
    refuse_non_tree(tree, what)


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
    check_tree_arg(tree, what, spec)
    paths, leaves, treespec = optree.tree_flatten_with_path(tree)
    if treespec != spec.treespec:
        spec_paths = set(spec.treespec.paths())
        extra = [p for p in paths if p not in spec_paths]
        missing = [p for p in spec.treespec.paths() if p not in set(paths)]
        detail = (f"unexpected {format_path(extra[0])}" if extra else
                  f"missing {format_path(missing[0])}" if missing else
                  f"{treespec} vs {spec.treespec}")
        raise ValueError(f"{what}: tree structure differs from the spec ({detail}); pass the "
                         f"tree the spec was planned for, or a matching sub-spec")
    for path, leaf, s in zip(paths, leaves, spec.leaves()):
        if not isinstance(s, TensorSpec):
            continue
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"{what}: {format_path(path)} should be a tensor, got "
                             f"{type(leaf).__name__}")
    return leaves


def group_by_unit(spec: ShardSpec) -> dict[Hashable, list[tuple[int, TensorSpec]]]:
    """``unit key -> [(leaf index, TensorSpec), ...]`` for the tensor leaves of ``spec``
    (from the grouping the spec computes once and keeps)."""
    leaves = spec.leaves()
    return {key: [(i, leaves[i]) for i, _ in members]
            for key, members in spec.unit_leaves().items()}
