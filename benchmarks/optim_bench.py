"""Seconds per optimizer update, side by side in one run, medians (CPU here; GPU if present).

One rank (``simulate(1)``, one torch thread), the same parameters and gradients for every row:
a stack of layers with two matrices and a norm each, and the same parameters with every matrix
cut into 4 row blocks (4x the tensors). Rows:

* ``torch AdamW``: ``torch.optim.AdamW(foreach=True)`` (``fused=True`` on CUDA), the yardstick;
* ``vfsdp adamw``;
* ``vfsdp adamw8bit``: the whole update, one flat 8-bit pass over the rank
  (``vfsdp.optim.quant.step8_flat``) and one multi-tensor AdamW for the norms;
* ``8-bit pass, per rank`` and ``8-bit pass, per tensor``: that pass alone, and the reference
  beside it (``step8`` of ``tests/optim/reference.py`` once per quantized tensor, what 0.2
  ran), over the same state;
* ``vfsdp muon``: Muon on the matrices, AdamW on the norms;
* ``vfsdp soap``: SOAP (1-D tensors on its Adam), beside ``pytorch-optimizer SOAP``, the
  reference, over the same tensors in one process with the same hyperparameters (eigenbases
  refreshed every 10 steps in both); ``vfsdp shampoo``: Shampoo on every tensor (blocks of
  at most 1024, the 1-D rule for the norms);
* ``offload(...)``: the same optimizers through ``vfsdp.optim.offload`` (state and fp32
  masters in host memory; on the CPU the "host" is the same memory, so the row shows what
  the per-unit copies and bookkeeping add), and ``offload(adamw fused)``, torch's fused CPU
  AdamW kernel on the host (``adamw(fused=True)``).

    python benchmarks/optim_bench.py
    python benchmarks/optim_bench.py --dim 512 --layers 2 --repeat 5
    python benchmarks/optim_bench.py --quick       # tiny shapes, 3 repeats: a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import optree
import torch

import vfsdp
from tests.optim.reference import step8
from vfsdp.testing import simulate


def params(dim: int, layers: int, cut: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        w, up = torch.randn(dim, dim, generator=g), torch.randn(2 * dim, dim, generator=g)
        layer = {"norm": torch.ones(dim)}
        for j, (a, b) in enumerate(zip(w.chunk(cut), up.chunk(cut))):
            layer[f"w{j}"], layer[f"up{j}"] = a, b
        out.append(layer)
    return optree.tree_map(lambda t: t.to(device), {"layers": out})


def _median(fn, repeat: int, sync) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _passes_8bit(state, shards, spec, flat: bool):
    """The 8-bit pass alone over ``state``: one over the rank (``step8_flat`` over every
    unit's shard laid end to end, what the update runs) or per tensor (``step8``, the
    reference)."""
    from vfsdp.optim.adamw8bit import _cat, _rank_pass
    from vfsdp.optim.base import unit_buffers
    from vfsdp.optim.quant import step8_flat

    maps = state.traced.maps
    units = unit_buffers(shards, spec, "bench")
    with torch.no_grad():
        if flat:
            run = _rank_pass(state, [(u, frozenset()) for u in units])
            g = _cat([u.unit.grads().shard for u in units])
            p, cm, cv = _cat(run.ps), _cat(run.cms), _cat(run.cvs)
            step8_flat(p, g, cm, cv, state.rank_scales_m, state.rank_scales_v, run.tiles,
                       *maps, 0.9, 0.999, 1e-8, 1e-4, 0.1, 0.5)
            return
        for u in units:
            key = u.key
            p, g = u.db.shard, u.unit.grads().shard
            cm, cv = state.codes_m[key].shard, state.codes_v[key].shard
            for t in state.plan.quantized[key]:
                if t.hi > t.lo:
                    s = slice(t.lo, t.hi)
                    step8(p[s].view(t.view), g[s].view(t.view), cm[s].view(t.view),
                          cv[s].view(t.view), state.scales_m[(key, t.k)],
                          state.scales_v[(key, t.k)], *maps, 0.9, 0.999, 1e-8, 1e-4, 0.1, 0.5)


def rows(dim: int, layers: int, cut: int, repeat: int, device: str) -> dict:
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    tree = params(dim, layers, cut, dev)
    leaves = [t.clone().requires_grad_() for t in optree.tree_leaves(tree)]
    for t in leaves:
        t.grad = torch.full_like(t, 0.01)
    fused = {"fused": True} if dev.type == "cuda" else {"foreach": True}
    topt = torch.optim.AdamW(leaves, lr=1e-3, **fused)
    out["torch AdamW"] = _median(topt.step, repeat, sync)
    try:
        from pytorch_optimizer import SOAP
    except ImportError:  # the row is left out
        SOAP = None
    if SOAP is not None:
        out["pytorch-optimizer SOAP"] = _median(
            SOAP(leaves, lr=1e-3, precondition_frequency=10).step, repeat, sync)
    is_matrix = lambda p: str(p[-1]) != "norm"
    made = {
        "vfsdp adamw": lambda: vfsdp.optim.adamw(lr=1e-3),
        "vfsdp adamw8bit": lambda: vfsdp.optim.adamw8bit(lr=1e-3, compile=False),
        "vfsdp muon": lambda: vfsdp.optim.partition(
            {"muon": vfsdp.optim.muon(lr=1e-3), "adamw": vfsdp.optim.adamw(lr=1e-3)},
            lambda p: "muon" if is_matrix(p) else "adamw"),
        "vfsdp soap": lambda: vfsdp.optim.soap(lr=1e-3, precondition_frequency=10),
        "vfsdp shampoo": lambda: vfsdp.optim.shampoo(lr=1e-3, precondition_frequency=10)}
    offload = getattr(vfsdp.optim, "offload", None)
    if offload is not None:
        made.update({
            "offload(adamw)": lambda: offload(made["vfsdp adamw"]()),
            "offload(adamw fused)": lambda: offload(vfsdp.optim.adamw(lr=1e-3, fused=True)),
            "offload(adamw8bit)": lambda: offload(made["vfsdp adamw8bit"]()),
            "offload(muon)": lambda: offload(made["vfsdp muon"]())})
    for name, make in made.items():
        opt = make()
        spec = vfsdp.plan(tree, 1, granularity=opt.granularity)
        shards = vfsdp.shard(tree, spec)
        state = opt.init(shards, spec)
        grads = vfsdp.grads(shards, spec)
        for g in optree.tree_leaves(grads):
            g.fill_(0.01)
        out[name] = _median(lambda: opt.update(grads, state, shards, spec), repeat, sync)
        if name == "vfsdp adamw8bit":
            for flat, row in ((True, "8-bit pass, per rank"), (False, "8-bit pass, per tensor")):
                out[row] = _median(lambda flat=flat: _passes_8bit(state, shards, spec, flat),
                                   repeat, sync)
    out["tensors"] = len(leaves)
    out["parameters"] = sum(t.numel() for t in leaves)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="128 wide, 2 layers, 3 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.repeat = 128, 2, 3
    device = args.device
    table = {cut: simulate(1, rows, args.dim, args.layers, cut, args.repeat, device,
                           device=device if device != "cpu" else None, timeout=None)[0]
             for cut in (1, 4)}
    one, four = table[1], table[4]
    print(f"{device}, {one['parameters']:,} parameters in {one['tensors']} tensors, then "
          f"{four['tensors']}; seconds per update (median of {args.repeat}), and against torch "
          f"AdamW in the same run")
    for name in ("torch AdamW", "vfsdp adamw", "vfsdp adamw8bit", "8-bit pass, per rank",
                 "8-bit pass, per tensor", "vfsdp muon", "vfsdp soap", "pytorch-optimizer SOAP",
                 "vfsdp shampoo", "offload(adamw)",
                 "offload(adamw fused)", "offload(adamw8bit)", "offload(muon)"):
        if name not in one:
            continue
        a, b = one[name], four[name]
        print(f"{name:<22} {a:9.4f} s ({a / one['torch AdamW']:5.2f}x)   x4 tensors: "
              f"{b:9.4f} s ({b / four['torch AdamW']:5.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
