"""An update is a transaction: one that fails, on one rank or on all, leaves every rank's
parameters and state, step count included, bit for bit as they were, and the next update
gives what it would have given had the failed one never been called."""

import pytest
import torch

import vfsdp
from tests.optim import txn_bodies as tb
from vfsdp.optim.base import PartialUpdateError, atomic, begin
from vfsdp.testing import simulate, spawn

FAILING = [(1,), (0, 1)]  # the schedule (or user transform) raises at step 2 on these ranks


def _check(ranks: list, kinds: list) -> None:
    for kind in kinds:
        plain = [r[(kind, ())] for r in ranks]
        assert all(r["raised"] is None for r in plain), kind
        for failing in FAILING:
            got = [r[(kind, failing)] for r in ranks]
            raised = [r["raised"] for r in got]
            for rank, message in enumerate(raised):  # every rank raised, naming the cause
                assert message is not None and "failed" in message, (kind, failing, raised)
                if rank not in failing:
                    assert message.startswith(f"RuntimeError: rank {failing[0]} failed"), message
            assert all(r["kept"] for r in got), (kind, failing)  # as before, bit for bit
            for a, b in zip(plain, got):  # and then as if it had never failed
                assert len(a["after"]) == len(b["after"]), kind
                assert all(torch.equal(x, y) for x, y in zip(a["after"], b["after"])), (
                    kind, failing)


def test_a_failed_update_changes_nothing_on_gloo_processes():
    kinds = ["adamw", "adamw8bit", "muon", "soap", "user", "offload(adamw)",
             "offload(adamw8bit)", "offload(muon)"]
    _check(spawn(tb.cases, 2, kinds, FAILING), kinds)  # one start of the processes


def test_a_failed_update_changes_nothing_in_compositions():
    kinds = ["adamw(fused)", "shampoo", "clip+adamw", "offload(user)", "offload(clip+adamw)"]
    _check(simulate(2, tb.cases, kinds, FAILING), kinds)


def test_a_failure_after_the_ranks_agreed_says_the_state_is_invalid():
    def update(grads, state, shards, spec):
        begin(state)
        state.add_(1)
        raise ArithmeticError("kernel failed")

    state = torch.zeros(1)
    with pytest.raises(PartialUpdateError, match=r"partly updated; load both from a checkpoint"):
        atomic(update)(None, state, None, None)


def test_an_update_of_your_own_in_a_composition_runs_once():
    calls = []

    def update(grads, state, shards, spec):
        calls.append(1)
        return state

    mine = vfsdp.optim.Optimizer(lambda shards, spec, mask=None: None, update)
    opt = vfsdp.optim.chain(mine, vfsdp.optim.clip_by_global_norm(1.0))

    def body():
        spec = vfsdp.plan({"w": torch.ones(4)}, 1)
        shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        opt.update(vfsdp.grads(shards, spec), opt.init(shards, spec), shards, spec)

    simulate(1, body)
    assert calls == [1]  # not again in the checking pass


@pytest.mark.parametrize("kind", ["adamw", "muon", "offload(adamw8bit)"])
def test_a_gradient_tree_one_rank_gets_wrong_is_refused_before_any_write(kind):
    assert simulate(2, tb.bad_tree, kind) == [("RuntimeError", True), ("ValueError", True)]


@pytest.mark.parametrize("kind", ["adamw", "offload(adamw)", "offload(clip+adamw)"])
def test_a_gradient_one_rank_gets_short_is_refused_before_any_write(kind):
    # offload checked the sizes after the ranks agreed: PartialUpdateError on that rank, and
    # the others waited in the host clip's all-reduce
    assert simulate(2, tb.bad_tree, kind, True) == [("RuntimeError", True), ("ValueError", True)]


def test_a_user_transform_failing_after_another_member_wrote_says_the_state_is_invalid():
    # partition(adamw, your chain): AdamW wrote before the user's transform raised on rank 0
    raised = [r["raised"] for r in simulate(2, tb.run, "adamw+user", (0,))]
    assert all(r.startswith("PartialUpdateError: ") for r in raised), raised
    assert "(RuntimeError: rank 0 failed: ArithmeticError: user transform failed)" in raised[1]
