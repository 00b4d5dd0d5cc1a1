"""HostMirror: the reduce transition copies the gradient shard; its fingerprint tells any
later write, whether or not a version counter sees it."""

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from vfsdp.collectives import HostMirror, slot_of
from vfsdp.collectives.mirror import fingerprint
from vfsdp.testing import simulate, spawn


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


def _same(mirror, unit):
    """Whether the host copy holds what the gradient shard holds now (by fingerprint)."""
    shard = unit.grads().shard
    mirror.wait()
    return mirror.holds and fingerprint(shard).tolist() == mirror.seen.tolist()


def lifecycle():
    spec, shards, unit, mirror = _setup()
    seen = []
    _backward(shards, spec)
    seen.append((_same(mirror, unit), mirror.host.tolist() == unit.grads().shard.tolist()))
    vfsdp.grads(shards, spec)["w"].add_(1.0)            # a write through a handed-out view
    seen.append(_same(mirror, unit))
    _backward(shards, spec, accumulate_grads=True)      # the next reduction: the same again
    seen.append(_same(mirror, unit))
    vfsdp.grads(shards, spec)["w"].data.mul_(0.5)       # no version counter sees .data
    seen.append(_same(mirror, unit))
    _backward(shards, spec, async_reduce=True, accumulate_grads=True)  # copied when done
    vfsdp.grads(shards, spec)
    seen.append(_same(mirror, unit))
    torch.distributed.all_reduce(unit.grads().shard)    # a collective, in place
    seen.append(_same(mirror, unit))
    mirror.forget()
    seen.append(_same(mirror, unit))
    copies = mirror.copies
    del mirror
    gc.collect()                                        # held weakly: it goes with its owner
    _backward(shards, spec, accumulate_grads=True)
    seen.append((unit.grad_mirror is None, copies, "mirrored" in repr(unit)))
    return seen


@pytest.mark.parametrize("run", [simulate, spawn])
def test_the_mirror_follows_reductions_and_tells_any_later_write(run):
    for world in (run(lifecycle, 2) if run is spawn else run(2, lifecycle)):
        assert world == [(True, True), False, True, False, True, False, False, (True, 3, False)]


def _reference(x: torch.Tensor) -> list:
    """The fingerprint by a loop over the bytes: 32-bit lanes, then the partial tail."""
    data = bytes(x.reshape(-1).view(torch.uint8).tolist()) if x.numel() else b""
    words = len(data) // 8 * 8
    lanes = [int.from_bytes(data[i:i + 4], "little") for i in range(0, words, 4)]
    high = [v for k, v in enumerate(lanes) if k % 2]
    tail = list(data[words:])
    linear = sum(lanes) + sum(tail)
    square = sum(v * v for v in lanes) + 2 * sum(v * v for v in high) + sum(t * t for t in tail)
    wrap = lambda v: (v + 2**63) % 2**64 - 2**63
    return [wrap(linear), wrap(square)]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64,
                        torch.int8]),
       st.integers(0, 40), st.integers(0, 7), st.integers(0, 2**31 - 1))
def test_fingerprint_is_the_lane_sums_and_tells_bit_flips_and_sign_changes(dtype, n, skip,
                                                                         seed):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n + skip, generator=g) * 100).to(dtype)
    x = base[skip:]                                     # any start in its storage
    assert fingerprint(x).tolist() == _reference(x)
    assert fingerprint(x).tolist() == fingerprint(x.clone()).tolist()  # alignment aside
    if n:
        y = x.clone()
        y.view(torch.uint8)[seed % (n * x.element_size())] ^= 1 << (seed % 8)  # one bit
        assert fingerprint(y).tolist() != fingerprint(x).tolist()
    if dtype.is_floating_point and bool((x != 0).any()):
        assert fingerprint(-x).tolist() != fingerprint(x).tolist()  # signs both ways


def test_fingerprint_tells_sign_changes_a_plain_sum_cancels():
    a = torch.tensor([1.0, 1.0, 1.0, 1.0])
    assert fingerprint(a).tolist() != fingerprint(a * torch.tensor([1, -1, 1, -1])).tolist()
    b = torch.tensor([1.0, 2.0, -1.0, 3.0])
    assert fingerprint(b).tolist() != fingerprint(b.neg()).tolist()


def test_fingerprint_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="not contiguous"):
        fingerprint(torch.ones(4, 4).t())
