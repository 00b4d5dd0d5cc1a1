"""``vfsdp.estimate(spec, ...)``: memory per rank and step time, from the plan alone."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import optree

from vfsdp.estimation.checks import count
from vfsdp.estimation.hardware import Hardware
from vfsdp.estimation.options import Options
from vfsdp.estimation.predict import Estimate, PlanSummary, predict
from vfsdp.planner.abstract import is_tensor_leaf, leaf_meta
from vfsdp.planner.spec import ShardSpec

__all__ = ["estimate", "Estimate", "optimizer_for"]


def optimizer_for(name: Union[str, Any], like: Any = None) -> Any:
    """A vfsdp optimizer from its name (``"adamw"``, ``"adamw8bit"``, ``"muon"``: Muon for
    the matrices of ``like``, a spec, a parameter tree or the tree's
    ``optree.tree_flatten_with_path``, AdamW for the rest; ``"soap"`` and ``"shampoo"``: that
    optimizer for its 1-D and 2-D tensors, as their own defaults do, AdamW for the rest), or
    the optimizer itself."""
    from vfsdp import optim

    if not isinstance(name, str):
        return name
    if name in ("adamw", "adamw8bit"):
        return getattr(optim, name)()
    if name in ("muon", "soap", "shampoo"):
        if isinstance(like, ShardSpec):
            ndim = {p: len(sh) for u in like.units.values() for p, sh in zip(u.paths, u.shapes)}
        else:  # a tree, or its optree.tree_flatten_with_path
            paths, leaves, _ = like if isinstance(like, tuple) else \
                optree.tree_flatten_with_path(like)
            ndim = {tuple(p): len(leaf_meta(x)[0]) for p, x in zip(paths, leaves)
                    if is_tensor_leaf(x)}
        dims = (2,) if name == "muon" else (1, 2)
        return optim.partition({name: getattr(optim, name)(), "adamw": optim.adamw()},
                               lambda path: name if ndim.get(tuple(path)) in dims else "adamw")
    raise ValueError(f"estimate: unknown optimizer {name!r}; pass 'adamw', 'adamw8bit', "
                     f"'muon', 'soap', 'shampoo' or a vfsdp.optim optimizer")


def estimate(spec: ShardSpec, hw: Union[str, Hardware] = "h100", optimizer: Any = "adamw", *,
             rank: Optional[int] = None, experts: Optional[ShardSpec] = None,
             **options: Any) -> Estimate:
    """Predict one training step of ``spec`` on ``hw`` (see ``docs/estimate.md``).

    Args:
        spec: The plan (any mesh; no process group is needed).
        hw: A hardware profile or its name (``"h800"``), or a JSON file from ``calibrate``.
        optimizer: A vfsdp optimizer or its name (``"adamw"``, ``"adamw8bit"``, ``"muon"``,
            ``"soap"``, ``"shampoo"``).
        rank: The shard rank whose optimizer state is counted (default: the larger of the
            first and the last rank's; they differ where whole tiles or matrices sit on
            one rank).
        experts: Expert parallelism: the plan of one expert-parallel rank's experts (planned
            with ``tp=rule, tp_axis="ep"``, or that rank's share of the experts planned over
            the GPUs divided by ``ep``), keyed like the layers of ``spec`` they belong to;
            ``spec`` is then the rest of the model, over every GPU. Each layer's experts are
            gathered, reduced and held with it, and its routed tokens cross the expert group
            in all-to-alls (two forward, two backward, two more with ``recompute``), on the
            compute lane.
        **options: The step, as :class:`~vfsdp.estimation.options.Options` takes it
            (defaults: ``param_dtype`` bf16, ``tokens_per_rank`` 4096, ``comm_library_bytes``
            2 GiB, ``micro_batches`` 1, ``logits_dtype`` fp32; ``prefetch``,
            ``reshard_after_forward`` and ``grad_sync`` on; the rest off or ``None``):

            * ``param_dtype``: The compute dtype the units are gathered in (``None``: the shards').
            * ``reduce_dtype``: The reduce-scatter dtype (default: ``param_dtype``).
            * ``prefetch``: As ``run_layers``'.
            * ``reshard_after_forward``: As ``run_layers``'.
            * ``tokens_per_rank``: Tokens each rank processes per step (over all its micro-batches).
            * ``costs``: Per unit key (or key prefix, such as ``("layers",)``) its
              :class:`LayerCost` for ``tokens_per_rank`` tokens (from :func:`layer_cost`);
              default: from the shapes (:func:`shape_costs`).
            * ``experts_per_token``: Routed experts per token, for the shapes' default costs of a
              model with ``experts``.
            * ``seq``: Sequence length, for the attention FLOPs of the default costs.
            * ``recompute``: Activation checkpointing for the default costs: ``True`` or ``"full"``
              (only each layer's input is kept, the forward runs again), ``"selective"``
              (torchtitan's op-level policy: every other output kept, half the forward's weight
              matmuls run again) or ``False``.
            * ``comm_library_bytes``: The communication library's own buffers (NCCL's, outside
              torch's caching allocator): in ``memory_per_rank``, not in ``peak_reserved``.
            * ``baseline``: ``"fsdp2"`` or ``"megatron"``: the same step as that system runs it: its
              padding (:func:`~vfsdp.estimation.memory.baseline_sizes`), its copies
              (``Estimate.copy_bytes``, their time on the compute lane), the buffers they
              hold, and its regather of the last layer. FSDP2: copy-in and copy-out around
              each all-gather and each reduce-scatter, in the memory each all-gather's output
              until it is copied out and each unit's unsharded gradients until copied into
              the reduce-scatter input, and its caching allocator's pool per stream
              (``Estimate.peak_reserved``). Megatron-FSDP: gathers in place from a shard it
              keeps in the compute dtype (cast once, after the update), each gradient copied
              into its main-grad bucket, held from the layer's backward's start, and the
              reduce-scatter's output added into the gradient shard; its allocator is not
              modelled (reserved = allocated).
            * ``padding``: ``"vfsdp"``, ``"fsdp2"`` or ``"megatron"``: another system's padding than
              the step's own (default), for ablations: ``baseline="fsdp2", padding="vfsdp"``
              is vfsdp's layout with FSDP2's copies, ``padding="fsdp2"`` vfsdp's step over
              FSDP2's per-tensor padding.
            * ``model_parallel``: ``"tp"`` for a ``tp=`` plan of Megatron-style layers: each layer
              all-reduces its activations (``tokens_per_rank`` x the embedding's width, in the
              compute dtype) twice forward and twice backward over the model axis, on the
              compute lane (exposed). ``None``: the model axis's own collectives are not
              modelled.
            * ``layers``: The unit keys ``run_layers`` runs, in order (default: the longest run of
              units keyed ``(name, i)``; the other units are gathered for the whole step).
            * ``ep``: The expert group's size, where ``experts`` has no ``"ep"`` axis of its own.
            * ``micro_batches``: Micro-batches per step (gradient accumulation), which split
              ``tokens_per_rank``: each gathers the units again; activations are one's.
            * ``grad_sync``: With ``micro_batches``, whether each reduces its gradients (FSDP's
              default); ``False``: only the last does, and every unit's whole gradient is held
              across them: in the parameters' dtype (vfsdp's ``grad_sync=False``), or in the
              reduce dtype for the FSDP2 and Megatron-FSDP baselines.
            * ``float8``: Float8 weight matmuls (at ``Hardware.float8_efficiency`` of twice the
              bf16 peak, their inputs' and output gradients' casts at the memory bandwidth;
              attention stays in bf16) and float8 all-gathers: the layers' weights cross and
              stay unsharded in one byte an element (torchao's ``enable_fsdp_float8_all_gather``).
            * ``float8_all_gather``: With ``float8``, whether the all-gathers are in float8
              (default: ``True`` with ``float8``); ``False``: float8 matmuls over weights gathered and
              kept in the parameters' dtype (torchao's rowwise recipes, Transformer Engine
              under FSDP1, ``enable_fsdp_float8_all_gather=False``).
            * ``float8_fused_casts``: With ``float8``, whether its casts run fused (an amax pass
              and one kernel writing both layouts, 6 bytes an element of each GEMM operand:
              torch.compile's, Transformer Engine's ``cast_transpose``) or as torchao's eager
              kernels (abs, max, upcast, scale, clamp, cast: 68 bytes, each linear casting its
              own input). Default: ``compiled``.
            * ``float8_recipe``: With ``float8``, torchao's scaling: ``"tensorwise"`` (default)
              or ``"rowwise"`` (per-row scales: its GEMMs at
              ``Hardware.float8_rowwise_efficiency``, 2 bytes more an element cast, and bf16
              all-gathers, ``float8_all_gather`` defaulting to ``False``).
            * ``float8_saved_weights``: With ``float8`` and ``compiled``, whether the compiled
              step saves each layer's unsharded float8 weights (their transposes) for its
              backward: torchao before June 2025 (03c850a) without
              ``force_recompute_fp8_weight_in_bwd`` (added in October 2024, e919558); since,
              it recomputes them (default). Layers under ``recompute`` save none.
            * ``logits_dtype``: The dtype the loss's softmax and its gradient are in (the default
              costs' logits: an eager loss's peak, 12 bytes per token and vocabulary entry in fp32,
              6 in bf16).
            * ``compiled``: Whether the step runs under ``torch.compile`` (the default costs' kernels
              outside the matmuls fused: less of their memory traffic; its partitioner's
              activations: a gated FFN's SiLU recomputed, with ``float8`` the norms' outputs and
              the gate product too; eager, an RMSNorm keeps its fp32 input and normalized value).
            * ``fused_loss``: Whether the loss is one fused kernel, holding only the bf16 logits and
              their gradient (``None``: as ``compiled``; torchtitan compiles its loss since
              2025, not before).
    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: an unknown profile or optimizer, a model with experts and no
            ``experts_per_token``, ``tokens_per_rank``, ``experts_per_token``, ``seq`` or
            ``ep`` not an int >= 1, a negative ``comm_library_bytes``, ``fused_loss`` not a
            bool, ``float8_saved_weights`` without ``float8`` and ``compiled``,
            ``float8_all_gather``, ``float8_fused_casts`` or ``float8_recipe`` without
            ``float8``, an unknown ``float8_recipe``, ``float8_all_gather=True`` with
            ``float8_recipe="rowwise"``, a ``rank``
            outside the plan, ``micro_batches`` that do not divide ``tokens_per_rank``, an
            unknown baseline or padding, or ``model_parallel="tp"`` for a plan without a
            model axis, ``layers`` naming a unit the plan does not have, or experts that do
            not fit the model's GPUs or layers.
        TypeError: ``spec`` or ``experts`` is not a :class:`ShardSpec`.

    Example:
        >>> params = {"layers": [{"w": torch.empty(4096, 4096, device="meta")}
        ...                      for _ in range(32)]}
        >>> est = vfsdp.estimate(vfsdp.plan(params, 64), hw="h100", tokens_per_rank=8192)
        >>> est.fits, est.gpus, est.comm_bytes["all_gather"] > 0
        (True, 64, True)
    """
    if not isinstance(spec, ShardSpec):
        raise TypeError(f"estimate: spec must be a ShardSpec (vfsdp.plan's), got "
                        f"{type(spec).__name__}")
    if experts is not None and not isinstance(experts, ShardSpec):
        raise TypeError(f"estimate: experts= takes the experts' ShardSpec, got "
                        f"{type(experts).__name__}")
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Options)} - {"muon"})
    if unknown or "muon" in options:  # in estimate's name, as a signature would
        raise TypeError(f"estimate() got an unexpected keyword argument "
                        f"{(unknown or ['muon'])[0]!r}")
    o = Options(hw=hw, muon=optimizer == "muon", **options)
    count("estimate", "rank", rank, least=0, optional=True)
    if rank is not None and rank >= spec.world_size:
        raise ValueError(f"estimate: rank={rank} is not a rank of the plan's {spec.world_size}")
    model = PlanSummary.of(spec, optimizer_for(optimizer, spec), rank)
    part = None if experts is None else PlanSummary.of(experts, optimizer_for(optimizer, experts))
    return predict(model, part, o)
