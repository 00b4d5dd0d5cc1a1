"""``ShardSpec.recipe()`` plans the same spec again, for every plan the strategies draw."""

import torch
from hypothesis import given, settings

import vfsdp
from vfsdp.testing import strategies as vst


def _rebuild(spec):
    namespace: dict = {}
    exec(spec.recipe(), namespace)
    return namespace["spec"]


@settings(max_examples=60, deadline=None)
@given(vst.plans())
def test_the_recipe_rebuilds_every_drawn_plan(case):
    _, spec = case
    again = _rebuild(spec)
    assert again == spec, (spec.recipe(), spec, again)


def test_the_recipe_of_the_issue_example_names_the_block():
    """rows(1) of one (3, 5) tensor on 2 ranks: S=12 (bound 8), the tensor at offset 2."""
    spec = vfsdp.plan({"w": torch.empty(3, 5)}, 2, granularity=vfsdp.rows(1))
    assert spec.units[()].offsets == (2,) and spec.units[()].shard_numel == 12
    assert "blocks = {('w',): 5}" in spec.recipe()
    assert _rebuild(spec) == spec
    element = vfsdp.plan({"w": torch.empty(3, 5)}, 2)
    assert _rebuild(element) == element and _rebuild(element) != spec


def test_named_meshes_comm_dtypes_and_mixed_units():
    params = {"layers": [{"w": torch.empty(4, 3)}, {"w": torch.empty(5, dtype=torch.bfloat16)}],
              "head": torch.empty(7, 2, dtype=torch.float64), "note": "x"}
    for spec in (vfsdp.plan(params, (("dp", 2), ("fsdp", 3)), granularity=vfsdp.whole),
                 vfsdp.plan(params, (2, 3), granularity=vfsdp.rows(2), alignment_bytes=64),
                 vfsdp.plan(params, 3, units=["head", "layers.0", "layers.1"])):
        assert _rebuild(spec) == spec, spec.recipe()
    odd = vfsdp.plan(params, 2, comm_dtypes=[torch.bfloat16])
    assert "add the comm_dtypes=" in odd.recipe()
