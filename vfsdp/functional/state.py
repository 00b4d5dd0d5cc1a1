"""How a state object (an optimizer's) tells checkpoints what to save: a two-method protocol.

A type that implements :class:`Checkpointable` is saved and loaded by
:mod:`vfsdp.checkpoint` without ``checkpoint`` importing the type's module:

* ``state.checkpoint_tree(spec)`` returns a pytree of what to save: local views of DBuffers
  (their global shapes and ranges come from the buffer), :class:`~vfsdp.collectives.Piece` s
  for other sharded data, other tensors (replicated) and ``bool``/``int``/``float``/``str``
  values. Tensors must alias the state's memory, so a load fills the state in place.
* ``state.restore_checkpoint(tree)`` takes the loaded tree (values filled in) and returns
  the state with its plain values (e.g. the step) put back.

:func:`param_tree` builds the usual shape of such a tree: one leaf per parameter, in the
parameters' own tree structure, so names are parameter paths and reload under any plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional, Protocol, runtime_checkable

import optree

from vfsdp.collectives.dbuffer import DBuffer
from vfsdp.collectives.piece import Piece
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["Checkpointable", "param_tree"]


@runtime_checkable
class Checkpointable(Protocol):
    """A state that checkpoints itself (see the module docstring).

    Example:
        >>> class Counter:                                   # no base class needed
        ...     def __init__(self):
        ...         self.steps, self.ema = 0, torch.zeros(2)
        ...     def checkpoint_tree(self, spec):
        ...         return {"steps": self.steps, "ema": self.ema}    # ema: loaded in place
        ...     def restore_checkpoint(self, tree):
        ...         self.steps = tree["steps"]
        ...         return self
        >>> isinstance(Counter(), Checkpointable)
        True
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        ...     saved = Counter()
        ...     saved.steps, saved.ema = 3, torch.ones(2)
        ...     vfsdp.checkpoint.save(path, {"params": shards, "counter": saved}, spec)
        ...     out = vfsdp.checkpoint.load(path, {"params": shards, "counter": Counter()}, spec)
        ...     return out["counter"].steps, out["counter"].ema.tolist()
        >>> vfsdp.testing.simulate(2, body)
        [(3, [1.0, 1.0]), (3, [1.0, 1.0])]
    """

    def checkpoint_tree(self, spec: ShardSpec) -> Any:
        """What to save, as a pytree of local views, Pieces, tensors and plain values."""

    def restore_checkpoint(self, tree: Any) -> Any:
        """The state after a load (``tree`` is what :meth:`checkpoint_tree` returned, with
        values filled in)."""


def param_tree(buffers: Mapping[Any, DBuffer], spec: ShardSpec,
               pieces: Optional[Callable[[DBuffer, int], Optional[Piece]]] = None) -> Any:
    """A tree shaped like the parameters holding, per tensor, its piece of ``buffers[unit]``.

    Args:
        buffers: ``unit key -> DBuffer`` (e.g. an optimizer moment per unit).
        spec: The plan.
        pieces: ``(db, k) -> Piece or None`` overrides the default leaf (tensor ``k``'s local
            view of ``db``).

    Returns:
        The spec's tree structure; tensors whose unit is not in ``buffers``, or for which
            ``pieces`` returns ``None``, become ``None`` (no leaf).

    Raises:
        KeyError: a buffer in ``buffers`` that does not hold the tensors of the unit it is
            keyed by (e.g. a buffer of another plan).

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"a": torch.ones(2), "b": torch.ones(3)}, 1)
        ...     shards = vfsdp.shard({"a": torch.ones(2), "b": torch.ones(3)}, spec)
        ...     m = slot_of(shards["a"]).buffer.like(torch.float32)
        ...     return {k: tuple(v.shape) for k, v in param_tree({(): m}, spec).items()}
        >>> vfsdp.testing.simulate(1, body)
        [{'a': (2,), 'b': (3,)}]
    """
    pieces = pieces or (lambda db, k: db.local(k))
    leaves = []
    for p, s in zip(spec.treespec.paths(), spec.leaves()):
        db = buffers.get(s.unit) if isinstance(s, TensorSpec) else None
        ok = db is not None and tuple(p) == s.path  # a tied leaf repeats its tensor: saved once
        leaves.append(pieces(db, db.index(s.path)) if ok else None)
    return optree.tree_unflatten(spec.treespec, leaves)
