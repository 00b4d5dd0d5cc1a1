"""The cost of ``shard_map``'s replication checking (``check_vma``) per torch op.

The same forward runs under ``vfsdp.shard_map`` with ``check_vma=True`` and ``False`` on one
simulated rank: a chain of small elementwise ops (the tracking's worst case: the op itself
costs a few microseconds), and the TP MLP of the docs at a small size, forward and backward,
with its ``pvary`` written and left to the check (the implicit pvary).
Each figure is the median over ``--repeats`` runs; the per-op cost is the difference of the
medians divided by the number of torch calls the tracker saw. ``bare mode``: the same body
under a ``TorchFunctionMode`` that only calls the op (the floor of any design that sees every
torch call without a tensor subclass).

    python benchmarks/vma_bench.py
    python benchmarks/vma_bench.py --repeats 21 --ops 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from torch.overrides import TorchFunctionMode

import vfsdp
from vfsdp import P, lax
from vfsdp.spmd import vma
from vfsdp.testing import simulate


def _chain(ops):
    def body(x, w):
        w = lax.pvary(w, "x")
        h = x
        for _ in range(ops // 2):
            h = (h * w).tanh()
        return h
    return body, (torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)), \
        (P("x"), P()), P("x")


def _mlp(ops, implicit=False):
    def body(x, up, down):  # implicit: the pvary left to check_vma (inserted where x @ up mixes)
        return lax.psum(torch.relu((x if implicit else lax.pvary(x, "x")) @ up) @ down, "x")
    return body, (torch.randn(16, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True),
                  torch.randn(64, 32, requires_grad=True)), (P(), P(None, "x"), P("x")), P()


class _Bare(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _time(kind, ops, repeats):
    mesh = vfsdp.mesh(("x", 1))
    body, args, specs, out_spec = {"chain": _chain, "mlp": _mlp,
                                   "mlp_implicit": lambda n: _mlp(n, True)}[kind](ops)
    seen = {}

    def counted(*a):
        out = body(*a)
        tracker = vma.current()
        seen["ops"] = tracker.ops if tracker is not None else 0
        return out

    def bare(*a):
        with _Bare():
            return body(*a)

    fns = {check: vfsdp.shard_map(bare if check == "bare" else counted, mesh, specs, out_spec,
                                  check_vma=check is True) for check in (False, True, "bare")}
    samples: dict = {False: [], True: [], "bare": []}
    for i in range(3 * repeats + 3):  # interleaved (the first round warms up)
        check = (False, True, "bare")[i % 3]
        t0 = time.perf_counter()
        y = fns[check](*args)  # the forward: the backward is not tracked
        if i >= 3:
            samples[check].append(time.perf_counter() - t0)
        if kind != "chain":
            y.sum().backward()
    out = {k: statistics.median(v) for k, v in samples.items()}
    return out[False], out[True], out["bare"], seen["ops"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ops", type=int, default=1000)
    args = parser.parse_args()
    for kind in ("chain", "mlp", "mlp_implicit"):
        off, on, bare, ops = simulate(1, _time, kind, args.ops, args.repeats)[0]
        per = max(ops, 1)
        print(f"{kind:12s} check_vma=False {off * 1e3:7.3f} ms  True {on * 1e3:7.3f} ms  "
              f"(ratio {on / off:4.2f})  bare mode {bare * 1e3:7.3f} ms  {ops} torch calls: "
              f"{(on - off) / per * 1e6:5.2f} us per call checked, "
              f"{(bare - off) / per * 1e6:5.2f} us of it the mode's dispatch")


if __name__ == "__main__":
    main()
