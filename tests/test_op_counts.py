"""The training step's op count (kernel launches on a GPU) does not grow with the parameters.

``benchmarks/vs_fsdp2.py`` compares the count with FSDP2's side by side; here the invariant
that makes it hold at any size: the example's step, ×4 and ×16 the parameters (same layers and
tensors), dispatches exactly the same aten ops, with each optimizer.
"""

import sys
from pathlib import Path

import pytest
import torch

import vfsdp
from vfsdp.testing import CopyCounter, simulate
from vfsdp.testing.models import GPTConfig, init_rule, meta_params

ROOT = Path(__file__).resolve().parents[1]


def _optimizer(name: str):
    if name == "adamw":
        return vfsdp.optim.adamw(lr=1e-3, weight_decay=0.1,
                                 weight_decay_mask=lambda p: p[-1] != "norm")
    if name == "adamw8bit":
        return vfsdp.optim.adamw8bit(lr=1e-3, min_8bit_numel=256, compile=False)
    return vfsdp.optim.partition(
        {"muon": vfsdp.optim.muon(), "adamw": vfsdp.optim.adamw()},
        lambda p: "muon" if p[-1].startswith("w") else "adamw")


def _step_ops(name: str, dim: int, param_dtype) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_gpt import train_step
    finally:
        sys.path.remove(str(ROOT / "examples"))
    cfg = GPTConfig(vocab=64, dim=dim, layers=2, heads=4, kv_heads=2, ffn=2 * dim, seq=8)
    opt = _optimizer(name)
    spec = vfsdp.plan(meta_params(cfg), 2, granularity=opt.granularity)
    shards = vfsdp.shard(meta_params(cfg), spec, init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    state = opt.init(shards, spec)
    tokens = torch.zeros(2, cfg.seq, dtype=torch.long)
    gopts = {"param_dtype": param_dtype, "reduce_dtype": torch.float32 if param_dtype else None}
    _, _, state = train_step(shards, spec, opt, state, [(tokens, tokens)], cfg, gopts)
    with CopyCounter() as c:
        train_step(shards, spec, opt, state, [(tokens, tokens)], cfg, gopts)
    return dict(c.ops)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_step_ops_do_not_grow_with_parameters(name, param_dtype):
    # From 128: every matrix has two 32-row stripes at least (one per rank) and whole tiles,
    # so each rank runs the same kinds of ops at every size.
    base = simulate(2, _step_ops, name, 128, param_dtype)
    for dim in (256, 512):  # x4 and x16 the parameters
        assert simulate(2, _step_ops, name, dim, param_dtype) == base


def _split_counts(name: str, times: int) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from op_counts import split_counts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return simulate(2, split_counts, name, times, 2)[0]


def test_structure_aware_updates_do_not_grow_with_the_number_of_tensors():
    """8-bit AdamW over the same parameters cut into 4x the tensors, and Muon, SOAP and Shampoo
    over 4x the matrices of the same shapes, dispatch (about) the same ops per update: one flat 8-bit pass
    per unit, one batched Newton-Schulz per shape (they grew per tensor: 332 -> ~1300 and
    152 -> 570 before)."""
    one, four = _split_counts("adamw8bit", 1), _split_counts("adamw8bit", 4)
    assert abs(four - one) <= 0.1 * one, (one, four)
    for name in ("muon", "soap", "shampoo"):
        one, four = _split_counts(name, 1), _split_counts(name, 4)
        assert abs(four - one) <= 0.1 * one, (name, one, four)


def test_offloaded_update_copies_per_unit_not_per_tensor():
    """offload(adamw8bit) over 4x the tensors (the same units): its copies are one per unit
    each way, so its ops stay flat too, a few per unit above the update's own: the copy back
    (two slices and a copy), and three fingerprints of about ten ops each (the parameter
    shard before the update and after the copy back, the gradient shard)."""
    one, four = _split_counts("offload(adamw8bit)", 1), _split_counts("offload(adamw8bit)", 4)
    assert abs(four - one) <= 0.1 * one, (one, four)
    assert 0 < one - _split_counts("adamw8bit", 1) <= 30 * 5, one  # 5 units: 4 layers, root


def _unit_counts(name: str, layers: int, dim: int) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from op_counts import unit_counts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return simulate(2, unit_counts, name, layers, dim, 2)[0]


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "clip"])
def test_one_pass_over_the_rank_whatever_the_number_of_units(name):
    """The same parameters in 4x the units (6 layers of 128-wide matrices, then 24 of 64-wide,
    one unit each): AdamW, 8-bit AdamW (one 8-bit pass over every unit's shard laid end to
    end) and clipping dispatch the same ops per update within 1.1x (8-bit AdamW grew about 77
    ops per unit before)."""
    one, four = _unit_counts(name, 6, 128), _unit_counts(name, 24, 64)
    assert four <= 1.1 * one, (one, four)
