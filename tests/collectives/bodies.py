"""DBuffer test bodies (module-level: they run under simulate and spawn)."""

import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import DBuffer, Role, reduce_scatter_reference, resolve_groups


def _unit_spec(world, mesh=None):
    params = {"layers": [{"w": torch.zeros(5, 3), "b": torch.zeros(4), "e": torch.zeros(0, 3)}]}
    return vfsdp.plan(params, mesh or world, granularity=vfsdp.rows(2))


def group_ops_keep_padding_zero():
    world = dist.get_world_size()
    spec = _unit_spec(world)
    db = DBuffer(spec.units[("layers", 0)], resolve_groups(spec))
    for k in range(len(db)):
        db.local(k).data.fill_(1.0 + k)
    other = db.like()
    other.copy_(db).add_(db)
    cast = db.like(torch.bfloat16, name="bf16")
    cast.copy_(db)
    mask = torch.ones(db.shard.numel(), dtype=torch.bool)
    for t in db.tensors:
        lo, hi = t.shard_range(db.rank)
        mask[lo:hi] = False
    pad_zero = all(not b.shard[mask].any() for b in (db, other, cast))
    values_ok = torch.equal(other.shard, 2 * db.shard) and torch.equal(cast.shard, db.shard.bfloat16())
    db.zero_()
    return pad_zero and values_ok and not db.shard.any()


def release_lets_go_of_memory():
    """The memory rule: a release lets go; views read as released, tensors made from them
    keep the values they were made from, the next gather hands out fresh memory."""
    from vfsdp.collectives.dbuffer import ReleasedTensor

    world = dist.get_world_size()
    spec = _unit_spec(world)
    db = DBuffer(spec.units[("layers", 0)], resolve_groups(spec))
    for k in range(len(db)):
        db.local(k).data.fill_(float(dist.get_rank() + 1))
    assert not db.is_allocated
    try:
        db.full(0)
        return False  # full views of a released buffer must be refused
    except RuntimeError:
        pass
    handle = db.all_gather(async_op=True)
    handle.wait()
    fulls = [db.full(k) for k in range(len(db))]
    first = [f.clone() for f in fulls]
    derived = [f.T if f.dim() == 2 else f[1:] for f in fulls]  # not vfsdp's to change
    db.free_global()
    assert not db.is_allocated and db.global_buffer.untyped_storage().nbytes() == 0
    released = all(type(f) is ReleasedTensor and f.untyped_storage().nbytes() == 0
                   and f.shape == a.shape for f, a in zip(fulls, first))
    kept = all(torch.equal(d, a.T if a.dim() == 2 else a[1:]) for d, a in zip(derived, first))
    db.all_gather()
    again = [db.full(k) for k in range(len(db))]
    return (released and kept and all(torch.equal(a, b) for a, b in zip(first, again))
            and all(type(f) is ReleasedTensor for f in fulls))


def holders(t):
    """How many tensors share ``t``'s storage (``t`` included)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata)) - 1


def release_keeps_no_reference():
    """After a release (and a set_to_none), only the user's own tensors hold the memory: it
    goes when they do, and vfsdp never frees memory under them."""
    import vfsdp

    params = {"w": torch.arange(16.0).view(4, 4)}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    full = vfsdp.gather(shards, spec, grads="buffer")
    t = full["w"].T
    (full["w"] * 2).sum().backward()
    g = vfsdp.grads(shards, spec)["w"]
    piece = g[:1]
    vfsdp.release(shards, spec)
    vfsdp.zero_grads(shards, spec)
    # torch's threaded group keeps each collective's tensors until every rank has finished
    # it (not vfsdp's reference): wait for the other rank first.
    dist.barrier()
    return (holders(t), holders(piece), float(t.sum()), set(piece.flatten().tolist()),
            type(full["w"]).__name__, type(g).__name__)


def reduce_scatter_semantics(op, reduce_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = _unit_spec(world)
    db = DBuffer(spec.units[("layers", 0)], resolve_groups(spec), dtype=torch.bfloat16,
                 role=Role.GRAD)
    gen = torch.Generator().manual_seed(rank)
    src = torch.randn(db.global_buffer.numel(), generator=gen).bfloat16()
    db.reduce_scatter(src, op=op, reduce_dtype=reduce_dtype)
    bufs = [torch.randn(db.global_buffer.numel(), generator=torch.Generator().manual_seed(r))
            .bfloat16().to(reduce_dtype or torch.bfloat16) for r in range(world)]
    want = reduce_scatter_reference(bufs, op)[rank].to(torch.bfloat16)
    acc = db.like(name="acc")
    acc.shard.fill_(1.0)
    acc.reduce_scatter(src, op=op, reduce_dtype=reduce_dtype, accumulate=True)
    tol = 2e-2  # bf16 results: about one ulp at these magnitudes
    return (torch.allclose(db.shard.float(), want.float(), atol=tol, rtol=tol)
            and torch.allclose(acc.shard.float(), want.float() + 1, atol=2 * tol, rtol=tol))


def hsdp_reduce(op):
    rank = dist.get_rank()
    spec = _unit_spec(4, mesh=(2, 2))
    groups = resolve_groups(spec)
    db = DBuffer(spec.units[("layers", 0)], groups, role=Role.GRAD)
    src = torch.full((db.global_buffer.numel(),), float(rank + 1))
    db.reduce_scatter(src, op=op)
    expect = 10.0 if op == "sum" else 2.5  # over all 4 ranks: 1+2+3+4
    return (groups.shard_size, groups.replicate_size, bool(torch.all(db.shard == expect)))


def wrong_world_size():
    spec = _unit_spec(dist.get_world_size() + 1)
    try:
        resolve_groups(spec)
    except ValueError as exc:
        return str(exc)
    return "no error"
