"""The table a :class:`~vfsdp.planner.spec.ShardSpec` prints as its repr: one row per run of
identical units, with each one's padding beside its certified bound."""

from __future__ import annotations

import itertools
from typing import Optional

from vfsdp.planner.check import plan_stats
from vfsdp.planner.spec import ShardSpec, UnitLayout, unit_name

__all__ = ["format_spec"]


def format_spec(spec: ShardSpec, max_rows: Optional[int] = None) -> str:
    """A table of the spec's units; consecutive identical units are merged into one row."""
    st = plan_stats(spec)
    axis = spec.model_axis  # (axis, size, index)
    where = "" if axis is None else f", the {axis[0]}={axis[2]} piece of a {axis[1]}-way {axis[0]} split"
    head = (
        f"ShardSpec(mesh={spec.mesh_shape}, m={spec.world_size}{where}, {st['units']} "
        f"units, {st['tensors']} tensors, {st['total_numel']:,} elements, padding "
        f"{100 * st['padding_ratio']:.3f}% (bound {100 * st['lower_bound_ratio']:.3f}%)"
    )
    rows = []
    for _, run in itertools.groupby(spec.units.values(), key=lambda u: u.signature):
        g: list[UnitLayout] = list(run)
        u = g[0]
        name = (unit_name(u.key) if len(g) == 1
                else f"{unit_name(u.key)} .. {unit_name(g[-1].key)} (x{len(g)})")
        lo, med, hi = u.tensors_per_rank_summary()
        rows.append(
            f"  {name:<34} {len(u.paths):>5} tensors  S={u.shard_numel:<12,} "
            f"padding {100 * u.padding_ratio:8.3f}% (bound {100 * u.lower_bound_ratio:8.3f}%)  "
            f"tensors/rank {lo}/{med:g}/{hi}"
        )
        if u.split is not None:
            rows.append(f"      ^ option: {u.split!r}")
    if max_rows is not None and len(rows) > max_rows:
        rows = rows[: max_rows - 1] + [f"  ... {len(rows) - max_rows + 1} more rows"]
    return "\n".join([head, *rows]) + "\n)"
