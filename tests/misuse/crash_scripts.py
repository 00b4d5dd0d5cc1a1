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


def derived_views_after_release():
    """Views made from gathered tensors (x.T, .view, slices, .detach) keep the memory they
    were made from, as torch views do: a release lets go of it, a gather gets fresh memory."""
    spec, shards = _setup()
    full = vfsdp.gather(shards, spec)
    kept = [full["v"].T, full["v"].view(-1), full["v"][1:], full["v"].detach()]
    (full["v"] ** 2).sum().backward()
    vfsdp.release(shards, spec)
    junk = [torch.full((4, 4), 7.0) for _ in range(8)]  # would reuse freed memory
    del junk
    with torch.no_grad():
        before = [float(t.sum()) for t in kept]
        vfsdp.release(shards, spec)
        shards["v"].mul_(2.0)
        vfsdp.gather(shards, spec)   # fresh memory: the kept tensors still read the old values
        return before, [float(t.sum()) for t in kept]


def derived_grad_view_after_zero_grads():
    spec, shards = _setup()
    full = vfsdp.gather(shards, spec, grads="buffer")
    (3 * full["w"].sum()).backward()
    flat = vfsdp.grads(shards, spec)["w"].view(-1)
    vfsdp.zero_grads(shards, spec)
    before = float(flat.sum())
    full = vfsdp.gather(shards, spec, grads="buffer")
    full["w"].sum().backward()  # fresh gradient memory: the kept tensor reads the old one
    return before, float(flat.sum()), float(vfsdp.grads(shards, spec)["w"].sum())


def gathered_twice_freed_after_backward():
    """Two micro-batches' forwards over the same unit, each freed after its backward."""
    spec, shards = _setup()
    f1 = vfsdp.gather(shards, spec, free_after_backward=True)
    l1 = (f1["w"] ** 2).sum()
    f2 = vfsdp.gather(shards, spec, free_after_backward=True)
    l2 = (f2["w"] ** 3).sum()
    l1.backward()
    still = float(f2["w"].detach().sum())  # the second forward's tensors are still readable
    l2.backward()
    return still, shards["w"].grad.sum().item(), type(f1["w"]).__name__


def state_views_after_export():
    """Optimizer states' full tensors a checkpoint stream handed out, kept after it."""
    from vfsdp.checkpoint.export import entries_and_names, stream_full

    spec, shards = _setup()
    state = vfsdp.optim.adamw().init(shards, spec)
    entries, _ = entries_and_names({"params": shards, "opt": state}, spec, None, "export")
    kept = [v for _, v in stream_full(entries) if isinstance(v, torch.Tensor)]
    return [float(v.sum()) for v in kept]


def update_with_grads_from_before_zero_grads():
    spec, shards = _setup()
    opt = vfsdp.optim.adamw()
    state = opt.init(shards, spec)
    g = vfsdp.grads(shards, spec)
    vfsdp.zero_grads(shards, spec)
    opt.update(g, state, shards, spec)


CASES = {f.__name__: f for f in (read_after_release, release_before_backward,
                                 saved_tensor_after_free, grad_after_zero_grads,
                                 returned_grad_after_zero_grads, derived_views_after_release,
                                 derived_grad_view_after_zero_grads,
                                 gathered_twice_freed_after_backward, state_views_after_export,
                                 update_with_grads_from_before_zero_grads)}


if __name__ == "__main__":
    try:
        print("result", vfsdp.testing.simulate(1, CASES[sys.argv[1]])[0])
    except vfsdp.testing.RankError as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        print("error", last)
