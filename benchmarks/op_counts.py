"""Aten ops per optimizer update and per training step, at two model sizes (same layers).

On a GPU every compute op is a kernel launch, so a count that grows with the parameters makes
a step launch-bound. The kernels are shown apart: the ops less views and allocations (metadata
and allocator calls, which launch nothing).
Counted at the dispatcher (``vfsdp.testing.CopyCounter``) on 2 simulated ranks, the
second step of each (the first builds what later steps reuse)::

    python benchmarks/op_counts.py
    python benchmarks/op_counts.py --dims 256 512 --layers 4

A second table counts one update over the same parameters cut into more tensors: 8-bit AdamW
with every matrix split into 4 (4x the tensors, the same numbers), Muon, SOAP and Shampoo with 4x
the layers of the same shapes. A structure-aware update whose ops grow per tensor shows it here.
``offload(...)`` rows: the same optimizer on host copies (its copies are per unit).

A third table counts one update over the same parameters in 4x the units: 6 layers of three
``dim x dim`` matrices and a norm (one unit each), then 24 layers of ``dim/2``-wide ones
(1.18M parameters at ``--unit-dim 256``). AdamW, 8-bit AdamW and clipping run one pass over
the whole rank, so their ops do not grow with the units.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import optree
import torch

import vfsdp
from vfsdp.testing import CopyCounter, simulate
from vfsdp.testing.models import GPTConfig, init_rule, meta_params


def _optimizer(name: str):
    if name.startswith("offload("):  # the same optimizer on host copies
        return vfsdp.optim.offload(_optimizer(name[len("offload("):-1]))
    no_norm = lambda path: not str(path[-1]).endswith("norm")
    if name == "adamw":
        return vfsdp.optim.adamw(lr=1e-3, weight_decay=0.1, weight_decay_mask=no_norm)
    if name == "adamw8bit":
        return vfsdp.optim.adamw8bit(lr=1e-3, weight_decay=0.1, weight_decay_mask=no_norm,
                                     compile=False)
    if name == "soap":  # the norms too: Adam on their owners
        return vfsdp.optim.soap(lr=1e-3)
    matrices = {"muon": vfsdp.optim.muon, "shampoo": vfsdp.optim.shampoo}[name]
    return vfsdp.optim.partition(
        {name: matrices(lr=1e-3), "adamw": vfsdp.optim.adamw(lr=1e-3)},
        lambda p: name if p[0] == "layers" and str(p[-1]).startswith("w") else "adamw")


def _counts(name: str, cfg: GPTConfig, world: int) -> dict:
    from train_gpt import train_step

    opt = _optimizer(name)
    spec = vfsdp.plan(meta_params(cfg), world, granularity=opt.granularity,
                      comm_dtypes=[torch.bfloat16])
    shards = vfsdp.shard(meta_params(cfg), spec, init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    state = opt.init(shards, spec)
    tokens = torch.zeros(4, cfg.seq, dtype=torch.long)
    gopts = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    _, _, state = train_step(shards, spec, opt, state, [(tokens, tokens)], cfg, gopts)
    with CopyCounter() as step:
        _, _, state = train_step(shards, spec, opt, state, [(tokens, tokens)], cfg, gopts)
    grads = vfsdp.grads(shards, spec)
    with CopyCounter() as update:
        opt.update(grads, state, shards, spec)
    return {"params": sum(t.numel() for t in optree.tree_leaves(meta_params(cfg))),
            "step_ops": sum(step.ops.values()), "update_ops": sum(update.ops.values()),
            "step_kernels": step.kernels, "update_kernels": update.kernels}


def split_params(name: str, times: int, dim: int = 256, layers: int = 4) -> dict:
    """The tensors of :func:`split_counts`: for ``adamw8bit`` each layer's two matrices cut
    into ``times`` row blocks each (the same parameters); for ``muon``, ``soap`` and
    ``shampoo`` ``times`` as many layers of the same shapes."""
    g = torch.Generator().manual_seed(0)
    if name.endswith("adamw8bit)") or name == "adamw8bit":
        rows = [dim // times] * times
        return {"layers": [{**{f"w{j}": torch.randn(r, dim, generator=g) for j, r in
                               enumerate(rows)},
                            **{f"up{j}": torch.randn(2 * r, dim, generator=g) for j, r in
                               enumerate(rows)},
                            "norm": torch.ones(dim)} for _ in range(layers)]}
    return {"layers": [{"w": torch.randn(dim, dim, generator=g),
                        "up": torch.randn(2 * dim, dim, generator=g), "norm": torch.ones(dim)}
                       for _ in range(layers * times)]}


def split_counts(name: str, times: int, world: int) -> int:
    """Aten ops of one update (the second; for SOAP, whose first only sets its eigenbases,
    the third) over :func:`split_params` on ``world`` ranks."""
    opt = _optimizer(name)
    params = split_params(name, times)
    spec = vfsdp.plan(params, world, granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    state = opt.init(shards, spec)
    grads = vfsdp.grads(shards, spec)
    for g in optree.tree_leaves(grads):
        g.fill_(0.01)
    for _ in range(2 if name == "soap" else 1):
        state = opt.update(grads, state, shards, spec)
    with CopyCounter() as update:
        opt.update(grads, state, shards, spec)
    return sum(update.ops.values())


def unit_params(layers: int, dim: int) -> dict:
    """:func:`unit_counts`' tensors: ``layers`` layers of three ``dim x dim`` matrices and a
    norm each."""
    g = torch.Generator().manual_seed(0)
    return {"layers": [{**{w: torch.randn(dim, dim, generator=g) for w in ("wq", "wk", "wo")},
                        "norm": torch.ones(dim)} for _ in range(layers)]}


def unit_counts(name: str, layers: int, dim: int, world: int) -> int:
    """Aten ops of one update (the second) of ``name`` (``adamw``, ``adamw8bit`` or ``clip``:
    ``vfsdp.clip_grad_norm``) over :func:`unit_params`, one unit per layer, on ``world``
    ranks."""
    opt = None if name == "clip" else _optimizer(name)
    params = unit_params(layers, dim)
    spec = vfsdp.plan(params, world, granularity=opt.granularity if opt else None)
    shards = vfsdp.shard(params, spec)
    state = opt.init(shards, spec) if opt else None
    grads = vfsdp.grads(shards, spec)
    for g in optree.tree_leaves(grads):
        g.fill_(0.01)
    step = ((lambda: opt.update(grads, state, shards, spec)) if opt else
            (lambda: vfsdp.clip_grad_norm(grads, spec, 1e-3)))
    step()
    with CopyCounter() as update:
        step()
    return sum(update.ops.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", nargs=2, type=int, default=[256, 512],
                    help="two model widths (x4 the parameters by default)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--unit-dim", type=int, default=256,
                    help="the third table's widths: this with 6 units, half with 24")
    args = ap.parse_args(argv)
    print(f"{'optimizer':<14} {'parameters':>22} {'update ops':>14} {'step ops':>14} "
          f"{'of them kernels (update, step)':>32}")
    for name in ("adamw", "adamw8bit", "muon", "offload(adamw)"):
        rows = []
        for dim in args.dims:
            cfg = GPTConfig(vocab=512, dim=dim, layers=args.layers, heads=8, kv_heads=4,
                            ffn=int(2.75 * dim) // 32 * 32, seq=32)
            rows.append(simulate(args.world, _counts, name, cfg, args.world)[0])
        a, b = rows
        print(f"{name:<14} {a['params']:>10,} -> {b['params']:<10,} {a['update_ops']:>6} -> "
              f"{b['update_ops']:<6} {a['step_ops']:>6} -> {b['step_ops']:<6} "
              f"{a['update_kernels']:>6} -> {b['update_kernels']:<6} {a['step_kernels']:>6} -> "
              f"{b['step_kernels']:<6}")
    print(f"\n{'optimizer':<18} {'update ops: tensors x1 -> x4':>30}  (same parameters for "
          f"adamw8bit, 4x the same shapes for muon, soap and shampoo)")
    for name in ("adamw8bit", "muon", "soap", "shampoo", "offload(adamw8bit)"):
        one, four = (simulate(args.world, split_counts, name, t, args.world)[0] for t in (1, 4))
        print(f"{name:<18} {one:>14} -> {four:<8} ({four / one:.2f}x)")
    d = args.unit_dim
    print(f"\n{'update':<18} {'ops: 6 units -> 24 units':>30}  (the same parameters: 6 layers "
          f"of {d}-wide matrices, 24 of {d // 2}-wide)")
    for name in ("adamw", "adamw8bit", "clip"):
        one, four = (simulate(args.world, unit_counts, name, n, w, args.world)[0]
                     for n, w in ((6, d), (24, d // 2)))
        print(f"{name:<18} {one:>14} -> {four:<8} ({four / one:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
