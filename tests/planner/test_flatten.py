"""The planner's flatten gives exactly optree's paths, leaves and treespec, on random nested
trees: plain dicts/lists/tuples (the planner's own walk) and everything else (optree's)."""

import collections
import pickle

import optree
import torch
from hypothesis import given
from hypothesis import strategies as st

import vfsdp
from vfsdp.planner.abstract import ShapeDtype
from vfsdp.planner.flatten import flatten_with_path

Pair = collections.namedtuple("Pair", "x y")
TENSORS = [torch.zeros(2), torch.nn.Parameter(torch.ones(3)), torch.empty(4, device="meta")]
LEAVES = st.one_of(st.sampled_from(TENSORS), st.just(ShapeDtype((2, 3))), st.none(),
                   st.integers(-3, 3), st.text(max_size=2), st.floats(allow_nan=False))
NAMES = st.sampled_from(["b", "a", "layers", "w", "0", "10", "2"])


def plain_containers(children):
    return st.one_of(st.dictionaries(NAMES, children, min_size=1, max_size=4),
                     st.dictionaries(st.integers(-5, 5), children, max_size=3),
                     st.lists(children, max_size=4), st.lists(children, max_size=3).map(tuple))


def any_containers(children):
    other = st.one_of(st.dictionaries(st.one_of(NAMES, st.integers(0, 3)), children, max_size=4),
                      st.dictionaries(NAMES, children, max_size=3).map(collections.OrderedDict),
                      st.tuples(children, children).map(lambda xy: Pair(*xy)))
    return st.one_of(plain_containers(children), other)


PLAIN_TREES = st.recursive(LEAVES, plain_containers, max_leaves=24)
TREES = st.recursive(LEAVES, any_containers, max_leaves=24)


def plain(tree) -> bool:
    """Whether the walk handles ``tree`` itself (optree's treespec comes back otherwise)."""
    if type(tree) is dict:
        kinds = set(map(type, tree))
        return len(kinds) < 2 and all(map(plain, tree.values()))
    if type(tree) in (list, tuple):
        return all(map(plain, tree))
    return optree.tree_is_leaf(tree) or tree is None


@given(st.one_of(PLAIN_TREES, TREES))
def test_the_walk_gives_optrees_paths_leaves_and_treespec(tree):
    paths, leaves, treespec = flatten_with_path(tree)
    want_paths, want_leaves, want_spec = optree.tree_flatten_with_path(tree)
    assert callable(treespec) == plain(tree)
    treespec = treespec() if callable(treespec) else treespec
    assert paths == want_paths
    assert len(leaves) == len(want_leaves) and all(map(lambda a, b: a is b, leaves, want_leaves))
    assert treespec == want_spec and str(treespec) == str(want_spec)
    marks = list(range(len(leaves)))  # unflatten restores each dict's insertion order
    assert repr(optree.tree_unflatten(treespec, marks)) == repr(optree.tree_unflatten(want_spec, marks))


def test_a_plans_treespec_is_made_once_when_first_read_and_kept():
    params = {"b": [{"w": torch.ones(4, 2)}, {"w": torch.ones(4, 2)}], "a": (None, torch.ones(3))}
    spec = vfsdp.plan(params, 2)
    assert callable(spec._treespec)  # not made by plan
    assert spec.treespec is spec.treespec == optree.tree_structure(params)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert vfsdp.plan(collections.OrderedDict(params), 2).treespec == optree.tree_structure(
        collections.OrderedDict(params))  # optree's own, made by plan


def test_shard_takes_its_trees_treespec_as_the_specs_where_the_structure_matches():
    params = {"layers": [{"w": torch.ones(4, 2)} for _ in range(2)], "b": torch.ones(3)}
    spec = vfsdp.plan(params, 2)
    treespec = optree.tree_structure(params)
    assert spec.same_structure(treespec, params) and spec._treespec is treespec
    assert not vfsdp.plan(params, 2).same_structure(optree.tree_structure({"b": 0}), {"b": 0})
    other = vfsdp.plan(params, 2)
    vfsdp.testing.simulate(2, lambda: vfsdp.shard(params, other))
    assert not callable(other._treespec) and other.treespec == treespec
