"""``vfsdp.visualize``: which rank holds which bytes of which tensor, as text or a figure.

Like ``jax.debug.visualize_array_sharding``, for a plan's communication units: each unit is
one flat buffer of ``m * S`` elements, rank ``r`` holds ``[r*S, (r+1)*S)``, tensors sit at
their offsets (a tensor may span ranks: its ragged shares), and what no tensor covers is
padding. Text works in a terminal; ``figure=True`` draws the same with matplotlib, inline in a
notebook.
"""

from __future__ import annotations

import string
from typing import Any, Optional

import optree

from vfsdp.collectives.dbuffer import slot_of
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, UnitLayout, unit_name

_LETTERS = string.ascii_uppercase + string.ascii_lowercase + string.digits


def _layouts(x: Any) -> list[UnitLayout]:
    if isinstance(x, ShardSpec):
        return list(x.units.values())
    if isinstance(x, UnitLayout):
        return [x]
    found = {slot.buffer.layout.key: slot.buffer.layout
             for slot in map(slot_of, optree.tree_leaves(x)) if slot is not None}
    if not found:
        raise TypeError(f"vfsdp.visualize: give a ShardSpec, a UnitLayout or a tree of shards "
                        f"(vfsdp.shard's output), got {type(x).__name__}")
    return list(found.values())


def _pick(layouts: list, unit: Any) -> list:
    if unit is None:
        return layouts
    chosen = [u for u in layouts if u.key == unit or unit_name(u.key) == unit]
    if not chosen:
        raise ValueError(f"vfsdp.visualize: no unit {unit!r}; the units are "
                         f"{[unit_name(u.key) for u in layouts]}")
    return chosen


def _segments(u: UnitLayout) -> list[tuple[int, int, Optional[int]]]:
    """``(start, stop, tensor index or None for padding)`` over the global buffer."""
    out, end = [], 0
    for i in sorted(range(len(u.paths)), key=lambda k: u.offsets[k]):
        lo, hi = u.offsets[i], u.offsets[i] + u.numels[i]
        if lo > end:
            out.append((end, lo, None))
        if hi > lo:
            out.append((lo, hi, i))
        end = max(end, hi)
    total = u.world_size * u.shard_numel
    if end < total:
        out.append((end, total, None))
    return out


