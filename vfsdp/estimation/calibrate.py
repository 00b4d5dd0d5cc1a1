"""``calibrate``: measure this machine's rates with the collectives vfsdp uses, as a profile.

Run collectively on every rank of a process group (``python -m vfsdp calibrate --world-size
W`` starts W gloo processes; under torchrun, NCCL on GPUs). It times:

* vfsdp's all-gather (``vfsdp.collectives.comm.all_gather_into``) at two sizes, and fits the
  ring's latency per step and bandwidth per rank (``t = (W - 1) * (latency + bytes / bw)``);
* the compute rate: forward and backward of the layer it is given (the command line gives the
  example model's block, :func:`vfsdp.testing.models.example_layer`) on every rank at once,
  over the FLOPs torch's flop counter counts for it;
* the memory bandwidth: an in-place add over a large tensor;
* the host's own work per unit and per tensor of a step (vfsdp's bookkeeping, launches): steps
  of tiny units of 1 and 8 tensors, which have next to no compute or bytes.

The profile has its efficiencies 1.0 and no contention (its rates are achieved
ones), one node of W devices, and the measured figures in ``source``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from vfsdp.collectives.comm import all_gather_into, device_for
from vfsdp.estimation.checks import count
from vfsdp.estimation.costs import layer_cost
from vfsdp.estimation.hardware import Hardware

__all__ = ["calibrate"]


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the device's work, not only its launch
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first is a warm-up


def _host_overhead(repeats: int, tensors: int, device: torch.device, world: int) -> float:
    """Host seconds per step of 4 tiny units of ``tensors`` tensors each (gather, backward,
    reduce, AdamW update), per unit: almost no compute or bytes, so it is bookkeeping."""
    import vfsdp

    params = {"layers": [{f"w{i}": torch.ones(4, 4, device=device) for i in range(tensors)}
                         for _ in range(4)]}
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.adamw()
    box = [opt.init(shards, spec)]

    def layer(p, x):
        return functools.reduce(torch.matmul, p.values(), x)

    def step() -> None:
        h = vfsdp.run_layers(layer, shards["layers"], spec["layers"],
                             torch.ones(2, 4, device=device))
        h.sum().backward()
        box[0] = opt.update(vfsdp.grads(shards, spec), box[0], shards, spec)
        vfsdp.zero_grads(shards, spec)

    return _median_time(step, repeats) / len(spec.units)


def calibrate(layer: tuple, sizes: tuple = (2**12, 2**24),
              repeats: int = 21, name: str = "calibrated") -> Hardware:
    """Collective: measure this machine (see the module docstring).

    Args:
        layer: ``(fn, params, inputs)`` whose forward and backward give the compute rate,
            e.g. :func:`vfsdp.testing.models.example_layer`.
        sizes: Two per-rank all-gather sizes in bytes (small: latency; large: bandwidth).
        repeats: Timed repetitions of each (medians; 21 keeps a 2-core machine's noise to a
            few percent, where 7 moved the compute rate by up to 40 % from run to run).
        name: The profile's name.

    Returns:
        The :class:`Hardware` profile (write it with ``to_json``).

    Raises:
        ValueError: ``sizes`` are not two increasing sizes, or ``repeats`` is not an int
            >= 1.

    Example:
        >>> from vfsdp.testing.models import example_layer
        >>> def body():
        ...     return calibrate(example_layer(), repeats=1).gpus_per_node
        >>> vfsdp.testing.simulate(2, body)
        [2, 2]
    """
    count("calibrate", "repeats", repeats)
    if len(sizes) != 2 or not 0 < sizes[0] < sizes[1]:
        raise ValueError(f"calibrate: sizes must be two increasing byte counts, got {sizes!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = device_for()  # where vfsdp's buffers go: CUDA under NCCL, else the CPU
    fits = [_median_time(functools.partial(all_gather_into, torch.empty(world * (size // 4), device=device),
                                           torch.ones(size // 4, device=device)), repeats) / max(world - 1, 1)
            for size in sizes]
    if fits[1] > fits[0]:
        bw = (sizes[1] - sizes[0]) / (fits[1] - fits[0])
        latency = max(fits[0] - sizes[0] / bw, 1e-7)
    else:  # noise swamped the small one: all of the large one's time is bandwidth
        bw, latency = sizes[1] / fits[1], 1e-7
    fn, params, inputs = layer
    flops = layer_cost(fn, params, *inputs).flops
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    rate = flops / _median_time(lambda: fn(live, *inputs).float().sum().backward(), repeats)
    big = torch.zeros(2**23, device=device)
    mem_bw = 2 * big.numel() * 4 / _median_time(lambda: big.add_(1.0), repeats)  # r + w
    one, eight = (_host_overhead(repeats, n, device, world) for n in (1, 8))
    per_tensor = max((eight - one) / 7, 0.0)
    overhead = max(one - per_tensor, 0.0)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(world, 1)  # the host's, shared
    return Hardware(name, rate, memory, mem_bw, world, bw, latency, bw, latency,
                    compute_efficiency=1.0, comm_efficiency=1.0, attention_efficiency=1.0,
                    float8_efficiency=1.0, unit_overhead=overhead, tensor_overhead=per_tensor,
                    source=f"measured by vfsdp calibrate on {world} rank(s): all-gather "
                           f"{bw / 1e9:.3f} GB/s per rank, {latency * 1e6:.1f} us per ring "
                           f"step; {rate / 1e9:.2f} GFLOP/s on the layer; memory "
                           f"{mem_bw / 1e9:.2f} GB/s; host work per step {overhead * 1e3:.2f} "
                           f"ms per unit and {per_tensor * 1e3:.3f} ms per tensor")
