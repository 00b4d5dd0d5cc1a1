"""The estimate's counts read less than a plan, and count the same: an optimizer's state over
only a rank's tensors where it declares its state local, and the shape rules from the prepared
tree rather than an assembled spec."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from vfsdp.estimation.costs import Shapes
from vfsdp.estimation.memory import optimizer_bytes
from vfsdp.planner.plan import prepare
from vfsdp.testing.strategies import param_trees

_OPTS = {"adamw": lambda: vfsdp.optim.adamw(),
         "adamw8bit": lambda: vfsdp.optim.adamw8bit(min_8bit_numel=64),
         "muon": lambda: vfsdp.optim.muon()}


def _both(opt, spec, rank, replicas=1):
    return (optimizer_bytes(opt, spec.units, rank, replicas),
            optimizer_bytes(opt._replace(local_state=False), spec.units, rank, replicas))


def test_which_optimizers_declare_a_local_state():
    assert vfsdp.optim.adamw().local_state and vfsdp.optim.adamw8bit().local_state
    assert not vfsdp.optim.muon().local_state  # see test_muon_counts_over_every_tensor
    chained = vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0), vfsdp.optim.adamw())
    assert not chained.local_state  # a combinator reads every tensor: exact, if slower


@settings(max_examples=30, deadline=None)
@given(tree=param_trees(max_layers=3, max_tensors=4, max_side=70, meta=True,
                        dtype_choices=(torch.float32, torch.bfloat16)),
       m=st.integers(1, 9), name=st.sampled_from(["adamw", "adamw8bit"]),
       replicas=st.integers(1, 2))
def test_a_local_states_count_over_a_ranks_tensors_is_the_count_over_all(tree, m, name,
                                                                          replicas):
    """Every rank, ranks holding no tensor (pure padding) and m = 1 included, and tiles of
    8-bit AdamW cut at rank boundaries."""
    opt = _OPTS[name]()
    spec = vfsdp.plan(tree, m, granularity=opt.granularity)
    for rank in range(m):
        local, full = _both(opt, spec, rank, replicas)
        assert local == full, (rank, local, full)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_a_rank_that_holds_no_tensor_still_counts_its_state_buffers(name):
    opt = _OPTS[name]()
    spec = vfsdp.plan({"w": torch.empty(2, device="meta")}, 4)
    u = spec.units[()]
    assert u.tensors_per_rank()[-1] == 0  # rank 3 is all padding
    local, full = _both(opt, spec, 3)
    assert local == full >= 2 * u.shard_numel  # the unit's S-element buffers, all the same


def test_muon_counts_over_every_tensor():
    """Muon keeps a unit's momentum on every rank when the unit has a matrix anywhere: a
    rank holding only a vector of it still has the buffer, which a count over that rank's
    tensors alone would miss. So Muon declares no local state, and its count reads all."""
    tree = {"layers": [{"w": torch.empty(16, 16, device="meta"),
                        "b": torch.empty(300, device="meta")}]}
    opt = _OPTS["muon"]()
    assert not opt.local_state
    spec = vfsdp.plan(tree, 2, granularity=opt.granularity)
    u = spec.units[("layers", 0)]
    held = [{t.path[-1] for t in u.tensors if r in t.ranks()} for r in range(2)]
    assert "w" not in held[0] or "w" not in held[1]  # one rank holds no matrix
    full = [optimizer_bytes(opt, spec.units, r) for r in range(2)]
    assert full == [4 * u.shard_numel] * 2
    wrong = [optimizer_bytes(opt._replace(local_state=True), spec.units, r) for r in range(2)]
    assert 0 in wrong


def _shapes_case():
    w = torch.empty(12, 8, device="meta")
    return {"embed": w, "head": w,  # a tie: one tensor, under its first name
            "layers": [{"attn": torch.empty(8, 8, device="meta"),
                        "norm": torch.empty(8, device="meta"),
                        "mlp": {"experts": [{"up": torch.empty(8, 4, device="meta")}
                                            for _ in range(3)],
                                "shared": {"experts": torch.empty(2, 8, 4, device="meta")}}}
                       for _ in range(2)]}


@pytest.mark.parametrize("m", [1, 3])
def test_the_shapes_of_the_prepared_tree_are_those_of_any_plan(m):
    tree = _shapes_case()
    flat = optree.tree_flatten_with_path(tree)
    assert Shapes.of_prepared(prepare(tree, flat=flat)) == Shapes.of(vfsdp.plan(tree, m))


def test_the_shapes_of_a_prepared_tp_tree_read_the_embeddings_global_shape():
    """A tp= plan prepares the local tree with each tensor's strided placement (as plan
    does): the embedding's width and vocabulary are the global ones, the weights local."""
    from torch.distributed.tensor import Replicate, Shard

    from vfsdp.planner.model_split import split_params

    tree = {"embed": torch.empty(12, 8, device="meta"),
            "layers": [{"q": torch.empty(8, 8, device="meta")} for _ in range(2)]}
    mesh = (("dp", 2), ("tp", 2))

    def rule(path):
        return Shard(1) if path[0] == "embed" else Shard(0) if path[-1] == "q" else Replicate()

    spec = vfsdp.plan(tree, mesh, tp=rule, tp_index=1)
    split = split_params(tree, mesh, (2, 2), ("dp", "tp"), rule, "tp", 1)
    got = Shapes.of_prepared(prepare(split.local, strided=split.strided))
    assert got == Shapes.of(spec)
    assert (got.width, got.vocab) == (8, 12) and got.units[("layers", 0)][0] == 32
