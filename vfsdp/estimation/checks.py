"""The estimator's argument checks: each refuses with a ``ValueError`` that names the argument,
the value and what to pass instead (the command line prints it as one ``error:`` line)."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["count", "rate", "fraction", "shape_dims"]


def count(where: str, name: str, value: Any, least: int = 1, optional: bool = False) -> Any:
    """``value`` if it is an int (not a bool) of at least ``least`` (or ``None`` where
    ``optional``).

    Args:
        where: The caller, for the message (``"sweep"``).
        name: The argument's name (``"shard"``, or an option: ``"--shard"``).
        value: Its value.
        least: The smallest allowed.
        optional: Whether ``None`` is allowed.

    Returns:
        ``value`` as an int, or ``None``.

    Raises:
        ValueError: naming ``where``, ``name`` and the value.

    Example:
        >>> count("sweep", "shard", 8)
        8
        >>> count("sweep", "shard", 0)
        Traceback (most recent call last):
        ...
        ValueError: sweep: shard must be an int >= 1, got 0
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{where}: {name} must be an int >= {least}, got {value!r}")
    return int(value)


def rate(where: str, name: str, value: Any, zero: bool = False) -> float:
    """``value`` as a float if it is a finite number above 0 (or at least 0 where ``zero``).

    Args:
        where: The caller, for the message.
        name: The argument's or field's name.
        value: Its value.
        zero: Whether 0 is allowed.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: naming ``where``, ``name`` and the value.

    Example:
        >>> rate("hardware h100", "flops", -1)
        Traceback (most recent call last):
        ...
        ValueError: hardware h100: flops must be a finite number > 0, got -1
    """
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and (value >= 0 if zero else value > 0)):
        raise ValueError(f"{where}: {name} must be a finite number {'>=' if zero else '>'} 0, "
                         f"got {value!r}")
    return float(value)


def fraction(where: str, name: str, value: Any) -> float:
    """``value`` if it is a number in ``(0, 1]``.

    Args:
        where: The caller, for the message.
        name: The argument's or field's name.
        value: Its value.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: naming ``where``, ``name`` and the value.

    Example:
        >>> fraction("hardware a", "comm_efficiency", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: hardware a: comm_efficiency must be in (0, 1], got 1.5
    """
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value <= 1):
        raise ValueError(f"{where}: {name} must be in (0, 1], got {value!r}")
    return float(value)


def shape_dims(source: str, data: Any) -> None:
    """Check a shape list's JSON (``{"params": [[name, [dims]], ...]}``): its structure, and
    dimensions that are ints >= 0 (a float such as ``4096.5`` would otherwise be truncated).

    Args:
        source: The file's name, for the message.
        data: Its parsed JSON.

    Returns:
        ``None``.

    Raises:
        ValueError: naming ``source`` and the entry or tensor.

    Example:
        >>> shape_dims("m.json", {"params": [["layers.0.w", [64, 64.5]]]})
        Traceback (most recent call last):
        ...
        ValueError: m.json: layers.0.w has dimension 64.5, not an int >= 0; write whole numbers
    """
    entries = data.get("params") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{source}: expected a JSON object with a 'params' list of "
                         f"[name, shape] pairs")
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list)):
            raise ValueError(f"{source}: bad entry {str(entry)[:80]}; expected [name, shape]")
        for d in entry[1]:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"{source}: {entry[0]} has dimension {d!r}, not an int "
                                 f">= 0; write whole numbers")
