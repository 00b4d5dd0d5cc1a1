"""plan pauses Python's cyclic collector while it runs and leaves it as it found it: with
ranks (threads) planning at once, and when a plan raises."""

import gc
import threading

import pytest
import torch

import vfsdp

PARAMS = {"layers": [{"w": torch.ones(4, 4)} for _ in range(2)]}


def test_the_collector_is_off_while_planning_and_on_after_a_plan_that_raises():
    seen = []

    def granularity(path, tensor):
        seen.append(gc.isenabled())
        if path[-1] == "w" and len(seen) > 2:
            raise ArithmeticError("granularity failed")
        return None

    vfsdp.plan(PARAMS, 2, granularity=granularity)
    with pytest.raises(ArithmeticError):
        vfsdp.plan(PARAMS, 2, granularity=granularity)
    assert seen and not any(seen) and gc.isenabled()


def test_a_plan_starting_as_another_ends_leaves_the_collector_on(monkeypatch):
    """Thread B reads the collector off (A is planning), A ends and turns it on, then B
    turns it off: B must not leave it off for good (it did: each plan kept its own flag)."""
    a_in, go_a, a_done, real = threading.Event(), threading.Event(), threading.Event(), gc.isenabled

    def isenabled():
        if threading.current_thread().name == "B" and not go_a.is_set():
            out = real()
            go_a.set()
            a_done.wait(5)  # A ends its plan before B goes on
            return out
        return real()

    def granularity(path, tensor):
        if threading.current_thread().name == "A":
            a_in.set()
            go_a.wait(5)  # B has started planning
        return None

    def plan_b():
        vfsdp.plan(PARAMS, 2)
        go_a.set()  # where B never reads the flag while A plans

    def plan_a():
        vfsdp.plan(PARAMS, 2, granularity=granularity)
        a_done.set()

    monkeypatch.setattr(gc, "isenabled", isenabled)
    assert real()
    a = threading.Thread(target=plan_a, name="A")
    b = threading.Thread(target=plan_b, name="B")
    try:
        a.start()
        a_in.wait(5)  # A plans, the collector paused
        b.start()
        a.join(10)
        b.join(10)
        assert real(), "plan left Python's cyclic collector disabled"
    finally:
        gc.enable()
