"""``ShardSpec.recipe()``: the ``vfsdp.plan(...)`` call that rebuilds a spec, as Python code.

A shrunk hypothesis example prints a spec's table (``S=12 (bound 8)``), which does not say
how it was planned. The recipe does: the tree as :class:`vfsdp.ShapeDtype` leaves, the mesh,
each tensor's block (what the granularity resolved to: ``rows(1)`` of a (3, 5) tensor is 5
elements; ``rows(k)`` where the block does not divide the tensor), each tensor's unit and
the alignment. Running it plans the same spec (equal ``fingerprint``), with no tensors and
no process group.
"""

from __future__ import annotations

from typing import Any

import optree

__all__ = ["recipe"]


class _Code(str):
    """A leaf whose repr is the code that makes it."""

    __repr__ = str.__str__


def recipe(spec: Any) -> str:
    """Python code whose last line plans ``spec`` again: ``spec = vfsdp.plan(...)``.

    Trees of dicts, lists and tuples render as literals; a non-tensor leaf becomes the string
    ``"passthrough"`` (the spec does not keep its value). A ``plan(tp=...)`` spec rebuilds
    the layout of its own index's pieces (their shapes), without ``tp=``: the strided
    placements, which need the global tensors and the rule, are not in the recipe.

    Args:
        spec: A :class:`vfsdp.ShardSpec`.

    Returns:
        The code, one statement a line.

    Raises:
        ValueError: never for a spec ``vfsdp.plan`` made; a spec whose units' alignments no
            single ``alignment_bytes`` gives is rendered with the first unit's and a comment.

    Example:
        >>> spec = vfsdp.plan({"w": torch.empty(3, 5)}, 2, granularity=vfsdp.rows(1))
        >>> print(recipe(spec))
        import torch, vfsdp
        from vfsdp import ShapeDtype
        params = {'w': ShapeDtype((3, 5), torch.float32)}
        blocks = {('w',): 5}  # each tensor's block: elements, or rows(k)
        units = {('w',): ()}  # each tensor's unit
        spec = vfsdp.plan(params, 2, alignment_bytes=16,
                          granularity=lambda path, t: blocks[tuple(path)],
                          units=lambda path: units[tuple(path)])
        >>> namespace = {}
        >>> exec(recipe(spec), namespace)
        >>> namespace["spec"] == spec
        True
    """
    from vfsdp.planner.spec import TensorSpec

    leaves = [_Code(f"ShapeDtype({tuple(x.shape)!r}, {x.dtype})") if isinstance(x, TensorSpec)
              else "passthrough" for x in spec.leaves()]
    blocks, units = {}, {}
    for x in spec.tensors():
        row = x.shape[-1] if len(x.shape) >= 2 else 1
        short = x.numel and x.numel % x.block  # a short last block: only rows(k) gives it
        blocks[x.path] = _Code(f"vfsdp.rows({x.block // row})") if short else x.block
        units[x.path] = x.unit
    tree = optree.tree_unflatten(spec.treespec, leaves)
    mesh = (tuple(zip(spec.mesh_dim_names, spec.mesh_shape)) if spec.mesh_dim_names is not None
            else spec.mesh_shape[0] if len(spec.mesh_shape) == 1 else spec.mesh_shape)
    aligned = sorted({u.alignment * u.dtype.itemsize for u in spec.units.values()})
    lines = ["import torch, vfsdp", "from vfsdp import ShapeDtype", f"params = {tree!r}",
             f"blocks = {blocks!r}  # each tensor's block: elements, or rows(k)",
             f"units = {units!r}  # each tensor's unit"]
    if len(aligned) > 1:
        lines.append(f"# the units are aligned to {aligned} bytes: add the comm_dtypes= "
                     f"the plan was made with")
    if spec.model_axis is not None:
        axis, size, index = spec.model_axis
        lines.append(f"# a plan(tp=...) spec: this rebuilds {axis}={index}'s pieces (of "
                     f"{size}) without the strided placements")
    lines += [f"spec = vfsdp.plan(params, {mesh!r}, alignment_bytes={aligned[0] if aligned else 16},",
              "                  granularity=lambda path, t: blocks[tuple(path)],",
              "                  units=lambda path: units[tuple(path)])"]
    return "\n".join(lines)
