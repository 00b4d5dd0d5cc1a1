"""Device bugs caught without a GPU.

Two checks, each shown to catch the two crashes 0.1 had on CUDA (8-bit AdamW's code map made
on the CPU; Muon's exchange buffers made without a device):

* static: every tensor factory call in ``vfsdp/`` names its ``device=`` (or says, in a
  ``# cpu:`` comment on the line, why the host is meant);
* dynamic: the example's training step, with each optimizer, runs under
  ``simulate(..., device="meta")``: every vfsdp buffer is a meta tensor, so one created on
  the CPU by mistake meets a meta tensor in the first op and fails.
"""

import ast
import importlib
import pathlib
import sys

import optree
import pytest
import torch

import vfsdp
from vfsdp.collectives.comm import device_for
from vfsdp.testing import RankError, simulate
from vfsdp.testing.models import GPTConfig, init_rule, meta_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
             "linspace", "logspace", "eye", "as_tensor", "empty_strided", "scalar_tensor",
             "randperm"}


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of each ``torch.<factory>(...)`` without ``device=`` and without a
    ``# cpu:`` comment on its line."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        if "# cpu:" in lines[node.lineno - 1] or "# cpu:" in lines[node.end_lineno - 1]:
            continue
        out.append((node.lineno, ast.unparse(node)[:80]))
    return out


def test_every_factory_call_in_vfsdp_names_its_device():
    bad = []
    for path in sorted((ROOT / "vfsdp").rglob("*.py")):
        for line, call in factory_calls_without_device(path.read_text()):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {call}")
    assert not bad, ("tensors created without device= (take it from the inputs, or mark "
                     "'# cpu: why'):\n" + "\n".join(bad))


def test_the_static_check_catches_both_old_crashes():
    old_quant = "def dynamic_map(signed):\n    return torch.tensor(_map(signed), dtype=torch.float32)\n"
    old_muon = ("def run(self, n, dtype):\n"
                "    recv = torch.empty(sum(self.recv_sizes), dtype=dtype)\n"
                "    outs = [torch.empty(k, dtype=dtype) for k in self.out_sizes]\n")
    assert [line for line, _ in factory_calls_without_device(old_quant)] == [2]
    assert [line for line, _ in factory_calls_without_device(old_muon)] == [2, 3]
    fixed = "x = torch.empty(3, dtype=dtype, device=src.device)\ny = torch.zeros(2)  # cpu: why\n"
    assert factory_calls_without_device(fixed) == []


# ---------------------------------------------------------------- the step on meta

CFG = GPTConfig(vocab=64, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=16)


def _optimizer(name: str):
    if name == "adamw":
        return vfsdp.optim.adamw(lr=1e-3)
    if name == "adamw8bit":
        return vfsdp.optim.adamw8bit(lr=1e-3, min_8bit_numel=256)
    return vfsdp.optim.partition(
        {"muon": vfsdp.optim.muon(), "adamw": vfsdp.optim.adamw()},
        lambda p: "muon" if p[-1].startswith("w") else "adamw")


def _setup(name: str):
    """The example's step, and the optimizer, spec, shards and state on this rank."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_gpt import train_step
    finally:
        sys.path.remove(str(ROOT / "examples"))
    opt = _optimizer(name)
    spec = vfsdp.plan(meta_params(CFG), dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(meta_params(CFG), spec, init_fn=vfsdp.init.sharded(init_rule(CFG), 0))
    return train_step, opt, spec, shards, opt.init(shards, spec)


def _step_on_this_device(name: str):
    train_step, opt, spec, shards, state = _setup(name)
    device = device_for()
    tokens = torch.zeros(2, CFG.seq, dtype=torch.long, device=device)
    for _ in range(2):
        loss, norm, state = train_step(shards, spec, opt, state, [(tokens, tokens)], CFG,
                                       {"param_dtype": torch.bfloat16,
                                        "reduce_dtype": torch.float32})
    return loss.device.type, norm.device.type


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_the_training_step_runs_with_every_buffer_on_meta(name):
    assert simulate(2, _step_on_this_device, name, device="meta") == [("meta", "meta")] * 2


def test_meta_catches_the_old_8bit_crash(monkeypatch):
    """0.1 made the code map without the parameters' device."""
    mod = importlib.import_module("vfsdp.optim.adamw8bit")
    real = mod.dynamic_map
    monkeypatch.setattr(mod, "dynamic_map", lambda signed, device=None: real(signed))
    with pytest.raises(RankError, match="on device meta is not on the expected device cpu"):
        simulate(2, _step_on_this_device, "adamw8bit", device="meta")


def test_meta_catches_the_old_muon_crash(monkeypatch):
    """0.1 made Muon's receive buffers on the default (CPU) device."""
    from vfsdp.collectives.redistribute import Redistribution

    real = Redistribution.exchange

    def on_the_default_device(self, send_buf, group=None, async_op=False, then=None):
        return real(self, send_buf.to("cpu"), group, async_op, then)

    monkeypatch.setattr(Redistribution, "exchange", on_the_default_device)
    with pytest.raises(RankError, match=r"Cannot copy out of meta tensor|expected device"):
        simulate(2, _step_on_this_device, "muon", device="meta")


# ---------------------------------------------------------------- one GPU, several ranks

def _train_three_steps(name: str):
    import torch.distributed as dist

    train_step, opt, spec, shards, state = _setup(name)
    world = dist.get_world_size()
    device = device_for()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG.vocab, (world, 2, CFG.seq + 1), generator=g)
    mine = tokens[dist.get_rank()].to(device)
    losses = []
    for _ in range(3):
        loss, _, state = train_step(shards, spec, opt, state, [(mine[:, :-1], mine[:, 1:])],
                                    CFG, {})
        losses.append(float(loss))
    full = vfsdp.gather(shards, spec)
    return losses, [t.detach().cpu() for t in optree.tree_leaves(full)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_match_the_cpu(world):
    """simulate(device="cuda"): rank threads share the GPU; the result equals the same ranks
    on the CPU (fp32, AdamW's foreach path on both)."""
    on_cpu = simulate(world, _train_three_steps, "adamw")
    on_gpu = simulate(world, _train_three_steps, "adamw", device="cuda")
    for (la, pa), (lb, pb) in zip(on_cpu, on_gpu):
        assert la == pytest.approx(lb, rel=1e-4)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(pa, pb))


def test_simulate_device_cpu_is_the_default():
    a = simulate(2, _train_three_steps, "adamw", device="cpu")
    b = simulate(2, _train_three_steps, "adamw")
    for (la, pa), (lb, pb) in zip(a, b):
        assert la == lb and all(torch.equal(x, y) for x, y in zip(pa, pb))
