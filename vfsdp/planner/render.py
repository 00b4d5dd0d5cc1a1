"""Draw a unit's buffer: ranks as columns, tensors as coloured spans, padding hatched.

matplotlib is an optional dependency (``pip install vfsdp[viz]``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, unit_name

__all__ = ["draw_unit"]


def draw_unit(
    spec: ShardSpec, unit: Optional[Hashable], path: str, *, max_ranks: int = 64
) -> str:
    """Save a PNG of one unit's layout.

    Args:
        spec: A plan.
        unit: The unit key (``None``: the unit with the most padding).
        path: Output PNG file.
        max_ranks: Draw at most this many ranks (the first ones).

    Returns:
        A one-line description of what was drawn.

    Raises:
        ImportError: matplotlib is not installed.
        KeyError: no such unit.

    Example:
        >>> import os, tempfile
        >>> params = {"layers": [{"w": torch.empty(10, 3), "b": torch.empty(5)}]}
        >>> out = os.path.join(tempfile.mkdtemp(), "layout.png")
        >>> draw_unit(vfsdp.plan(params, 4), ("layers", 0), out).split(" (")[0]
        'drew unit layers.0'
        >>> os.path.getsize(out) > 0
        True
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError as exc:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("drawing layouts needs matplotlib: pip install 'vfsdp[viz]'") from exc

    if unit is None:
        unit = max(spec.units, key=lambda k: spec.units[k].padded_numel - spec.units[k].total_numel)
    if unit not in spec.units:
        names = ", ".join(unit_name(k) for k in list(spec.units)[:8])
        raise KeyError(f"no unit {unit!r}; units include {names}")
    u = spec.units[unit]
    s, m = u.shard_numel, u.world_size
    shown = min(m, max_ranks)
    fig, ax = plt.subplots(figsize=(min(2 + 0.35 * shown, 24), 6))
    ax.add_patch(Rectangle((0, 0), shown, 1, facecolor="white", edgecolor="grey",
                           hatch="////", linewidth=0))
    cmap = plt.get_cmap("tab20")
    handles = []
    for i, (p, off, e) in enumerate(zip(u.paths, u.offsets, u.numels)):
        color = cmap(i % 20)
        if len(handles) < 20:
            handles.append(Patch(facecolor=color, label=format_path(p)))
        if not e:
            continue
        for r in range(off // s, min((off + e - 1) // s + 1, shown)):
            lo = max(off, r * s) - r * s
            hi = min(off + e, (r + 1) * s) - r * s
            ax.add_patch(Rectangle((r, lo / s), 1, (hi - lo) / s, facecolor=color,
                                   edgecolor="black", linewidth=0.3))
    for r in range(1, shown):
        ax.axvline(r, color="black", linewidth=0.8)
    ax.set_xlim(0, shown)
    ax.set_ylim(1, 0)
    ax.set_xlabel(f"rank (showing {shown} of {m})")
    ax.set_ylabel(f"offset in shard (fraction of S = {s:,} elements)")
    ax.set_title(f"unit {unit_name(unit)}: padding {100 * u.padding_ratio:.3f}% "
                 f"(bound {100 * u.lower_bound_ratio:.3f}%), hatched = padding")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"drew unit {unit_name(unit)} ({shown} of {m} ranks) to {path}"
