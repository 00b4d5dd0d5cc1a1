"""One layer from several plans: the pieces :func:`vfsdp.run_layers` gathers as one step.

An MoE layer's dense part (attention, norms, router) is planned over every rank, its experts
over the expert-data mesh: two plans, two shards trees, two meshes. ``run_layers`` takes them
per layer as a dict of pieces (``specs=None``)::

    layers = [{"dense": (shards["layers"][i], spec["layers"][i]),
               "experts": (e_shards["layers"][i], e_spec["layers"][i])} for i in range(n)]
    h = vfsdp.run_layers(lambda p, h: block(p["dense"], p["experts"], h), layers, None, h)

Each piece is ``(shards, spec)`` or ``(shards, spec, mesh)`` (the mesh for plain-tensor
shards, as ``gather``'s ``mesh=``; shards of ``vfsdp.shard`` carry theirs). Every piece's
units are gathered, prefetched, resharded and reduced as the units of a one-plan layer are,
each over its own groups. Layers may hold different pieces (dense layers before MoE ones).

This module only reads the arguments into :class:`LayerPiece` records, and refuses malformed
ones naming the layer, the piece and the fix; :mod:`vfsdp.functional.schedule` runs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vfsdp import _torch_private as tp
from vfsdp.functional.tree import own_mesh
from vfsdp.planner.local import local_plan
from vfsdp.planner.spec import ShardSpec

__all__ = ["Planned", "LayerPiece", "layer_pieces", "assemble_layer"]

_FORM = ("{name: (shards, spec)} or {name: (shards, spec, mesh)}, e.g. "
         "{'dense': (shards['layers'][i], spec['layers'][i]), "
         "'experts': (e_shards['layers'][i], e_spec['layers'][i])}")


@dataclass(frozen=True)
class Planned:
    """A tree with its plan and mesh: a checkpoint's part, one plan's piece of a layer
    (:class:`LayerPiece`), a tree of gradients to clip (:class:`vfsdp.optim.GradTree`).

    Attributes:
        tree: The tree (shards, gradients, a training state).
        spec: The ``ShardSpec`` ``vfsdp.plan`` made for it.
        mesh: The ``DeviceMesh`` its shards were made on (``None``: ``vfsdp.shard``'s shards
            carry theirs, or the default group).
        name: Its name among several (``None`` alone).

    Example:
        >>> spec = vfsdp.plan({"w": torch.ones(4)}, 1)
        >>> Planned({"w": torch.ones(4)}, spec, name="dense").name
        'dense'
    """

    tree: Any
    spec: ShardSpec
    mesh: Any = None
    name: Any = None


@dataclass(frozen=True)
class LayerPiece(Planned):
    """One plan's share of one layer: a :class:`Planned` (``name``: its key in the layer's
    dict, ``None`` in the one-plan form) and ``what``, the entry point with the layer and
    piece, for messages.

    Example:
        >>> spec = vfsdp.plan({"w": torch.ones(4)}, 1)
        >>> LayerPiece({"w": torch.ones(4)}, spec, name="dense", what="f").what
        'f'
    """

    what: str = ""


def layer_pieces(shards: Any, specs: Any, mesh: Any, what: str) -> list[tuple[LayerPiece, ...]]:
    """The layers of a ``run_layers`` call, each a tuple of :class:`LayerPiece`.

    Args:
        shards: One shards subtree per layer, or (``specs=None``) one dict of pieces per layer.
        specs: The matching sub-specs (a list spec or a sequence of them), or ``None``.
        mesh: ``run_layers``' ``mesh=`` (the one-plan form only).
        what: The entry point, for messages. (While compiling, meshes are not read, and a
            list spec's sub-specs are those ``vfsdp.shard`` prepared; with ``all_gather=``
            hooks only shards of ``vfsdp.shard`` get here: a mesh with them is refused, as
            ``gather`` does.)

    Returns:
        One tuple per layer; the one-plan form's hold one piece each, named ``None``
        (:func:`assemble_layer` hands the layer function its tree as it is).

    Raises:
        TypeError: a layer or piece of the wrong form, ``mesh=`` beside pieces, or a spec
            that is not a ``ShardSpec``: naming the layer, the piece and the form to pass.
        ValueError: ``shards`` and ``specs`` differ in length.

    Example:
        >>> spec = vfsdp.plan({"layers": [{"w": torch.ones(4)}] * 2}, 1)
        >>> layers = [{"a": ({"w": torch.ones(4)}, spec["layers"][i])} for i in range(2)]
        >>> [[(p.name, p.what) for p in layer] for layer in layer_pieces(layers, None, None, "f")]
        [[('a', "f (layer 0, piece 'a')")], [('a', "f (layer 1, piece 'a')")]]
    """
    compiled = tp.compiling()
    if isinstance(specs, ShardSpec):  # spec["layers"]: a ShardSpec whose tree is a list
        if local_plan(specs)[2] < 0:  # (its subtrees: prepared by vfsdp.shard, for compiling)
            raise ValueError(f"{what}: specs is a ShardSpec of a {type(specs.tree).__name__}; pass "
                             f"the sub-spec of a list of layers (spec['layers']) or a list of sub-specs")
        specs = [specs[i] for i in range(local_plan(specs)[2])]
    if specs is not None:
        specs = list(specs)
        if len(shards) != len(specs):
            raise ValueError(f"{what}: {len(shards)} shard subtrees but {len(specs)} specs")
        mesh = None if compiled else own_mesh(shards, mesh, what)
        return [(LayerPiece(s, sp, mesh, what=what),) for s, sp in zip(shards, specs)]
    if mesh is not None:
        raise TypeError(f"{what}: mesh= beside pieces (specs=None); give a piece of plain-tensor "
                        f"shards its mesh as (shards, spec, mesh)")
    if isinstance(shards, (Mapping, ShardSpec)) or not isinstance(shards, Sequence):
        raise TypeError(f"{what}: with specs=None, shards is a list of layers, each a dict of "
                        f"pieces {_FORM}; got a {type(shards).__name__}")
    return [_layer(layer, i, what, compiled) for i, layer in enumerate(shards)]


def _layer(layer: Any, i: int, what: str, compiled: bool) -> tuple[LayerPiece, ...]:
    if not isinstance(layer, Mapping) or not layer:
        got = "an empty dict" if isinstance(layer, Mapping) else f"a {type(layer).__name__}"
        raise TypeError(f"{what}: layer {i} is {got}; with specs=None each layer is a dict of "
                        f"pieces {_FORM}")
    out = []
    for name, piece in layer.items():
        at = f"{what} (layer {i}, piece {name!r})"
        if name is None:
            raise TypeError(f"{what}: layer {i} has a piece named None; name each piece (the "
                            f"layer function gets {{name: full tree}})")
        if not isinstance(piece, tuple) or len(piece) not in (2, 3):
            got = f"a tuple of {len(piece)}" if isinstance(piece, tuple) else f"a {type(piece).__name__}"
            raise TypeError(f"{at}: a piece is (shards, spec) or (shards, spec, mesh), got "
                            f"{got}; pass {_FORM}")
        tree, spec, piece_mesh = piece if len(piece) == 3 else (*piece, None)
        if isinstance(tree, ShardSpec) and not isinstance(spec, ShardSpec):
            raise TypeError(f"{at}: got a ShardSpec where the shards go; a piece is "
                            f"(shards, spec), in that order")
        if not isinstance(spec, ShardSpec):
            raise TypeError(f"{at}: the spec is a {type(spec).__name__}, not a ShardSpec; a "
                            f"piece is (shards, spec) with the sub-spec vfsdp.plan made for "
                            f"those shards, e.g. (e_shards['layers'][{i}], "
                            f"e_spec['layers'][{i}])")
        piece_mesh = None if compiled else own_mesh(tree, piece_mesh, at)
        out.append(LayerPiece(tree, spec, piece_mesh, name=name, what=at))
    return tuple(out)


def assemble_layer(layer: tuple[LayerPiece, ...], fulls: list) -> Any:
    """What the layer function gets: the tree itself (one-plan form), or ``{name: tree}``."""
    return fulls[0] if layer[0].name is None else {p.name: f for p, f in zip(layer, fulls)}
