"""vfsdp.scatter against its reference semantics, and scatter/gather round trips (hypothesis)."""

import optree
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from tests.functional.reference import scatter_reference
from vfsdp.collectives import counts, reset_counts
from vfsdp.functional import match_tree
from vfsdp.testing import shard_reference, simulate, spawn
from vfsdp.testing import strategies as vst


def _local(tree, spec):
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x
            for x in match_tree(tree, spec, "test")]


def scatter_and_gather(params, spec, src):
    """This rank's shards from scatter, and the full tree gather gives back from them."""
    rank = dist.get_rank()
    given_tree = params
    if src is not None and rank != src:  # only the source holds values
        given_tree = optree.tree_map(lambda t: torch.empty_like(t, device="meta")
                                     if isinstance(t, torch.Tensor) else t, params)
    reset_counts()
    shards = vfsdp.scatter(given_tree, spec, src=src)
    scattered = dict(counts())
    full = vfsdp.gather(shards, spec)
    return _local(shards, spec), _local(full, spec), scattered


def _check(params, spec, results, src):
    ref = scatter_reference(params, spec)
    other = shard_reference(params, spec)
    want_full = match_tree(params, spec, "test")
    for rank, (local, full, scattered) in enumerate(results):
        mine = match_tree(ref[rank % spec.world_size], spec, "test")
        also = match_tree(other[rank % spec.world_size], spec, "test")
        for a, b, c in zip(local, mine, also):
            if isinstance(a, torch.Tensor):
                assert a.shape == b.shape == c.shape and a.dtype == b.dtype
                assert torch.equal(a, b) and torch.equal(b, c)
            else:
                assert a == b
        for a, b in zip(full, want_full):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        if src is None:  # every rank copies its own pieces: no communication but the
            assert set(scattered) <= {"spec_check", "spec_check_bytes"}  # one-time spec check
        elif rank // spec.world_size == src // spec.world_size:  # the source's replica
            assert scattered.get("scatter") == len(spec.units)


@settings(max_examples=30, deadline=None)
@given(vst.plans(), st.data())
def test_scatter_then_gather_round_trips_against_the_reference(case, data):
    params, spec = case
    n = vst.ranks(spec)
    src = data.draw(st.one_of(st.none(), st.integers(0, n - 1)))
    _check(params, spec, simulate(n, scatter_and_gather, params, spec, src), src)


def test_scatter_on_gloo_from_a_nonzero_rank():
    params = {"layers": [{"w": torch.arange(15.0).reshape(5, 3)}], "b": torch.arange(4.0)}
    spec = vfsdp.plan(params, 3)
    _check(params, spec, spawn(scatter_and_gather, 3, params, spec, 2), 2)


def test_hsdp_scatter_broadcasts_to_the_other_replica():
    params = {"w": torch.arange(12.0).reshape(4, 3)}
    spec = vfsdp.plan(params, (2, 2))
    _check(params, spec, simulate(4, scatter_and_gather, params, spec, 3), 3)


def bad_source(what):
    params = {"w": torch.arange(6.0), "b": torch.ones(2)}
    spec = vfsdp.plan(params, dist.get_world_size())
    given_tree = params
    if what == "meta":
        given_tree = {"w": torch.empty(6, device="meta"), "b": torch.ones(2)}
    try:
        vfsdp.scatter(given_tree, spec, src=1 if what != "rank" else 7)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("what, msg", [("meta", "w is a meta tensor"),
                                       ("rank", "rank 7 is not in this mesh")])
def test_bad_source_fails_on_every_rank(what, msg):
    for rank, got in enumerate(simulate(2, bad_source, what)):
        assert msg in got, got
        if what == "meta" and rank == 0:
            assert "rank 1 failed" in got  # the other rank names the source's error


def test_shard_src_uses_scatter():
    def body():
        params = {"w": torch.arange(6.0)}
        spec = vfsdp.plan(params, 2)
        reset_counts()
        shards = vfsdp.shard(params if dist.get_rank() == 0 else
                             {"w": torch.empty(6, device="meta")}, spec, src=0)
        return counts()["scatter"], shards["w"].tolist()

    assert simulate(2, body) == [(1, [0.0, 1.0, 2.0, 3.0]), (1, [4.0, 5.0])]


def _scatter_with_none(case):
    params = {"w": torch.arange(10.0).view(5, 2), "e": torch.ones(3)}
    if case == "passthrough":
        params["n"] = 3
    spec = vfsdp.plan(params, dist.get_world_size())
    source = dist.get_rank() == 0
    full = params if source and case != "none_on_source" else None
    try:
        out = vfsdp.scatter(full, spec, src=0)
    except ValueError as exc:
        return str(exc)
    want = vfsdp.shard(params, spec)
    return all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(out),
                                                 optree.tree_leaves(want))
               if isinstance(a, torch.Tensor))


