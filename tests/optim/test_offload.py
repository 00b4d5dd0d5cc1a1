"""offload(opt): the optimizer on host copies, bitwise equal to it without offload."""

import os
import shutil
import tempfile

import pytest
import torch

import vfsdp
from tests.optim import offload_bodies as ob
from vfsdp.optim import adamw, offload
from vfsdp.testing import simulate, spawn


def _same(a: list, b: list) -> bool:
    return all(len(x["shards"]) == len(y["shards"])
               and all(torch.equal(p, q) for p, q in zip(x["shards"], y["shards"]))
               for x, y in zip(a, b))


def test_offload_equals_the_optimizer_on_gloo_processes():
    kinds = ["adamw", "adamw8bit", "muon", "member"]
    ranks = spawn(ob.train_both, 2, kinds)  # one start of the processes for every kind
    for kind in kinds:
        plain, off = [r[kind][0] for r in ranks], [r[kind][1] for r in ranks]
        assert _same(plain, off), kind  # bitwise, over 3 steps
        assert not _same(plain, simulate(2, ob.train, kind, False, 1)), kind  # steps did something
        if kind != "member":
            assert [r["resyncs"] for r in off] == [0, 0], kind  # nothing else wrote the params
            assert all(r["host_bytes"] > 0 for r in off), kind


@pytest.mark.parametrize("world", [1, 3])
def test_offload_of_a_chain_with_clip_and_odd_worlds(world):
    assert _same(simulate(world, ob.train, "chain", False),
                 simulate(world, ob.train, "chain", True))


@pytest.mark.parametrize("mode,copies", [("buffer", 0), ("async", 0), ("micro", 0),
                                         ("return", 12), ("clip", 12)])
def test_the_backward_copies_gradients_to_the_host_unless_they_change_after(mode, copies):
    # Each reduction copies the unit's gradient shard to the host; the update copies again
    # only what changed since (clipped in place on the device) or is not the buffer (.grad).
    plain = simulate(2, ob.train, "adamw", False, 3, False, False, mode)
    off = simulate(2, ob.train, "adamw", True, 3, False, False, mode)
    assert _same(plain, off)
    assert [r["grad_copies"] for r in off] == [copies, copies]  # 4 units x 3 steps


def test_frozen_tensors_and_device_writes_are_followed():
    # A tensor frozen after init gets no update, as without offload.
    assert _same(simulate(2, ob.train, "adamw", False, 3, True),
                 simulate(2, ob.train, "adamw", True, 3, True))
    # An in-place write to a device shard is read back into the master before the update.
    plain = simulate(2, ob.train, "adamw", False, 3, False, True)
    off = simulate(2, ob.train, "adamw", True, 3, False, True)
    assert _same(plain, off)
    assert [r["resyncs"] for r in off] == [1, 1]


def test_checkpoint_saved_offloaded_loads_without_offload_at_another_world_size():
    tmp = tempfile.mkdtemp(prefix="vfsdp-offload-")
    try:
        for kind in ["adamw", "adamw8bit", "muon"]:
            off, on = os.path.join(tmp, kind + "-off"), os.path.join(tmp, kind + "-on")
            saved_off = spawn(ob.save, 2, off, kind, True)[0]
            assert saved_off == simulate(2, ob.save, on, kind, False)[0]  # the same entries
            assert sum(k.startswith("opt.") and "step" not in k for k in saved_off) >= 6
            plain = simulate(3, ob.load_and_step, on, kind, False)[0]
            assert simulate(3, ob.load_and_step, off, kind, False)[0] == plain
            # and back: loaded into an offloaded state, it steps as without offload
            assert simulate(3, ob.load_and_step, on, kind, True)[0] == plain
    finally:
        shutil.rmtree(tmp)


def test_a_host_failure_on_one_rank_raises_on_every_rank():
    # An optimizer of one's own is not part of the transaction (vfsdp.optim.base.atomic): its
    # failure is past the ranks' agreement, so every rank says its state is partly updated.
    got = spawn(ob.failing_update, 2)
    assert all(r.startswith("PartialUpdateError: ") and "partly updated" in r for r in got), got
    assert "(RuntimeError: rank 1 failed: ArithmeticError: host kernel failed)" in got[0]
    assert "(ArithmeticError: host kernel failed)" in got[1]


def test_bf16_parameters_keep_fp32_masters():
    for r in simulate(2, ob.bf16_masters):
        assert r["master_dtype"] == "torch.float32" and r["rounded"] and r["resyncs"] == 0
        assert r["grad_copies"] == 0  # the backward's bf16 copies are used, not made again
        # updates below bf16's resolution add up in the master and reach the device
        assert r["masters_moved"] > r["device_moved"] > r["plain_moved"]


def test_misuse_is_refused(monkeypatch):
    with pytest.raises(TypeError, match=r"takes a vfsdp\.optim\.Optimizer"):
        offload(lambda: None)
    with pytest.raises(TypeError, match="master_dtype must be a floating-point"):
        offload(adamw(), master_dtype=torch.int8)

    def body():
        params = {"w": torch.ones(8)}
        spec = vfsdp.plan(params, 1)
        opt = offload(adamw())
        a, b = vfsdp.shard(params, spec), vfsdp.shard(params, spec)
        state = opt.init(a, spec)
        errors = []
        try:
            opt.update(vfsdp.grads(b, spec), state, b, spec)
        except ValueError as exc:
            errors.append(str(exc))
        monkeypatch.setattr(vfsdp._torch_private, "compiling", lambda: True)
        try:
            opt.update(vfsdp.grads(a, spec), state, a, spec)
        except ValueError as exc:
            errors.append(str(exc))
        return errors

    errors = simulate(1, body)[0]
    assert "not the ones offload.init was given" in errors[0]
    assert "under torch.compile is not supported" in errors[1]


def test_meta_parameters_are_refused():
    def body():
        params = {"w": torch.ones(8)}
        spec = vfsdp.plan(params, 2)
        return offload(adamw()).init(vfsdp.shard(params, spec), spec)

    with pytest.raises(Exception, match="on meta, which holds no values"):
        simulate(2, body, device="meta")


def test_writes_no_version_counter_sees_are_followed():
    # all_reduce (gloo), GradScaler's unscale kernel and .data writes of the gradients after
    # the backward; a broadcast and .data writes of the parameters, a frozen one among them
    plain = spawn(ob.hidden_writes, 2, False, timeout=60)
    off = spawn(ob.hidden_writes, 2, True, timeout=60)
    assert _same(plain, off)
    assert [r["grad_copies"] for r in off] == [9, 9]  # all 4 units twice, then the embedding
    assert [r["resyncs"] for r in off] == [1, 1]  # rank 0 holds the norm, rank 1 got a broadcast



def test_a_second_init_takes_the_mirrors_and_the_first_state_still_steps():
    for r in simulate(2, ob.reinit):
        assert r == {"new": (0, 0), "old": (4, 4)}  # old: copies its 4 units, reads them back
