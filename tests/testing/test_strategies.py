"""vfsdp.testing.strategies: what it generates, and the docs' example property test."""

import os
import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from vfsdp.testing import strategies as vst

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_docs_property_test_runs_as_written():
    """docs/property-tests.md's first example, which the docs build runs too."""
    with open(os.path.join(ROOT, "docs", "property-tests.md"), encoding="utf-8") as f:
        page = f.read()
    code = re.search(r'```python exec="on"[^\n]*\n(.*?)```', page, re.S).group(1)
    assert "def test_scatter_then_gather_is_the_identity" in code
    namespace: dict = {}
    exec(compile(code, "docs/property-tests.md", "exec"), namespace)
    namespace["test_scatter_then_gather_is_the_identity"]()


@settings(max_examples=60, deadline=None)
@given(vst.meshes(), st.data())
def test_plans_are_valid_and_cover_the_edge_cases(mesh, data):
    _, spec = data.draw(vst.plans(mesh=st.just(mesh)))
    vfsdp.check_spec(spec)
    assert vst.ranks(spec) == (mesh if isinstance(mesh, int) else mesh[0] * mesh[1])
    dtypes = {spec.units[k].dtype for k in spec.units}
    assert dtypes <= set(vst.DTYPES)


def test_strategies_reach_the_edge_cases():
    seen = {"zero": False, "scalar": False, "hsdp": False, "prime": False, "mixed": False}

    @settings(max_examples=200, deadline=None)
    @given(vst.plans())
    def collect(case):
        _, spec = case
        shapes = [t.shape for t in spec.tensors()]
        seen["zero"] |= any(0 in s for s in shapes)
        seen["scalar"] |= any(s == () for s in shapes)
        seen["hsdp"] |= spec.replicas > 1
        seen["prime"] |= spec.world_size in vst.PRIMES and spec.world_size > 2
        seen["mixed"] |= len({u.dtype for u in spec.units.values()}) > 1

    collect()
    assert all(seen.values()), seen


def test_meta_trees_and_ragged_cases():
    @settings(max_examples=30, deadline=None)
    @given(vst.param_trees(meta=True), vst.ragged_cases())
    def check(tree, case):
        leaves = [*tree["root"].values(), *(x for layer in tree["layers"] for x in layer.values())]
        assert all(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves)
        shape, placement = case
        from vfsdp.placements import validate_placement

        validate_placement(placement, shape)

    check()