def test_scatter_takes_none_off_the_source_as_torch_distributed_does():
    """Off the source, ``None`` was refused ("tree structure differs ... missing e"):
    torch.distributed.scatter users pass None there, and the spec holds the structure."""
    assert simulate(3, _scatter_with_none, "tensors") == [True] * 3
    for msg in simulate(3, _scatter_with_none, "none_on_source"):  # every rank raises
        assert "the full tensors are None on rank 0, the source; pass them there" in msg, msg
    for msg in simulate(3, _scatter_with_none, "passthrough"):
        assert "passed None, but the tree has leaves that are not tensors" in msg, msg


def _tp_scatter(mesh_shape, src, given):
    """A tp= plan (Megatron's column and row cuts, a replicated bias, a 0-size piece at
    tp=4) sharded from the global tensors on ``src``: meta tensors or None elsewhere."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = vfsdp.mesh(*mesh_shape)
    g = torch.Generator().manual_seed(0)
    params = {"up": torch.randn(4, 6, generator=g), "down": torch.randn(6, 4, generator=g),
              "b": torch.randn(5, generator=g), "odd": torch.randn(3, 2, generator=g)}
    rule = {"up": Shard(1), "down": Shard(0), "b": Replicate(), "odd": Shard(0)}
    spec = vfsdp.plan(params, mesh, tp=lambda path: rule[path[-1]])
    here = dist.get_rank() == src
    full = params if here else None if given == "none" else optree.tree_map(
        lambda t: torch.empty_like(t, device="meta"), params)
    if here and given == "piece":  # the source's own piece of up, not the global tensor
        full = {**params, "up": params["up"][:, :6 // mesh_shape[-1][1]]}
    try:
        shards = vfsdp.shard(full, spec, mesh=mesh, src=src)
    except ValueError as exc:
        return str(exc)
    want = vfsdp.shard(params, spec, mesh=mesh)  # every rank copies its own pieces
    return all(torch.equal(shards[k], want[k]) for k in params)


@pytest.mark.parametrize("mesh_shape, src, given", [
    ((("dp", 2), ("tp", 2)), 0, "meta"), ((("dp", 2), ("tp", 2)), 3, "none"),
    ((("dp", 1), ("tp", 4)), 1, "meta"), ((("rep", 2), ("dp", 1), ("tp", 2)), 2, "meta")])
def test_shard_from_a_source_of_a_tp_plan_gives_every_index_its_pieces(mesh_shape, src,
                                                                       given):
    """The source holds the global tensors, the others meta tensors or None: each tp index
    gets its pieces from the source's model group (it failed on the other indices with a
    traceback from inside, while the source's index waited)."""
    world = 4
    assert simulate(world, _tp_scatter, mesh_shape, src, given, timeout=30) == [True] * world


def test_shard_from_a_source_holding_only_its_piece_of_a_tp_plan_is_refused_on_every_rank():
    got = simulate(4, _tp_scatter, (("dp", 2), ("tp", 2)), 0, "piece", timeout=30)
    assert "vfsdp.scatter: up has shape (4, 3); the source of a plan split over 'tp' must hold the " \
           "global tensors (4, 6)" in got[0], got
    assert all("rank 0 failed" in m and "must hold the global tensors" in m
               for m in got[1:]), got


def _tp_scatter_on_the_data_mesh():
    from torch.distributed.tensor import Shard

    mesh = vfsdp.mesh(("dp", 2), ("tp", 2))
    params = {"w": torch.ones(4, 4)}
    spec = vfsdp.plan(params, mesh, tp=lambda path: Shard(0))
    try:
        vfsdp.shard(params if dist.get_rank() == 0 else None, spec, mesh=mesh["dp"], src=0)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_shard_from_a_source_of_a_tp_plan_on_the_data_mesh_asks_for_the_whole_mesh():
    """Given only the data mesh, the source cannot reach the other tp indices: every rank
    says so (the other indices failed in groups.coords while the source's waited)."""
    for msg in simulate(4, _tp_scatter_on_the_data_mesh, timeout=30):
        assert "split over 'tp', but the mesh given has no such axis; pass the whole mesh" in msg


def _frozen_scatter():
    torch.manual_seed(0)
    full = {"w": torch.nn.Parameter(torch.randn(5), requires_grad=False),
            "b": torch.nn.Parameter(torch.randn(3))}
    spec = vfsdp.plan(full, dist.get_world_size())
    tree = full if dist.get_rank() == 0 else None       # off the source: the spec says it
    shards = vfsdp.scatter(tree, spec, src=0)
    return spec.frozen, shards["w"].requires_grad, shards["b"].requires_grad


def test_a_frozen_parameter_stays_frozen_through_scatter_from_a_source():
    assert simulate(2, _frozen_scatter) == [({("w",)}, False, True)] * 2


def test_the_reference_of_a_tree_without_tensors_has_every_rank():
    """shard_reference gave no rank at all for a tree with no leaves (then gather_reference
    refused its own answer: 'expected 4 ranks, got 0')."""
    params = {"embed": None, "layers": []}
    spec = vfsdp.plan(params, 4)
    pieces = shard_reference(params, spec)
    assert pieces == [params] * 4
    assert vfsdp.testing.gather_reference(pieces, spec) == params
