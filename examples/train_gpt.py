"""Train a small LLaMA-style decoder with vfsdp: the training step written by hand, no wrapping.

The model is plain functions over a parameter pytree (``vfsdp.testing.models``): RMSNorm,
rotary, SwiGLU, grouped-query attention. Each step gathers the embedding/head unit, runs the
layers with ``vfsdp.run_layers`` (prefetch, release after forward, regather in backward,
reduce-scatter as each layer's backward ends), clips the global gradient norm and applies
AdamW on the flat shards.

``--tp N`` adds Megatron tensor parallelism (a ``(dp, tp)`` mesh: attention split by heads, the
MLP by hidden units; the ``tp`` ranks of one data-parallel group read the same batch) and
``--ep N`` expert parallelism over a top-k routed MoE (a ``(dp, ep)`` mesh: stacked experts
split over ``ep``, every rank its own batch; the rest of the model data-parallel over every
rank). Either composes with FSDP (and ``--hsdp``) over the data axes.

    python examples/train_gpt.py                       # 4 gloo processes, the embedded corpus
    python examples/train_gpt.py --world-size 2 --steps 40 --png loss.png   # vs one process
    python examples/train_gpt.py --data my.txt --param-dtype bf16 --hsdp 2
    python examples/train_gpt.py --ckpt runs/ckpt --save-every 50       # checkpoints
    python examples/train_gpt.py --world-size 2 --resume runs/ckpt/step-50   # on 2 ranks
    python examples/train_gpt.py --tp 2                # mesh dp=2 x tp=2
    python examples/train_gpt.py --ep 2 --experts 4    # mesh dp=2 x ep=2, top-2 routing
    python examples/train_gpt.py --ep 2 --experts 4 --ckpt runs/moe --save-every 50
    python examples/train_gpt.py --ep 4 --experts 4 --resume runs/moe/step-50    # ep 2 -> 4
    python examples/train_gpt.py --simulate --tp 2 --hsdp 2 --world-size 8   # threads
    torchrun --nproc-per-node 8 examples/train_gpt.py  # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 8 examples/train_gpt.py --tp 4   # dp=2 x tp=4

The default corpus is the text of Python's own help topics (``pydoc_data``), so nothing is
downloaded. The loss curve is saved to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import GatheredProbe, simulate, spawn
from vfsdp.testing.models import GPTConfig, block, embed, head_loss, init_rule, loss_fn, meta_params
from vfsdp.testing.models_tp import block_ep, block_tp, ep_rule, split_experts, tp_rule

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def corpus(path: str | None) -> torch.Tensor:
    """Bytes of ``path``, or of Python's bundled help-topic text."""
    if path:
        with open(path, "rb") as f:
            data = f.read()
    else:
        from pydoc_data.topics import topics

        data = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    if len(data) < 1024:
        raise ValueError(f"corpus has {len(data)} bytes; need at least 1024")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(data: torch.Tensor, step: int, rank: int, micro: int, args) -> tuple:
    """Deterministic windows for (step, rank, micro-batch): the same on every run."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank * 31 + micro)
    starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
    idx = starts[:, None] + torch.arange(args.seq + 1)[None, :]
    window = data[idx]
    return window[:, :-1], window[:, 1:]


def make_optimizer(args):
    """AdamW, block-wise 8-bit AdamW, or Muon for the layers' matrices with AdamW for the rest.

    Norms take no weight decay. Muon uses Moonlight's update scale, so one learning rate
    suits both of its halves.
    """
    schedule = vfsdp.optim.warmup_cosine(args.lr, max(1, args.steps // 10), args.steps, args.lr / 10)
    no_norm = lambda path: not str(path[-1]).endswith("norm")
    if args.optim == "muon":
        return vfsdp.optim.partition(
            {"muon": vfsdp.optim.muon(lr=schedule, weight_decay=0.1, scale="moonlight"),
             "adamw": vfsdp.optim.adamw(lr=schedule, betas=(0.9, 0.95), weight_decay=0.1,
                                        weight_decay_mask=no_norm)},
            lambda path: "muon" if path[0] == "layers" and str(path[-1]).startswith("w") else "adamw")
    factory = {"adamw": vfsdp.optim.adamw, "adamw8bit": vfsdp.optim.adamw8bit}[args.optim]
    return factory(lr=schedule, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=no_norm)


def train_step(shards, spec, opt, state, micro_batches, cfg: GPTConfig, gopts: dict):
    """One optimizer step over micro-batches; returns (this rank's loss, grad norm, state).

    Gradients reduce-scatter only on the last micro-batch (``grad_sync``); before that they
    accumulate unsharded in ``reduce_dtype``.
    """
    vfsdp.zero_grads(shards, spec)
    layer_specs = [spec["layers"][i] for i in range(cfg.layers)]
    step_loss = 0.0
    for micro, (tokens, targets) in enumerate(micro_batches):
        sync = micro == len(micro_batches) - 1
        io = vfsdp.gather(shards["io"], spec["io"], grads="buffer", free_after_backward=True,
                          grad_sync=sync, **gopts)
        x = embed(io, tokens)
        x = vfsdp.run_layers(lambda p, h: block(p, h, cfg), shards["layers"], layer_specs, x,
                             grad_sync=sync, **gopts)
        loss = head_loss(io, x, targets) / len(micro_batches)
        loss.backward()
        step_loss = step_loss + loss.detach()
    grads = vfsdp.grads(shards, spec)
    norm = vfsdp.clip_grad_norm(grads, spec, 1.0)
    state = opt.update(grads, state, shards, spec)
    return step_loss, norm, state


def train_step_tp(shards, spec, mesh, opt, state, micro_batches, cfg: GPTConfig, gopts: dict):
    """:func:`train_step` on TP-local pieces: the same FSDP calls with ``mesh=`` (they run
    over the data axes) and :func:`block_tp` for the layers. ``vfsdp.clip_grad_norm`` of a
    ``tp=`` plan's gradients is the global norm: the split tensors' pieces add over ``tp``,
    the replicated ones (the same gradient on every ``tp`` rank) count once."""
    vfsdp.zero_grads(shards, spec)
    layer_specs = [spec["layers"][i] for i in range(cfg.layers)]
    step_loss = 0.0
    for micro, (tokens, targets) in enumerate(micro_batches):
        sync = micro == len(micro_batches) - 1
        io = vfsdp.gather(shards["io"], spec["io"], grads="buffer",
                          free_after_backward=True, grad_sync=sync, **gopts)
        x = embed(io, tokens)
        x = vfsdp.run_layers(lambda p, h: block_tp(p, h, cfg, mesh), shards["layers"],
                             layer_specs, x, grad_sync=sync, **gopts)
        loss = head_loss(io, x, targets) / len(micro_batches)
        loss.backward()
        step_loss = step_loss + loss.detach()
    grads = vfsdp.grads(shards, spec)
    norm = vfsdp.clip_grad_norm(grads, spec, 1.0)
    state = opt.update(grads, state, shards, spec)
    return step_loss, norm, state


def train_step_ep(trees, mesh, opt, states, micro_batches, cfg: GPTConfig, gopts: dict):
    """:func:`train_step` with the experts split over ``"ep"``. ``trees`` is ``[(shards,
    spec)]`` of the rest (FSDP over every rank) and of the experts (over ``"dp"``).

    Each rank's experts compute tokens of every rank of its ``ep`` group, so each rank's
    loss is divided by the world size and the gradients are summed (``grad_reduce="sum"``):
    the rest's over every rank, the experts' over ``dp`` (the ``ep`` peers' share came
    through the all-to-all). An average would count the experts' gradients ``ep`` times.
    Each layer is one ``run_layers`` step of two pieces, its dense part and its experts,
    gathered, prefetched, released after its forward and regathered for its backward together,
    each reduce-scattered over its own group.
    """
    (shards, spec), (e_shards, e_spec) = trees
    world = dist.get_world_size()
    for s, sp in trees:
        vfsdp.zero_grads(s, sp)
    layers = [{"dense": (shards["layers"][i], spec["layers"][i]),
               "experts": (e_shards["layers"][i], e_spec["layers"][i])}
              for i in range(cfg.layers)]
    step_loss = 0.0
    for micro, (tokens, targets) in enumerate(micro_batches):
        opts = dict(gopts, grad_sync=micro == len(micro_batches) - 1, grad_reduce="sum")
        io = vfsdp.gather(shards["io"], spec["io"], grads="buffer", free_after_backward=True,
                          **opts)
        x = vfsdp.run_layers(lambda p, h: block_ep(dict(p["dense"], **p["experts"]), h, cfg, mesh),
                             layers, None, embed(io, tokens), **opts)
        loss = head_loss(io, x, targets) / len(micro_batches)
        (loss / world).backward()
        step_loss = step_loss + loss.detach()
    grads = [vfsdp.grads(s, sp) for s, sp in trees]
    norm = vfsdp.optim.clip_grad_norm_of([(grads[0], spec), (grads[1], e_spec, mesh)], 1.0)
    states = [opt.update(g, st, s, sp) for g, st, (s, sp) in zip(grads, states, trees)]
    return step_loss, norm, states


def config(args) -> GPTConfig:
    return GPTConfig(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                     ffn=args.ffn, seq=args.seq, experts=args.experts, top_k=args.top_k or 0)


def model_mesh(args, world: int):
    """``(axes, DeviceMesh or None)``: ``[("rep", r),] ("dp", d), ("tp" | "ep", n)`` with
    ``--tp``/``--ep``, else the plain FSDP (or HSDP) shape and no mesh object."""
    model = ("tp", args.tp) if args.tp > 1 else ("ep", args.ep) if args.ep > 1 else None
    if model is None:
        return ((("rep", args.hsdp),) if args.hsdp > 1 else ()) + (("dp", world // args.hsdp),), None
    axes = ((("rep", args.hsdp),) if args.hsdp > 1 else ()) + (
        ("dp", world // (args.hsdp * model[1])), model)
    return axes, vfsdp.mesh(*axes)


def train(args) -> dict:
    """The SPMD training loop; every rank runs it. Returns losses and memory figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(args)
    if world % (args.hsdp * args.tp * args.ep):
        raise ValueError(f"{world} ranks do not split into --hsdp {args.hsdp} x --tp {args.tp} "
                         f"x --ep {args.ep} x dp")
    axes, par_mesh = model_mesh(args, world)  # the (rep,) dp x tp|ep mesh, or None
    mesh = (args.hsdp, world // args.hsdp) if args.hsdp > 1 else world
    param_dtype = DTYPES[args.param_dtype]
    opt = make_optimizer(args)  # it declares the blocks it needs kept whole on one rank
    init_fn = vfsdp.init.sharded(init_rule(cfg), args.seed)  # a tp/ep piece: the global values
    if args.tp > 1:  # one plan of this tp index's pieces over the data axes
        spec = vfsdp.plan(meta_params(cfg), par_mesh, tp=tp_rule(cfg), tp_axis="tp",
                          granularity=opt.granularity, comm_dtypes=[torch.bfloat16])
        shards = vfsdp.shard(meta_params(cfg), spec, mesh=par_mesh, init_fn=init_fn)
    elif args.ep > 1:  # the rest over every rank, this ep index's experts over "dp"
        rest, experts = split_experts(meta_params(cfg))
        spec = vfsdp.plan(rest, mesh, granularity=opt.granularity, comm_dtypes=[torch.bfloat16])
        shards = vfsdp.shard(rest, spec, init_fn=init_fn)
        e_spec = vfsdp.plan(experts, par_mesh, tp=ep_rule, tp_axis="ep",
                            granularity=opt.granularity, comm_dtypes=[torch.bfloat16])
        e_shards = vfsdp.shard(experts, e_spec, mesh=par_mesh, init_fn=init_fn)
        e_state = opt.init(e_shards, e_spec)
    else:
        spec = vfsdp.plan(meta_params(cfg), mesh, granularity=opt.granularity,
                          comm_dtypes=[torch.bfloat16])
        shards = vfsdp.shard(meta_params(cfg), spec, init_fn=init_fn)
    state = opt.init(shards, spec)
    data_rank = rank // args.tp  # the tp ranks of one data-parallel group: the same batch
    first = 1
    if args.resume:  # any world size, mesh or optimizer plan: the checkpoint reshards
        tree = {"params": shards, "opt": state, "step": 0}
        if args.ep > 1:  # two plans in one checkpoint; each part reshards (another dp or ep)
            loaded = vfsdp.checkpoint.load(args.resume, {
                "rest": (tree, spec),
                "experts": ({"params": e_shards, "opt": e_state}, e_spec, par_mesh)})
            tree, e_state = loaded["rest"], loaded["experts"]["opt"]
        else:
            tree = vfsdp.checkpoint.load(args.resume, tree, spec)
        state, first = tree["opt"], tree["step"] + 1
        if rank == 0:
            print(f"resumed from {args.resume} at step {tree['step']}", file=sys.stderr)
    pending = None
    data = corpus(args.data)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    gopts = {"param_dtype": param_dtype, "reduce_dtype": torch.float32}

    losses, norms, probe, t_start = [], [], GatheredProbe(), time.perf_counter()
    tokens_per_step = world // args.tp * args.batch * args.seq * args.accumulate
    for step in range(first, args.steps + 1):
        micro_batches = [tuple(t.to(device) for t in batch(data, step, data_rank, micro, args))
                         for micro in range(args.accumulate)]
        with probe:
            if args.tp > 1:
                step_loss, norm, state = train_step_tp(shards, spec, par_mesh, opt, state,
                                                       micro_batches, cfg, gopts)
            elif args.ep > 1:
                step_loss, norm, (state, e_state) = train_step_ep(
                    [(shards, spec), (e_shards, e_spec)], par_mesh, opt, [state, e_state],
                    micro_batches, cfg, gopts)
            else:
                step_loss, norm, state = train_step(shards, spec, opt, state, micro_batches,
                                                    cfg, gopts)
        dist.all_reduce(step_loss)
        losses.append(float(step_loss) / world)
        norms.append(float(norm))
        if rank == 0:
            elapsed = time.perf_counter() - t_start
            done = int(30 * step / args.steps)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{args.steps} loss "
                  f"{losses[-1]:.4f} |g| {norms[-1]:.3f} "
                  f"{tokens_per_step * (step - first + 1) / elapsed:,.0f} tok/s",
                  end="", file=sys.stderr, flush=True)
        if args.ckpt and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            # each rank writes its own shards; async: copied now, written while training goes on
            tree = {"params": shards, "opt": state, "step": step}
            if args.ep > 1:  # the rest's plan and the experts' plan as one checkpoint
                tree, spec_or_none = {"rest": (tree, spec), "experts": (
                    {"params": e_shards, "opt": e_state}, e_spec, par_mesh)}, None
            else:
                spec_or_none = spec
            pending = vfsdp.checkpoint.save(os.path.join(args.ckpt, f"step-{step}"), tree,
                                            spec_or_none, overwrite=True,
                                            async_save=args.async_save)
    if pending is not None:
        pending.wait()
    if rank == 0:
        print(file=sys.stderr)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"losses": losses, "grad_norms": norms, "rank": rank,
            "peak_gathered_mib": probe.peak_bytes / 2**20, "peak_rss_mib": rss,
            "mesh": " x ".join(f"{n}={s}" for n, s in axes),
            "seconds": time.perf_counter() - t_start, "tokens": tokens_per_step * (args.steps - first + 1)}


