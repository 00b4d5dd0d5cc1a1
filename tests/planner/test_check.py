"""check_spec must catch every kind of violation; corrupt valid specs one way at a time."""

import dataclasses

import pytest
import torch

from vfsdp import check_spec, plan, rows
from vfsdp.placements import StridedRaggedShard
from vfsdp.planner.spec import ShardSpec, TensorSpec


def _spec():
    tree = {"layers": [{"a": torch.empty(8, 4, device="meta"), "b": torch.empty(6, 4, device="meta"),
                        "c": torch.empty(4, device="meta")}]}
    return plan(tree, 4, granularity=rows(2))


def _rebuild(spec, **changes):
    """Replace fields of the single unit and re-point the tensors at it (consistently)."""
    (key, u), = spec.units.items()
    new = dataclasses.replace(u, **changes)
    leaves = []
    for leaf in spec.leaves():
        if isinstance(leaf, TensorSpec):
            k = new.paths.index(leaf.path)
            leaf = TensorSpec(leaf.path, key, new.offsets[k], new.numels[k], leaf.shape, leaf.dtype,
                              new.blocks[k], new)
        leaves.append(leaf)
    return ShardSpec(spec.treespec, leaves, {key: new}, spec.mesh_shape)


def test_valid_spec_passes():
    check_spec(_spec())


def test_columns_of_different_lengths_are_caught():
    spec = _spec()
    u = next(iter(spec.units.values()))
    with pytest.raises(ValueError, match="differ in length"):
        check_spec(_rebuild(spec, shapes=u.shapes[:-1]))


def test_a_piece_shaped_unlike_its_strided_placement_is_caught():
    from torch.distributed.tensor import Shard

    spec = plan({"w": torch.empty(4, 6, device="meta")}, (("dp", 2), ("tp", 2)), tp=lambda p: Shard(1),
                tp_index=0)
    check_spec(spec)
    t = spec.tensor(("w",))
    rows_ = StridedRaggedShard("tp", 2, 0, 0, (4, 6))  # a (2, 6) piece, not the (4, 3) planned
    bad = TensorSpec(t.path, t.unit, t.offset, t.numel, t.shape, t.dtype, t.block, t.layout, rows_)
    with pytest.raises(ValueError, match=r"shape \(4, 3\) but its Shard\(0\) over tp"):
        check_spec(ShardSpec(spec.treespec, [bad], dict(spec.units), spec.mesh_shape))


def test_overlap_is_caught():
    spec = _spec()
    u = next(iter(spec.units.values()))
    offsets = list(u.offsets)
    offsets[1] = offsets[0] + 1
    with pytest.raises(ValueError, match="overlaps"):
        check_spec(_rebuild(spec, offsets=tuple(offsets)))


def test_block_cut_is_caught():
    spec = _spec()
    u = next(iter(spec.units.values()))
    # shift everything by one element so a boundary lands inside an 8-element block
    offsets = tuple(o + 1 for o in u.offsets)
    with pytest.raises(ValueError, match=r"cuts a 8-element block|past the buffer"):
        check_spec(_rebuild(spec, offsets=offsets, shard_numel=u.shard_numel))


def test_shard_spanning_tensor_needs_block_multiple_s():
    tree = {"w": torch.empty(40, device="meta")}
    spec = plan(tree, 8, granularity=4)
    # starts 4 before the first boundary (a block edge), but S=6 puts the next one mid-block
    bad = _rebuild(spec, shard_numel=6, alignment=2, offsets=(2,))
    with pytest.raises(ValueError, match="S=6 is not a multiple of block 4"):
        check_spec(bad)


def test_alignment_and_bounds_are_caught():
    spec = _spec()
    u = next(iter(spec.units.values()))
    with pytest.raises(ValueError, match="alignment"):
        check_spec(_rebuild(spec, shard_numel=u.shard_numel + 1))
    with pytest.raises(ValueError, match="past the buffer"):
        check_spec(_rebuild(spec, offsets=u.offsets[:-1] + (u.padded_numel,)))


def test_inconsistent_tensor_is_caught():
    spec = _spec()
    (key, u), = spec.units.items()
    leaves = list(spec.leaves())
    t = leaves[0]
    leaves[0] = TensorSpec(t.path, key, t.offset, t.numel, (t.numel + 1,), t.dtype, t.block, u)
    with pytest.raises(ValueError, match="prod"):
        check_spec(ShardSpec(spec.treespec, leaves, dict(spec.units), spec.mesh_shape))
    leaves[0] = TensorSpec(t.path, key, t.offset + 2, t.numel, t.shape, t.dtype, t.block, u)
    with pytest.raises(ValueError, match="disagree"):
        check_spec(ShardSpec(spec.treespec, leaves, dict(spec.units), spec.mesh_shape))
    leaves[0] = TensorSpec(t.path, key, t.offset, t.numel, t.shape, torch.float16, t.block, u)
    with pytest.raises(ValueError, match="dtype"):
        check_spec(ShardSpec(spec.treespec, leaves, dict(spec.units), spec.mesh_shape))
    with pytest.raises(ValueError, match="world size"):
        check_spec(ShardSpec(spec.treespec, spec.leaves(), dict(spec.units), (8,)))
