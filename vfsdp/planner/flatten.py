"""``optree.tree_flatten_with_path`` for the planner, quicker on plain trees.

A model's parameter tree is dicts, lists and tuples of tensors, and a large one has tens of
thousands of leaves under as many dicts. optree builds its treespec with a list of keys per
dict, objects that outlive the plan and that Python's collector then walks; the planner needs
only the leaves and their paths. :func:`flatten_with_path` walks exact ``dict`` (keys
``sorted``, as optree orders them), ``list``, ``tuple`` and ``None`` nodes itself and returns
the treespec as a function that makes it (optree's own, from a record of the tree's structure
that holds no leaf). Any other node (an ``OrderedDict``, a namedtuple, a registered class, keys
that do not sort) goes to optree for the whole tree.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Union

import optree
import torch

from vfsdp._gc import paused_gc
from vfsdp.planner.abstract import ShapeDtype

__all__ = ["flatten_with_path", "Structure"]

_LEAF = object()  # the record's mark of a leaf
_LEAF_TYPES = frozenset((ShapeDtype, torch.Tensor, torch.nn.Parameter))


class _NotPlain(Exception):
    """A node the walk leaves to optree."""


def flatten_with_path(tree: Any) -> tuple[list, list, Union[optree.PyTreeSpec, Structure]]:
    """``optree.tree_flatten_with_path(tree)``, with the treespec made when asked for.

    Args:
        tree: Any optree pytree (default namespace, ``None`` a node).

    Returns:
        ``(paths, leaves, treespec)``: the paths and leaves exactly as
        ``optree.tree_flatten_with_path`` gives them, and its treespec, or (for a tree of
        plain ``dict``/``list``/``tuple``/``None`` nodes) a function of no arguments that
        returns it (a :class:`Structure`).

    Raises:
        Whatever ``optree.tree_flatten_with_path`` raises for the tree (it reads any tree the
        walk leaves).

    Example:
        >>> paths, leaves, make = flatten_with_path({"b": [1, None], "a": (2,)})
        >>> paths, leaves, make()
        ([('a', 0), ('b', 0)], [2, 1], PyTreeSpec({'a': (*,), 'b': [*, None]}))
    """
    paths: list = []
    leaves: list = []
    record: list = []  # dict, n, its n keys (insertion order) | list/tuple, n | None | _LEAF
    add_path, add_leaf, rec, ext = paths.append, leaves.append, record.append, record.extend
    leaf_kinds: dict = dict.fromkeys(_LEAF_TYPES, True)  # type -> whether optree makes it a leaf
    leaf_types, leaf = _LEAF_TYPES, _LEAF  # cells, read quicker than globals

    def walk(node, path):
        kind = type(node)
        if kind is dict:
            try:
                keys = sorted(node)
            except TypeError:
                raise _NotPlain from None
            rec(dict)
            rec(len(keys))
            ext(node)
            for key in keys:
                child = node[key]
                if type(child) in leaf_types:  # most children: no call
                    rec(leaf)
                    add_path(path + (key,))
                    add_leaf(child)
                else:
                    walk(child, path + (key,))
        elif kind is list or kind is tuple:
            rec(kind)
            rec(len(node))
            for key, child in enumerate(node):
                if type(child) in leaf_types:
                    rec(leaf)
                    add_path(path + (key,))
                    add_leaf(child)
                else:
                    walk(child, path + (key,))
        elif node is None:
            rec(None)
        else:
            if kind not in leaf_kinds:
                leaf_kinds[kind] = optree.tree_is_leaf(node)
            if not leaf_kinds[kind]:
                raise _NotPlain
            rec(leaf)
            add_path(path)
            add_leaf(node)

    try:
        walk(tree, ())
    except (_NotPlain, RecursionError):
        return optree.tree_flatten_with_path(tree)
    return paths, leaves, Structure(record)


class Structure:
    """A plain tree's structure as :func:`flatten_with_path` recorded it (no leaf): called,
    optree's treespec of it."""

    __slots__ = ("record",)

    def __init__(self, record: list) -> None:
        self.record = record

    def __call__(self) -> optree.PyTreeSpec:
        return _structure(self.record)

    def matches(self, tree: Any) -> bool:
        """Whether ``tree`` has this structure (its walk records the same), without making
        either treespec."""
        got = flatten_with_path(tree)[2]
        return isinstance(got, Structure) and got.record == self.record


def _structure(record: list) -> optree.PyTreeSpec:
    """The treespec of the tree the walk recorded: its skeleton rebuilt (leaves ``0``), then
    given to optree."""
    items = iter(record)
    take, leaf = items.__next__, _LEAF

    def node(kind):
        if kind is leaf or kind is None:
            return None if kind is None else 0
        n = take()
        if kind is dict:
            keys = list(islice(items, n))
            by_key = {key: node(take()) for key in sorted(keys)}
            return by_key if len(keys) < 2 else {k: by_key[k] for k in keys}
        return kind(map(node, islice(items, n)))

    with paused_gc():
        return optree.tree_structure(node(take()))
