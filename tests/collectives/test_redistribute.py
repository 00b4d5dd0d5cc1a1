"""flat_redistribute (one all_to_all_single) against its loop-over-ranks reference."""

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.collectives.reference import flat_redistribute_reference
from vfsdp.collectives.redistribute import flat_redistribute, shard0_range
from vfsdp.testing import simulate, spawn
from vfsdp.testing.strategies import compositions


def _ranges(sizes):
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


@st.composite
def layouts(draw):
    world = draw(st.sampled_from([1, 2, 3, 5, 7]))
    numels = draw(st.lists(st.integers(0, 12), min_size=1, max_size=4))
    src = [_ranges(draw(compositions(n, world))) for n in numels]
    dst = [_ranges(draw(compositions(n, world))) for n in numels]
    return world, numels, src, dst


def _body(numels, src, dst):
    rank = dist.get_rank()
    fulls = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    mine = [f[src[i][rank][0]:src[i][rank][1]] for i, f in enumerate(fulls)]
    return [t.tolist() for t in flat_redistribute(mine, src, dst)]


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_matches_reference_including_empty_pieces(case):
    world, numels, src, dst = case
    fulls = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    sources = [[f[src[i][r][0]:src[i][r][1]] for i, f in enumerate(fulls)] for r in range(world)]
    want = flat_redistribute_reference(sources, src, dst)
    got = simulate(world, _body, numels, src, dst)
    assert got == [[t.tolist() for t in w] for w in want]
    assert got == [[f[dst[i][r][0]:dst[i][r][1]].tolist() for i, f in enumerate(fulls)]
                   for r in range(world)]


def test_on_gloo_with_uneven_splits():
    src = [[(0, 7), (7, 7), (7, 10)]]
    dst = [[(0, 1), (1, 9), (9, 10)]]
    got = spawn(_body, 3, [10], src, dst)
    assert got == [[[0.0]], [[float(x) for x in range(1, 9)]], [[9.0]]]


def _uncovered():
    try:
        flat_redistribute([torch.zeros(3)], [[(0, 3)]], [[(0, 4)]])
    except ValueError as exc:
        return str(exc)


def test_uncovered_destination_is_refused():
    assert "cover 3 of the 4" in simulate(1, _uncovered)[0]


def test_shard0_range_is_torch_chunk():
    for rows, world in [(5, 3), (2, 4), (0, 2), (8, 8), (7, 1)]:
        chunks = torch.arange(rows * 2).reshape(rows, 2).chunk(world) if rows else []
        for r in range(world):
            lo, hi = shard0_range((rows, 2), world, r)
            want = chunks[r].reshape(-1).tolist() if r < len(chunks) else []
            assert list(range(lo, hi)) == want
