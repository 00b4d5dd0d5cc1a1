import collections
import math
import pickle
import subprocess
import sys

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vfsdp import ShapeDtype, check_spec, plan, plan_stats, rows, whole
from vfsdp.functional import gather_reference, shard_reference, unit_buffer_reference
from vfsdp.planner import PASSTHROUGH, ShardSpec
from vfsdp.testing.strategies import shapes, world_sizes

WORLD_SIZES = st.one_of(world_sizes(17), st.just(64))


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


# ---------------------------------------------------------------- random pytrees


@st.composite
def granularities(draw, shape):
    numel = math.prod(shape)
    choice = draw(st.sampled_from(["none", "int", "rows", "whole"]))
    if choice == "int":
        divisors = [d for d in range(1, numel + 1) if numel % d == 0] or [1]
        return draw(st.sampled_from(divisors))
    if choice == "rows":
        return rows(draw(st.integers(1, 4)))
    return whole if choice == "whole" else None


@st.composite
def param_trees(draw):
    """Nested dict/list/tuple trees of tensors plus non-tensor leaves; per-path granularity."""
    grans = {}
    counter = iter(range(10**6))

    def leaf():
        kind = draw(st.sampled_from(["t", "t", "t", "int", "str", "none"]))
        if kind == "t":
            shape = draw(shapes())
            i = next(counter)
            grans[i] = draw(granularities(shape))
            x = torch.randn(shape, dtype=torch.float64)
            x.__dict__["_gid"] = i
            return x
        return {"int": 7, "str": "static", "none": None}[kind]

    def node(depth):
        if depth == 0 or draw(st.booleans()):
            return leaf()
        kind = draw(st.sampled_from(["dict", "list", "tuple"]))
        n = draw(st.integers(0, 3))
        children = [node(depth - 1) for _ in range(n)]
        if kind == "dict":
            return {f"k{i}": c for i, c in enumerate(children)}
        return children if kind == "list" else tuple(children)

    tree = {"embed": leaf(), "layers": [node(2) for _ in range(draw(st.integers(0, 3)))],
            "head": node(2)}
    return tree, grans


def _gran_fn(grans):
    return lambda path, t: grans[t.__dict__["_gid"]]


@given(param_trees(), WORLD_SIZES, st.sampled_from([4, 8, 16]))
def test_random_trees_plan_check_and_roundtrip(case, m, align_bytes):
    tree, grans = case
    spec = plan(tree, m, granularity=_gran_fn(grans), alignment_bytes=align_bytes)
    check_spec(spec)
    assert spec.treespec == optree.tree_structure(tree)
    leaves = optree.tree_leaves(tree)
    for leaf, s in zip(leaves, spec.leaves()):
        assert (s is PASSTHROUGH) == (not isinstance(leaf, torch.Tensor))
    # splitting by placements and reassembling is the identity, and matches the unit buffers
    pieces = shard_reference(tree, spec)
    back = gather_reference(pieces, spec)
    for a, b in zip(leaves, optree.tree_leaves(back)):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and torch.equal(a, b)
        else:
            assert a == b
    for key, u in spec.units.items():
        buf = unit_buffer_reference(tree, spec, key)
        s_ = u.shard_numel
        for t in spec.unit_tensors(key):
            for r in t.ranks():
                lo, hi = t.shard_range(r)
                piece = optree.tree_leaves(pieces[r])[optree.tree_leaves(spec.tree).index(t)]
                assert torch.equal(buf[r * s_ + lo:r * s_ + hi], piece.reshape(-1))
        # padding is only between tensors: everything outside the tensors is zero
        mask = torch.ones(u.padded_numel, dtype=torch.bool)
        for off, e in zip(u.offsets, u.numels):
            mask[off:off + e] = False
        assert not buf[mask].any()
    # deterministic: the same inputs give an equal spec
    again = plan(tree, m, granularity=_gran_fn(grans), alignment_bytes=align_bytes)
    assert again == spec and hash(again) == hash(spec) and again.fingerprint == spec.fingerprint


# ---------------------------------------------------------------- units


def _layers_tree(n=3):
    return {"embed": meta(10, 4), "layers": [{"w": meta(4, 4), "b": meta(4)} for _ in range(n)],
            "norm": meta(4)}


def test_default_units_from_outer_list():
    spec = plan(_layers_tree(), 2)
    assert list(spec.units) == [(), ("layers", 0), ("layers", 1), ("layers", 2)]
    assert spec.units[()].paths == (("embed",), ("norm",))
    assert spec.tensor(("layers", 1, "w")).unit == ("layers", 1)


def test_default_units_from_dotted_names():
    flat = {"embed.weight": meta(10, 4), "layers.0.w": meta(4, 4), "layers.1.w": meta(4, 4),
            "layers.10.w": meta(4, 4)}
    spec = plan(flat, 2)
    assert set(spec.units) == {(), ("layers", 0), ("layers", 1), ("layers", 10)}


def test_default_units_namedtuple_is_not_a_layer_list():
    Params = collections.namedtuple("Params", "embed layers")
    spec = plan(Params(meta(3), [meta(2), meta(2)]), 2)
    assert set(spec.units) == {(), (1, 0), (1, 1)}


