"""Pieces: flat ranges of global tensors, cut into DCP boxes."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from vfsdp.collectives.piece import Piece, boxes
from vfsdp.testing.strategies import shapes as shape_st


def boxes_reference(shape: tuple, start: int, stop: int) -> set:
    """The flat indices the boxes of ``[start, stop)`` cover, enumerated element by element."""
    covered = set()
    for offsets, sizes in boxes(shape, start, stop):
        idx = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(0)  # cpu: reference
        sl = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        covered |= set(idx[sl].reshape(-1).tolist())
    return covered


@st.composite
def ranges(draw):
    shape = draw(shape_st(max_dims=4, max_side=5))
    n = math.prod(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@given(ranges())
def test_boxes_tile_the_range_exactly(case):
    shape, a, b = case
    got = boxes(shape, a, b)
    assert boxes_reference(shape, a, b) == set(range(a, b))
    assert sum(math.prod(s) for _, s in got) == b - a        # no overlap
    assert len(got) <= max(1, 2 * len(shape) - 1)
    flat = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(0)
    start = a
    for o, s in got:  # in flat order, each box contiguous
        idx = flat[tuple(slice(i, i + k) for i, k in zip(o, s))].reshape(-1)
        assert idx.tolist() == list(range(start, start + idx.numel()))
        start += idx.numel()


@given(shape_st(max_dims=3, max_side=5), st.data())
def test_whole_rows_are_one_box_and_box_data_is_a_view(shape, data):
    if not shape or not math.prod(shape):
        return
    inner = math.prod(shape[1:])
    r0 = data.draw(st.integers(0, shape[0] - 1))
    r1 = data.draw(st.integers(r0 + 1, shape[0]))
    assert len(boxes(shape, r0 * inner, r1 * inner)) == 1
    full = torch.arange(math.prod(shape)).reshape(shape)
    a = data.draw(st.integers(0, full.numel() - 1))
    b = data.draw(st.integers(a + 1, full.numel()))
    piece = Piece(full.reshape(-1)[a:b], shape, a)
    for o, s in piece.boxes():
        view = piece.box_data(o, s)
        assert view.data_ptr() >= piece.local.data_ptr()
        assert torch.equal(view, full[tuple(slice(i, i + k) for i, k in zip(o, s))])
