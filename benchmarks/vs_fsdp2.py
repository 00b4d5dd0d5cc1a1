"""Train the same model with vfsdp and with torch's ``fully_shard`` (FSDP2), side by side.

Same seed, initial weights, batches, world size, mixed-precision settings and AdamW math;
reshard after forward on for both (every block is one ``fully_shard`` / one vfsdp unit, the
embedding and head form the root). gloo on CPU, one thread per process. For each
configuration (world size x model) it prints medians over the timed steps after warm-up:

* step time ratio (vfsdp / FSDP2), steps interleaved (one vfsdp step, one FSDP2 step, ...);
* peak tracked memory ratio: the same dispatcher-level tracker (``vfsdp.testing.LiveBytes``)
  for both, over one step each, counting parameters, gradients, optimizer states, gathered
  buffers and activations, and re-reading storage sizes so storage-resize frees are seen;
* bytes copied outside the collectives per step (``vfsdp.testing.CopyCounter``), in total and
  net of the model's own copies (the same model run unsharded on one process, same batch);
* aten ops per step at the dispatcher (the same counter for both, collectives' own work
  excluded), and of them the kernels: the ops less views and allocations, which launch
  nothing (each kernel is a launch on a GPU); FSDP2's optimizer kernel is chosen with
  ``--fsdp2-optim`` (``single``, the default, is bitwise vfsdp's math; ``fused`` has the
  fewest ops);
* collectives per step (c10d ops at the dispatcher);
* final loss of each.

    python benchmarks/vs_fsdp2.py                      # W = 2 and 4, dense and MoE
    python benchmarks/vs_fsdp2.py --world-sizes 2 --models dense --steps 12 --json out.json
    python benchmarks/vs_fsdp2.py --world-sizes 1 2 --models dense --fsdp2-optim fused
    python benchmarks/vs_fsdp2.py --world-sizes 4 --models moe --ep 2     # EP x FSDP
    python benchmarks/vs_fsdp2.py --world-sizes 2 --models gpt2 llama mixtral   # transformers

``--ep N`` runs the MoE model top-2 routed with its experts split over ``N`` ranks, on a
``(dp, ep)`` mesh, both ways torchtitan does it: vfsdp as ``examples/train_gpt.py --ep``
(the rest planned over every rank, each ``ep`` index's experts over ``dp``, every layer one
``run_layers`` step of both pieces), FSDP2 with each block's experts ``fully_shard``-ed over
``dp`` (their gradients divided by the world size: by ``dp`` in the reduce-scatter, by
``ep`` with the clip, as gloo has no ``PREMUL_SUM``) and the rest over every rank; the same
``moe_ep`` all-to-alls, one gradient norm over both, clipped to 1. The table's collectives
column also gives the bytes they move (each collective's largest tensor, the same count for
both).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import optree
import torch
import torch.distributed as dist
from gpt_module import Block, GPTModule

import vfsdp
from vfsdp.collectives import slot_of
from vfsdp.testing import CopyCounter, LiveBytes, moe, spawn
from vfsdp.testing.models import (
    GPTConfig,
    _heads,
    _rms,
    init_rule,
    loss_fn,
    meta_params,
)

MODELS = {
    "dense": GPTConfig(dim=256, layers=4, heads=8, kv_heads=4, ffn=688, seq=64),
    "moe": GPTConfig(dim=128, layers=3, heads=4, kv_heads=2, ffn=0, seq=64, experts=16,
                     expert_ffn=64),
}
# Hugging Face models from small configs (transformers >= 5; nothing is downloaded). vfsdp runs
# them through vfsdp.functionalize with the decoder blocks under run_layers; FSDP2 puts
# fully_shard on each block and on the root, as for the models above.
HF_MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {
        "n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "llama": ("LlamaForCausalLM", "LlamaConfig", {
        "num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 344,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {
        "num_hidden_layers": 3, "hidden_size": 128, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "num_local_experts": 8, "num_experts_per_tok": 2}),
}
HF_VOCAB, HF_SEQ = 512, 64
BATCH, LR = 4, 1e-3


def _hf_model(name: str):
    import transformers as tf

    cls, cfg_cls, kw = HF_MODELS[name]
    config = getattr(tf, cfg_cls)(vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=1,
                                  loss_type="ForCausalLM", **kw)
    torch.manual_seed(0)
    return getattr(tf, cls)(config)


def _hf_batches(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 131 + rank)
    tokens = torch.randint(0, HF_VOCAB, (BATCH, HF_SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _hf_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _vfsdp_hf_system(name: str, param_dtype):
    world = dist.get_world_size()
    params, apply = vfsdp.functionalize(_hf_model(name))
    spec = vfsdp.plan(params, world, comm_dtypes=[torch.bfloat16])
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.adamw(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    box = {"state": opt.init(shards, spec)}
    policy = vfsdp.Policy(param_dtype=param_dtype,
                          reduce_dtype=torch.float32 if param_dtype else None)

    def step(tokens, targets):
        vfsdp.zero_grads(shards, spec)
        loss = _hf_loss(apply.run_layers(shards, spec, input_ids=tokens, policy=policy).logits,
                        targets)
        loss.backward()
        grads = vfsdp.grads(shards, spec)
        vfsdp.clip_grad_norm(grads, spec, 1.0)
        box["state"] = opt.update(grads, box["state"], shards, spec)
        return loss.item()

    return step, lambda: _units_buffers([shards], [box["state"]])


def _fsdp2_hf_system(name: str, param_dtype, fsdp2_optim: str = "single"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _hf_model(name)
    _, apply = vfsdp.functionalize(model)  # only to find the module list of blocks
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                              reduce_dtype=torch.float32 if param_dtype else None)
    for blk in model.get_submodule(".".join(map(str, apply.blocks))):
        fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    return _fsdp2_step(model, lambda tokens, targets: _hf_loss(model(input_ids=tokens).logits,
                                                               targets), fsdp2_optim)


def _batches(step: int, rank: int, cfg: GPTConfig):
    g = torch.Generator().manual_seed(step * 131 + rank)
    tokens = torch.randint(0, cfg.vocab, (BATCH, cfg.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _vfsdp_system(cfg: GPTConfig, param_dtype):
    from train_gpt import train_step  # the example's hand-written step, shared on purpose

    world = dist.get_world_size()
    spec = vfsdp.plan(meta_params(cfg), world, comm_dtypes=[torch.bfloat16])
    shards = vfsdp.shard(meta_params(cfg), spec, init_fn=vfsdp.init.sharded(init_rule(cfg), 0))
    opt = vfsdp.optim.adamw(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    box = {"state": opt.init(shards, spec)}
    gopts = {"param_dtype": param_dtype, "reduce_dtype": torch.float32 if param_dtype else None}

    def step(tokens, targets):
        loss, _, box["state"] = train_step(shards, spec, opt, box["state"], [(tokens, targets)],
                                           cfg, gopts)
        return float(loss)

    return step, lambda: _units_buffers([shards], [box["state"]])


def _fsdp2_system(cfg: GPTConfig, param_dtype, fsdp2_optim: str = "single"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    full = vfsdp.init.full_tree(init_rule(cfg), meta_params(cfg), 0)
    model = GPTModule(full, cfg)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                              reduce_dtype=torch.float32 if param_dtype else None)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    return _fsdp2_step(model, model, fsdp2_optim)


def _fsdp2_step(model, loss_of, fsdp2_optim: str):
    kind = {"single": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[fsdp2_optim]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1,
                            **kind)

    def step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    def persistent():
        out = []
        for p in model.parameters():
            out.append(p._local_tensor if hasattr(p, "_local_tensor") else p)
        for st in opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    return step, persistent


def _units_buffers(trees: list, states: list) -> list:
    """Every buffer of every unit of the shards ``trees``, and the AdamW ``states``' moments."""
    units = {id(u): u for tree in trees for u in (slot_of(t).unit for t in optree.tree_leaves(tree))}
    out = []
    for u in units.values():
        for db in u.buffers():
            out += [db.shard, db.global_buffer]
    for state in states:
        for db in (*state.exp_avg.values(), *state.exp_avg_sq.values()):
            out.append(db.shard)
    return out


