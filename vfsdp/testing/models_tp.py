"""The decoder of :mod:`vfsdp.testing.models` with tensor parallelism (Megatron) or expert
parallelism, on the named-axis collectives of :mod:`vfsdp.lax`.

* TP: :func:`tp_rule` places each **global** parameter over a ``"tp"`` axis (attention split
  by heads, the MLP by its hidden units, everything else replicated); ``vfsdp.plan(params,
  mesh, tp=tp_rule(cfg))`` plans each index's pieces over the data axes, and
  :func:`block_tp` runs a block on them: the residual stream stays replicated over ``"tp"``
  (every rank of a tp group sees the same batch), each block costs two all-reduces forward
  (the row-parallel outputs) and two backward (the column-parallel inputs).
* EP: a top-k routed model (``GPTConfig(experts=E, top_k=k)``) whose stacked experts are split
  over an ``"ep"`` axis (:func:`ep_rule`, ``Shard(0)``) while every rank sees its own batch.
  :func:`split_experts` separates the experts from the rest: the rest is data-parallel over
  every rank (its gradients are summed over ``dp`` *and* ``ep``), the experts over ``dp``
  only. :func:`block_ep` runs a block with this rank's experts
  (:func:`vfsdp.testing.moe.moe_ep`: tokens travel to their experts and back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.distributed.tensor import Replicate, Shard

from vfsdp.spmd import lax
from vfsdp.testing import moe
from vfsdp.testing.models import GPTConfig, _heads, _rms, mixture

_COLUMNS = ("wq", "wk", "wv", "w_gate", "w_up")   # split by output columns (heads, hidden)
_ROWS = ("wo", "w_down")                           # split by input rows: partial sums


def tp_rule(cfg: GPTConfig) -> Callable[[tuple], Any]:
    """Megatron's placements of the model's global parameters over a tensor-parallel axis.

    ``wq``/``wk``/``wv`` ``Shard(1)`` (whole heads per rank: query head ``j`` and its kv head
    ``j // (heads / kv_heads)`` land on the same rank), ``wo`` ``Shard(0)``; the MLP's
    ``w_gate``/``w_up`` ``Shard(1)`` and ``w_down`` ``Shard(0)``; norms, embedding, head,
    and a MoE layer's router and experts ``Replicate()`` (the experts compute the replicated
    stream on every tp rank: correct, not memory-saving; use expert parallelism for those).

    Args:
        cfg: The model's configuration (kept for the rule's future needs; the placements
            depend only on the names).

    Returns:
        ``path -> Shard(dim) | Replicate()``, for ``vfsdp.plan(..., tp=)`` or
            ``vfsdp.lax.tp_local``.

    Raises:
        TypeError: ``cfg`` is not a :class:`GPTConfig`.

    Example:
        >>> rule = tp_rule(GPTConfig())
        >>> rule(("layers", 0, "wq")), rule(("layers", 0, "w_down")), rule(("io", "embed"))
        (Shard(dim=1), Shard(dim=0), Replicate())
    """
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"tp_rule: expected a GPTConfig, got {type(cfg).__name__}")

    def rule(path: tuple) -> Any:
        name = None if "experts" in path or not path else path[-1]
        return Shard(1) if name in _COLUMNS else Shard(0) if name in _ROWS else Replicate()

    return rule


def block_tp(p: dict, x: torch.Tensor, cfg: GPTConfig, mesh: Optional[Any] = None,
             axis: str = "tp") -> torch.Tensor:
    """One decoder block on this rank's tensor-parallel pieces (:func:`tp_rule`'s).

    ``x`` is replicated over ``axis``. Attention runs this rank's ``heads / tp`` query and
    ``kv_heads / tp`` key/value heads, the MLP this rank's hidden units; ``wo`` and
    ``w_down`` are row-parallel (:func:`vfsdp.lax.row_parallel`: partial products summed).
    The normalised input feeds the column-parallel matmuls through one ``pvary`` each for
    attention and MLP (what :func:`vfsdp.lax.column_parallel` does per matmul), so the
    backward sums its gradient over ``axis`` once, not once per matmul.

    Args:
        p: One layer's TP-local parameters (``vfsdp.gather``/``run_layers`` of a
            ``tp=tp_rule(cfg)`` plan, or ``vfsdp.lax.tp_local``).
        x: ``(batch, seq, dim)``, the same on every rank of ``axis``.
        cfg: The model's configuration (global sizes).
        mesh: The mesh holding ``axis`` (default: the innermost ``vfsdp.lax.use_mesh``).
        axis: The tensor-parallel axis.

    Returns:
        The block's output, replicated over ``axis``: :func:`vfsdp.testing.models.block` of
            the global parameters.

    Raises:
        ValueError: heads or kv heads not divisible by the axis size, or no such axis.

    Example:
        >>> from vfsdp.testing.models import block, init_rule, meta_params
        >>> cfg = GPTConfig(dim=16, heads=4, kv_heads=2, ffn=24, seq=5)
        >>> full = vfsdp.init.full_tree(init_rule(cfg), meta_params(cfg))["layers"][0]
        >>> x = torch.randn(2, 5, 16)
        >>> def body():
        ...     mesh = vfsdp.mesh(("tp", 2))
        ...     local = vfsdp.lax.tp_local(full, tp_rule(cfg), "tp", mesh=mesh)
        ...     return torch.allclose(block_tp(local, x, cfg, mesh), block(full, x, cfg),
        ...                           atol=1e-5)
        >>> vfsdp.testing.simulate(2, body)
        [True, True]
    """
    n = lax.axis_size(axis, mesh=mesh)
    if cfg.heads % n or cfg.kv_heads % n:
        raise ValueError(f"block_tp: {cfg.heads} heads and {cfg.kv_heads} kv heads do not split "
                         f"over {n} tensor-parallel ranks; both must be multiples of {n}")
    h = lax.pvary(_rms(x, p["attn_norm"]), axis, mesh=mesh)
    x = x + lax.row_parallel(_heads(h, p, cfg, cfg.heads // n, cfg.kv_heads // n), p["wo"], axis,
                             mesh=mesh)
    h = _rms(x, p["mlp_norm"])
    # a mixture is replicated over the axis (every rank computes all of it); w_down is row-parallel
    return x + (mixture(p, h, cfg) if "experts" in p else
                lax.psum(moe.swiglu(lax.pvary(h, axis, mesh=mesh), p), axis, mesh=mesh))


def ep_rule(path: tuple) -> Any:
    """The expert-parallel placement: stacked experts (any path through ``"experts"``)
    ``Shard(0)``, whole experts per rank; everything else ``Replicate()``.

    Args:
        path: A parameter's path.

    Returns:
        ``Shard(0)`` or ``Replicate()``.

    Raises:
        TypeError: ``path`` is not a tuple.

    Example:
        >>> ep_rule(("layers", 0, "experts", "w_up")), ep_rule(("layers", 0, "router"))
        (Shard(dim=0), Replicate())
    """
    if not isinstance(path, tuple):
        raise TypeError(f"ep_rule: a path is a tuple, got {type(path).__name__}")
    return Shard(0) if "experts" in path else Replicate()


def split_experts(params: dict) -> tuple[dict, dict]:
    """``(rest, experts)``: the model's tree without the experts, and the experts alone
    (``{"layers": [{"experts": ...}, ...]}``), every tensor at the same path as in
    ``params`` (so ``vfsdp.init.sharded`` gives both the values it gives the whole tree).

    Args:
        params: A model tree (global, meta, shards: any leaves) with MoE layers.

    Returns:
        The two trees (sharing ``params``' leaves).

    Raises:
        ValueError: a layer without experts.

    Example:
        >>> from vfsdp.testing.models import meta_params
        >>> rest, experts = split_experts(meta_params(GPTConfig(experts=4, top_k=2)))
        >>> "experts" in rest["layers"][0], sorted(experts["layers"][0]["experts"])
        (False, ['w_down', 'w_gate', 'w_up'])
    """
    layers = params["layers"]
    for i, layer in enumerate(layers):
        if "experts" not in layer:
            raise ValueError(f"split_experts: layer {i} has no experts (GPTConfig(experts=E))")
    return (dict(params, layers=[{k: v for k, v in layer.items() if k != "experts"} for layer in layers]),
            {"layers": [{"experts": layer["experts"]} for layer in layers]})


def block_ep(p: dict, x: torch.Tensor, cfg: GPTConfig, mesh: Optional[Any] = None,
             axis: str = "ep") -> torch.Tensor:
    """One top-k routed decoder block with the experts split over ``axis``.

    Attention, norms and router are whole on every rank and ``x`` is this rank's own batch;
    the ``batch * seq`` tokens go to the ranks of their experts and back
    (:func:`vfsdp.testing.moe.moe_ep`).

    Args:
        p: One layer's parameters, ``p["experts"]`` this rank's stacked experts
            (``E / ep`` of them, :func:`ep_rule`'s pieces).
        x: ``(batch, seq, dim)``, this rank's.
        cfg: The model's configuration (``experts``, ``top_k > 0``).
        mesh: The mesh holding ``axis`` (default: the innermost ``vfsdp.lax.use_mesh``).
        axis: The expert-parallel axis.

    Returns:
        The block's output for this rank's batch: :func:`vfsdp.testing.models.block` of the
            global parameters.

    Raises:
        ValueError: ``cfg.top_k`` is 0, the experts do not split evenly over the axis, or
            no such axis.

    Example:
        >>> from vfsdp.testing.models import block, init_rule, meta_params
        >>> cfg = GPTConfig(dim=16, heads=4, kv_heads=2, experts=4, top_k=2, seq=5)
        >>> full = vfsdp.init.full_tree(init_rule(cfg), meta_params(cfg))["layers"][0]
        >>> xs = torch.randn(2, 2, 5, 16)                        # one batch per rank
        >>> def body():
        ...     mesh, r = vfsdp.mesh(("ep", 2)), dist.get_rank()
        ...     local = dict(full, experts={k: v[2 * r:2 * r + 2]
        ...                                 for k, v in full["experts"].items()})
        ...     return torch.allclose(block_ep(local, xs[r], cfg, mesh),
        ...                           block(full, xs[r], cfg), atol=1e-5)
        >>> vfsdp.testing.simulate(2, body)
        [True, True]
    """
    if not cfg.top_k:
        raise ValueError("block_ep: expert parallelism routes tokens: GPTConfig(top_k=k > 0)")
    x = x + _heads(_rms(x, p["attn_norm"]), p, cfg, cfg.heads, cfg.kv_heads) @ p["wo"]
    h = _rms(x, p["mlp_norm"])
    return x + moe.moe_ep(p["router"], p["experts"], h.reshape(-1, h.shape[-1]), cfg.top_k, axis,
                          cfg.experts, mesh=mesh).view_as(h)
