"""``run_layers`` over layers from two plans: an MoE layer's dense part FSDP over every rank,
its experts split over ``"ep"`` and FSDP over ``"dp"``, gathered as one scheduled step.

Against the unscheduled path (each piece gathered by ``vfsdp.gather`` inside the layer):
bitwise. Against one plain-torch process (``moe_reference``): to 1e-5, with two micro-batches
of gradient accumulation and a rank holding no token.
"""

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import UnitState, slot_of
from vfsdp.testing import moe, simulate
from vfsdp.testing.models_tp import ep_rule

D, H, E, K, T, L = 8, 12, 4, 2, 6, 3


def _params():
    """``(dense, experts)``: per layer a mixing matrix and a router, and stacked experts."""
    g = torch.Generator().manual_seed(7)
    dense, experts = [], []
    for i in range(L):
        m = moe.moe_params(D, H, E, seed=i)
        dense.append({"w": torch.randn(D, D, generator=g) / D, "router": m["router"]})
        experts.append({"experts": {k: v * 0.5 for k, v in m["experts"].items()}})
    return {"layers": dense}, {"layers": experts}


def _layer(p, h, mesh):
    h = h + torch.tanh(h @ p["dense"]["w"])
    return h + moe.moe_ep(p["dense"]["router"], p["experts"]["experts"], h, K, "ep", E,
                          mesh=mesh)


def _tokens(micro: int, r: int, empty):
    g = torch.Generator().manual_seed(1000 * micro + r)
    x, y = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    return (x[:0], y[:0]) if r == empty else (x, y)


def _setup(dp: int, ep: int):
    mesh = vfsdp.mesh(("dp", dp), ("ep", ep))
    dense, experts = _params()
    spec = vfsdp.plan(dense, dist.get_world_size())
    e_spec = vfsdp.plan(experts, mesh, tp=ep_rule, tp_axis="ep")
    return mesh, spec, vfsdp.shard(dense, spec), e_spec, vfsdp.shard(experts, e_spec, mesh=mesh)


def _pieces(shards, spec, e_shards, e_spec):
    return [{"dense": (shards["layers"][i], spec["layers"][i]),
             "experts": (e_shards["layers"][i], e_spec["layers"][i])} for i in range(L)]


class _Identity:
    """A low-precision all-gather hook that sends the shard as it is: the functional path."""

    def pre_all_gather(self, shard, unit):
        return shard, shard.new_zeros(0)

    def post_all_gather(self, payload, meta, unit):
        return payload


