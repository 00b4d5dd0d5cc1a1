"""Hypothesis strategies for property-testing sharding code: trees, meshes, granularities, plans.

Needs ``hypothesis`` (``pip install 'vfsdp[dev]'``); ``import vfsdp`` does not import this
module. Every strategy covers the edge cases plans must survive: 0-size and 0-d tensors, odd
and prime sizes, world sizes larger than a tensor, prime world sizes and HSDP meshes, and a
different dtype per unit. A property test a user can copy::

    from hypothesis import given, settings
    from optree import tree_leaves
    import torch, vfsdp
    from vfsdp.testing import strategies as vst

    @settings(max_examples=20, deadline=None)
    @given(vst.plans())
    def test_scatter_then_gather_is_the_identity(case):
        params, spec = case

        def body():
            full = vfsdp.gather(vfsdp.scatter(params, spec, src=None), spec)
            return all(torch.equal(a.detach(), b) if isinstance(b, torch.Tensor) else a == b
                       for a, b in zip(tree_leaves(full), tree_leaves(params)))

        assert all(vfsdp.testing.simulate(vst.ranks(spec), body))
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any, Optional

import torch

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("vfsdp.testing.strategies needs hypothesis: pip install 'vfsdp[dev]'"
                      ) from exc

from vfsdp.placements import RaggedShard
from vfsdp.planner import ShardSpec, plan, rows, whole

__all__ = ["shapes", "world_sizes", "meshes", "granularities", "dtypes", "param_trees", "plans",
           "compositions", "ragged_cases", "ranks", "DTYPES", "PRIMES"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
PRIMES = (2, 3, 5, 7, 11, 13, 17)


def ranks(spec: ShardSpec) -> int:
    """The number of ranks a spec runs on (``simulate(ranks(spec), ...)``)."""
    return spec.world_size * spec.replicas


@st.composite
def shapes(draw, max_dims: int = 3, max_side: int = 6) -> tuple:
    """Shapes with 0..``max_dims`` dims and sides 0..``max_side`` (0-size, 0-d, 1-element)."""
    ndim = draw(st.integers(0, max_dims))
    return tuple(draw(st.integers(0, max_side)) for _ in range(ndim))


def world_sizes(max_size: int = 17) -> st.SearchStrategy:
    """Shard-group sizes 1..``max_size`` (primes included), shrinking towards 1."""
    return st.integers(1, max_size)


@st.composite
def meshes(draw, max_ranks: int = 8, hsdp: bool = True) -> Any:
    """An int world size, or (with ``hsdp``) a ``(replicate, shard)`` tuple, with at most
    ``max_ranks`` ranks in all; primes and axes of size 1 included."""
    if hsdp and max_ranks >= 2 and draw(st.booleans()):
        r = draw(st.integers(1, max_ranks))
        m = draw(st.integers(1, max(1, max_ranks // r)))
        return (r, m)
    return draw(st.integers(1, max_ranks))


def granularities() -> st.SearchStrategy:
    """Element, ``rows(k)`` for k in 1..4, ``whole``, and a per-tensor mix of those."""
    fixed = st.sampled_from([None, rows(1), rows(2), rows(3), rows(4), whole])

    @st.composite
    def mixed(draw):
        table = draw(st.lists(st.sampled_from([None, rows(1), rows(2), whole]), min_size=1,
                              max_size=4))
        # a hash that is the same in every process (str hashes are salted per process)
        return lambda path, tensor: table[zlib.crc32(repr(tuple(path)).encode()) % len(table)]

    return st.one_of(fixed, mixed())


def dtypes(choices: Sequence[torch.dtype] = DTYPES) -> st.SearchStrategy:
    """One of ``choices``."""
    return st.sampled_from(list(choices))


@st.composite
def param_trees(draw, max_layers: int = 3, max_tensors: int = 3, max_side: int = 6,
                dtype_choices: Sequence[torch.dtype] = DTYPES, meta: bool = False) -> dict:
    """``{"layers": [{"t0": ..., ...}, ...], "root": {...}, "note": str}``.

    Each layer is a unit under the planner's default rule and ``root`` the root unit; each
    unit draws its own dtype. Values are deterministic (``arange`` scaled per tensor), or
    ``meta`` tensors with ``meta=True``. At least one tensor is present.
    """
    counter = [0]

    def tensor(shape, dtype):
        counter[0] += 1
        n = math.prod(shape)
        if meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        values = (torch.arange(n, dtype=torch.float64) * 0.25  # cpu: test data
                   + counter[0]).reshape(shape)
        return values.to(dtype)

    layers = []
    for _ in range(draw(st.integers(0, max_layers))):
        dtype = draw(dtypes(dtype_choices))
        layers.append({f"t{j}": tensor(draw(shapes(2, max_side)), dtype)
                       for j in range(draw(st.integers(1, max_tensors)))})
    dtype = draw(dtypes(dtype_choices))
    root = {f"r{j}": tensor(draw(shapes(3, max_side)), dtype)
            for j in range(draw(st.integers(0 if layers else 1, max_tensors)))}
    return {"layers": layers, "root": root, "note": "passes through"}


@st.composite
def plans(draw, trees: Optional[st.SearchStrategy] = None, mesh: Optional[st.SearchStrategy] = None,
          granularity: Optional[st.SearchStrategy] = None) -> tuple:
    """``(params, spec)``: a drawn tree planned for a drawn mesh and granularity."""
    params = draw(trees if trees is not None else param_trees())
    spec = plan(params, draw(mesh if mesh is not None else meshes()),
                granularity=draw(granularity if granularity is not None else granularities()))
    return params, spec


@st.composite
def compositions(draw, total: int, parts: int) -> tuple:
    """``parts`` non-negative ints summing to ``total`` (zeros allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return tuple(bounds[i + 1] - bounds[i] for i in range(parts))


@st.composite
def ragged_cases(draw, max_world: int = 17) -> tuple:
    """``(shape, RaggedShard)`` pairs that form valid placements (world sizes up to
    ``max_world`` and 64)."""
    shape = draw(shapes())
    m = draw(st.one_of(st.integers(1, max_world), st.just(64)))
    d = draw(st.integers(0, len(shape)))
    lead = math.prod(shape[:d])
    if math.prod(shape) == 0:
        units = (0,) * m
    else:
        divisors = [k for k in range(1, lead + 1) if lead % k == 0]
        units = draw(compositions(draw(st.sampled_from(divisors)), m))
    return shape, RaggedShard(tuple(range(d)), units)
