"""Scripts that used to crash the process (SIGSEGV): each runs in a subprocess and must exit 0,
printing the Python error it got. ``python crash_scripts.py CASE``."""

import sys

import torch
import torch.distributed as dist

import vfsdp


def _setup():
    spec = vfsdp.plan({"w": torch.ones(8), "v": torch.ones(4, 4)}, dist.get_world_size())
    shards = vfsdp.shard({"w": torch.ones(8), "v": torch.ones(4, 4)}, spec)
    return spec, shards


def read_after_release():
    spec, shards = _setup()
    full = vfsdp.gather(shards, spec, grads="buffer")
    vfsdp.release(shards, spec)
    del shards
    return float(full["v"].sum())


def release_before_backward():
    spec, shards = _setup()
    full = vfsdp.gather(shards, spec)
    loss = (full["v"] @ full["v"]).sum() + full["w"].sum()
    vfsdp.release(shards, spec)
    loss.backward()  # the backward still reads the saved views: kept alive until it is done
    return shards["v"].grad.sum().item()


def saved_tensor_after_free():
    spec, shards = _setup()
    full = vfsdp.gather(shards, spec, free_after_backward=True)
    loss = (full["v"] @ full["v"]).sum()
    loss.backward(retain_graph=True)   # with retain_graph the unit stays gathered ...
    loss.backward()                    # ... so the second backward reads valid memory
    return shards["v"].grad.sum().item()


def grad_after_zero_grads():
    spec, shards = _setup()
    full = vfsdp.gather(shards, spec, grads="buffer")
    full["w"].sum().backward()
    grads = vfsdp.grads(shards, spec)
    vfsdp.zero_grads(shards, spec)
    return float(grads["w"].sum())


def returned_grad_after_zero_grads():
    spec, shards = _setup()
    vfsdp.gather(shards, spec)["w"].sum().backward()
    g = shards["w"].grad
    vfsdp.zero_grads(shards, spec)
    return float(g.sum()), shards["w"].grad


CASES = {f.__name__: f for f in (read_after_release, release_before_backward,
                                 saved_tensor_after_free, grad_after_zero_grads,
                                 returned_grad_after_zero_grads)}


if __name__ == "__main__":
    try:
        print("result", vfsdp.testing.simulate(1, CASES[sys.argv[1]])[0])
    except vfsdp.testing.RankError as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        print("error", last)
