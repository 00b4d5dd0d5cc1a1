"""What one rank's compiled gather reads of a spec: plain data, a pure function of the spec
and the rank, made once (eagerly, by ``vfsdp.shard``) and kept in the spec's cache."""

from __future__ import annotations

from typing import Optional

from vfsdp._torch_private import compiling as _compiling
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["local_plan"]


def local_plan(spec: ShardSpec, rank: Optional[int] = None) -> tuple:
    """Plain data about this spec as shard rank ``rank`` sees it, made once and kept: what
    the compiled path reads (nothing about a spec is computed while tracing, so
    ``vfsdp.shard`` makes it first). A pure function of the spec and ``rank``, kept in the
    spec's cache of its own data.

    ``rank=None``: ``(number of leaves, indices of the tensor leaves, subtrees of a list
    spec or -1, ((leaf index, path), ...) of each tensor once, whether this spec's ranks
    count each in a norm)`` (off model index 0, a tensor a ``tp=`` plan replicates is
    counted by index 0 only). A rank: its units, each ``(key, S, dtype, pieces, views)``
    with ``pieces`` the ``(leaf index, lo, hi)`` of the rank's shard in order (empty ones
    too, a tie once) and ``views`` the ``(leaf index, offset, numel, shape)`` of the full
    tensors.

    Args:
        spec: The plan (or a sub-spec).
        rank: A shard rank, or ``None``.

    Returns:
        The tuple described above.

    Raises:
        ValueError: while compiling, a plan that was not made before.

    Example:
        >>> spec = vfsdp.plan({"w": torch.ones(3, 2), "b": torch.ones(2)}, 2)
        >>> local_plan(spec)[:3], local_plan(spec, 1)[0][3]      # rank 1: the rest of w
        ((2, (0, 1), -1), ((0, 0, 0), (1, 0, 4)))
    """
    found = spec._local.get(rank)
    if found is not None:
        return found
    if _compiling():
        raise ValueError("vfsdp: this spec was not prepared for the compiled path under "
                         "torch.compile; make its shards with vfsdp.shard before compiling "
                         "(and take sub-specs from that spec)")
    if rank is None:
        tree = spec.tree
        found = (spec.treespec.num_leaves,
                 tuple(i for i, t in enumerate(spec.leaves()) if isinstance(t, TensorSpec)),
                 len(tree) if isinstance(tree, (list, tuple)) else -1, *_local_norms(spec))
    else:
        found = _local_units(spec, rank)
    spec._local[rank] = found
    return found

def _local_units(spec: ShardSpec, rank: int) -> tuple:
    units = []
    ts = spec.leaves()
    for key, members in spec.unit_leaves().items():
        # each buffer index's first leaf (a tie is one tensor), ordered by the piece's place
        first = {k: i for i, k in reversed(members)}.values()
        pieces = tuple((i, *ts[i].shard_range(rank)) for i in
                       sorted(first, key=lambda i: (ts[i].shard_range(rank), i)))
        views = tuple((i, ts[i].offset, ts[i].numel, tuple(ts[i].shape)) for i, _k in members)
        layout = spec.units[key]
        units.append((key, layout.shard_numel, layout.dtype, pieces, views))
    return tuple(units)

def _local_norms(spec: ShardSpec) -> tuple:
    model, first = spec.model_axis, {}  # (unit, path) -> (its first leaf, its TensorSpec)
    for i, t in enumerate(spec.leaves()):
        if isinstance(t, TensorSpec):
            first.setdefault((t.unit, t.path), (i, t))
    return (tuple((i, t.path) for i, t in first.values()),
            tuple(model is None or model[2] == 0 or t.strided.dim is not None for _, t in first.values()))
