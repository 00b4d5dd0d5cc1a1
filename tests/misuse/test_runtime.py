"""The runtime's seams, closed by design (issue "One runtime"): each case on threads and gloo,
against one plain-torch process; and the unit's illegal transitions."""

import pytest
import torch
import torch.distributed as dist

import vfsdp
from tests.misuse import runtime_bodies as b
from vfsdp.collectives import IllegalTransitionError, UnitState, slot_of
from vfsdp.functional.gather import SWEEP, pending
from vfsdp.testing import simulate, spawn


def _illegal():
    spec = vfsdp.plan({"layers": [{"w": torch.ones(4, 2)} for _ in range(2)]},
                      dist.get_world_size())
    shards = vfsdp.shard({"layers": [{"w": torch.ones(4, 2)} for _ in range(2)]}, spec)
    unit = slot_of(shards["layers"][0]["w"]).unit
    seen = []
    try:
        unit.reshard(unit.params)                 # released: nothing to reshard
    except IllegalTransitionError as e:
        seen.append(("reshard", str(e)))
    try:
        unit.wait()                               # nothing in flight
    except IllegalTransitionError as e:
        seen.append(("wait", str(e)))
    full = vfsdp.gather(shards["layers"][0], spec["layers"][0])
    rec = pending().entries[-1]
    grads = [torch.ones(4, 2)]
    unit.post_backward(rec, grads, accumulates=False)
    try:
        unit.post_backward(rec, grads, accumulates=False)   # the same gather, once more
    except IllegalTransitionError as e:
        seen.append(("post_backward", str(e)))
    del full
    return seen, unit.state


def test_illegal_transitions_raise_naming_the_unit_and_the_state():
    for seen, state in simulate(2, _illegal):
        kinds = [k for k, _ in seen]
        assert kinds == ["reshard", "wait", "post_backward"]
        reshard, wait, post = (m for _, m in seen)
        assert "unit layers.0" in reshard and "while it is released" in reshard
        assert "while it is released" in wait and "gather(async_op=True)" in wait
        assert "second post_backward() of one gather" in post
        assert state in (UnitState.GATHERED, UnitState.RELEASED)


def test_a_stored_state_is_what_the_transitions_set():
    def body():
        spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        unit = slot_of(vfsdp.shard({"w": torch.ones(8)}, spec)["w"]).unit
        states = [unit.state]
        unit.gather(async_op=True)
        states.append(unit.state)          # GATHERING until waited, whatever the backend did
        unit.wait()
        states.append(unit.state)
        unit.reshard(unit.params)
        states.append(unit.state)
        unit.pre_backward(unit.params)
        states.append(unit.state)
        unit.release()
        states.append(unit.state)
        return states
    S = UnitState
    assert simulate(2, body)[0] == [S.RELEASED, S.GATHERING, S.GATHERED, S.RESHARDED,
                                    S.GATHERED, S.RELEASED]


def test_routing_collapse_does_not_hang_and_matches_one_process_on_threads():
    for dense, experts in simulate(2, b.routing_collapse, timeout=60):
        assert dense < 1e-5
        assert experts is True or experts < 1e-5


def test_routing_collapse_does_not_hang_and_matches_one_process_on_gloo():
    for dense, experts in spawn(b.routing_collapse, 2, timeout=120):
        assert dense < 1e-5
        assert experts is True or experts < 1e-5


def _reference_layers(order, seed, n=2):
    torch.manual_seed(seed)
    ws = [(torch.randn(4, 4) / 2).requires_grad_(True) for _ in range(n)]
    h = torch.ones(1, 4)
    for i in order:
        h = torch.tanh(h @ ws[i])
    return h, ws


def test_a_reshard_leaves_memory_a_graph_of_yours_holds():
    h, ws = _reference_layers([0, 1], seed=1)
    y = (torch.ones(1, 4) @ ws[0]).sum()
    (y + h.sum()).backward()
    got = simulate(2, b.reshard_keeps_a_held_graph)
    full = [torch.cat([torch.tensor(r[i]).reshape(-1) for r in got]) for i in range(2)]
    for w, f in zip(ws, full):
        # the mean over 2 ranks of identical losses: torch's gradient
        torch.testing.assert_close(f, w.grad.reshape(-1), rtol=1e-5, atol=1e-6)


