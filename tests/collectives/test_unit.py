"""Unit, Slot and the DBuffer constructor: identity travels with the tensors."""

import gc

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import DBuffer, Role, Unit, View, counts, reset_counts, resolve_groups, slot_of
from vfsdp.collectives.dbuffer import observe
from vfsdp.testing import simulate


def identity():
    """Every shard, full view and gradient view names its buffer, index and unit."""
    params = {"layers": [{"w": torch.randn(5, 3), "b": torch.randn(3)} for _ in range(2)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    full = vfsdp.gather(shards, spec, param_dtype=torch.bfloat16)
    grads = vfsdp.grads(shards, spec)
    ok = []
    for s, f, g, t in zip(optree.tree_leaves(shards), optree.tree_leaves(full),
                          optree.tree_leaves(grads), spec.tensors()):
        a, b, c = slot_of(s), slot_of(f), slot_of(g)
        ok += [a.view is View.LOCAL and a.buffer.role is Role.PARAM,
               b.view is View.FULL and b.buffer.role is Role.COMPUTE and f.dtype == torch.bfloat16,
               c.view is View.LOCAL and c.buffer.role is Role.GRAD,
               a.unit is b.unit is c.unit and a.unit.key == t.unit,
               a.index == b.index == c.index == a.unit.layout.index(t.path)]
    unit = slot_of(shards["layers"][0]["w"]).unit
    ok.append(set(unit.gathered()) == {slot_of(full["layers"][0]["w"]).buffer})
    unit.release()  # the gathered tensors still belong to a live graph: memory stays until
    ok.append(type(full["layers"][0]["w"]).__name__ == "ReleasedTensor")  # ... it is dropped
    ok.append(len(unit.gathered()) == 1)
    del full
    gc.collect()
    # A dropped graph is settled by the next vfsdp call on this rank (the node dies inside the
    # destruction of a tensor still holding the memory, so not at that moment).
    ok.append(len(unit.gathered()) == 1)
    vfsdp.gather(shards["layers"][1], spec["layers"][1])
    ok.append(unit.gathered() == [])
    return all(ok)


def test_views_carry_their_unit():
    assert all(simulate(3, identity))


def test_dbuffer_is_built_from_a_layout_and_groups():
    def body():
        spec = vfsdp.plan({"w": torch.ones(6)}, 2)
        groups = resolve_groups(spec)
        msgs = []
        for bad in ((spec, groups), (spec.units[()], groups, None, "grad")):
            try:
                DBuffer(*bad)
            except TypeError as exc:
                msgs.append(str(exc))
        db = DBuffer(spec.units[()], groups)
        try:
            db.like(role="exp_avg")  # 0.1's spelling, deprecated in 0.2
        except TypeError as exc:
            msgs.append(str(exc))
        state = db.like(role=Role.STATE, name="exp_avg")
        return msgs, state.role, state.name, repr(db)

    msgs, role, name, text = simulate(2, body)[0]
    assert "layout must be a UnitLayout (spec.units[key])" in msgs[0]
    assert "role must be a vfsdp.collectives.Role" in msgs[1]
    assert "role must be a vfsdp.collectives.Role, got 'exp_avg'" in msgs[2]
    assert role is Role.STATE and name == "exp_avg"
    assert text.startswith("DBuffer(param, unit <root>, rank 0/2")


def test_unit_makes_its_buffers_on_first_use():
    def body():
        spec = vfsdp.plan({"w": torch.ones(8)}, 1)
        unit = Unit(spec.units[()], resolve_groups(spec))
        before = [db.role for db in unit.buffers()]
        same = unit.compute(None) is unit.params and unit.compute(torch.float32) is unit.params
        bf16 = unit.compute(torch.bfloat16)
        unit.grads()
        unit.unreduced(create=True)
        unit.stage(torch.bfloat16)
        after = [db.role for db in unit.buffers()]
        return before, same, bf16 is unit.compute(torch.bfloat16), after, unit.stage(
            torch.float32) is unit.grads()

    before, same, once, after, stage_is_grads = simulate(1, body)[0]
    assert before == [Role.PARAM] and same and once and stage_is_grads
    assert after == [Role.PARAM, Role.COMPUTE, Role.GRAD, Role.ACCUM, Role.STAGE]


def test_buffer_events_reach_observers_only_while_observing():
    def body():
        seen = []
        spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        with observe(lambda event, db: seen.append((event, db.role))):
            vfsdp.gather(shards, spec)
            vfsdp.release(shards, spec)
        vfsdp.gather(shards, spec)  # not observed
        return seen

    assert simulate(2, body)[0] == [("alloc", Role.PARAM), ("free", Role.PARAM)]


def muon_collectives():
    params = {"layers": [{"w": torch.randn(8, 6), "v": torch.randn(6, 6)} for _ in range(3)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.muon(wave_size=4)
    state = opt.init(shards, spec)
    reset_counts()
    opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    return counts()["all_to_all"], len(state.plan.waves)


def test_muon_exchanges_are_counted_collectives():
    for n, waves in simulate(3, muon_collectives):
        assert waves == 2 and n == 2 * waves  # one gather to the roots, one scatter back


def _compute_copy_holds_no_memory():
    """With param_dtype the cast writes straight into this rank's slice of the compute global
    buffer, which is all-gathered in place: one cast, no other copy, and between gathers the
    compute buffer holds no memory (only the master shard persists)."""
    from vfsdp.testing import CopyCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    params = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.arange(5.0)}
    spec = vfsdp.plan(params, world)
    unit = Unit(spec.units[()], resolve_groups(spec))
    for k, t in enumerate(unit.tensors):
        lo, hi = t.local_range(rank)
        unit.params.local(k).data.copy_(params[t.path[0]].reshape(-1)[lo:hi])
    with CopyCounter() as c:
        db, _ = unit.gather(torch.bfloat16)
    s = unit.layout.shard_numel
    in_place = (db.shard.data_ptr() == db.global_buffer.data_ptr() + rank * s * 2)
    full = {t.path[0]: db.full(k).float() for k, t in enumerate(unit.tensors)}
    ok = all(torch.equal(full[k], v) for k, v in params.items())
    copies = {k: v for k, v in c.ops.items() if k in ("copy_", "_to_copy", "cat")}
    del full
    unit.release()
    return (in_place, ok, copies, db.global_buffer.untyped_storage().nbytes(),
            db.shard.untyped_storage().nbytes(), unit.params.shard.untyped_storage().nbytes() > 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_compute_copy_is_a_slice_of_its_global_buffer_and_persists_nothing(world):
    assert simulate(world, _compute_copy_holds_no_memory) == [
        (True, True, {"copy_": 1}, 0, 0, True)] * world


def _dropping_the_shards_frees_the_unit_at_once():
    """vfsdp.grads hands out views the unit keeps; they must not form a cycle with it."""
    import weakref

    params = {"w": torch.ones(4, 4)}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    grads = vfsdp.grads(shards, spec)
    again = vfsdp.grads(shards, spec)
    same = again["w"] is grads["w"]
    unit = weakref.ref(slot_of(shards["w"]).unit)
    gdb = weakref.ref(slot_of(grads["w"]).buffer)
    gc.disable()
    try:
        del shards, grads, again
        return same, unit() is None, gdb() is None
    finally:
        gc.enable()


def test_grads_views_are_kept_without_a_reference_cycle():
    assert simulate(2, _dropping_the_shards_frees_the_unit_at_once) == [(True, True, True)] * 2


def _lifecycle():
    """Unit.state follows its transitions, and repr(unit) shows it, the buffers holding
    memory and what is pending."""
    from vfsdp.collectives import UnitState
    from vfsdp.functional.gather import pending

    params = {"layers": [{"w": torch.full((4, 2), 0.5)} for _ in range(3)]}
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=vfsdp.rows(1))
    shards = vfsdp.shard(params, spec)
    units = [slot_of(s["w"]).unit for s in shards["layers"]]
    seen = {"start": [u.state for u in units]}
    units[0].gather(async_op=True)
    seen["async"] = units[0].state
    units[0].wait()
    seen["waited"] = units[0].state
    units[0].release()
    seen["released"] = units[0].state
    h = vfsdp.run_layers(lambda p, x: x @ p["w"] @ p["w"].T, shards["layers"], spec["layers"],
                         torch.ones(1, 4))
    seen["forward"] = [u.state for u in units]
    seen["repr"] = repr(units[0])
    seen["record"] = repr(pending())
    seen["links"] = [u.backward_prefetch is not None for u in units]
    h.sum().backward()
    seen["backward"] = [u.state for u in units]
    seen["after"] = (repr(units[0]), repr(pending()))
    full = vfsdp.gather(shards["layers"][0], spec["layers"][0])
    loss = full["w"].sum()
    units[0].release()
    seen["held"] = units[0].state
    loss.backward()
    seen["freed"] = units[0].state
    return seen, UnitState


def test_a_unit_moves_through_its_lifecycle_and_shows_it():
    seen, UnitState = simulate(2, _lifecycle)[0]
    R, G = UnitState.RELEASED, UnitState.GATHERED
    assert seen["start"] == [R, R, R]
    assert seen["async"] in (UnitState.GATHERING, G)  # threads: the collective may be done
    assert (seen["waited"], seen["released"]) == (G, R)
    # run_layers: every unit but the last resharded after its forward, the last kept gathered
    assert seen["forward"] == [UnitState.RESHARDED, UnitState.RESHARDED, G]
    assert "resharded" in seen["repr"] and "1 backward(s)" in seen["repr"]
    assert seen["record"].startswith("RankGathers(3 awaiting")
    assert seen["links"] == [False, True, True]  # each prefetches the one run before it
    # gathered again for their backward, then freed after it (free_after_backward)
    assert seen["backward"] == [R, R, R]
    assert ("released; holding [param float32 shard, grad float32 shard]; pending []"
            in seen["after"][0])
    assert seen["after"][1].startswith("RankGathers(0 awaiting") and "running: None" in seen["after"][1]
    assert (seen["held"], seen["freed"]) == (UnitState.HELD, R)


def test_only_the_units_transitions_issue_unit_collectives():
    """The functional and optimizer layers never call a DBuffer's all-gather or
    reduce-scatter: the Unit's transitions do."""
    import pathlib
    import re

    root = pathlib.Path(vfsdp.__file__).parent
    bad = []
    for sub in ("functional", "optim"):
        for path in sorted((root / sub).glob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if re.search(r"\.(all_gather|reduce_scatter|regather)\(", code) \
                        and ">>>" not in code and "vfsdp.reduce_scatter(" not in code:
                    bad.append(f"{path.name}:{n}: {line.strip()}")
    assert bad == []
