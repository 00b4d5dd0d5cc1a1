"""SPMD test bodies: module-level so they run under both simulate (threads) and spawn (processes).

Each body builds its inputs deterministically from a seed, runs on every rank, and returns
plain data (lists, floats, bools) that the test compares against the reference semantics.
"""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import counts, reset_counts
from vfsdp.functional import dbuffers, shard_reference
from vfsdp.testing import CopyCounter


def make_params(seed: int, shapes, dtype=torch.float32):
    """``{"layers": [{"t0": ..., ...}, ...], "root": ...}`` from a list of per-layer shape lists."""
    g = torch.Generator().manual_seed(seed)
    layers = [{f"t{j}": torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
               for j, s in enumerate(layer)} for layer in shapes["layers"]]
    root = {f"r{j}": torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
            for j, s in enumerate(shapes["root"])}
    return {"layers": layers, "root": root, "static": "passes-through"}


def roundtrip(seed, shapes, gran, mesh_shape=None):
    """gather(shard(x)) == x bitwise; local shards equal the reference split; zero copies."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = make_params(seed, shapes)
    spec = vfsdp.plan(params, mesh_shape or world, granularity=gran)
    shards = vfsdp.shard(params, spec)
    expect = shard_reference(params, spec)[rank % spec.world_size]
    for a, b in zip(optree.tree_leaves(shards), optree.tree_leaves(expect)):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and torch.equal(a.detach(), b), "local shard differs"
    reset_counts()
    with CopyCounter() as c:
        full = vfsdp.gather(shards, spec)
    n_units = len(spec.units)
    assert counts()["all_gather"] == n_units, (counts(), n_units)
    assert c.copies == 0, c.ops
    ok = all(torch.equal(a.detach(), b) if isinstance(a, torch.Tensor) else a == b
             for a, b in zip(optree.tree_leaves(full), optree.tree_leaves(params)))
    # zero-copy addresses: full views sit at their planned offsets, local pieces in the shard
    for _key, db in dbuffers(shards, spec).items():
        base = db.global_buffer.data_ptr()
        size = db.global_buffer.element_size()
        for k, t in enumerate(db.tensors):
            if not t.numel:
                continue  # a 0-size tensor has no address to check
            assert db.full(k).data_ptr() == base + t.offset * size
            lo, hi = t.shard_range(db.rank)
            if hi > lo:
                assert db.local(k).data_ptr() == db.shard.data_ptr() + lo * size
    for leaf, t in zip(optree.tree_leaves(full), spec.leaves()):
        if isinstance(t, vfsdp.TensorSpec) and t.numel:
            db = dbuffers(shards, spec)[t.unit]
            assert leaf.data_ptr() == db.global_buffer.data_ptr() + t.offset * leaf.element_size()
    vfsdp.release(shards, spec)
    return ok


def loss_of(full, x):
    """A scalar that touches every tensor in a rank-dependent way."""
    total = torch.zeros((), dtype=torch.float64)
    for j, t in enumerate(optree.tree_leaves(full)):
        if isinstance(t, torch.Tensor) and t.numel():
            w = torch.linspace(-1, 1, t.numel(), dtype=torch.float64).reshape(t.shape)
            total = total + ((t.double() * w + x) ** 2).sum() * (1 + 0.1 * j)
    return total


def gradients(seed, shapes, gran, op, mode, mesh_shape=None):
    """Per-rank gradient pieces from backward / autograd.grad / torch.func.grad."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = make_params(seed, shapes)
    spec = vfsdp.plan(params, mesh_shape or world, granularity=gran)
    shards = vfsdp.shard(params, spec)
    x = 0.5 + rank
    tensors = [t for t in optree.tree_leaves(shards) if isinstance(t, torch.Tensor)]
    if mode == "backward":
        loss_of(vfsdp.gather(shards, spec, grad_reduce=op), x).backward()
        grads = [t.grad for t in tensors]
    elif mode == "autograd":
        grads = torch.autograd.grad(loss_of(vfsdp.gather(shards, spec, grad_reduce=op), x), tensors,
                                    allow_unused=True)
    else:  # torch.func.grad over the tensor-only subtrees
        sub = {"layers": shards["layers"], "root": shards["root"]}
        sub_spec_tree = {"layers": spec.tree["layers"], "root": spec.tree["root"]}
        full_spec = vfsdp.ShardSpec(optree.tree_structure(sub), optree.tree_leaves(sub_spec_tree),
                                    dict(spec.units), spec.mesh_shape, spec.mesh_dim_names)

        def f(s):
            return loss_of(vfsdp.gather(s, full_spec, grad_reduce=op), x)

        g = torch.func.grad(f)(sub)
        grads = optree.tree_leaves(g)
    return [None if g is None else g.detach().reshape(-1).tolist() for g in grads]


