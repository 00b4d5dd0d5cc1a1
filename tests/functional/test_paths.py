"""Every path (eager gather and run_layers, an identity low-precision hook on each,
torch.func, compiled) under every option combination gives one plain-torch process's
gradients, or the same refusal."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.functional import paths_bodies as pb
from vfsdp.testing import simulate, spawn


@st.composite
def cases(draw, paths=("gather", "run_layers", "lowp", "lowp_layers", "func")):
    micro = draw(st.integers(1, 2))
    return {
        "path": draw(st.sampled_from(paths)),
        "micro": [draw(st.booleans()) for _ in range(micro - 1)] + [True],
        "accumulate": draw(st.sampled_from([None, True])),
        "op": draw(st.sampled_from(["avg", "sum"])),
        "reduce_dtype": draw(st.sampled_from([None, "float64"])),
        "world": draw(st.sampled_from([1, 2, 3])),
    }


def _check(case, got):
    refused = pb.refusal(case)
    if refused is not None:
        assert all(isinstance(g, str) and refused in g for g in got), (case, got)
        return
    want = pb.reference(case)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert not isinstance(g, str), (case, g)
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert len(a) == len(b)
            assert all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5) for x, y in zip(a, b)), \
                (rank, a, b, case)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_every_eager_path_and_option_gives_plain_torchs_gradients(case):
    _check(case, simulate(case["world"], pb.run, case))


COMPILED = [  # a fixed set: each compiles a graph per grad_sync value
    {"entry": "gather", "micro": [False, True], "accumulate": True, "op": "sum",
     "reduce_dtype": None},
    {"entry": "run_layers", "micro": [True, True], "accumulate": None, "op": "avg",
     "reduce_dtype": None},
]


@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILED, ids=lambda c: f"{c['entry']}-{len(c['micro'])}")
def test_the_compiled_path_gives_plain_torchs_gradients(case):
    case = dict(case, path="compiled", world=2)
    _check(case, spawn(pb.run_compiled, 2, case))  # processes: see test_compiled's docstring