def test_units_depth_callable_and_prefixes():
    tree = _layers_tree()
    assert set(plan(tree, 2, units=1).units) == {("embed",), ("layers",), ("norm",)}
    spec = plan(tree, 2, units=lambda p: "all")
    assert list(spec.units) == ["all"]
    spec = plan(tree, 2, units=["layers.0", ("layers", 1)])
    assert set(spec.units) == {("layers", 0), ("layers", 1), ()}
    assert spec.tensor(("layers", 2, "w")).unit == ()


def test_units_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"layers.7.*matches no tensor"):
        plan(_layers_tree(), 2, units=["layers.7"])
    with pytest.raises(TypeError, match=r"unhashable.*for embed"):
        plan(_layers_tree(), 2, units=lambda p: [p])
    with pytest.raises(ValueError, match=">= 0"):
        plan(_layers_tree(), 2, units=-1)


def test_mixed_dtypes_error_names_both_tensors():
    tree = {"layers": [{"w": meta(4, 4, dtype=torch.bfloat16), "norm": meta(4)}]}
    with pytest.raises(ValueError, match=r"layers\.0.*mixes dtypes.*layers\.0\.norm.*layers\.0\.w"):
        plan(tree, 2)
    spec = plan(tree, 2, units=lambda p: p)  # one unit per tensor works
    check_spec(spec)


# ---------------------------------------------------------------- granularity


def test_rows_blocks_and_partial_last_block():
    spec = plan({"w": meta(10, 4)}, 4, granularity=rows(3))
    t = spec.tensor(("w",))
    assert t.block == 12
    # blocks of 3 rows start at rows 0, 3, 6, 9: every rank boundary lands on one of them
    for r in t.ranks():
        start, stop = t.local_range(r)
        assert start % 12 == 0 and (stop % 12 == 0 or stop == 40)
    p = t.placement
    assert p.dims == (0,) and sum(p.local_units) * math.gcd(12, 40) == 40
    check_spec(spec)


def test_rows_of_1d_and_0d_tensors_are_elements():
    spec = plan({"b": meta(10), "s": meta()}, 2, granularity=rows(4))
    assert spec.tensor(("b",)).block == 4 and spec.tensor(("s",)).block == 4
    check_spec(spec)


def test_whole_keeps_every_tensor_on_one_rank():
    tree = {f"t{i}": meta(3 + i, 2) for i in range(5)}
    spec = plan(tree, 3, granularity=whole)
    for t in spec.tensors():
        assert len(t.ranks()) == 1
        assert sorted(t.placement.local_units)[-1] == 1 and sum(t.placement.local_units) == 1


def test_int_block_must_divide():
    with pytest.raises(ValueError, match=r"granularity 7 does not divide w \(shape \(10, 4\)"):
        plan({"w": meta(10, 4)}, 2, granularity=7)
    with pytest.raises(ValueError, match=">= 1"):
        plan({"w": meta(10, 4)}, 2, granularity=0)
    with pytest.raises(TypeError, match="unsupported granularity"):
        plan({"w": meta(10, 4)}, 2, granularity="rows")
    with pytest.raises(ValueError, match=">= 1"):
        rows(0)


def test_granularity_callable_gets_path_and_tensor():
    seen = []

    def gran(path, t):
        seen.append((path, tuple(t.shape)))
        return rows(2) if t.dim() == 2 else None

    spec = plan(_layers_tree(1), 2, granularity=gran)
    assert (("layers", 0, "w"), (4, 4)) in seen
    assert spec.tensor(("layers", 0, "w")).block == 8 and spec.tensor(("norm",)).block == 1


# ---------------------------------------------------------------- edge cases and meshes


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 64, 1000])
def test_zero_size_tiny_and_oversubscribed(m):
    tree = {"empty": meta(0, 5), "one": meta(1), "small": meta(3, 2), "scalar": meta()}
    spec = plan(tree, m)
    check_spec(spec)
    assert spec.tensor(("empty",)).placement.local_units == (0,) * m
    u = spec.units[()]
    assert u.shard_numel >= 1 and u.world_size == m
    if m > 8:
        assert 0 in u.tensors_per_rank()  # some ranks hold nothing but padding


def test_world_size_and_mesh_validation():
    with pytest.raises(ValueError, match="world size must be >= 1"):
        plan({"w": meta(4)}, 0)
    with pytest.raises(ValueError, match="world size must be >= 1"):
        plan({"w": meta(4)}, (2, 0))
    with pytest.raises(TypeError, match="mesh must be"):
        plan({"w": meta(4)}, "8")
    with pytest.raises(TypeError, match="mesh must be"):
        plan({"w": meta(4)}, True)


def test_hsdp_mesh_and_device_mesh_like():
    spec = plan(_layers_tree(), (2, 4))
    assert spec.world_size == 4 and spec.replicas == 2 and spec.mesh_shape == (2, 4)

    class FakeMesh:  # anything shaped like torch's DeviceMesh; no process group is touched
        mesh = torch.zeros(3, 5)
        mesh_dim_names = ("replicate", "shard")

    spec = plan(_layers_tree(), FakeMesh())
    assert spec.world_size == 5 and spec.mesh_dim_names == ("replicate", "shard")