def _vfsdp_ep_system(cfg: GPTConfig, param_dtype, ep: int):
    """``train_gpt --ep``'s step: the rest over every rank, this ``ep`` index's experts over
    ``dp``, each layer one ``run_layers`` step of both."""
    from train_gpt import train_step_ep

    from vfsdp.testing.models_tp import ep_rule, split_experts

    world = dist.get_world_size()
    mesh = vfsdp.mesh(("dp", world // ep), ("ep", ep))
    init_fn = vfsdp.init.sharded(init_rule(cfg), 0)
    rest, experts = split_experts(meta_params(cfg))
    spec = vfsdp.plan(rest, world, comm_dtypes=[torch.bfloat16])
    shards = vfsdp.shard(rest, spec, init_fn=init_fn)
    e_spec = vfsdp.plan(experts, mesh, tp=ep_rule, tp_axis="ep", comm_dtypes=[torch.bfloat16])
    e_shards = vfsdp.shard(experts, e_spec, mesh=mesh, init_fn=init_fn)
    opt = vfsdp.optim.adamw(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    box = {"states": [opt.init(shards, spec), opt.init(e_shards, e_spec)]}
    gopts = {"param_dtype": param_dtype, "reduce_dtype": torch.float32 if param_dtype else None}

    def step(tokens, targets):
        loss, _, box["states"] = train_step_ep([(shards, spec), (e_shards, e_spec)], mesh, opt,
                                               box["states"], [(tokens, targets)], cfg, gopts)
        return float(loss)

    return step, lambda: _units_buffers([shards, e_shards], box["states"])


class _Experts(torch.nn.Module):
    """This ``ep`` index's experts of one layer; its forward is the routed MoE layer (so FSDP2
    gathers them around it)."""

    def __init__(self, local: dict, cfg: GPTConfig, mesh) -> None:
        super().__init__()
        self.cfg, self.mesh = cfg, mesh
        for name, value in local.items():
            self.register_parameter(name, torch.nn.Parameter(value.clone()))

    def forward(self, router: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        local = {n: getattr(self, n) for n in ("w_gate", "w_up", "w_down")}
        return moe.moe_ep(router, local, h, self.cfg.top_k, "ep", self.cfg.experts,
                          mesh=self.mesh)


class _EPBlock(torch.nn.Module):
    """``block_ep`` as modules: the dense part's parameters here, the experts a child."""

    def __init__(self, tree: dict, cfg: GPTConfig, mesh, index: int, ep: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.names = [k for k in tree if k != "experts"]
        for name in self.names:
            self.register_parameter(name, torch.nn.Parameter(tree[name].clone()))
        per = cfg.experts // ep
        self.experts = _Experts({k: v[index * per:(index + 1) * per]
                                 for k, v in tree["experts"].items()}, cfg, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, cfg = {n: getattr(self, n) for n in self.names}, self.cfg
        x = x + _heads(_rms(x, p["attn_norm"]), p, cfg, cfg.heads, cfg.kv_heads) @ p["wo"]
        h = _rms(x, p["mlp_norm"])
        return x + self.experts(p["router"], h.reshape(-1, h.shape[-1])).view_as(h)


class _EPModel(GPTModule):
    """GPTModule (its forward) with each block's experts split over ``ep``."""

    def __init__(self, full: dict, cfg: GPTConfig, mesh, ep: int) -> None:
        torch.nn.Module.__init__(self)
        self.cfg = cfg
        index = mesh.get_local_rank("ep")
        self.io = Block(full["io"], cfg)
        self.blocks = torch.nn.ModuleList(_EPBlock(p, cfg, mesh, index, ep)
                                          for p in full["layers"])


def _fsdp2_ep_system(cfg: GPTConfig, param_dtype, ep: int, fsdp2_optim: str = "single"):
    """torchtitan's EP x FSDP2: each block's experts ``fully_shard``-ed over ``dp`` (their
    gradients divided by the world size: they hold every ``ep`` peer's tokens), the rest over
    every rank; one gradient norm over both (the experts' squares summed over ``ep``).
    ``ep`` divides the experts: ``E / ep`` each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    mesh = vfsdp.mesh(("dp", world // ep), ("ep", ep))
    model = _EPModel(vfsdp.init.full_tree(init_rule(cfg), meta_params(cfg), 0), cfg, mesh, ep)
    world_mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                              reduce_dtype=torch.float32 if param_dtype else None)
    for blk in model.blocks:
        fully_shard(blk.experts, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=True)
        fully_shard(blk, mesh=world_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=world_mesh, mp_policy=mp, reshard_after_forward=True)
    expert_ids = {id(p) for blk in model.blocks for p in blk.experts.parameters()}
    experts = [p for p in model.parameters() if id(p) in expert_ids]
    rest = [p for p in model.parameters() if id(p) not in expert_ids]
    kind = {"single": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[fsdp2_optim]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1,
                            **kind)
    ep_group = mesh.get_group("ep")

    def step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        # The experts' gradients came averaged over dp: / ep more makes them / world (gloo
        # has no PREMUL_SUM for set_gradient_divide_factor); folded into the clip's scale.
        sq = (torch.nn.utils.get_total_norm([p.grad for p in experts]).full_tensor() / ep) ** 2
        dist.all_reduce(sq, group=ep_group)  # every ep index's experts
        sq = sq + torch.nn.utils.get_total_norm([p.grad for p in rest]).full_tensor() ** 2
        coef = min(1.0, 1.0 / (float(sq.sqrt()) + 1e-6))
        for p in rest:
            p.grad.mul_(coef)
        for p in experts:
            p.grad.mul_(coef / ep)
        opt.step()
        return loss.item()

    def persistent():
        out = [p._local_tensor if hasattr(p, "_local_tensor") else p for p in model.parameters()]
        for st in opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    return step, persistent


def bench_rank(model_name: str, steps: int, warmup: int, param_dtype_name: str,
               fsdp2_optim: str = "single", ep: int = 1) -> dict:
    torch.manual_seed(0)
    rank = dist.get_rank()
    hf = model_name in HF_MODELS
    cfg = None if hf else MODELS[model_name]
    param_dtype = {"fp32": None, "bf16": torch.bfloat16}[param_dtype_name]
    if hf:
        torch.set_num_threads(1)
        systems = {"vfsdp": _vfsdp_hf_system(model_name, param_dtype),
                   "fsdp2": _fsdp2_hf_system(model_name, param_dtype, fsdp2_optim)}
        batches = lambda step, rank: _hf_batches(step, rank)
    else:
        if ep > 1:  # top-2 routed, the experts split over ep
            cfg = dataclasses.replace(cfg, top_k=2)
            systems = {"vfsdp": _vfsdp_ep_system(cfg, param_dtype, ep),
                       "fsdp2": _fsdp2_ep_system(cfg, param_dtype, ep, fsdp2_optim)}
        else:
            systems = {"vfsdp": _vfsdp_system(cfg, param_dtype),
                       "fsdp2": _fsdp2_system(cfg, param_dtype, fsdp2_optim)}
        batches = lambda step, rank: _batches(step, rank, cfg)
    times = {k: [] for k in systems}
    losses = {k: [] for k in systems}
    for step in range(1, warmup + steps + 1):
        tokens, targets = batches(step, rank)
        for name, (fn, _) in systems.items():
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(fn(tokens, targets))
            if step > warmup:
                times[name].append(time.perf_counter() - t0)
    out = {"config": f"W={dist.get_world_size()} {model_name}{f' ep={ep}' if ep > 1 else ''} "
                     f"{param_dtype_name}"}
    tokens, targets = batches(warmup + steps + 1, rank)
    for name, (fn, persistent) in systems.items():
        mem = LiveBytes().track(*persistent())
        with CopyCounter() as copies, mem:
            fn(tokens, targets)
        out[name] = {"step_s": statistics.median(times[name]), "peak_bytes": mem.peak,
                     "copied_bytes": copies.copy_bytes, "collectives": copies.collectives,
                     "collective_bytes": copies.collective_bytes,
                     "aten_ops": sum(copies.ops.values()), "kernels": copies.kernels,
                     "final_loss": losses[name][-1], "first_loss": losses[name][0]}
    # The model's own copies (attention reshapes, rotary stacks): the same model run on one
    # process without any FSDP, same batch; what each system adds is the rest.
    if hf:
        plain = _hf_model(model_name)
        with CopyCounter() as base:
            _hf_loss(plain(input_ids=tokens).logits, targets).backward()
    else:
        full = vfsdp.init.full_tree(init_rule(cfg), meta_params(cfg), 0)
        for t in optree.tree_leaves(full):
            t.requires_grad_(True)
        with CopyCounter() as base:
            loss_fn(full, tokens, targets, cfg).backward()
    out["model_copied_bytes"] = base.copy_bytes
    v, f = out["vfsdp"], out["fsdp2"]
    for r in (v, f):
        r["added_copied_bytes"] = r["copied_bytes"] - base.copy_bytes
    out["added_copied_bytes_ratio"] = v["added_copied_bytes"] / max(f["added_copied_bytes"], 1)
    out["step_time_ratio"] = v["step_s"] / f["step_s"]
    out["peak_memory_ratio"] = v["peak_bytes"] / f["peak_bytes"]
    out["copied_bytes_ratio"] = v["copied_bytes"] / max(f["copied_bytes"], 1)
    out["aten_ops_ratio"] = v["aten_ops"] / max(f["aten_ops"], 1)
    out["kernels_ratio"] = v["kernels"] / max(f["kernels"], 1)
    out["collective_bytes_ratio"] = v["collective_bytes"] / max(f["collective_bytes"], 1)
    return out if rank == 0 else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--models", nargs="*", default=list(MODELS),
                    choices=[*MODELS, *HF_MODELS],
                    help="the GPT of vfsdp.testing.models (dense, moe) or Hugging Face models "
                         "from small configs (gpt2, llama, mixtral; needs transformers)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per system (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--fsdp2-optim", choices=["single", "foreach", "fused"], default="single",
                    help="torch.optim.AdamW's kernel for FSDP2: single (bitwise vfsdp's math on "
                         "the CPU), foreach or fused (fewest ops)")
    ap.add_argument("--ep", type=int, default=1,
                    help="MoE only: split the experts over this many ranks (EP x FSDP), top-2")
    ap.add_argument("--json", help="write one record per configuration to this file")
    args = ap.parse_args(argv)
    if args.ep > 1:
        if args.models != ["moe"]:
            ap.error(f"--ep {args.ep} splits the MoE model's experts: pass --models moe")
        bad = [w for w in args.world_sizes if w % args.ep]
        if bad or MODELS["moe"].experts % args.ep:
            ap.error(f"--ep {args.ep} must divide every world size (not {bad}) and the "
                     f"{MODELS['moe'].experts} experts")
    os.environ["OMP_NUM_THREADS"] = "1"
    mib = 2 ** 20
    records = []
    print(f"{'config':<22} {'step ms vfsdp/FSDP2':>20} {'ratio':>6} {'peak MiB vfsdp/FSDP2':>22} "
          f"{'ratio':>6} {'copied MiB vfsdp/FSDP2':>23} {'ratio':>6} {'added by system':>16} "
          f"{'ratio':>6} {'aten ops vfsdp/FSDP2':>21} {'ratio':>6} {'kernels vfsdp/FSDP2':>20} "
          f"{'ratio':>6} {'collectives (MiB)':>26} {'ratio':>6} "
          f"{'final loss':>17}")
    for world in args.world_sizes:
        for model in args.models:
            r = spawn(bench_rank, world, model, args.steps, args.warmup, args.param_dtype,
                      args.fsdp2_optim, args.ep, timeout=3600)[0]
            v, f = r["vfsdp"], r["fsdp2"]
            print(f"{r['config']:<22} {1e3 * v['step_s']:>9.1f}/{1e3 * f['step_s']:<10.1f} "
                  f"{r['step_time_ratio']:>6.3f} {v['peak_bytes'] / mib:>10.2f}/"
                  f"{f['peak_bytes'] / mib:<11.2f} {r['peak_memory_ratio']:>6.3f} "
                  f"{v['copied_bytes'] / mib:>10.2f}/{f['copied_bytes'] / mib:<12.2f} "
                  f"{r['copied_bytes_ratio']:>6.3f} {v['added_copied_bytes'] / mib:>7.2f}/"
                  f"{f['added_copied_bytes'] / mib:<8.2f} {r['added_copied_bytes_ratio']:>6.3f} "
                  f"{v['aten_ops']:>9}/{f['aten_ops']:<11} {r['aten_ops_ratio']:>6.3f} "
                  f"{v['kernels']:>9}/{f['kernels']:<10} {r['kernels_ratio']:>6.3f} "
                  f"{v['collectives']:>4} ({v['collective_bytes'] / mib:.2f})/"
                  f"{f['collectives']:<4} ({f['collective_bytes'] / mib:.2f}) "
                  f"{r['collective_bytes_ratio']:>6.3f} "
                  f"{v['final_loss']:>8.4f}/{f['final_loss']:<8.4f}", flush=True)
            records.append(r)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