def test_a_shared_unit_is_not_freed_by_the_previous_layers_reshard():
    want, ws = _reference_layers([0, 0, 1], seed=2)
    want.sum().backward()
    got = simulate(2, b.shared_unit_prefetch)
    for h, _ in got:
        torch.testing.assert_close(torch.tensor(h), want.detach())
    full = [torch.cat([torch.tensor(r[1][i]).reshape(-1) for r in got]) for i in range(2)]
    for w, f in zip(ws, full):
        torch.testing.assert_close(f, w.grad.reshape(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("runner", ["threads", "gloo"])
def test_frozen_units_are_released_after_their_backward(runner):
    got = (simulate(2, b.frozen_units_are_released) if runner == "threads"
           else spawn(b.frozen_units_are_released, 2, timeout=120))
    for gathered, x_has_grad in got:
        assert x_has_grad
        assert gathered == [False] * 4


def test_option_values_are_checked_where_the_policy_is_made():
    with pytest.raises(ValueError, match="grad_sync must be True, False or None"):
        vfsdp.Policy(grad_sync="False")
    with pytest.raises(ValueError, match="prefetch must be True, False or None"):
        vfsdp.Policy(prefetch=1)

    def body():
        spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        try:
            vfsdp.gather(shards, spec, grad_sync="False")
        except ValueError as e:
            refused = str(e)
        full = vfsdp.gather(shards, spec, grad_sync=None)  # None: the default (sync)
        full["w"].sum().backward()
        return refused, shards["w"].grad.tolist()
    got = simulate(2, body)
    for refused, _ in got:
        assert "grad_sync must be True, False or None" in refused
    assert [x for _, g in got for x in g] == [1.0] * 4  # synced: every rank's piece arrived


def _check_uneven(uses, how, retain=False):
    want = b.uneven_reference(2, uses, retain)
    got = simulate(2, b.uneven_use, uses, how, timeout=60)
    flat = [w.reshape(-1) for w in want]
    for grads, ranges in got:
        for g, (lo, hi), w in zip(grads, ranges, flat):
            piece = torch.zeros(hi - lo) if g is None else g.reshape(-1)
            torch.testing.assert_close(piece, w[lo:hi], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["gather", "run_layers"])
def test_two_forwards_then_two_backwards_with_a_unit_one_rank_does_not_use(how):
    """Rank 0's second micro-batch skips layer 1: the other rank still runs it in the second
    backward, so this rank must keep its record (its node is dead here, alive there)."""
    _check_uneven([[[0, 1, 2], [0, 2]], [[0, 1, 2], [0, 1, 2]]], how)


@pytest.mark.parametrize("how", ["gather-retain", "run_layers-retain"])
def test_retain_graph_with_a_unit_one_rank_does_not_use(how):
    _check_uneven([[[0, 2]], [[0, 1, 2]]], how, retain=True)


@pytest.mark.parametrize("runner", ["threads", "gloo"])
def test_evaluations_with_grad_on_do_not_pile_up_records(runner):
    """0.3 kept one record per unit per evaluation until the next backward (6,000 after 2,000
    evaluations); now the ranks forget the orphans dead everywhere every SWEEP gathers."""
    evals = 100  # 300 gathers: one sweep
    got = (simulate(2, b.evaluations_with_grad_on, evals) if runner == "threads"
           else spawn(b.evaluations_with_grad_on, 2, evals))
    for kept, diff, after in got:
        assert kept < SWEEP, kept
        assert diff < 1e-6 and after == 0


@pytest.mark.parametrize("how", ["resharded", "kept gathered"])
def test_a_kept_forward_survives_a_dropped_one(how):
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(4, 4, generator=g) / 2).requires_grad_() for _ in range(2)]
    h = torch.ones(2, 4)
    for w in ws:
        h = torch.tanh(h @ w)
    h.sum().backward()
    for world in (1, 2):
        got = simulate(world, b.kept_forward_after_a_dropped_one, how)
        for i, w in enumerate(ws):
            full = torch.cat([torch.tensor(r[i]) for r in got])
            torch.testing.assert_close(full, w.grad.reshape(-1))


def test_back_to_back_backwards_with_no_collective_between_do_not_hang_on_threads():
    """Two backward passes from one gather, no reduction between them (grad_sync=False): each
    pass's agreement waits for the other ranks; a lock shared by the rank threads (Python
    3.11's functools.cached_property) held while waiting hung them."""
    def run(full, rounds):
        for _ in range(rounds):
            h = torch.ones(1, 4)
            for layer in full()["layers"]:
                h = h @ layer["w"]
            h.sum().backward(retain_graph=True)
            (h * 2).sum().backward()

    params = {"layers": [{"w": torch.ones(4, 4)} for _ in range(2)]}

    def body():
        spec = vfsdp.plan(params, dist.get_world_size())
        shards = vfsdp.shard(params, spec)
        run(lambda: vfsdp.gather(shards, spec, grad_sync=False), 40)
        run(lambda: vfsdp.gather(shards, spec), 1)  # synced: the 41 rounds' gradients
        with torch.no_grad():
            return [g["w"] for g in vfsdp.gather(vfsdp.grads(shards, spec), spec)["layers"]]

    # plain torch, one process: the same 41 rounds accumulated in .grad
    ref = {"layers": [{"w": torch.ones(4, 4, requires_grad=True)} for _ in range(2)]}
    run(lambda: ref, 41)
    for got in simulate(4, body, timeout=60):  # every rank the same batch: the average is it
        for g, r in zip(got, ref["layers"]):
            torch.testing.assert_close(g, r["w"].grad)
