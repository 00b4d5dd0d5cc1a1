"""Hugging Face's layouts of mixture-of-experts weights in safetensors files.

A ``transformers`` 5 MoE model holds each layer's experts fused: ``experts.gate_up_proj``
``(E, 2I, H)`` (each expert's gate rows, then its up rows) and ``experts.down_proj``
``(E, H, I)``. Its ``save_pretrained`` writes one tensor per expert instead, and fuses them
again at load:

* ``"per_expert"`` (Qwen2/3-MoE, DeepSeek, GLM-MoE and the others transformers converts as
  Qwen2-MoE): ``experts.N.gate_proj.weight`` and ``experts.N.up_proj.weight`` ``(I, H)``,
  ``experts.N.down_proj.weight`` ``(H, I)``;
* ``"mixtral"``: the same under ``block_sparse_moe`` (every ``.mlp.`` of the model), named
  ``w1`` (gate), ``w3`` (up) and ``w2`` (down).

In both, the per-expert tensors, in the order listed (expert by expert, gate before up), are
the fused tensor's bytes cut into consecutive pieces: a save writes the fused bytes unchanged
under several header records, and a read maps a rank's flat range of the fused tensor onto
the pieces it spans.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["LAYOUTS", "parts", "candidates"]

LAYOUTS = ("fused", "per_expert", "mixtral")
_FUSED = re.compile(r"(?P<pre>(?:.*\.)?)experts\.(?P<which>gate_up_proj|down_proj)")
_NAMES = {"per_expert": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}

Part = tuple[str, tuple]


def _mixtral(name: str) -> str:
    return name.replace(".mlp.", ".block_sparse_moe.")


def parts(name: str, shape: tuple, layout: Optional[str]) -> Optional[list[Part]]:
    """The file tensors ``(key, shape)`` whose bytes, concatenated, are tensor ``name``'s in
    ``layout``, or ``None`` when it is stored whole under ``name``.

    Args:
        name: The tensor's dotted name.
        shape: Its shape.
        layout: ``None``/``"fused"``, ``"per_expert"`` or ``"mixtral"``.

    Returns:
        ``[(key, shape)]`` in byte order, or ``None``.

    Raises:
        ValueError: an unknown layout.

    Example:
        >>> parts("m.0.mlp.experts.gate_up_proj", (2, 8, 3), "mixtral")[:2]
        [('m.0.block_sparse_moe.experts.0.w1.weight', (4, 3)),
         ('m.0.block_sparse_moe.experts.0.w3.weight', (4, 3))]
        >>> parts("m.0.mlp.experts.down_proj", (2, 3, 4), "per_expert")[1]
        ('m.0.mlp.experts.1.down_proj.weight', (3, 4))
    """
    if layout is None or layout == "fused":
        return None
    if layout not in _NAMES:
        raise ValueError(f"save_safetensors: hf_layout must be one of {LAYOUTS} or None, got "
                         f"{layout!r}")
    found = _FUSED.fullmatch(name)
    rename = _mixtral if layout == "mixtral" else (lambda n: n)
    if found is None or len(shape) != 3 or (found["which"] == "gate_up_proj" and shape[1] % 2):
        return [(rename(name), tuple(shape))] if rename(name) != name else None
    gate, up, down = _NAMES[layout]
    pre = rename(found["pre"] + "experts.")
    experts, rows, cols = shape
    if found["which"] == "down_proj":
        return [(f"{pre}{e}.{down}.weight", (rows, cols)) for e in range(experts)]
    half = (rows // 2, cols)
    return [(f"{pre}{e}.{w}.weight", half) for e in range(experts) for w in (gate, up)]


def candidates(key: str, shape: tuple) -> list[list[Part]]:
    """Where a reader may find tensor ``key`` of ``shape``, in the order tried: whole under
    its own name, then each per-expert layout, then under Mixtral's ``block_sparse_moe``.

    Args:
        key: The tensor's name in the file's scheme.
        shape: Its shape.

    Returns:
        A list of ``[(key, shape)]`` options; a reader takes the first whose keys all exist.

    Raises:
        Nothing.

    Example:
        >>> [c[0][0] for c in candidates("l.mlp.gate.weight", (4, 3))]
        ['l.mlp.gate.weight', 'l.block_sparse_moe.gate.weight']
    """
    out = [[(key, tuple(shape))]]
    for layout in ("per_expert", "mixtral"):
        found = parts(key, shape, layout)
        if found is not None and found not in out:
            out.append(found)
    return out
