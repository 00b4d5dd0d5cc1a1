import math
import os
import random
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.planner import oracle
from vfsdp.planner import solver
from vfsdp.planner.solver import lower_bound, pack, place_in_order


def _certify_unit(*args):
    """benchmarks/plan_bench.py's exhaustive optimum (``--certify``)."""
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, bench)
    try:
        from plan_bench import certify_unit
    finally:
        sys.path.remove(bench)
    return certify_unit(*args)


def _tiny(rng: random.Random):
    n = rng.randint(1, 5)
    numels = [rng.choice([0, 1, 2, 3, 4, 5, 6, 8]) for _ in range(n)]
    blocks = [rng.choice([1, 1, 2, 3, 4]) for _ in range(n)]
    m = rng.randint(1, 4)
    align = rng.choice([1, 1, 2])
    return numels, blocks, m, align


def test_fixed_small_cases():
    # S=4 would cut a 3-element block of the first tensor
    p = pack([6, 2], [3, 1], 2, 1)
    assert (p.shard_numel, p.offsets, p.lower_bound) == (5, (2, 8), 4)
    # blocks tile the shards exactly: zero padding
    p = pack([8, 8, 16], [4, 4, 8], 4, 1)
    assert p.shard_numel == 8 and p.shard_numel * 4 == 32
    # world size 1: one shard, S = total rounded up to the alignment
    assert pack([5, 6], [5, 3], 1, 4).shard_numel == 12
    # more ranks than elements: S is one alignment unit, most ranks hold only padding
    p = pack([3], [1], 16, 4)
    assert p.shard_numel == 4 and p.offsets == (0,)
    # only 0-size tensors: S is still positive
    assert pack([0, 0], [1, 1], 3, 2).shard_numel == 2


def test_llama3_70b_layer_bound():
    """The issue's example: rows(32) at m = 1024 forces S = lcm(32*8192, 32*28672)."""
    h, i, kv = 8192, 28672, 1024
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    numels = [math.prod(s) for s in shapes]
    blocks = [32 * s[-1] if len(s) > 1 else 32 for s in shapes]
    p = pack(numels, blocks, 1024, 8)
    assert p.lower_bound == math.lcm(32 * h, 32 * i) == p.shard_numel


def test_bad_input():
    with pytest.raises(ValueError, match="world size"):
        pack([1], [1], 0, 1)
    with pytest.raises(ValueError, match="alignment"):
        pack([1], [1], 1, 0)
    with pytest.raises(ValueError, match="blocks"):
        pack([1], [0], 1, 1)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=6),
       st.integers(1, 7), st.sampled_from([1, 2, 4, 8]))
def test_lower_bound_matches_linear_scan(items, m, align):
    numels = [e for e, _ in items]
    blocks = [g for _, g in items]
    assert lower_bound(numels, blocks, m, align) == oracle.lower_bound_scan(numels, blocks, m, align)


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 9)), min_size=1, max_size=6),
       st.integers(1, 30), st.sampled_from([1, 2, 4]))
def test_next_admissible_is_smallest(items, start, align):
    numels = [e for e, _ in items]
    blocks = [g for _, g in items]
    got = solver._Bound(numels, blocks, align).next_admissible(start)

    def admissible(s):
        return s % align == 0 and all(s % g == 0 for e, g in items if e >= 2 * s and e)

    assert got >= start and admissible(got)
    assert not any(admissible(s) for s in range(max(start, 1), got))


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 16)), min_size=1, max_size=8),
       st.one_of(st.integers(1, 17), st.just(64)), st.sampled_from([1, 2, 4, 8]))
def test_plans_are_valid_and_above_bound(items, m, align):
    numels = [e for e, _ in items]
    blocks = [g for _, g in items]
    p = pack(numels, blocks, m, align)
    s = p.shard_numel
    assert s >= p.lower_bound and s % align == 0 and s > 0
    assert oracle.padding_ok(p.offsets, numels, blocks, s, m)
    assert sorted(p.order) == list(range(len(numels)))
    assert m * s >= sum(numels)


def test_earliest_start_placement_is_exact_for_an_order():
    rng = random.Random(7)
    for _ in range(300):
        numels, blocks, m, align = _tiny(rng)
        order = list(range(len(numels)))
        for s in range(align, max(sum(numels), 1) + align, align):
            greedy = place_in_order(order, numels, solver._bound(numels, blocks, m, align)[0], s, m)
            assert (greedy is not None) == oracle.fits_in_order(order, numels, blocks, s, m)


def test_against_brute_force_oracle():
    """Never worse than the best plan for the given order; report how often it is optimal."""
    rng = random.Random(2026)
    optimal = total = 0
    for _ in range(250):
        numels, blocks, m, align = _tiny(rng)
        s = pack(numels, blocks, m, align).shard_numel
        fixed = oracle.best_for_order(list(range(len(numels))), numels, blocks, m, align)
        best = oracle.optimum(numels, blocks, m, align)
        assert best <= s <= fixed, (numels, blocks, m, align)
        assert _certify_unit(numels, blocks, m, align) == best
        optimal += s == best
        total += 1
    rate = optimal / total
    print(f"\nplanner optimal on {optimal}/{total} brute-forced instances ({100 * rate:.1f}%)")
    assert rate >= 0.98
