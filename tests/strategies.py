"""Shared hypothesis strategies."""

from __future__ import annotations

import math

from hypothesis import strategies as st

WORLD_SIZES = st.one_of(st.integers(1, 17), st.just(64))


@st.composite
def shapes(draw, max_dims=3, max_side=6):
    """Shapes with 0-3 dims, sides 0..max_side (0-size and 1-element tensors included)."""
    ndim = draw(st.integers(0, max_dims))
    return tuple(draw(st.integers(0, max_side)) for _ in range(ndim))


@st.composite
def compositions(draw, total, parts):
    """``parts`` non-negative ints summing to ``total`` (zeros allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return tuple(bounds[i + 1] - bounds[i] for i in range(parts))


@st.composite
def ragged_cases(draw):
    """(shape, dims, local_units) that form a valid RaggedShard."""
    from vfsdp.placements import RaggedShard

    shape = draw(shapes())
    m = draw(WORLD_SIZES)
    d = draw(st.integers(0, len(shape)))
    lead = math.prod(shape[:d])
    numel = math.prod(shape)
    if numel == 0:
        units = (0,) * m
    else:
        divisors = [k for k in range(1, lead + 1) if lead % k == 0]
        total = draw(st.sampled_from(divisors))
        units = draw(compositions(total, m))
    return shape, RaggedShard(tuple(range(d)), units)
