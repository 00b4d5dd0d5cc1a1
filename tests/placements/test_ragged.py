import math
import pickle

import pytest
import torch
from hypothesis import given

from vfsdp.placements import (
    RaggedShard,
    assemble_reference,
    flat_range,
    local_numel,
    local_shape,
    split_reference,
    validate_placement,
)
from vfsdp.testing.strategies import ragged_cases


def _loop_ranges(numel, units):
    """Independent statement of the semantics: cumulative sums of unit * local_units."""
    total = sum(units)
    unit = numel // total if total else 0
    out, start = [], 0
    for u in units:
        out.append((start, start + unit * u))
        start += unit * u
    return out


def test_docs_example():
    p = RaggedShard((0,), (1, 2, 0, 2))
    assert [flat_range(p, (10, 4), r) for r in range(4)] == [(0, 8), (8, 24), (24, 24), (24, 40)]
    assert local_shape(p, (10, 4), 1) == (4, 4)
    assert local_shape(p, (10, 4), 2) == (0, 4)


def test_frozen_hashable_repr_pickle():
    p = RaggedShard((0,), (1, 0, 2))
    assert p == RaggedShard((0,), [1, 0, 2]) and hash(p) == hash(RaggedShard((0,), (1, 0, 2)))
    with pytest.raises(AttributeError):
        p.dims = (0, 1)
    assert pickle.loads(pickle.dumps(p)) == p
    long = RaggedShard((0,), (0,) * 100 + (3,) + (0,) * 100)
    assert "0x100" in repr(long) and len(repr(long)) < 80


@pytest.mark.parametrize(
    "dims, units, error",
    [
        ((1,), (1, 1), ValueError),  # not a prefix
        ((0,), (), ValueError),  # no ranks
        ((0,), (1, -1), ValueError),
        ((0,), (1.0, 1), TypeError),
        ((0,), (True, 1), TypeError),
    ],
)
def test_bad_construction(dims, units, error):
    with pytest.raises(error):
        RaggedShard(dims, units)


def test_validate_against_shape():
    with pytest.raises(ValueError, match="not divisible"):
        validate_placement(RaggedShard((0,), (1, 2)), (4, 2))  # 8 elements / 3 units
    with pytest.raises(ValueError, match="slabs"):
        validate_placement(RaggedShard((0,), (1, 1)), (1, 2, 3))  # unit of 3 vs a 6-element slab
    with pytest.raises(ValueError, match="rank"):
        validate_placement(RaggedShard((0, 1, 2), (1,)), (4, 2))
    with pytest.raises(ValueError, match="0-size"):
        validate_placement(RaggedShard((0,), (0, 0)), (2,))
    validate_placement(RaggedShard((0,), (0, 0)), (0, 3))
    with pytest.raises(ValueError, match="out of range"):
        flat_range(RaggedShard((0,), (1, 1)), (2,), 2)


def test_only_ragged_shards_are_placements():
    with pytest.raises(TypeError, match="RaggedShard"):
        flat_range("replicate", (3, 2), 0)


@given(ragged_cases())
def test_split_matches_loop_and_roundtrips(case):
    shape, p = case
    numel = math.prod(shape)
    full = torch.arange(numel, dtype=torch.float64).reshape(shape)
    pieces = split_reference(full, p)
    ranges = _loop_ranges(numel, p.local_units)
    assert len(pieces) == p.world_size
    for r, piece in enumerate(pieces):
        start, stop = ranges[r]
        assert flat_range(p, shape, r) == (start, stop)
        assert local_numel(p, shape, r) == stop - start
        assert tuple(piece.shape) == local_shape(p, shape, r)
        assert torch.equal(piece.reshape(-1), full.reshape(-1)[start:stop])
        trailing = shape[len(p.dims):]
        if p.dims and piece.numel():
            assert tuple(piece.shape[1:]) == trailing
    assert sum(x.numel() for x in pieces) == numel
    back = assemble_reference(pieces, p, shape)
    assert back.shape == full.shape and torch.equal(back, full)


def test_assemble_rejects_wrong_pieces():
    p = RaggedShard((0,), (1, 1))
    with pytest.raises(ValueError, match="expected 2 pieces"):
        assemble_reference([torch.zeros(1)], p, (2,))
    with pytest.raises(ValueError, match="piece 1"):
        assemble_reference([torch.zeros(1), torch.zeros(2)], p, (2,))
