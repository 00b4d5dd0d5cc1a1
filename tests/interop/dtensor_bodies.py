"""Rank bodies for DTensor interop."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import vfsdp
import vfsdp.checkpoint as ckpt
from vfsdp.collectives.comm import default_mesh

EVEN = {"a": torch.arange(32.0).reshape(8, 4)}   # S is whole, aligned rows: Shard(0)
RAGGED = {"layers": [{"w": torch.arange(15.0).reshape(5, 3), "v": torch.arange(7.0) - 3}
                     for _ in range(2)], "s": torch.tensor(2.5)}


def even_views(mesh_shape=None):
    world = dist.get_world_size()
    spec = vfsdp.plan({"a": EVEN["a"]}, mesh_shape or world, granularity=vfsdp.rows(1))
    shards = vfsdp.shard({"a": EVEN["a"]}, spec)
    dts = vfsdp.to_dtensor(shards, spec)
    dt = dts["a"]
    zero_copy = dt.to_local().data_ptr() == shards["a"].data_ptr()
    with torch.no_grad():
        shards["a"].add_(1)   # the DTensor sees it: same memory
    full = dt.full_tensor()
    return list(dt.placements), zero_copy, torch.equal(full, EVEN["a"] + 1)


def ragged(mode):
    world = dist.get_world_size()
    spec = vfsdp.plan(RAGGED, world)
    shards = vfsdp.shard(RAGGED, spec)
    try:
        dts = vfsdp.to_dtensor(shards, spec, ragged=mode)
    except ValueError as exc:
        return str(exc)
    out = {}
    for key, dt in [("w0", dts["layers"][0]["w"]), ("v1", dts["layers"][1]["v"]), ("s", dts["s"])]:
        out[key] = dt.full_tensor() if isinstance(dt, DTensor) else ("local", tuple(dt.shape))
    return out


def roundtrip_other_plan():
    """to_dtensor (redistributed) then from_dtensor under another plan: same tensors."""
    world = dist.get_world_size()
    spec = vfsdp.plan(RAGGED, world)
    dts = vfsdp.to_dtensor(vfsdp.shard(RAGGED, spec), spec, ragged="redistribute")
    other = vfsdp.plan(RAGGED, world, granularity=vfsdp.whole, units=1)
    shards = vfsdp.from_dtensor(dts, other)
    full = vfsdp.gather(shards, other)
    ok = all(torch.equal(full["layers"][i][k], RAGGED["layers"][i][k])
             for i in range(2) for k in ("w", "v")) and torch.equal(full["s"], RAGGED["s"])
    return ok and shards["layers"][0]["w"].requires_grad


def from_full_and_bad_placement():
    world = dist.get_world_size()
    spec = vfsdp.plan(RAGGED, world)
    shards = vfsdp.from_dtensor(RAGGED, spec)  # plain full tensors: replicated
    full = vfsdp.gather(shards, spec)
    ok = torch.equal(full["layers"][1]["w"], RAGGED["layers"][1]["w"])
    mesh = default_mesh(spec)
    bad = dict(RAGGED, s=RAGGED["s"])
    bad["layers"] = [dict(p) for p in RAGGED["layers"]]
    bad["layers"][0]["w"] = distribute_tensor(RAGGED["layers"][0]["w"], mesh, [Shard(1)])
    try:
        vfsdp.from_dtensor(bad, spec)
    except ValueError as exc:
        return ok, str(exc)
    return ok, "accepted"


def plain_dcp_reads_vfsdp_checkpoint(path):
    """A vfsdp checkpoint of ragged shards loads with plain DCP into even Shard(0) DTensors."""
    world = dist.get_world_size()
    spec = vfsdp.plan(RAGGED, world)
    ckpt.save(path, {"p": vfsdp.shard(RAGGED, spec)}, spec)
    mesh = default_mesh(spec)
    target = {"p.layers.1.w": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]),
              "p.layers.0.v": distribute_tensor(torch.zeros(7), mesh, [Shard(0)])}
    dcp.load(target, checkpoint_id=path)
    return (torch.equal(target["p.layers.1.w"].full_tensor(), RAGGED["layers"][1]["w"])
            and torch.equal(target["p.layers.0.v"].full_tensor(), RAGGED["layers"][0]["v"]))
