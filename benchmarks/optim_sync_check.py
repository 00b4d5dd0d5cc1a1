"""The optimizers' step counter on a GPU: no update reads a value back to the host, and
AdamW's fused path is bitwise ``torch.optim.AdamW(fused=True)`` with a schedule.

One rank (``simulate(1, device=...)``). Per optimizer (AdamW fused and foreach, 8-bit AdamW,
Muon, ``clip_by_global_norm`` + AdamW), two updates run under
``torch.cuda.set_sync_debug_mode("error")``: a host sync inside raises. Then three AdamW steps
from the same gradients against torch's (fused: bitwise; foreach, whose step size divides the
denominator on a GPU as ``capturable=True`` does: the largest difference). On the CPU the
sync check is skipped (there is no device to wait for) and the rest runs::

    python benchmarks/optim_sync_check.py            # CUDA if present
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import optree
import torch

import vfsdp
from vfsdp.testing import simulate


def _params(device) -> dict:
    g = torch.Generator().manual_seed(0)
    tree = {"layers": [{"w": torch.randn(64, 64, generator=g) * 0.1, "norm": torch.ones(64)}
                       for _ in range(4)]}
    return optree.tree_map(lambda t: t.to(device), tree)


def _grads(step: int, params: dict) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return optree.tree_map(lambda t: torch.randn(t.shape, generator=g).to(t.device), params)


def _optimizers() -> dict:
    schedule = vfsdp.optim.warmup_cosine(1e-2, 2, 10)
    return {
        "adamw fused": lambda: vfsdp.optim.adamw(lr=schedule, fused=True),
        "adamw foreach": lambda: vfsdp.optim.adamw(lr=schedule, fused=False),
        "adamw8bit": lambda: vfsdp.optim.adamw8bit(lr=schedule, min_8bit_numel=1024,
                                                   compile=False),
        "muon": lambda: vfsdp.optim.muon(lr=schedule, weight_decay=0.1,
                                         only=lambda p: p[-1] == "w"),
        "clip + adamw": lambda: vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0),
                                                  vfsdp.optim.adamw(lr=schedule)),
    }


def _train(name: str, device, steps: int = 3) -> tuple:
    params = _params(device)
    opt = _optimizers()[name]()
    if name == "muon":  # Muon takes matrices; the norms go to AdamW
        opt = vfsdp.optim.partition({"m": opt, "a": vfsdp.optim.adamw(lr=1e-2)},
                                    lambda p: "m" if p[-1] == "w" else "a")
    spec = vfsdp.plan(params, 1, granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    state = opt.init(shards, spec)
    sync = "not checked (CPU)"
    for step in range(1, steps + 1):
        grads = vfsdp.grads(shards, spec)
        for g, full in zip(optree.tree_leaves(grads), optree.tree_leaves(_grads(step, params))):
            g.copy_(full.reshape(g.shape))  # one rank: its piece is the whole tensor
        checked = torch.device(device).type == "cuda" and step > 1
        if checked:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            state = opt.update(grads, state, shards, spec)
            if checked:
                sync = "none"
        except RuntimeError as exc:
            sync = f"SYNC: {str(exc).splitlines()[0][:120]}"
            break
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode(0)
    full = vfsdp.gather(shards, spec)
    return sync, [t.detach().cpu().clone() for t in optree.tree_leaves(full)]


def _torch(fused: bool, device, steps: int = 3) -> list:
    params = _params(device)
    leaves = [t.clone().requires_grad_() for t in optree.tree_leaves(params)]
    schedule = vfsdp.optim.warmup_cosine(1e-2, 2, 10)
    kind = {"fused": True} if fused else {"foreach": True, "capturable": device != "cpu"}
    opt = torch.optim.AdamW(leaves, lr=schedule(1), **kind)
    for step in range(1, steps + 1):
        opt.param_groups[0]["lr"] = schedule(step)
        for p, g in zip(leaves, optree.tree_leaves(_grads(step, params))):
            p.grad = g
        opt.step()
    return [t.detach().cpu() for t in leaves]


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {"device": device} if device != "cpu" else {}
    print(f"device: {device}")
    got = {}
    for name in _optimizers():
        sync, got[name] = simulate(1, _train, name, device, **kw)[0]
        print(f"{name:<14} host syncs in an update: {sync}")
    for name, fused in (("adamw fused", True), ("adamw foreach", False)):
        want = _torch(fused, device)
        same = all(torch.equal(a, b) for a, b in zip(got[name], want))
        diff = max(float((a - b).abs().max()) for a, b in zip(got[name], want))
        print(f"{name:<14} vs torch.optim.AdamW({'fused' if fused else 'foreach'}): "
              f"bitwise {same}, largest difference {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