def reference(args, world: int) -> list:
    """The same model, data and optimizer math on one process (the global batch of all ranks)."""
    cfg = config(args)
    params = vfsdp.init.full_tree(init_rule(cfg), meta_params(cfg), args.seed)
    spec = vfsdp.plan(params, 1, granularity=make_optimizer(args).granularity)
    shards_like = params  # plain tensors; the optimizer runs over one-rank flat buffers below
    losses = []

    def body():
        shards = vfsdp.shard(shards_like, spec)
        opt = make_optimizer(args)
        state = opt.init(shards, spec)
        data = corpus(args.data)
        for step in range(1, args.steps + 1):
            vfsdp.zero_grads(shards, spec)
            full = vfsdp.gather(shards, spec, grads="buffer", grad_reduce="sum", accumulate_grads=True)
            total = 0.0
            for r in range(world):
                for micro in range(args.accumulate):
                    tokens, targets = batch(data, step, r, micro, args)
                    loss = loss_fn(full, tokens, targets, cfg) / (world * args.accumulate)
                    loss.backward(retain_graph=True)
                    total += loss.item()
            grads = vfsdp.grads(shards, spec)
            vfsdp.clip_grad_norm(grads, spec, 1.0)
            state = opt.update(grads, state, shards, spec)
            del full, loss  # the retained graph: dropping it lets release free the unit now
            vfsdp.release(shards, spec)
            losses.append(total)
            done = int(30 * step / args.steps)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] reference step {step}/{args.steps} "
                  f"loss {total:.4f}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        return losses

    # One process, one thread: no watchdog (it takes as long as it takes on a busy machine).
    return simulate(1, body, timeout=None)[0]


