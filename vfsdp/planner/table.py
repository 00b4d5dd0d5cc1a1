"""The table a :class:`~vfsdp.planner.spec.ShardSpec` prints as its repr: one row per run of
identical units, with each one's padding beside its certified bound."""

from __future__ import annotations

from typing import Optional

from vfsdp.planner.spec import ShardSpec, UnitLayout, unit_name

__all__ = ["format_spec"]


def format_spec(spec: ShardSpec, max_rows: Optional[int] = None) -> str:
    """A table of the spec's units; consecutive identical units are merged into one row."""
    total = sum(u.total_numel for u in spec.units.values())
    padded = sum(u.padded_numel for u in spec.units.values())
    bound = sum(u.world_size * u.lower_bound for u in spec.units.values())
    ratio = (padded - total) / total if total else 0.0
    bratio = (bound - total) / total if total else 0.0
    n_tensors = sum(1 for _ in spec.tensors())
    split = next((t.strided for t in spec.tensors() if t.strided is not None), None)
    where = ("" if split is None else
             f", the {split.axis}={split.index} piece of a {split.size}-way {split.axis} split")
    head = (
        f"ShardSpec(mesh={spec.mesh_shape}, m={spec.world_size}{where}, {len(spec.units)} "
        f"units, {n_tensors} tensors, {total:,} elements, padding {100 * ratio:.3f}% "
        f"(bound {100 * bratio:.3f}%)"
    )
    rows = []
    groups: list[list[UnitLayout]] = []
    for u in spec.units.values():
        if groups and groups[-1][0].signature == u.signature:
            groups[-1].append(u)
        else:
            groups.append([u])
    for g in groups:
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