def reference_gradients(seed, shapes, world, op):
    """Sum or mean over ranks of single-process gradients, as full flat lists per tensor."""
    total = None
    for rank in range(world):
        params = make_params(seed, shapes)
        tensors = [t for t in optree.tree_leaves(params) if isinstance(t, torch.Tensor)]
        for t in tensors:
            t.requires_grad_(True)
        grads = torch.autograd.grad(loss_of(params, 0.5 + rank), tensors, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    if op == "avg":
        total = [t / world for t in total]
    return [t.reshape(-1) for t in total]


def shard_modes(seed, shapes, gran, mode, mesh_shape=None):
    """shard() from full tensors everywhere, from rank 0 only, or from an init function."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = make_params(seed, shapes)
    spec = vfsdp.plan(params, mesh_shape or world, granularity=gran)
    rank = rank % spec.world_size  # the rank within the shard group
    if mode == "everywhere":
        shards = vfsdp.shard(params, spec)
    elif mode == "src0":
        given = params if rank == 0 else optree.tree_map(
            lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, params)
        reset_counts()
        shards = vfsdp.shard(given, spec, src=0)
        if dist.get_rank() < spec.world_size:  # replica 0 scatters; the others receive broadcasts
            assert counts()["scatter"] == len(spec.units)
        if spec.replicas > 1:
            assert counts()["broadcast"] == len(spec.units)
    else:
        flat = {t.path: leaf for t, leaf in zip(spec.leaves(), optree.tree_leaves(params))
                if isinstance(t, vfsdp.TensorSpec)}

        def init(path, local, tspec):
            lo, hi = tspec.local_range(rank)
            local.copy_(flat[path].reshape(-1)[lo:hi].reshape(local.shape))

        meta = optree.tree_map(
            lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, params)
        shards = vfsdp.shard(meta, spec, init_fn=init)
    full = vfsdp.gather(shards, spec)
    return all(torch.equal(a.detach(), b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(optree.tree_leaves(full), optree.tree_leaves(params)))


def async_and_twice(seed, shapes):
    """gather_async equals gather; a second gather without release is allowed."""
    world = dist.get_world_size()
    params = make_params(seed, shapes)
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    handle = vfsdp.gather_async(shards["layers"][0], spec["layers"][0])
    rest = vfsdp.gather(shards["root"], spec["root"])
    first = handle.wait()
    again = vfsdp.gather(shards["layers"][0], spec["layers"][0])
    ok = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(first), optree.tree_leaves(again)))
    ok &= all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(first),
                                               optree.tree_leaves(params["layers"][0])))
    ok &= all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(rest),
                                               optree.tree_leaves(params["root"])))
    return ok


def hsdp_gradients(seed, shapes, mesh_shape, op):
    """Gradient pieces under an explicit (replicate, shard) plan, as flat lists."""
    return gradients(seed, shapes, None, op, "autograd", mesh_shape=mesh_shape)


def copies_on_grad_path(seed, shapes):
    """Bytes copied outside the collectives by the gradient path, and the tensors' bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = make_params(seed, shapes)
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    tensors = [t for t in optree.tree_leaves(shards) if isinstance(t, torch.Tensor)]
    full = vfsdp.gather(shards, spec)
    # a float32 loss, so autograd itself casts nothing: every copy counted below is vfsdp's
    loss = sum(((t * (1.0 + rank)) ** 2).sum() for t in optree.tree_leaves(full)
               if isinstance(t, torch.Tensor))
    reset_counts()
    with CopyCounter() as c:
        torch.autograd.grad(loss, tensors)
    nbytes = sum(t.numel * 4 for t in spec.tensors())  # float32 tensors
    return c.copies, c.copy_bytes, nbytes, counts()["reduce_scatter"], len(spec.units)


def explicit_reduce_scatter(seed, shapes, op):
    rank, world = dist.get_rank(), dist.get_world_size()
    params = make_params(seed, shapes)
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    grads = optree.tree_map(lambda t: t * (rank + 1) if isinstance(t, torch.Tensor) else None, params)
    out = vfsdp.reduce_scatter(grads, spec, shards=shards, grad_reduce=op)
    factor = sum(r + 1 for r in range(world)) / (world if op == "avg" else 1)
    expect = shard_reference(optree.tree_map(
        lambda t: t * factor if isinstance(t, torch.Tensor) else t, params), spec)[rank]
    return all(torch.allclose(a, b) for a, b in zip(optree.tree_leaves(out), optree.tree_leaves(expect))
               if isinstance(a, torch.Tensor))


def flat_index(spec, tensors_full_lists, rank):
    """Slice full flat gradients to what ``rank`` holds, in spec tensor order."""
    out = []
    for t, full in zip([t for t in spec.leaves() if isinstance(t, vfsdp.TensorSpec)], tensors_full_lists):
        lo, hi = t.local_range(rank % spec.world_size)
        out.append(full[lo:hi])
    return out



def error_messages():
    """Bad inputs to shard/gather/reduce_scatter: every message names the path and the fix."""
    world = dist.get_world_size()
    params = make_params(0, {"layers": [[(4, 3)]], "root": [(5,)]})
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    msgs = {}

    def catch(name, fn):
        try:
            fn()
            msgs[name] = "no error"
        except (ValueError, TypeError) as exc:
            msgs[name] = str(exc)

    catch("structure", lambda: vfsdp.gather({"layers": shards["layers"]}, spec))
    bad_shape = dict(params, root={"r0": torch.zeros(6)})
    catch("shape", lambda: vfsdp.shard(bad_shape, spec))
    bad_dtype = dict(params, root={"r0": torch.zeros(5, dtype=torch.float64)})
    catch("dtype", lambda: vfsdp.shard(bad_dtype, spec))
    other = vfsdp.plan(params, world, granularity=vfsdp.whole, alignment_bytes=64)
    catch("other_spec", lambda: vfsdp.gather(shards, other))
    wrong_local = dict(shards, root={"r0": torch.zeros(99)})
    catch("local_shape", lambda: vfsdp.gather(wrong_local, spec))
    catch("op", lambda: vfsdp.gather(shards, spec, grad_reduce="max"))
    catch("src", lambda: vfsdp.shard(params, spec, src=world + 3))
    catch("not_tensor", lambda: vfsdp.gather(dict(shards, root={"r0": "x"}), spec))
    return msgs
