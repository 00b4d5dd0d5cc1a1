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

Reproducing a falsifying example: print ``spec.recipe()`` in the property; it is the
``vfsdp.plan(...)`` call (the tree as ``ShapeDtype`` leaves, each tensor's block and unit, the
mesh) that rebuilds the spec hypothesis shrank to, which its table alone does not say.

Discard rate: hypothesis discards a few draws of these strategies itself (draws that run past
their data; the test never sees them): about 13 % of ``plans()``, 9 % of ``param_trees()``,
6 % of ``ragged_cases()``, under 3 % of ``shapes()``/``granularities()``, measured by
``python benchmarks/strategy_discards.py --examples 1000``.
"""

from __future__ import annotations

import itertools
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
"""The dtypes the strategies draw parameters in."""
PRIMES = (2, 3, 5, 7, 11, 13, 17)
"""Prime world sizes the strategies favour (no shard size divides evenly)."""


def ranks(spec: ShardSpec) -> int:
    """The number of ranks a spec runs on (``simulate(ranks(spec), ...)``).

    Args:
        spec: A plan, e.g. the second item a :func:`plans` case holds.

    Returns:
        The shard-group size times the replicas (HSDP): ``spec.world_size * spec.replicas``.

    Raises:
        AttributeError: ``spec`` is not a :class:`vfsdp.ShardSpec`.

    Example:
        >>> ranks(vfsdp.plan({"w": torch.ones(8)}, 4))
        4
        >>> ranks(vfsdp.plan({"w": torch.ones(8)}, (2, 3)))      # HSDP: 2 replicas of 3
        6
    """
    return spec.world_size * spec.replicas


@st.composite
def shapes(draw, max_dims: int = 3, max_side: int = 6) -> tuple:
    """Shapes with 0..``max_dims`` dims and sides 0..``max_side`` (0-size, 0-d, 1-element).

    Args:
        max_dims: The most dims a shape has.
        max_side: The largest size of a dim.

    Returns:
        (st.SearchStrategy[tuple]): A strategy of shape tuples, shrinking towards ``()`` and sides of 0.

    Raises:
        hypothesis.errors.InvalidArgument: when a value is drawn, ``max_dims`` negative, or
            ``max_side`` negative for a shape with dims.

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> find(shapes(), lambda s: len(s) == 2, settings=fixed)
        (0, 0)
        >>> find(shapes(max_dims=1), lambda s: s and s[0] > 4, settings=fixed)
        (5,)
    """
    ndim = draw(st.integers(0, max_dims))
    return tuple(draw(st.integers(0, max_side)) for _ in range(ndim))


def world_sizes(max_size: int = 17) -> st.SearchStrategy:
    """Shard-group sizes 1..``max_size`` (primes included), shrinking towards 1.

    Args:
        max_size: The largest size.

    Returns:
        A strategy of ints.

    Raises:
        hypothesis.errors.InvalidArgument: when a value is drawn, ``max_size`` is below 1.

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> find(world_sizes(), lambda m: m > 1, settings=fixed)
        2
    """
    return st.integers(1, max_size)


@st.composite
def meshes(draw, max_ranks: int = 8, hsdp: bool = True) -> Any:
    """An int world size, or (with ``hsdp``) a ``(replicate, shard)`` tuple, with at most
    ``max_ranks`` ranks in all; primes and axes of size 1 included.

    Args:
        max_ranks: The most ranks a mesh has.
        hsdp: Draw ``(replicate, shard)`` tuples too.

    Returns:
        (st.SearchStrategy[Any]): A strategy of meshes, as :func:`vfsdp.plan` takes them.

    Raises:
        hypothesis.errors.InvalidArgument: when a value is drawn, ``max_ranks`` is below 1.

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> find(meshes(), lambda m: isinstance(m, tuple) and m[0] * m[1] > 2, settings=fixed)
        (1, 3)
    """
    if hsdp and max_ranks >= 2 and draw(st.booleans()):
        r = draw(st.integers(1, max_ranks))
        return (r, draw(st.integers(1, max(1, max_ranks // r))))
    return draw(st.integers(1, max_ranks))


def granularities() -> st.SearchStrategy:
    """Element, ``rows(k)`` for k in 1..4, ``whole``, and a per-tensor mix of those.

    Returns:
        A strategy of ``granularity=`` values for :func:`vfsdp.plan` (``None``: element).

    Raises:
        TypeError: not from ``granularities()`` itself (it takes no arguments); a drawn
            per-tensor mix, a callable ``(path, tensor) -> granularity``, raises it when
            called with other arguments.

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> print(find(granularities(), lambda g: True, settings=fixed))
        None
        >>> find(granularities(), lambda g: g is not None, settings=fixed)
        rows(1)
    """
    @st.composite
    def mixed(draw):
        table = draw(st.lists(st.sampled_from([None, rows(1), rows(2), whole]), min_size=1,
                              max_size=4))
        # a hash that is the same in every process (str hashes are salted per process)
        return lambda path, tensor: table[zlib.crc32(repr(tuple(path)).encode()) % len(table)]

    return st.one_of(st.sampled_from([None, rows(1), rows(2), rows(3), rows(4), whole]), mixed())


def dtypes(choices: Sequence[torch.dtype] = DTYPES) -> st.SearchStrategy:
    """One of ``choices``.

    Args:
        choices: The dtypes (default: float32, float64 and bfloat16).

    Returns:
        A strategy of dtypes, shrinking towards the first.

    Raises:
        hypothesis.errors.InvalidArgument: when a value is drawn, ``choices`` is empty.

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> find(dtypes(), lambda d: True, settings=fixed)
        torch.float32
        >>> find(dtypes(), lambda d: d.itemsize == 2, settings=fixed)
        torch.bfloat16
    """
    return st.sampled_from(list(choices))


@st.composite
def param_trees(draw, max_layers: int = 3, max_tensors: int = 3, max_side: int = 6,
                dtype_choices: Sequence[torch.dtype] = DTYPES, meta: bool = False) -> dict:
    """``{"layers": [{"t0": ..., ...}, ...], "root": {...}, "note": str}``.

    Each layer is a unit under the planner's default rule and ``root`` the root unit; each
    unit draws its own dtype. Values are deterministic (``arange`` scaled per tensor), or
    ``meta`` tensors with ``meta=True``. At least one tensor is present.

    Args:
        max_layers: The most layers (0 layers: a root unit only).
        max_tensors: The most tensors per unit.
        max_side: The largest size of a dim.
        dtype_choices: The dtypes a unit draws from.
        meta: Make ``meta`` tensors (no data), e.g. to plan large trees.

    Returns:
        (st.SearchStrategy[dict]): A strategy of parameter trees.

    Raises:
        hypothesis.errors.InvalidArgument: when a value is drawn, ``max_tensors`` below 1, a negative
            ``max_layers``, no ``dtype_choices``, or a negative ``max_side`` for a tensor
            with dims.

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> tree = find(param_trees(), lambda t: len(t["layers"]) == 2, settings=fixed)
        >>> tree["layers"], tree["root"], tree["note"]
        ([{'t0': tensor(1.)}, {'t0': tensor(2.)}], {}, 'passes through')
    """
    counter = itertools.count(1)  # the tensor's number, added to its values

    def tensor(shape, dtype):
        if meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        values = torch.arange(math.prod(shape), dtype=torch.float64) * 0.25  # cpu: test data
        return (values + next(counter)).reshape(shape).to(dtype)

    def unit(prefix: str, dims: int, least: int) -> dict:  # one dtype per unit
        dtype = draw(dtypes(dtype_choices))
        return {f"{prefix}{j}": tensor(draw(shapes(dims, max_side)), dtype)
                for j in range(draw(st.integers(least, max_tensors)))}

    layers = [unit("t", 2, 1) for _ in range(draw(st.integers(0, max_layers)))]
    return {"layers": layers, "root": unit("r", 3, 0 if layers else 1), "note": "passes through"}


@st.composite
def plans(draw, trees: Optional[st.SearchStrategy] = None, mesh: Optional[st.SearchStrategy] = None,
          granularity: Optional[st.SearchStrategy] = None) -> tuple:
    """``(params, spec)``: a drawn tree planned for a drawn mesh and granularity.

    Args:
        trees: The trees (default: :func:`param_trees`).
        mesh: The meshes (default: :func:`meshes`).
        granularity: The granularities (default: :func:`granularities`).

    Returns:
        (st.SearchStrategy[tuple]): A strategy of ``(params, spec)`` tuples; run a case on
            ``ranks(spec)`` ranks.

    Raises:
        ValueError: when a value is drawn, a mesh :func:`vfsdp.plan` refuses (e.g. a
            world size of 0).

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> params, spec = find(plans(), lambda case: case[1].world_size == 3, settings=fixed)
        >>> params["root"], ranks(spec)
        ({'r0': tensor(1.)}, 3)
    """
    params = draw(trees if trees is not None else param_trees())
    return params, plan(params, draw(mesh if mesh is not None else meshes()),
                        granularity=draw(granularity if granularity is not None else granularities()))


@st.composite
def compositions(draw, total: int, parts: int) -> tuple:
    """``parts`` non-negative ints summing to ``total`` (zeros allowed).

    Args:
        total: The sum.
        parts: How many ints.

    Returns:
        (st.SearchStrategy[tuple]): A strategy of ``parts``-tuples.

    Raises:
        hypothesis.errors.InvalidArgument: when a value is drawn, ``parts`` below 1 or ``total`` negative.

    Example:
        >>> from hypothesis import find, settings
        >>> fixed = settings(database=None, derandomize=True)     # the same result each run
        >>> find(compositions(5, 3), lambda c: True, settings=fixed)
        (0, 0, 5)
        >>> find(compositions(5, 3), lambda c: c[0] == 2, settings=fixed)
        (2, 0, 3)
    """
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return tuple(b - a for a, b in itertools.pairwise([0, *cuts, total]))


@st.composite
def ragged_cases(draw, max_world: int = 17) -> tuple:
    """``(shape, RaggedShard)`` pairs that form valid placements (world sizes up to
    ``max_world`` and 64).

    Args:
        max_world: The largest world size besides 64.

    Returns:
        (st.SearchStrategy[tuple]): A strategy of ``(shape, placement)`` tuples; the placement
            has one unit count per rank.

    Raises:
        hypothesis.errors.InvalidArgument: when a value is drawn, ``max_world`` is below 1.

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=25, database=None, deadline=None)
        ... @given(ragged_cases(max_world=5))
        ... def test_ranks_cover_the_tensor(case):
        ...     shape, p = case
        ...     ranges = [flat_range(p, shape, r) for r in range(len(p.local_units))]
        ...     assert sum(hi - lo for lo, hi in ranges) == math.prod(shape)
        >>> test_ranks_cover_the_tensor()
    """
    shape = draw(shapes())
    m = draw(st.one_of(st.integers(1, max_world), st.just(64)))
    d = draw(st.integers(0, len(shape)))
    lead = math.prod(shape[:d])
    divisors = [k for k in range(1, lead + 1) if lead % k == 0]
    units = (0,) * m if math.prod(shape) == 0 else draw(compositions(draw(st.sampled_from(divisors)), m))
    return shape, RaggedShard(tuple(range(d)), units)
