"""A plan's spec leaves are made on first read; ranks (threads) that share one spec and read
them at once get the same leaves."""

import threading
import time

import torch

import vfsdp
from vfsdp.planner import spec as spec_module


def test_threads_reading_a_fresh_specs_leaves_at_once_get_the_same_leaves(monkeypatch):
    checked = spec_module._checked

    def slow(treespec, leaves):  # widen the window between two readers
        time.sleep(0.01)
        return checked(treespec, leaves)

    monkeypatch.setattr(spec_module, "_checked", slow)
    params = {"layers": [{"w": torch.ones(8, 4), "b": torch.ones(4)} for _ in range(64)]}
    for _ in range(5):
        spec = vfsdp.plan(params, 4)
        start, got, errors = threading.Barrier(8), [], []

        def read():
            start.wait()
            try:
                got.append(spec.leaves())
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert all(leaves is got[0] for leaves in got)
