"""vfsdp.scatter against its reference semantics, and scatter/gather round trips (hypothesis)."""

import optree
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from vfsdp.collectives import counts, reset_counts
from vfsdp.functional import match_tree
from vfsdp.testing import scatter_reference, shard_reference, simulate, spawn
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