def _train(dp: int, ep: int, scheduled, micro: int, empty):
    """``micro`` backwards (the last one syncs); this rank's outputs, and its full dense and
    local expert gradients. ``scheduled``: ``True`` (pieces), ``False`` (each piece gathered
    in the layer) or ``"hooks"`` (pieces through an all-gather hook: the functional path)."""
    r, world = dist.get_rank(), dist.get_world_size()
    mesh, spec, shards, e_spec, e_shards = _setup(dp, ep)
    total = D * T * (world - (empty is not None))
    outs = []
    for m in range(micro):
        x, y = _tokens(m, r, empty)
        opts = {"grad_reduce": "sum", "grad_sync": m == micro - 1}
        if scheduled == "hooks":  # reshard off: under simulate's threads, the regather's
            # selective checkpoint finds its saved all_to_all output written after it was
            # saved (the threaded group copies into it late); gloo processes run it
            opts.update(all_gather=_Identity(), reshard_after_forward=False)
        if scheduled:
            h = vfsdp.run_layers(lambda p, h: _layer(p, h, mesh),
                                 _pieces(shards, spec, e_shards, e_spec), None, x, **opts)
        else:  # each piece gathered inside the layer, held until its backward
            h = x
            for i in range(L):
                full = {name: vfsdp.gather(s, sp, grads="buffer", free_after_backward=True,
                                           **opts)
                        for name, (s, sp) in _pieces(shards, spec, e_shards, e_spec)[i].items()}
                h = _layer(full, h, mesh)
        ((h - y).pow(2).sum() / total).backward()
        outs.append(h.detach())
    plain = lambda tree: optree.tree_map(torch.clone, tree)
    grads = vfsdp.gather(plain(vfsdp.grads(shards, spec)), spec)
    e_grads = vfsdp.gather(plain(vfsdp.grads(e_shards, e_spec)), e_spec, mesh=mesh)
    return mesh.get_local_rank("ep") * (E // ep), outs, grads, e_grads


def _reference(world: int, micro: int, empty):
    dense, experts = optree.tree_map(lambda t: t.clone().requires_grad_(True), _params())
    total = D * T * (world - (empty is not None))
    loss, outs = 0, []
    for m in range(micro):
        for r in range(world):
            h, y = _tokens(m, r, empty)
            for d, e in zip(dense["layers"], experts["layers"]):
                h = h + torch.tanh(h @ d["w"])
                h = h + moe.moe_reference({"router": d["router"], **e}, h, K)
            outs.append(h.detach())
            loss = loss + (h - y).pow(2).sum() / total
    loss.backward()
    return outs, optree.tree_map(lambda t: t.grad, dense), optree.tree_map(lambda t: t.grad,
                                                                          experts)


@pytest.mark.parametrize("dp, ep, micro, empty", [(2, 2, 2, 1), (1, 4, 1, None),
                                                  (1, 2, 2, None), (2, 1, 1, 0)])
def test_pieces_equal_the_unscheduled_path_bitwise_and_one_process(dp, ep, micro, empty):
    """The dense part over every rank and the experts over ``"dp"`` per ``"ep"`` index, as
    one ``run_layers`` step per layer: the outputs and both plans' gradients are bitwise
    those of gathering each piece inside the layer, and those of one process to 1e-5, with
    two micro-batches' gradients accumulated and a rank holding no token."""
    world = dp * ep
    want_outs, want, want_e = _reference(world, micro, empty)
    got = simulate(world, _train, dp, ep, True, micro, empty, timeout=90)
    unscheduled = simulate(world, _train, dp, ep, False, micro, empty, timeout=90)
    for r, ((first, outs, grads, e_grads), (_, u_outs, u_grads, u_e_grads)) in enumerate(
            zip(got, unscheduled)):
        for a, b in zip([*outs, *optree.tree_leaves(grads), *optree.tree_leaves(e_grads)],
                        [*u_outs, *optree.tree_leaves(u_grads), *optree.tree_leaves(u_e_grads)]):
            assert torch.equal(a, b), r
        for m, out in enumerate(outs):
            assert torch.allclose(out, want_outs[m * world + r], atol=1e-5), (r, m)
        for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(want)):
            assert torch.allclose(a, b, atol=1e-5), r
        for a, b in zip(optree.tree_leaves(e_grads), optree.tree_leaves(want_e)):
            assert torch.allclose(a, b[first:first + a.shape[0]], atol=1e-5), r


def test_pieces_through_an_all_gather_hook_equal_one_process():
    """The functional path (an identity all-gather hook: each piece gathered functionally,
    its gradients to ``.grad``) takes the same pieces, with the same results."""
    want_outs, want, want_e = _reference(4, 2, 1)
    for r, (first, outs, grads, e_grads) in enumerate(simulate(4, _train, 2, 2, "hooks", 2, 1,
                                                               timeout=90)):
        for m, out in enumerate(outs):
            assert torch.allclose(out, want_outs[m * 4 + r], atol=1e-5), (r, m)
        for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(want)):
            assert torch.allclose(a, b, atol=1e-5), r
        for a, b in zip(optree.tree_leaves(e_grads), optree.tree_leaves(want_e)):
            assert torch.allclose(a, b[first:first + a.shape[0]], atol=1e-5), r


