"""vfsdp against FSDP2 on GPUs: step time, tokens/s, MFU, memory, kernel launches, optimizers.

The driver starts one ``torchrun`` job per (configuration, system), so each system runs in
its own processes and its memory figures are clean, then prints them side by side and
writes one JSON record per configuration::

    python benchmarks/gpu_vs_fsdp2.py                         # 1 GPU: NCCL, W=1
    python benchmarks/gpu_vs_fsdp2.py --nproc 8 --json gpu.json
    python benchmarks/gpu_vs_fsdp2.py --cpu                   # gloo, 2 CPU processes, tiny sizes

Systems (each in its own job):

* ``vfsdp``: the step of ``examples/train_gpt.py`` (``run_layers``, bf16 gathers, fp32
  reduction, grad clipping), AdamW (torch's fused kernel on CUDA), then each optimizer's
  update alone on the same shards (``adamw``, ``adamw8bit``, Muon + AdamW);
* ``fsdp2``: the same model as modules, ``fully_shard`` per block and the root,
  ``MixedPrecisionPolicy(bf16, fp32)``, the same clipping, ``torch.optim.AdamW(fused=True)``;
* ``torch``: the optimizer baselines on the full (unsharded) parameters of one rank:
  ``torch.optim.AdamW(fused=True)`` and ``torch.optim.Muon`` on the layers' matrices plus
  fused AdamW on the rest;
* ``vfsdp_compiled``: the same step written for ``torch.compile(fullgraph=True)`` (bf16
  gathers, reduce-scatters in bf16, clipping and AdamW in the graph), against eager FSDP2;
* ``vfsdp_offload`` and ``fsdp2_offload``: the eager steps with the optimizer state and fp32
  masters in host memory: ``vfsdp.optim.offload(adamw(fused=True))`` (torch's fused CPU
  AdamW on the host) against ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` with
  ``torch.optim.AdamW(fused=True)``; the table gives their step times against the step
  without offload, and the device memory allocated before a step.

Configurations: ``large`` (886M LLaMA-style: vocab 32000, dim 2048, 16 layers, 16 heads, 8 KV
heads, FFN 5632, 4 x 2048 tokens per rank) and ``small`` (``examples/train_gpt.py``'s
defaults, 8 x 64 tokens per rank). ``--cpu`` shrinks ``large`` to a few million parameters.

Figures (medians over ``--steps`` timed steps after ``--warmup``):

* step time and tokens/s (all ranks); MFU = model FLOPs (6 x matmul parameters + 12 x layers
  x dim x seq per token) / (step time x ``--peak-tflops`` x ranks);
* peak allocated and reserved memory over the timed steps, and what is allocated before a
  step (parameters, gradients, optimizer state);
* kernel launches in one step: CPU-side ``cudaLaunchKernel`` calls in a ``torch.profiler``
  trace (``--cpu``: aten ops at the dispatcher, the launches a GPU would see);
* optimizer update time per optimizer; vfsdp's updates this rank's shards (1/W of the
  parameters), torch's baselines the full parameters, so the two compare at W=1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt_module import GPTModule  # noqa: E402

import vfsdp  # noqa: E402
from vfsdp.testing import CopyCounter  # noqa: E402
from vfsdp.testing.models import GPTConfig, meta_params  # noqa: E402

CONFIGS = {
    "large": (GPTConfig(vocab=32000, dim=2048, layers=16, heads=16, kv_heads=8, ffn=5632,
                        seq=2048), 4),
    "small": (GPTConfig(vocab=256, dim=96, layers=3, heads=4, kv_heads=2, ffn=256, seq=64), 8),
}
CPU_CONFIGS = {
    "large": (GPTConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, ffn=352, seq=64), 2),
    "small": CONFIGS["small"],
}
SYSTEMS = ("vfsdp", "fsdp2", "torch", "vfsdp_compiled", "vfsdp_offload", "fsdp2_offload")
OPTIMIZERS = ("adamw", "adamw8bit", "muon")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel")


# ---------------------------------------------------------------- model FLOPs and init

def matmul_params(cfg: GPTConfig) -> int:
    """Parameters that take part in matmuls (everything 2-D but the embedding table)."""
    total = 0
    for path, t in zip(_paths(meta_params(cfg)), _leaves(meta_params(cfg))):
        if t.dim() == 2 and path[-1] != "embed":
            total += t.numel()
    return total


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 per matmul parameter, plus attention's 12 x layers x dim x
    seq (scores and values, forward and backward)."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.layers * cfg.dim * cfg.seq


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def _paths(tree):
    import optree

    return optree.tree_paths(tree)


def _init_values(path: tuple, shape, device, dtype=torch.float32) -> torch.Tensor:
    """Fast on-device init: ones for norms, N(0, 0.02) otherwise (values only need to train)."""
    if str(path[-1]).endswith("norm"):
        return torch.ones(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(repr(path).encode()))
    return torch.randn(shape, dtype=dtype, device=device, generator=g) * 0.02


def _batch(cfg: GPTConfig, batch: int, step: int, device) -> tuple:
    g = torch.Generator(device=device).manual_seed(1000 + step * 31 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g, device=device)
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------- measuring

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, steps: int, warmup: int) -> list:
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn(i)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _launches(fn, device, compiled: bool = False) -> dict:
    """Kernel launches of one call (CUDA: runtime launch calls in a profiler trace; CPU: aten
    ops at the dispatcher, or, for a compiled function, which a dispatch mode would send back
    to eager, aten ops in a profiler trace: its fused kernels are not among them)."""
    if device.type != "cuda":
        if compiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
            return {"launches": ops, "launch_kind": "aten ops in a profiler trace (CPU)"}
        with CopyCounter() as c:
            fn()
        return {"launches": sum(c.ops.values()), "launch_kind": "aten ops (CPU)"}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    events = prof.events()
    launches = sum(1 for e in events if e.name in LAUNCHES)
    kernels = sum(1 for e in events if getattr(e, "device_type", None) is not None
                  and str(e.device_type).endswith("CUDA"))
    return {"launches": launches, "gpu_kernels": kernels, "launch_kind": "cudaLaunchKernel"}


def _memory(device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device)}


# ---------------------------------------------------------------- the systems

def _vfsdp(cfg, batch, device, args, offloaded: bool = False) -> dict:
    from train_gpt import train_step

    world = dist.get_world_size()
    gran = vfsdp.optim.adamw8bit().granularity  # so every optimizer can run on these shards
    spec = vfsdp.plan(meta_params(cfg), world, granularity=gran, comm_dtypes=[torch.bfloat16])
    shards = vfsdp.shard(meta_params(cfg), spec,
                         init_fn=lambda path, local, t: _init_values(path, local.shape, device))
    no_norm = lambda path: not str(path[-1]).endswith("norm")
    opt = vfsdp.optim.adamw(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            weight_decay_mask=no_norm, fused=True if offloaded else None)
    if offloaded:
        opt = vfsdp.optim.offload(opt)
    box = {"state": opt.init(shards, spec)}
    gopts = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}

    def step(i):
        tokens, targets = _batch(cfg, batch, i, device)
        loss, _, box["state"] = train_step(shards, spec, opt, box["state"], [(tokens, targets)],
                                           cfg, gopts)
        box["loss"] = loss

    out = _run_steps(step, device, args)
    out["final_loss"] = float(box["loss"])
    if offloaded:
        out["host_bytes"] = box["state"].host_bytes()
        return out
    grads = vfsdp.grads(shards, spec)
    opts = {
        "adamw": opt,
        "adamw8bit": vfsdp.optim.adamw8bit(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                           weight_decay_mask=no_norm),
        "muon": vfsdp.optim.partition(
            {"muon": vfsdp.optim.muon(lr=1e-4, weight_decay=0.1, scale="moonlight"),
             "adamw": vfsdp.optim.adamw(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                        weight_decay_mask=no_norm)},
            lambda path: "muon" if path[0] == "layers" and str(path[-1]).startswith("w")
            else "adamw"),
    }
    del box["state"]
    out["optimizer_s"] = {}
    for name in args.optimizers:
        o = opts[name]
        st = {"s": o.init(shards, spec)}

        def upd(_i, o=o, st=st):
            st["s"] = o.update(grads, st["s"], shards, spec)

        times = _timed(upd, device, args.opt_steps, 2)
        out["optimizer_s"][name] = statistics.median(times)
        out.setdefault("optimizer_launches", {})[name] = _launches(lambda: upd(0), device)
        del st["s"]
    return out


def _vfsdp_compiled(cfg, batch, device, args) -> dict:
    """vfsdp's step under ``torch.compile(fullgraph=True)``: bf16 gathers (``run_layers``
    re-gathering in backward), the gradients reduce-scattered in bf16 (the compiled path
    reduces in the gather dtype; FSDP2 here reduces in fp32), clipping and AdamW in the graph."""
    from compile_bench import step_fn
    from torch._dynamo.utils import counters

    world = dist.get_world_size()
    spec = vfsdp.plan(meta_params(cfg), world, comm_dtypes=[torch.bfloat16])
    shards = vfsdp.shard(meta_params(cfg), spec,
                         init_fn=lambda path, local, t: _init_values(path, local.shape, device))
    no_norm = lambda path: not str(path[-1]).endswith("norm")
    opt = vfsdp.optim.adamw(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            weight_decay_mask=no_norm)
    state = opt.init(shards, spec)
    train = step_fn(spec, opt, cfg, param_dtype=torch.bfloat16)

    fast = torch.compile(train, fullgraph=True)
    box = {}

    def step(i):
        tokens, targets = _batch(cfg, batch, i, device)
        box["loss"] = fast(shards, state, tokens, targets)

    t0 = time.perf_counter()
    step(0)
    _sync(device)
    compile_s = time.perf_counter() - t0
    out = _run_steps(step, device, args, compiled=True)
    out.update(final_loss=float(box["loss"]), compile_s=compile_s,
               graphs=counters["stats"]["unique_graphs"])
    return out


def _fsdp2(cfg, batch, device, args, offloaded: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    model = GPTModule(meta_params(cfg), cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init_values(tuple(name.split("__")), p.shape, device))
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    extra = {"offload_policy": CPUOffloadPolicy()} if offloaded else {}
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=True, **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True, **extra)
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm")]
    rest = [p for n, p in model.named_parameters() if n.endswith("norm")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), fused=True)
    box = {}

    def step(i):
        tokens, targets = _batch(cfg, batch, i, device)
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        box["loss"] = loss

    out = _run_steps(step, device, args)
    out["final_loss"] = float(box["loss"])
    out["optimizer_s"] = {"adamw": statistics.median(_timed(lambda i: opt.step(), device,
                                                            args.opt_steps, 2))}
    return out


def _torch(cfg, batch, device, args) -> dict:
    """torch's optimizers on one rank's full parameters (fp32), gradients filled once."""
    params = {}
    for path, t in zip(_paths(meta_params(cfg)), _leaves(meta_params(cfg))):
        p = _init_values(path, t.shape, device).requires_grad_(True)
        p.grad = torch.randn_like(p) * 1e-3
        params[path] = p
    no_norm = [p for path, p in params.items() if not str(path[-1]).endswith("norm")]
    norms = [p for path, p in params.items() if str(path[-1]).endswith("norm")]
    groups = [{"params": no_norm, "weight_decay": 0.1}, {"params": norms, "weight_decay": 0.0}]
    out: dict = {"optimizer_s": {}, "optimizer_launches": {}}
    adamw = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=True)
    out["optimizer_s"]["adamw_fused"] = statistics.median(
        _timed(lambda i: adamw.step(), device, args.opt_steps, 2))
    out["optimizer_launches"]["adamw_fused"] = _launches(adamw.step, device)
    adamw = None  # free its state before the next baseline
    if hasattr(torch.optim, "Muon"):
        mats = [p for path, p in params.items() if path[0] == "layers" and p.dim() == 2]
        others = [p for path, p in params.items() if not (path[0] == "layers" and p.dim() == 2)]
        muon = torch.optim.Muon(mats, lr=1e-4, weight_decay=0.1)
        rest = torch.optim.AdamW(others, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                 fused=True)

        def both(_i=0):
            muon.step()
            rest.step()

        out["optimizer_s"]["muon_adamw"] = statistics.median(
            _timed(both, device, args.opt_steps, 2))
        out["optimizer_launches"]["muon_adamw"] = _launches(both, device)
    return out


def _run_steps(step, device, args, compiled: bool = False) -> dict:
    for i in range(args.warmup):
        step(i)
    _sync(device)
    persistent = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _timed(lambda i: step(args.warmup + i), device, args.steps, 0)
    out = {"step_s": statistics.median(times), "persistent_allocated": persistent,
           **_memory(device)}
    out.update(_launches(lambda: step(0), device, compiled))
    return out


def worker(args) -> None:
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    cfg, batch = (CPU_CONFIGS if args.cpu else CONFIGS)[args.config]
    systems = {"vfsdp": _vfsdp, "fsdp2": _fsdp2, "torch": _torch,
               "vfsdp_compiled": _vfsdp_compiled,
               "vfsdp_offload": lambda *a: _vfsdp(*a, offloaded=True),
               "fsdp2_offload": lambda *a: _fsdp2(*a, offloaded=True)}
    out = systems[args.system](cfg, batch, device, args)
    world = dist.get_world_size()
    if "step_s" in out:
        tokens = batch * cfg.seq * world
        out["tokens_per_s"] = tokens / out["step_s"]
        out["mfu"] = (out["tokens_per_s"] * flops_per_token(cfg)
                      / (args.peak_tflops * 1e12 * world))
    out.update(config=args.config, system=args.system, world=world, device=str(device),
               torch=torch.__version__, params=sum(t.numel() for t in _leaves(meta_params(cfg))))
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver

def _launch(args, config: str, system: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", os.path.abspath(__file__), "--worker",
           "--config", config, "--system", system, "--out", out,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--opt-steps", str(args.opt_steps), "--peak-tflops", str(args.peak_tflops),
           "--optimizers", *args.optimizers] + (["--cpu"] if args.cpu else [])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"error": f"exit {proc.returncode}", "log_tail": tail}
    with open(out) as fh:
        return json.load(fh)


def _fmt(x, scale=1.0, spec=".3f") -> str:
    return "n/a" if x is None else format(x * scale, spec)


def _ratio(a, b) -> str:
    return "n/a" if a is None or b in (None, 0) else f"{a / b:.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes, tiny sizes")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: 1 GPU; 2 on --cpu)")
    ap.add_argument("--configs", nargs="*", default=["large", "small"], choices=list(CONFIGS))
    ap.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    ap.add_argument("--steps", type=int, default=6, help="timed training steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--opt-steps", type=int, default=5, help="timed optimizer updates (median)")
    ap.add_argument("--peak-tflops", type=float, default=790.0,
                    help="the GPU's peak bf16 TFLOP/s (H200: about 790 measured)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--json", help="write one record per configuration to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.nproc = args.nproc or (2 if args.cpu else 1)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            rec: dict = {"config": config, "world": args.nproc, "cpu": args.cpu,
                         "peak_tflops": args.peak_tflops}
            for system in args.systems:
                rec[system] = _launch(args, config, system, os.path.join(tmp, f"{system}.json"))
                if "error" in rec[system]:
                    print(f"{config} {system}: {rec[system]['error']}\n{rec[system]['log_tail']}",
                          file=sys.stderr)
            records.append(rec)
            _print(rec)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0 if all("error" not in r.get(s, {}) for r in records for s in args.systems) else 1


def _print(rec: dict) -> None:
    v, f, t = rec.get("vfsdp", {}), rec.get("fsdp2", {}), rec.get("torch", {})
    gib = 2 ** -30
    print(f"\n== {rec['config']} (W={rec['world']}{', CPU' if rec['cpu'] else ''}) ==")
    print(f"{'':28} {'vfsdp':>12} {'FSDP2':>12} {'ratio':>8}")
    rows = [("step time (s, median)", "step_s", 1.0, ".4f"),
            ("tokens/s", "tokens_per_s", 1.0, ",.0f"),
            ("MFU", "mfu", 1.0, ".3f"),
            ("peak allocated (GiB)", "peak_allocated", gib, ".2f"),
            ("peak reserved (GiB)", "peak_reserved", gib, ".2f"),
            ("allocated before a step (GiB)", "persistent_allocated", gib, ".2f"),
            ("kernel launches / step", "launches", 1.0, ".0f")]
    for label, key, scale, spec in rows:
        a, b = v.get(key), f.get(key)
        print(f"{label:28} {_fmt(a, scale, spec):>12} {_fmt(b, scale, spec):>12} "
              f"{_ratio(a, b):>8}")
    if v.get("launch_kind"):
        print(f"  (launches counted as {v['launch_kind']})")
    vo, fo, to = v.get("optimizer_s", {}), f.get("optimizer_s", {}), t.get("optimizer_s", {})
    base = {"adamw": to.get("adamw_fused"), "adamw8bit": to.get("adamw_fused"),
            "muon": to.get("muon_adamw")}
    names = {"adamw": "AdamW(fused)", "adamw8bit": "AdamW(fused) fp32", "muon": "Muon + AdamW"}
    print(f"{'optimizer update (s)':28} {'vfsdp':>12} {'torch':>12} {'ratio':>8}  against")
    for name in vo:
        print(f"{name:28} {_fmt(vo[name], 1, '.4f'):>12} {_fmt(base[name], 1, '.4f'):>12} "
              f"{_ratio(vo[name], base[name]):>8}  torch.optim {names[name]}")
    if fo.get("adamw") is not None:
        print(f"{'(FSDP2 AdamW fused step)':28} {'':>12} {_fmt(fo['adamw'], 1, '.4f'):>12}")
    c = rec.get("vfsdp_compiled", {})
    if "step_s" in c:
        print(f"{'compiled vfsdp':28} {'compiled':>12} {'FSDP2':>12} {'ratio':>8}")
        for label, key, scale, spec in rows[:5] + rows[6:]:
            a, b = c.get(key), f.get(key)
            print(f"{label:28} {_fmt(a, scale, spec):>12} {_fmt(b, scale, spec):>12} "
                  f"{_ratio(a, b):>8}")
        print(f"  compiled in {c['compile_s']:.1f} s; graphs: {c['graphs']} (1 = no recompiles)")
    vo_, fo_ = rec.get("vfsdp_offload", {}), rec.get("fsdp2_offload", {})
    if "step_s" in vo_ or "step_s" in fo_:
        print(f"{'offloaded optimizer':28} {'vfsdp':>12} {'FSDP2':>12} {'ratio':>8}")
        for label, key, scale, spec in (rows[0], rows[5]):
            a, b = vo_.get(key), fo_.get(key)
            print(f"{label:28} {_fmt(a, scale, spec):>12} {_fmt(b, scale, spec):>12} "
                  f"{_ratio(a, b):>8}")
        for label, a, b in (("step / step without offload", vo_.get("step_s"), v.get("step_s")),
                            ("FSDP2: the same", fo_.get("step_s"), f.get("step_s"))):
            print(f"{label:28} {_ratio(a, b):>12}")
        saved = [None if x.get("persistent_allocated") is None or y.get("persistent_allocated")
                 is None else (y["persistent_allocated"] - x["persistent_allocated"]) * gib
                 for x, y in ((vo_, v), (fo_, f))]
        print(f"{'device memory saved (GiB)':28} {_fmt(saved[0], 1, '.2f'):>12} "
              f"{_fmt(saved[1], 1, '.2f'):>12}")
        if vo_.get("host_bytes") is not None:
            print(f"  vfsdp host memory per rank: {vo_['host_bytes'] * gib:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
