"""``check_spec``: re-verify a spec from its data alone, without the planner's code.

Used by the tests on every plan; cheap enough to call at start-up in user code too.
"""

from __future__ import annotations

import math
from typing import Any

from vfsdp.placements.ragged import flat_range
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import PASSTHROUGH, ShardSpec, TensorSpec, over, unit_name

__all__ = ["check_spec", "plan_stats"]

_PLACEMENT_CHECK_LIMIT = 2_000_000


def _fail(msg: str) -> None:
    raise ValueError(f"invalid spec: {msg}")


def check_spec(spec: ShardSpec, *, placements: bool | None = None) -> None:
    """Verify every planning constraint of ``spec``; raise on the first violation.

    Checked per unit: ``S`` is a positive multiple of the alignment; tensors are disjoint,
    contiguous intervals inside ``[0, m*S)``; no block crosses a rank boundary. Checked per
    tensor: it belongs to its unit's layout at the same offset, ``numel == prod(shape)``,
    its dtype is the unit's, its shape is its ``strided`` piece's, and (when ``placements``)
    its ``RaggedShard`` reproduces the same per-rank ranges and is valid for its shape.

    Args:
        spec: The spec to check.
        placements: Also rebuild every placement (O(m) per tensor). Default: only when
            ``m * tensors <= 2e6``.

    Returns:
        ``None``: the spec is valid.

    Raises:
        ValueError: naming the unit or tensor path and the violated constraint.

    Example:
        >>> check_spec(vfsdp.plan({"w": torch.empty(10)}, 3))
    """
    for key, u in spec.units.items():
        name = unit_name(key)
        m, s = u.world_size, u.shard_numel
        if m != spec.world_size:
            _fail(f"unit {name} has world size {m}, spec has {spec.world_size}")
        if s <= 0 or u.alignment < 1 or s % u.alignment:
            _fail(f"unit {name}: S={s} is not a positive multiple of alignment {u.alignment}")
        if len(set(u.paths)) != len(u.paths):
            _fail(f"unit {name} lists a path twice")
        columns = (u.offsets, u.numels, u.blocks, u.shapes, u.strided or u.paths)
        if any(len(c) != len(u.paths) for c in columns):
            _fail(f"unit {name}: paths/offsets/numels/blocks/shapes/strided differ in length")
        end = 0
        for path, off, e, g in zip(u.paths, u.offsets, u.numels, u.blocks):
            where = f"{format_path(path)} (unit {name})"
            if g < 1 or e < 0:
                _fail(f"{where}: block {g} / numel {e} out of range")
            if off < end:
                _fail(f"{where} at offset {off} overlaps the previous tensor ending at {end}")
            if off + e > m * s:
                _fail(f"{where} ends at {off + e}, past the buffer of {m}*{s}")
            end = off + e
            if e == 0:
                continue
            first = (off // s + 1) * s  # first boundary strictly after the start
            if first < off + e and (first - off) % g:
                _fail(f"{where}: rank boundary {first} cuts a {g}-element block")
            if first + s < off + e and s % g:
                _fail(f"{where}: spans a whole shard but S={s} is not a multiple of block {g}")
    tensors = [x for x in spec.leaves() if x is not PASSTHROUGH]
    for t in tensors:
        if not isinstance(t, TensorSpec):
            _fail(f"unexpected leaf {t!r}")
        where, u = format_path(t.path), spec.units.get(t.unit)
        if u is None or t.layout is not u:
            _fail(f"{where}: unit {unit_name(t.unit)} is not in spec.units")
        k = u._index.get(t.path)  # its position in the unit's buffer order
        if k is None:
            _fail(f"{where}: missing from unit {unit_name(t.unit)}'s paths")
        if (u.offsets[k], u.numels[k], u.blocks[k]) != (t.offset, t.numel, t.block):
            _fail(f"{where}: offset/numel/block disagree with unit {unit_name(t.unit)}")
        if math.prod(t.shape) != t.numel:
            _fail(f"{where}: numel {t.numel} != prod(shape {tuple(t.shape)})")
        if t.dtype != u.dtype:
            _fail(f"{where}: dtype {t.dtype} differs from unit dtype {u.dtype}")
        if t.strided is not None and t.strided.local_shape != tuple(t.shape):
            _fail(f"{where}: shape {tuple(t.shape)} but its {t.strided.describe()} piece is "
                  f"{t.strided.local_shape}")
    if placements is None:
        placements = spec.world_size * len(tensors) <= _PLACEMENT_CHECK_LIMIT
    for t in spec.tensors() if placements else ():
        p, covered = t.placement, 0
        for r in range(t.world_size):
            got = flat_range(p, t.shape, r)  # also validates the placement against the shape
            want = t.local_range(r)
            if got[1] - got[0] != want[1] - want[0] or (want[1] > want[0] and got != want):
                _fail(f"{format_path(t.path)}: placement gives rank {r} {got}, layout gives {want}")
            covered += got[1] - got[0]
        if covered != t.numel:
            _fail(f"{format_path(t.path)}: placement covers {covered} of {t.numel} elements")


def plan_stats(spec: ShardSpec) -> dict[str, Any]:
    """Whole-spec totals.

    Args:
        spec: A plan.

    Returns:
        ``{"total_numel", "padded_numel" (sum of m*S), "padding_ratio",
            "lower_bound_numel", "lower_bound_ratio", "units", "tensors"}``.

    Raises:
        AttributeError: ``spec`` is not a :class:`ShardSpec` (nothing is raised for a
            spec; :func:`check_spec` verifies one).

    Example:
        >>> plan_stats(vfsdp.plan({"w": torch.empty(10)}, 4))["padded_numel"]
        16
    """
    total = sum(u.total_numel for u in spec.units.values())
    padded = sum(u.padded_numel for u in spec.units.values())
    bound = sum(u.world_size * u.lower_bound for u in spec.units.values())
    return {
        "total_numel": total,
        "padded_numel": padded,
        "padding_ratio": over(padded, total),
        "lower_bound_numel": bound,
        "lower_bound_ratio": over(bound, total),
        "units": len(spec.units),
        "tensors": sum(1 for _ in spec.tensors()),
    }