def _schedule(dp: int, ep: int, reshard: bool):
    """The units' states after the forward, and the collectives of forward and backward."""
    from vfsdp.collectives import counts, reset_counts

    mesh, spec, shards, e_spec, e_shards = _setup(dp, ep)
    x, y = _tokens(0, dist.get_rank(), None)
    reset_counts()
    h = vfsdp.run_layers(lambda p, h: _layer(p, h, mesh), _pieces(shards, spec, e_shards, e_spec),
                         None, x, grad_reduce="sum", reshard_after_forward=reshard)
    unit = lambda tree: slot_of(optree.tree_leaves(tree)[0]).unit
    states = [(unit(shards["layers"][i]).state, unit(e_shards["layers"][i]).state)
              for i in range(L)]
    ((h - y).pow(2).sum()).backward()
    got = counts()
    return states, got["all_gather"], got["reduce_scatter"]


@pytest.mark.parametrize("reshard", [True, False])
def test_every_piece_is_prefetched_resharded_and_reduced_with_its_layer(reshard):
    """After the forward every layer's pieces but the last's are resharded (with
    ``reshard_after_forward``); the backward gathers them again, one all-gather per piece
    and layer, and reduce-scatters each piece once, over its own group."""
    for states, gathers, reduces in simulate(4, _schedule, 2, 2, reshard):
        held = UnitState.RESHARDED if reshard else UnitState.GATHERED
        assert states == [(held, held)] * (L - 1) + [(UnitState.GATHERED,) * 2]
        assert gathers == 2 * L + (2 * (L - 1) if reshard else 0)
        assert reduces == 2 * L


def _refusal(case: str):
    mesh, spec, shards, e_spec, e_shards = _setup(1, 2)
    layers = _pieces(shards, spec, e_shards, e_spec)
    if case == "another layer's spec":
        layers[1]["experts"] = (e_shards["layers"][1], e_spec["layers"][2])
    elif case == "another piece's spec":
        layers[0]["experts"] = (e_shards["layers"][0], spec["layers"][0])
    elif case == "swapped":
        layers[2]["dense"] = (spec["layers"][2], shards["layers"][2])
    elif case == "not a tuple":
        layers[1]["experts"] = e_shards["layers"][1]
    elif case == "not a dict":
        layers[1] = (shards["layers"][1], spec["layers"][1])
    try:
        vfsdp.run_layers(lambda p, h: _layer(p, h, mesh), layers, None, torch.ones(2, D),
                         **({"mesh": mesh} if case == "mesh=" else {}))
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("case, kind, words", [
    ("another layer's spec", "ValueError",
     ["vfsdp.run_layers (layer 1, piece 'experts'): the shards of unit layers.2 were made "
      "for another plan (unit layers.1", "use the spec they were sharded with"]),
    ("another piece's spec", "ValueError",
     ["vfsdp.run_layers (layer 0, piece 'experts'): tree structure differs from the spec",
      "pass the tree the spec was planned for"]),
    ("swapped", "TypeError",
     ["vfsdp.run_layers (layer 2, piece 'dense'): got a ShardSpec where the shards go",
      "(shards, spec), in that order"]),
    ("not a tuple", "TypeError",
     ["vfsdp.run_layers (layer 1, piece 'experts'): a piece is (shards, spec) or "
      "(shards, spec, mesh), got a dict"]),
    ("not a dict", "TypeError",
     ["vfsdp.run_layers: layer 1 is a tuple; with specs=None each layer is a dict of pieces"]),
    ("mesh=", "TypeError", ["give a piece of plain-tensor shards its mesh as (shards, spec, mesh)"]),
])
def test_mismatched_pieces_are_refused_on_every_rank_naming_layer_piece_and_fix(case, kind,
                                                                                words):
    for got in simulate(2, _refusal, case):
        assert got is not None and got[0] == kind, got
        for w in words:
            assert w in got[1], got[1]
