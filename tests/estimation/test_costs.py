"""The shape rules read from the prepared tree (``Shapes.of_prepared``, what a sweep reads
once) equal those read from any plan of it (``Shapes.of``): ties whichever name sorts first,
experts, ``tp=`` plans; and a sweep's row equals the estimate of its plan with such a tie."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from vfsdp.estimation import sweep
from vfsdp.estimation.costs import Shapes
from vfsdp.planner.plan import prepare


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
    local, strided, *_ = split_params(tree, mesh, (2, 2), ("dp", "tp"), rule, "tp", 1)
    got = Shapes.of_prepared(prepare(local, strided=strided))
    assert got == Shapes.of(spec)
    assert (got.width, got.vocab) == (8, 12) and got.units[("layers", 0)][0] == 32


def _tree():
    tok = torch.empty(100, 8, device="meta")  # vocabulary 100
    # insertion order: tok_embeddings first, so it is the head of the tie; optree order:
    # head < layers < pos_embeddings < tok_embeddings, so spec.tensors() meets tok first
    return {"tok_embeddings": tok, "pos_embeddings": torch.empty(5, 8, device="meta"),
            "head": tok, "layers": [{"w": torch.empty(8, 8, device="meta")}]}


@pytest.mark.parametrize("m", [1, 2, 3])
def test_of_prepared_equals_of_when_a_tie_alias_sorts_before_its_head(m):
    tree = _tree()
    spec = vfsdp.plan(tree, m)
    assert dict(spec.ties) == {("head",): ("tok_embeddings",)}
    got = Shapes.of_prepared(prepare(tree, flat=optree.tree_flatten_with_path(tree)))
    want = Shapes.of(spec)
    assert (got.width, got.vocab) == (want.width, want.vocab), (got, want)
    assert got == want


def test_a_sweep_row_equals_the_estimate_of_its_plan_with_such_a_tie():
    tree = _tree()
    (_, row), = sweep(tree, [2], shard=2, tokens_per_gpu=4096)
    want = vfsdp.estimate(vfsdp.plan(tree, 2), tokens_per_rank=4096)
    diff = {f.name: (getattr(row, f.name), getattr(want, f.name))
            for f in dataclasses.fields(want) if getattr(row, f.name) != getattr(want, f.name)}
    assert not diff, diff


_NAMES = ["a_head", "embed", "tok_embed", "pos_embed", "w", "z_embed", "lm_head"]


@st.composite
def _tied_trees(draw):
    names = draw(st.permutations(_NAMES))[:draw(st.integers(2, len(_NAMES)))]  # insertion
    tensors = [torch.empty(draw(st.integers(1, 9)), draw(st.integers(1, 9)), device="meta")
               for _ in names]
    tree = dict(zip(names, tensors))
    i, j = draw(st.integers(0, len(names) - 1)), draw(st.integers(0, len(names) - 1))
    tree[names[i]] = tree[names[j]]  # maybe a tie, head by insertion order
    tree["layers"] = [{"w": torch.empty(4, 4, device="meta")}]
    return tree


@settings(max_examples=60, deadline=None)
@given(tree=_tied_trees(), m=st.integers(1, 5))
def test_of_prepared_equals_of_on_trees_with_ties(tree, m):
    assert Shapes.of_prepared(prepare(tree)) == Shapes.of(vfsdp.plan(tree, m))


@pytest.mark.parametrize("heads,kv,head_dim", [(4, 2, 32), (2, 1, 8), (4, 4, 16)])
def test_attention_flops_are_counted_at_heads_times_head_dim_as_torch_counts_them(heads, kv,
                                                                                 head_dim):
    # a LLaMA block (torchtitan's names, torch's (out, in) weights) whose heads are not the
    # width (64): the shape rules' FLOPs against torch's FlopCounterMode on the same block
    from vfsdp.estimation import layer_cost, shape_costs

    d, f, b, s = 64, 96, 2, 16
    def m(*shape):
        return torch.empty(*shape, device="meta")

    layer = {"attention": {"wq": m(heads * head_dim, d), "wk": m(kv * head_dim, d),
                           "wv": m(kv * head_dim, d), "wo": m(d, heads * head_dim)},
             "feed_forward": {"w1": m(f, d), "w2": m(d, f), "w3": m(f, d)}}

    def block(p, x):
        a, ff = p["attention"], p["feed_forward"]
        q, k, v = (torch.nn.functional.linear(x, a[w]).view(b, s, -1, head_dim).transpose(1, 2)
                   for w in ("wq", "wk", "wv"))
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = torch.softmax(q @ k.transpose(-1, -2), -1) @ v  # QK^T and AV: what is counted
        lin = torch.nn.functional.linear
        h = x + lin(att.transpose(1, 2).reshape(b, s, -1), a["wo"])
        return h + lin(torch.nn.functional.silu(lin(h, ff["w1"])) * lin(h, ff["w3"]), ff["w2"])

    traced = layer_cost(block, layer, m(b, s, d))
    tree = {"tok_embed": m(100, d), "layers": [layer, layer]}
    rule = shape_costs(vfsdp.plan(tree, 2), tokens=b * s, seq=s)[("layers", 0)]
    assert rule.flops == traced.flops
