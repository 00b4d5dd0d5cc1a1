"""HostMirror: the reduce transition copies the gradient shard; any later write makes it stale."""

import gc

import torch

import vfsdp
from vfsdp.collectives import HostMirror, slot_of
from vfsdp.testing import simulate


def _setup():
    params = {"w": torch.ones(8), "b": torch.ones(3)}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    unit = slot_of(shards["w"]).unit
    mirror = HostMirror(torch.zeros(unit.layout.shard_numel), None)
    unit.mirror_grads(mirror)
    return spec, shards, unit, mirror


def _backward(shards, spec, scale=3.0, **opts):
    full = vfsdp.gather(shards, spec, grads="buffer", **opts)
    (full["w"] * scale).sum().add(full["b"].sum()).backward()


def lifecycle():
    spec, shards, unit, mirror = _setup()
    seen = []
    _backward(shards, spec)
    seen.append((mirror.current(unit), mirror.host.tolist() == unit.grads().shard.tolist()))
    vfsdp.grads(shards, spec)["b"].add_(1.0)            # a write through a handed-out view
    seen.append(mirror.current(unit))
    _backward(shards, spec, accumulate_grads=True)      # the next reduction: current again
    seen.append((mirror.current(unit), mirror.host.tolist() == unit.grads().shard.tolist()))
    vfsdp.zero_grads(shards, spec)                      # a released shard: stale
    seen.append(mirror.current(unit))
    _backward(shards, spec, async_reduce=True)          # copied when the reduction is done
    vfsdp.grads(shards, spec)
    seen.append((mirror.current(unit), mirror.host.tolist() == unit.grads().shard.tolist()))
    unit.grads().scale_(0.5)                            # a write to the shard itself
    seen.append(mirror.current(unit))
    mirror.forget()
    seen.append(mirror.current(unit))
    copies = mirror.copies
    del mirror
    gc.collect()                                        # held weakly: it goes with its owner
    _backward(shards, spec, accumulate_grads=True)
    seen.append((unit.grad_mirror is None, copies, "mirrored" in repr(unit)))
    return seen


def test_the_mirror_follows_reductions_and_goes_stale_on_any_later_write():
    for world in simulate(2, lifecycle):
        assert world == [(True, True), False, (True, True), False, (True, True), False, False,
                         (True, 3, False)]