def test_shape_dtype_leaves_and_alignment():
    spec = plan({"w": ShapeDtype((5, 3), torch.bfloat16)}, 4)
    assert spec.units[()].alignment == 8 and spec.units[()].shard_numel % 8 == 0
    spec = plan({"w": meta(5, 3)}, 4, comm_dtypes=[torch.bfloat16])
    assert spec.units[()].alignment == 8
    with pytest.raises(ValueError, match="alignment_bytes"):
        plan({"w": meta(5, 3)}, 4, alignment_bytes=0)


# ---------------------------------------------------------------- the spec object


def test_the_leaves_are_made_on_first_read_as_an_eager_spec_has_them():
    spec = plan(_layers_tree(), 3, granularity=rows(2))
    eager = ShardSpec(spec.treespec, list(spec.leaves()), dict(spec.units), spec.mesh_shape)
    assert eager == spec and eager.leaves() == spec.leaves() and spec.tree["layers"][1]["w"].offset
    with pytest.raises(ValueError, match="disagree"):
        ShardSpec(spec.treespec, lambda: spec.leaves()[1:], dict(spec.units), spec.mesh_shape).leaves()


def test_spec_is_frozen_hashable_picklable_and_readable():
    spec = plan(_layers_tree(), 3, granularity=rows(2))
    with pytest.raises(AttributeError):
        spec.units = {}
    with pytest.raises(TypeError):
        spec.units[()] = None
    t = spec.tensor(("layers", 0, "w"))
    with pytest.raises(AttributeError):
        t.offset = 0
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert len({spec, plan(_layers_tree(), 3, granularity=rows(2))}) == 1
    assert spec != plan(_layers_tree(), 4, granularity=rows(2))
    text = repr(spec)
    assert "padding" in text and "bound" in text and "layers.0 .. layers.2 (x3)" in text
    assert "tensors/rank" in text
    assert "TensorSpec(layers.0.w" in repr(t)
    # mutating the returned tree does not change the spec
    tree = spec.tree
    tree["layers"].clear()
    assert len(spec.tree["layers"]) == 3


def test_subspec_and_introspection_contract():
    spec = plan(_layers_tree(), 3)
    sub = spec["layers"][1]
    assert list(sub.units) == [("layers", 1)]
    u = spec.units[("layers", 1)]
    assert (u.world_size, u.dtype) == (3, torch.float32) and u.paths == sub.units[("layers", 1)].paths
    for t in spec.unit_tensors(("layers", 1)):
        assert (t.unit, t.numel, t.shape) == (("layers", 1), math.prod(t.shape), tuple(t.shape))
        assert u.offsets[u.paths.index(t.path)] == t.offset
    st_ = plan_stats(spec)
    assert st_["padded_numel"] == sum(u.padded_numel for u in spec.units.values())
    assert st_["total_numel"] == 40 + 3 * 20 + 4
    assert st_["padding_ratio"] == pytest.approx((st_["padded_numel"] - 104) / 104)
    with pytest.raises(KeyError, match="no tensor"):
        spec.tensor(("nope",))


def test_plan_is_identical_in_another_process():
    code = (
        "import torch, vfsdp\n"
        "t = {'embed': torch.empty(10, 4, device='meta'), 'layers': [{'w': torch.empty(4, 4, "
        "device='meta'), 'b': torch.empty(4, device='meta')} for _ in range(3)], "
        "'norm': torch.empty(4, device='meta')}\n"
        "print(vfsdp.plan(t, 3, granularity=vfsdp.rows(2)).fingerprint)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == plan(_layers_tree(), 3, granularity=rows(2)).fingerprint


def test_split_suggestion_is_offered_and_accepting_it_helps():
    h, i = 64, 176  # llama-like layer where down_proj's block forces a large LCM
    layer = {"q": meta(h, h), "up": meta(i, h), "down": meta(h, i), "norm": meta(h)}
    spec = plan({"layers": [layer]}, 8, granularity=rows(8))
    u = spec.units[("layers", 0)]
    assert u.split is not None and u.split.padding_after * 2 <= u.split.padding_now
    moved = set(u.split.moved)
    accepted = plan({"layers": [layer]}, 8, granularity=rows(8),
                    units=lambda p: p[:2] + (("split",) if p in moved else ()))
    check_spec(accepted)
    assert plan_stats(accepted)["padded_numel"] - plan_stats(accepted)["total_numel"] == u.split.padding_after
    assert "option: split off" in repr(spec)


@given(__import__("vfsdp.testing.strategies", fromlist=["plans"]).plans())
def test_local_shape_equals_the_placements_local_shape(case):
    # the O(1) fast path (what DBuffers use) against the placement's, on every rank
    from vfsdp.placements.ragged import local_shape

    _, spec = case
    for t in spec.tensors():
        for r in range(spec.world_size):
            assert t.local_shape(r) == local_shape(t.placement, t.shape, r), (t.path, r)