def plot(path: str, losses: list, ref: list | None, title: str = "") -> None:
    """The loss curve (and the single-process one), with their difference below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if ref is not None else 1
    fig, axes = plt.subplots(rows, 1, figsize=(7, 3 + 2 * rows), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2][:rows]})
    ax = axes[0][0]
    first = len(ref) - len(losses) + 1 if ref is not None else 1  # a resumed run starts later
    steps = range(first, first + len(losses))
    ax.plot(steps, losses, label="vfsdp (sharded)")
    if ref is not None:
        ax.plot(range(1, len(ref) + 1), ref, "--", label="single process")
        diff = axes[1][0]
        diff.plot(steps, [a - b for a, b in zip(losses, ref[first - 1:])], color="C2")
        diff.axhline(0.0, color="grey", linewidth=0.8)
        diff.set_ylabel("sharded - single")
        diff.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--simulate", action="store_true", help="threads in one process, not gloo processes")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=0,
                    help="MoE layers with this many experts (a dense soft mixture; see --top-k)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--param-dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--hsdp", type=int, default=1, help="replicate dim of a (replicate, shard) mesh")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron, x FSDP)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree (x FSDP); needs --experts, routes top-k")
    ap.add_argument("--top-k", type=int, default=None,
                    help="route each token to its top-k experts (default: 2 with --ep, else the "
                         "dense soft mixture)")
    ap.add_argument("--optim", choices=["adamw", "adamw8bit", "muon"], default="adamw")
    ap.add_argument("--data", help="a text file to train on (default: Python's help topics)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/train_gpt.json", help="where to save the loss curve")
    ap.add_argument("--png", help="plot the loss curve against a single-process run")
    ap.add_argument("--ckpt", help="save checkpoints to CKPT/step-N (at the end, and see --save-every)")
    ap.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    ap.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    ap.add_argument("--resume", help="a checkpoint directory to continue from (any world size)")
    args = ap.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.world_size
    for name in ("hsdp", "tp", "ep"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if world % (args.hsdp * args.tp * args.ep):
        ap.error(f"the world size {world} must be a multiple of --hsdp {args.hsdp} x --tp "
                 f"{args.tp} x --ep {args.ep} (the rest is the data-parallel shard dim)")
    if args.tp > 1 and args.ep > 1:
        ap.error("--tp and --ep together (a 3-D dp x tp x ep mesh) are not supported by this "
                 "example; use one of them")
    if args.tp > 1 and (args.heads % args.tp or args.kv_heads % args.tp):
        ap.error(f"--tp {args.tp} splits attention by heads: --heads {args.heads} and --kv-heads "
                 f"{args.kv_heads} must both be multiples of it")
    if args.ep > 1 and (not args.experts or args.experts % args.ep):
        ap.error(f"--ep {args.ep} splits the experts: give --experts E, a multiple of {args.ep} "
                 f"(got {args.experts})")
    if args.top_k is None and args.ep > 1:
        args.top_k = 2
    if args.top_k is not None and not (args.experts and 1 <= args.top_k <= args.experts):
        ap.error(f"--top-k {args.top_k} needs --experts E with 1 <= k <= E "
                 f"(got --experts {args.experts})")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if "RANK" in os.environ:  # under torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        results = [train(args)]
        world = dist.get_world_size()
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        world = args.world_size
        results = simulate(world, train, args) if args.simulate else spawn(train, world, args)
    losses = results[0]["losses"]
    print(f"mesh: {results[0]['mesh']} ({world} ranks)")
    for r in results:
        print(f"rank {r['rank']}: peak RSS {r['peak_rss_mib']:.0f} MiB, peak gathered parameters "
              f"{r['peak_gathered_mib']:.2f} MiB, {r['tokens'] / r['seconds']:,.0f} tok/s")
    if not losses:
        print(f"nothing to do: the checkpoint is at or past step {args.steps}")
        return 0
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    title = (f"{world} ranks ({results[0]['mesh']}), {args.optim}, {args.param_dtype}, "
             f"{args.steps} steps (dim {args.dim}, {args.layers} layers)")
    if args.out:  # saved before the (slow) reference run, so a failure there loses nothing
        save_curve(args.out, args, results[0], None)
        print(f"loss curve saved to {args.out}")
    if args.png:
        plot(args.png, losses, None, title)  # the sharded curve alone first, for the same reason
        print("running the same training in one process for comparison ...", file=sys.stderr)
        ref = reference(args, world // args.tp)  # the data-parallel ranks' batches
        if args.out:
            save_curve(args.out, args, results[0], ref)
        plot(args.png, losses, ref, title)
        gap = max(abs(a - b) for a, b in zip(losses, ref[len(ref) - len(losses):]))
        print(f"max |loss - single-process loss| = {gap:.2e}; plot saved to {args.png}")
    return 0


def save_curve(path: str, args, result: dict, ref: list | None) -> None:
    """The run's arguments, mesh, losses and gradient norms (before clipping), and the
    single-process losses when there are some."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"args": vars(args), "mesh": result["mesh"], "losses": result["losses"],
                   "grad_norms": result["grad_norms"], "reference": ref}, f)


if __name__ == "__main__":
    sys.exit(main())
