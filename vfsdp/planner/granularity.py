"""Granularity: the indivisible block of each tensor, which is never split across ranks.

Forms accepted by ``vfsdp.plan(..., granularity=...)``:

* ``None`` or ``1``: element granularity (the default).
* an ``int`` ``g``: blocks of ``g`` elements; ``g`` must divide the tensor's numel.
* ``rows(k)``: blocks of ``k`` rows, where a row is a vector along the last dim. ``rows(32)`` of
  a ``[4096, 1024]`` weight is a block of ``32 * 1024`` elements and keeps every 32x32 tile
  whole. A row of a 1-D (or 0-D) tensor is one element. **Partial-block rule:** when the
  number of rows is not a multiple of ``k``, blocks are counted from the tensor's start and
  the last block holds the remaining rows; it is never split either (so 8-bit tiles at a
  ragged edge are partial tiles on one rank). Use an ``int`` granularity to demand exact
  division instead.
* ``whole``: the whole tensor lives on one rank.
* a callable ``(path, tensor) -> one of the above`` for per-tensor rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "Rows", "rows", "whole", "Whole", "Granularity", "block_elements", "format_path",
    "parse_granularity", "combine",
]


@dataclass(frozen=True)
class Rows:
    """Blocks of ``k`` rows (vectors along the last dim). Build with :func:`rows`.

    Example:
        >>> rows(2), Rows(2) == rows(2)
        (rows(2), True)
        >>> spec = vfsdp.plan({"w": torch.empty(6, 4)}, 4, granularity=rows(2))
        >>> [spec.tensor(("w",)).local_range(r) for r in range(4)]   # 8-element blocks, uncut
        [(0, 8), (8, 16), (16, 24), (24, 24)]
    """

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"rows(k) needs an int k >= 1, got {self.k!r}")

    def __repr__(self) -> str:
        return f"rows({self.k})"


class Whole:
    """The whole tensor is one block. Use the singleton :data:`whole`."""

    def __repr__(self) -> str:
        return "whole"

    __reduce__ = __repr__  # pickles (and copies) as this module's ``whole``


whole = Whole()
"""Granularity: the whole tensor is one block (never split across ranks)."""
Granularity = Union[None, int, Rows, Whole, Callable[[tuple, Any], Any]]


def rows(k: int) -> Rows:
    """Granularity of ``k`` rows (vectors along the last dim).

    Args:
        k: Rows per block, ``>= 1``.

    Returns:
        A :class:`Rows` value for ``vfsdp.plan(..., granularity=...)``.

    Raises:
        ValueError: ``k`` is not an int >= 1.

    Example:
        >>> from vfsdp import rows
        >>> rows(32)
        rows(32)
    """
    return Rows(k)


def format_path(path: tuple) -> str:
    """Dotted rendering of an optree key path: ``('layers', 3, 'w')`` -> ``'layers.3.w'``."""
    return ".".join(str(p) for p in path) if path else "<root>"


def block_elements(gran: Any, path: tuple, shape: tuple[int, ...], numel: int, tensor: Any) -> int:
    """Resolve a granularity for one tensor into a block size in elements.

    Args:
        gran: Any accepted granularity form (see the module docstring).
        path: The tensor's optree key path (for error messages and callables).
        shape: The tensor's shape.
        numel: Its number of elements.
        tensor: The leaf itself, passed to a callable granularity.

    Returns:
        The block size in elements (``>= 1``; a value ``>= numel`` means the whole tensor).

    Raises:
        ValueError: a non-positive block, or an ``int`` block that does not divide ``numel``.
        TypeError: an unrecognised granularity value.

    Example:
        >>> block_elements(rows(32), ("w",), (4096, 1024), 4096 * 1024, None)
        32768
    """
    if callable(gran):  # rows(k) and whole are not callables
        resolved = gran(path, tensor)
        if callable(resolved):
            raise TypeError(
                f"granularity callable returned another callable for {format_path(path)}; "
                f"return an int, rows(k) or whole"
            )
        return block_elements(resolved, path, shape, numel, tensor)
    if gran is None:
        return 1
    if isinstance(gran, Whole):
        return max(numel, 1)
    if isinstance(gran, Rows):  # a row of a 1-D (or 0-D) tensor is one element
        return max(gran.k * (shape[-1] if len(shape) >= 2 else 1), 1)
    if isinstance(gran, int) and not isinstance(gran, bool):
        if gran < 1:
            raise ValueError(
                f"granularity {gran} for {format_path(path)} must be >= 1 element; "
                f"use 1 for element granularity"
            )
        if numel and numel % gran:
            common = math.gcd(numel, gran)
            hint = f" (e.g. {common})" if common > 1 else ""
            raise ValueError(
                f"granularity {gran} does not divide {format_path(path)} (shape {tuple(shape)}, "
                f"{numel} elements); use a divisor of {numel}{hint}, rows(k) (which allows a "
                f"short last block), or whole"
            )
        return gran
    raise TypeError(
        f"unsupported granularity {gran!r} for {format_path(path)}; use None, an int, "
        f"vfsdp.rows(k), vfsdp.whole, or a callable (path, tensor) -> one of those"
    )


def _pair(a: Any, b: Any, shape: tuple) -> Any:
    """The coarsest-needed granularity keeping every block of ``a`` and of ``b`` whole."""
    if a is None or a == 1:
        return b
    if b is None or b == 1:
        return a
    if isinstance(a, Whole) or isinstance(b, Whole):
        return whole
    row = shape[-1] if len(shape) >= 2 else 1
    if isinstance(a, int) and isinstance(b, int):
        return math.lcm(a, b)  # both divide numel, so their lcm does
    if isinstance(a, Rows) and isinstance(b, Rows):
        return Rows(math.lcm(a.k, b.k))
    k, n = (a.k, b) if isinstance(a, Rows) else (b.k, a)
    # rows(k') with k' a multiple of k whose blocks are a multiple of n elements: every
    # k-row block and every n-element block then lies inside one k'-row block.
    return Rows(math.lcm(k, n // math.gcd(n, max(row, 1))))


def combine(*grans: Granularity) -> Granularity:
    """One granularity that keeps whole every block any of ``grans`` needs.

    ``None`` needs nothing; ``whole`` wins; ``rows(a)`` and ``rows(b)`` give
    ``rows(lcm(a, b))``; two element counts their lcm; ``rows(k)`` and ``n`` elements the
    smallest ``rows(k')`` whose blocks hold whole ``n``-element blocks. Callables are resolved
    per tensor. This is how :func:`vfsdp.optim.chain` combines its members' needs.

    Example:
        >>> g = combine(rows(32), rows(48), None)
        >>> block_elements(g, ("w",), (96, 8), 768, None)
        768
        >>> combine(None, None) is None, combine(rows(2)) == rows(2)
        (True, True)
    """
    grans = tuple(g for g in grans if g is not None)
    if len(grans) < 2:
        return grans[0] if grans else None

    def combined(path: tuple, tensor: Any) -> Any:
        shape = tuple(getattr(tensor, "shape", ()))
        numel = math.prod(shape)
        out = None
        for g in grans:
            value = g(path, tensor) if callable(g) else g
            block_elements(value, path, shape, numel, tensor)  # validate each member's value
            out = _pair(out, value, shape)
        return out

    return combined


_NAMED = {"element": None, "elements": None, "none": None, "1": None, "whole": whole}


def parse_granularity(text: str) -> Granularity:
    """Parse a command-line granularity: ``element``, ``rows:K``, ``whole`` or an int.

    Raises:
        ValueError: anything else.

    Example:
        >>> parse_granularity("rows:32")
        rows(32)
    """
    t = text.strip().lower()
    if t in _NAMED:
        return _NAMED[t]
    if t.startswith("rows:") and t[5:].isdigit():
        return rows(int(t[5:]))
    if t.isdigit():
        return int(t)
    raise ValueError(f"bad granularity {text!r}; use element, rows:K, whole or an int")
