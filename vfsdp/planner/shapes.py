"""Shape lists: ``{"params": [["dotted.path", [shape]], ...]}`` files, as in ``benchmarks/shapes``."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch

from vfsdp.planner.abstract import ShapeDtype

__all__ = ["load_shapes", "nest_dotted", "DTYPES"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
"""The dtypes a shape list's command line may name (``--dtype bf16``), by name and short name."""


def nest_dotted(items: Iterable[tuple[str, Any]]) -> Any:
    """Nest ``("layers.3.mlp.w", leaf)`` pairs into dicts, with lists for integer components.

    Integer components become list indices when they count 0, 1, 2, ... at that level, so
    ``layers.<i>.`` yields a ``layers`` list (each element one unit under the default rule).

    Raises:
        ValueError: a name is both a leaf and a prefix of another name.

    Example:
        >>> nest_dotted([("layers.0.w", 1), ("layers.1.w", 2), ("norm", 3)])
        {'layers': [{'w': 1}, {'w': 2}], 'norm': 3}
    """
    root: dict = {}
    for name, leaf in items:
        node = root
        parts = name.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{name!r}: {part!r} is both a tensor and a module")
            node = child
        if parts[-1] in node:
            raise ValueError(f"{name!r} appears twice, or is both a tensor and a module")
        node[parts[-1]] = leaf

    def convert(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items()}
        if out and all(k.isdigit() for k in out) and sorted(map(int, out)) == list(range(len(out))):
            return [out[str(i)] for i in range(len(out))]
        return out

    return convert(root)


def load_shapes(
    source: Union[str, os.PathLike, dict], dtype: torch.dtype = torch.bfloat16
) -> Any:
    """Read a shape-list file into a nested pytree of :class:`ShapeDtype` leaves.

    Args:
        source: Path to a JSON file, or the already-parsed dict.
        dtype: Dtype given to every tensor.

    Returns:
        A nested dict/list tree (see :func:`nest_dotted`).

    Raises:
        ValueError: the file lacks a ``params`` list of ``[name, shape]`` pairs.

    Example:
        >>> tree = load_shapes({"params": [["layers.0.w", [4, 4]]]})
        >>> tree["layers"][0]["w"].shape
        (4, 4)
    """
    data = source if isinstance(source, dict) else json.loads(pathlib.Path(source).read_text())
    entries: Sequence = data.get("params") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{source!r}: expected a JSON object with a 'params' list")
    items = []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise ValueError(f"{source!r}: bad entry {entry!r}; expected [name, shape]")
        items.append((str(entry[0]), ShapeDtype(tuple(entry[1]), dtype)))
    return nest_dotted(items)