def _text(u: UnitLayout, width: int, shown: int) -> str:
    m, s = u.world_size, u.shard_numel
    per = max(4, width // max(shown, 1))
    segs = _segments(u)
    lines = [f"unit {unit_name(u.key)}: {len(u.paths)} tensors, {m} ranks x S={s} "
             f"{str(u.dtype).replace('torch.', '')}, padding "
             f"{sum(b - a for a, b, i in segs if i is None)} elements{_model(u)}"]

    def cell(a: int, b: int) -> str:  # what most of the elements [a, b) are
        i = max(segs, key=lambda g: min(max(a + 1, b), g[1]) - max(a, g[0]))[2]
        return "." if i is None else _LETTERS[i % len(_LETTERS)]

    lines.append("|" + "|".join("".join(cell(r * s + s * c // per, r * s + s * (c + 1) // per) if s else " "
                                        for c in range(per)) for r in range(shown)) + "|")
    lines.append((" " + " ".join(f"rank {r}".center(per) for r in range(shown))).rstrip()
                 + (f" (first {shown} of {m} ranks)" if shown < m else ""))
    for i, (path, t) in enumerate(zip(u.paths, u.tensors)):
        shares = [f"r{r}:{t.shard_range(r)[1] - t.shard_range(r)[0]}" for r in range(m)
                  if t.shard_range(r)[1] > t.shard_range(r)[0]]
        st = t.strided
        split = ("" if st is None else f" = {st.describe()} of {st.global_shape}"
                 if st.dim is not None else f" ({st.describe()})")
        lines.append(f"  {_LETTERS[i % len(_LETTERS)]} {format_path(path)} "
                     f"{tuple(u.shapes[i])}{split}: {' '.join(shares) or 'empty'}")
    lines.append("  . padding")
    return "\n".join(lines)


def _model(u: UnitLayout) -> str:
    """``', the tp=1 piece of a 2-way tp split'`` for a unit of a ``tp=`` plan, else ``''``."""
    st = next((x for x in u.strided if x is not None), None)
    return "" if st is None else f"; the {st.axis}={st.index} piece of a {st.size}-way split"


def visualize(x: Any, unit: Any = None, *, width: int = 72, figure: bool = False,
              max_ranks: Optional[int] = None) -> Any:
    """Draw which rank holds which elements of which tensor, per communication unit.

    Args:
        x: A :class:`~vfsdp.ShardSpec`, one :class:`~vfsdp.UnitLayout`, or a tree of shards.
        unit: Only this unit (its key, e.g. ``("layers", 0)``, or its name ``"layers.0"``).
        width: Characters for the ranks' bars (text).
        figure: Return a matplotlib ``Figure`` (one row per unit, one bar per rank, a colour
            per tensor, padding hatched) instead of text (``.savefig(path)`` writes a PNG:
            ``python -m vfsdp plan --png``).
        max_ranks: Draw only each unit's first ``max_ranks`` ranks (default: all).

    Ranks are the data-parallel (shard) ranks. For a plan split over a model axis
    (``vfsdp.plan(..., tp=rule)``) the header names the model-axis index the plan is of, and
    each tensor says where its piece sits in the global tensor (``Shard(1) over tp: 5 of 10
    at 5``); visualize each index's spec (``tp_index=i``) to see them all.

    Returns:
        The text (``print`` it), or the ``Figure``.

    Raises:
        TypeError: ``x`` is none of those.
        ValueError: no such unit, or ``max_ranks`` below 1.
        ImportError: ``figure=True`` without matplotlib (``pip install vfsdp[viz]``).

    Example:
        >>> params = {"w": torch.ones(6, 4), "b": torch.ones(5)}
        >>> print(visualize(vfsdp.plan(params, 2, granularity=vfsdp.rows(1)), width=24))
        unit <root>: 2 tensors, 2 ranks x S=16 float32, padding 3 elements
        |AAAA..BBBBBB|BBBBBBBBBBBB|
            rank 0       rank 1
          A b (5,): r0:5
          B w (6, 4): r0:8 r1:16
          . padding
    """
    layouts = _pick(_layouts(x), unit)
    if max_ranks is not None and max_ranks < 1:
        raise ValueError(f"vfsdp.visualize: max_ranks must be at least 1, got {max_ranks}")
    shown = {u.key: min(u.world_size, max_ranks or u.world_size) for u in layouts}
    return _figure(layouts, shown) if figure else "\n\n".join(_text(u, width, shown[u.key]) for u in layouts)


def _figure(layouts: list, shown: dict) -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("vfsdp.visualize(figure=True) needs matplotlib: pip install "
                          "vfsdp[viz]") from exc
    fig, ax = plt.subplots(figsize=(10, 0.45 * sum(shown.values()) + 1.2))
    cmap = plt.get_cmap("tab20")
    y, ticks, handles = 0, [], {}  # ticks: (y, the row's label)
    for u in layouts:
        s, st = u.shard_numel, next((x for x in u.strided if x is not None), None)
        label = unit_name(u.key) + ("" if st is None else f" {st.axis}{st.index}")
        for r in range(shown[u.key]):
            for a, b, i in _segments(u):
                lo, hi = max(a, r * s), min(b, (r + 1) * s)
                if hi <= lo:
                    continue
                if i is None:
                    name, style = "padding", {"color": "white", "edgecolor": "grey", "hatch": "//"}
                else:
                    t = u.tensors[i].strided
                    part = ("" if t is None or t.dim is None else
                            f" [{t.axis} {t.start}:{t.start + t.lengths[t.index]} of dim {t.dim}]")
                    name = f"{unit_name(u.key)}: {format_path(u.paths[i])}{part}"
                    style = {"color": cmap(i % 20)}
                handles.setdefault(name, ax.barh(y, hi - lo, left=lo - r * s, height=0.8, **style))
            ticks.append((y, f"{label} r{r}"))
            y -= 1
        y -= 0.5
    ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks])
    ax.set_xlabel("element of the rank's shard (S)")
    ax.legend(list(handles.values()), list(handles), bbox_to_anchor=(1.01, 1), loc="upper left",
              fontsize="small")
    fig.tight_layout()
    return fig
