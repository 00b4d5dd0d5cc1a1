"""Deterministic initialisation that materialises only this rank's shard.

Values come from a counter-based stream: a tensor's flat elements are cut into fixed chunks of
``CHUNK`` elements and chunk ``c`` of the tensor at ``path`` is drawn from a generator seeded
by ``(seed, path, c)``. A rank generates only the chunks its shard touches, and an unsharded
tensor built with :func:`full_tensor` holds exactly the same values, whatever the plan::

    rule = vfsdp.init.rule(default=vfsdp.init.normal(0.02), ones=lambda path: "norm" in path[-1])
    shards = vfsdp.shard(meta_params, spec, init_fn=vfsdp.init.sharded(rule, seed=0))
    # == vfsdp.shard(vfsdp.init.full_tree(rule, meta_params, seed=0), spec), bit for bit
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import optree
import torch

from vfsdp.collectives.dbuffer import slot_of

__all__ = ["normal", "constant", "rule", "sharded", "full_tensor", "full_tree", "CHUNK"]

CHUNK = 1 << 14
"""Elements per counter-based random block: a tensor's values are drawn in blocks of this
many elements, so any rank can draw any range of them alone, the same as one process."""


@dataclass(frozen=True)
class normal:
    """Normal(0, std) values.

    Example:
        >>> t = full_tensor(rule(normal(0.02)), ("w",), (1000,))
        >>> round(float(t.std()), 2)
        0.02
    """

    std: float


@dataclass(frozen=True)
class constant:
    """A constant value.

    Example:
        >>> full_tensor(rule(constant(3.0)), ("b",), (2,)).tolist()
        [3.0, 3.0]
    """

    value: float


Rule = Callable[[tuple, tuple], Any]


def rule(default: Any = normal(0.02), ones: Optional[Callable[[tuple], bool]] = None,
         zeros: Optional[Callable[[tuple], bool]] = None) -> Rule:
    """A ``(path, shape) -> normal | constant`` rule: ``ones``/``zeros`` predicates on the path.

    Args:
        default: What every other tensor gets.
        ones: ``path -> bool``: tensors filled with 1 (e.g. norms).
        zeros: ``path -> bool``: tensors filled with 0 (e.g. biases).

    Returns:
        The rule, a callable ``(path, shape) -> normal | constant``.

    Raises:
        TypeError: not from ``rule`` itself; when values are drawn (:func:`sharded`,
            :func:`full_tensor`, :func:`full_tree`), a ``default`` that is neither a
            :class:`normal` nor a :class:`constant`. The rule raises what ``ones`` or
            ``zeros`` raise.

    Example:
        >>> r = rule(normal(0.02), ones=lambda p: "norm" in str(p[-1]))
        >>> r(("layers", 0, "norm"), (8,)), r(("w",), (8, 8))
        (constant(value=1.0), normal(std=0.02))
    """

    def resolve(path: tuple, shape: tuple) -> Any:
        return (constant(1.0) if ones is not None and ones(path) else
                constant(0.0) if zeros is not None and zeros(path) else default)

    return resolve


def _chunk_seed(seed: int, path: tuple, chunk: int) -> int:
    digest = hashlib.sha256(repr((seed, tuple(path), chunk)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _values(kind: Any, path: tuple, lo: int, hi: int, numel: int, seed: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Flat elements ``[lo, hi)`` of the ``numel``-element tensor at ``path``, chunk by chunk.

    A chunk is always drawn whole (``torch.randn`` orders its output differently for
    different sizes), then cut to the requested range.
    """
    if isinstance(kind, constant):
        return torch.full((hi - lo,), kind.value, dtype=dtype)  # cpu: copied into the shard
    if not isinstance(kind, normal):
        raise TypeError(f"init rule returned {kind!r} for {path}; use vfsdp.init.normal or constant")
    first = lo // CHUNK
    blocks = [torch.randn(min((c + 1) * CHUNK, numel) - c * CHUNK, dtype=torch.float32,  # cpu: seeded
                          generator=torch.Generator().manual_seed(_chunk_seed(seed, path, c)))
              for c in range(first, -(-hi // CHUNK))]
    drawn = torch.cat(blocks) if blocks else torch.empty(0)  # cpu: drawn on the host, copied into the shard
    return (drawn[lo - first * CHUNK:hi - first * CHUNK] * kind.std).to(dtype)


def sharded(init_rule: Rule, seed: int = 0) -> Callable:
    """An ``init_fn`` for :func:`vfsdp.shard` that fills each rank's pieces only.

    Args:
        init_rule: A rule (:func:`rule`), given each tensor's global shape.
        seed: The seed; the same seed gives the same values under any plan, including a
            ``tp=`` plan's pieces (the global tensor's values at the piece's places).

    Returns:
        ``init_fn(path, local, tspec)`` for ``vfsdp.shard(..., init_fn=...)``.

    Raises:
        ValueError: when called, ``local`` is not a piece ``vfsdp.shard`` handed over.
        TypeError: when called, the rule returned something else than normal/constant.

    Example:
        >>> meta = {"w": torch.empty(5, 3, device="meta")}
        >>> def body():
        ...     spec = vfsdp.plan(meta, 2)
        ...     shards = vfsdp.shard(meta, spec, init_fn=sharded(rule(), seed=0))
        ...     full = vfsdp.gather(shards, spec)["w"].detach()
        ...     return torch.equal(full, full_tensor(rule(), ("w",), (5, 3)))
        >>> vfsdp.testing.simulate(2, body)
        [True, True]
    """

    def init_fn(path, local, tspec) -> None:
        slot = slot_of(local)
        if slot is None:
            raise ValueError("vfsdp.init.sharded: the piece is not a DBuffer view; use it as "
                             "vfsdp.shard(..., init_fn=vfsdp.init.sharded(rule, seed))")
        lo, hi = tspec.local_range(slot.buffer.rank)
        st = tspec.strided
        kind = init_rule(tuple(path), tspec.global_shape)
        if st is None or st.dim is None or lo == hi:
            values = _values(kind, tuple(path), lo, hi, tspec.numel, seed, local.dtype)
        else:  # a TP/EP piece: its elements' places in the global tensor
            numel = math.prod(st.global_shape)
            where = torch.arange(numel).view(st.global_shape).narrow(  # cpu: index arithmetic
                st.dim, st.start, st.lengths[st.index]).reshape(-1)[lo:hi]
            first, last = int(where.min()), int(where.max()) + 1
            values = _values(kind, tuple(path), first, last, numel, seed, local.dtype)[where - first]
        local.view(-1).copy_(values.to(local.device))

    return init_fn


def full_tensor(init_rule: Rule, path: tuple, shape: tuple, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> torch.Tensor:
    """The unsharded tensor with the same values :func:`sharded` gives each rank.

    Args:
        init_rule: A rule (:func:`rule`).
        path: The tensor's key path.
        shape: Its shape.
        dtype: Its dtype.
        seed: The seed.

    Returns:
        A new tensor of ``shape`` on the CPU.

    Raises:
        TypeError: the rule returned something else than normal/constant.

    Example:
        >>> full_tensor(rule(constant(2.0)), ("w",), (2, 2)).tolist()
        [[2.0, 2.0], [2.0, 2.0]]
    """
    n = math.prod(shape)
    return _values(init_rule(tuple(path), tuple(shape)), tuple(path), 0, n, n, seed, dtype).reshape(shape)


def full_tree(init_rule: Rule, like: Any, seed: int = 0) -> Any:
    """:func:`full_tensor` for every tensor leaf of ``like`` (e.g. a ``meta`` tree).

    Args:
        init_rule: A rule (:func:`rule`).
        like: A tree of tensors (``meta`` is fine) giving paths, shapes and dtypes.
        seed: The seed.

    Returns:
        The tree with full tensors (other leaves unchanged).

    Raises:
        TypeError: the rule returned something else than normal/constant.

    Example:
        >>> tree = full_tree(rule(constant(1.0)), {"w": torch.empty(2, device="meta")})
        >>> tree["w"].tolist()
        [1.0, 1.0]
    """
    return optree.tree_map_with_path(
        lambda path, t: full_tensor(init_rule, path, tuple(t.shape), t.dtype, seed)
        if isinstance(t, torch.Tensor) else t, like)
