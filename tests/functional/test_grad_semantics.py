"""Gradients equal plain torch's on every path: a hypothesis property over option combinations,
sequences of backwards, retain_graph, autograd.grad and frozen tensors, against the same
scenario in one process with plain tensors."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.functional import semantics_bodies as sb
from vfsdp.testing import simulate, spawn

N_TENSORS = 5


@st.composite
def cases(draw):
    retain = draw(st.booleans())
    n = draw(st.integers(1, 3))
    steps = []
    for i in range(n):
        sync = True if retain else draw(st.booleans())
        steps.append({"sync": sync, "zero_before": i > 0 and draw(st.booleans())})
    mesh = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    return {
        "mode": draw(st.sampled_from(["return", "buffer"])),
        "accumulate": draw(st.sampled_from([None, True])),   # None: the default
        "steps": steps,
        "retain": retain,
        "path": draw(st.sampled_from(["backward", "autograd"])),
        "frozen": sorted(draw(st.sets(st.integers(0, N_TENSORS - 1), max_size=2))),
        "op": draw(st.sampled_from(["avg", "sum"])),
        "mesh": mesh,
    }


def _world(case):
    m = case["mesh"]
    return m if isinstance(m, int) else math.prod(m)


def _check(case, got):
    want = sb.reference(case, _world(case))
    for rank, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w) == N_TENSORS
        for i, (a, b) in enumerate(zip(g, w)):
            assert (a is None) == (b is None), (rank, i, a, b, case)
            if a is not None:
                assert len(a) == len(b)
                assert all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) for x, y in zip(a, b)), \
                    (rank, i, a, b, case)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_every_combination_matches_one_process(case):
    _check(case, simulate(_world(case), sb.run, case))


@pytest.mark.parametrize("case", [
    {"mode": "return", "accumulate": None, "retain": False, "path": "backward", "frozen": [],
     "op": "avg", "mesh": 2, "steps": [{"sync": True, "zero_before": False}] * 3},
    {"mode": "buffer", "accumulate": True, "retain": True, "path": "backward", "frozen": [1],
     "op": "sum", "mesh": 2, "steps": [{"sync": True, "zero_before": False}] * 2},
    {"mode": "return", "accumulate": None, "retain": False, "path": "autograd", "frozen": [0],
     "op": "avg", "mesh": 3,
     "steps": [{"sync": False, "zero_before": False}, {"sync": True, "zero_before": False}]},
])
def test_on_gloo_processes(case):
    _check(case, spawn(sb.run, _world(case), case))


def test_the_reported_doubling_is_gone():
    """Issue row 1: shards reused across steps with zero_grads between: gradients 1, 2, 3."""
    case = {"mode": "return", "accumulate": None, "retain": False, "path": "backward",
            "frozen": [], "op": "avg", "mesh": 2,
            "steps": [{"sync": True, "zero_before": i > 0} for i in range(3)]}
    _check(case, simulate(2, sb.run, case))


def test_a_grad_set_to_none_by_hand_restarts_that_tensor_only():
    """torch: a.grad = None, then a backward: a gets the new gradient, b adds to what it had.
    (The second backward raised "b was released" on the gradient buffer's released view.)"""
    got = simulate(2, sb.one_grad_replaced)  # rank 0 holds all of a, rank 1 all of b
    assert got == [([2.0], []), ([], [6.0])]
