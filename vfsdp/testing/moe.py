"""A top-k routed MoE layer: the single-process reference and its expert-parallel version.

Real routing, not a dense soft mixture: each token goes to its ``k`` highest-scoring experts
(softmax router, the top-k weights renormalised), only those experts compute it, and the
results are summed with those weights. Experts are SwiGLU MLPs, stacked on dim 0 (as grouped
GEMMs store them)::

    {"router": [D, E], "experts": {"w_gate": [E, D, H], "w_up": [E, D, H], "w_down": [E, H, D]}}

:func:`moe_ep` runs the same layer with the experts split over a mesh axis (expert parallelism):
tokens are dispatched to the ranks holding their experts and combined back with
:func:`vfsdp.lax.all_to_all` (uneven counts per rank), so autograd carries the gradients both
ways. Expert parallelism x FSDP is then ``vfsdp.plan(params, mesh, tp=ep_rule, tp_axis="ep")``:
:func:`ep_rule` splits the stacked experts by dim 0 over ``"ep"`` and replicates the router, and
checkpoints reshard across ``ep`` degrees like any ``tp=`` plan.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from vfsdp.functional import lax

__all__ = ["moe_params", "route", "expert", "moe_reference", "moe_ep", "ep_rule"]


def moe_params(dim: int, hidden: int, experts: int, seed: int = 0) -> dict:
    """Random parameters of one MoE layer (fp32, on the CPU).

    Example:
        >>> p = moe_params(8, 16, 4)
        >>> tuple(p["router"].shape), tuple(p["experts"]["w_down"].shape)
        ((8, 4), (4, 16, 8))
    """
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(shape, generator=g) / shape[-2] ** 0.5  # cpu: test data

    return {"router": w(dim, experts),
            "experts": {"w_gate": w(experts, dim, hidden), "w_up": w(experts, dim, hidden),
                        "w_down": w(experts, hidden, dim)}}


def ep_rule(path: tuple) -> Any:
    """The expert-parallel placement of :func:`moe_params`' tensors: the stacked experts
    (``w_gate``, ``w_up``, ``w_down``) ``Shard(0)``, whole experts per rank; everything else
    (the router) ``Replicate()``.

    Gradients: an expert's gradient sums the tokens of every ``ep`` rank, but FSDP reduces it
    over the data axis only, so ``grad_reduce="avg"`` would divide by the data axis' size, not
    by the number of ranks whose tokens it saw. Gather with ``grad_reduce="sum"`` and divide
    the loss by the world size (the global mean), as the tests and ``train_gpt.py --ep`` do.

    Example:
        >>> ep_rule(("experts", "w_up")), ep_rule(("router",))
        (Shard(dim=0), Replicate())
    """
    from torch.distributed.tensor import Replicate, Shard

    return Shard(0) if path and path[-1] in ("w_gate", "w_up", "w_down") else Replicate()


def route(x: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert ids [T, k], weights [T, k])``: the top-k of the router's softmax, renormalised."""
    probs = F.softmax(x @ router, dim=-1)
    top, ids = probs.topk(k, dim=-1)
    return ids, top / top.sum(-1, keepdim=True)


def expert(p: dict, t: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e`` of the stacked experts ``p`` (SwiGLU) on the tokens ``t`` [N, D]."""
    return (F.silu(t @ p["w_gate"][e]) * (t @ p["w_up"][e])) @ p["w_down"][e]


def moe_reference(params: dict, x: torch.Tensor, k: int) -> torch.Tensor:
    """The layer on one process: every expert computes only the tokens routed to it.

    Example:
        >>> p = moe_params(8, 16, 4)
        >>> moe_reference(p, torch.randn(5, 8), 2).shape
        torch.Size([5, 8])
    """
    ids, weights = route(x, params["router"], k)
    out = torch.zeros_like(x)
    for e in range(params["router"].shape[-1]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            out = out.index_add(0, tok, expert(params["experts"], x[tok], e)
                                * weights[tok, slot, None])
    return out


def moe_ep(router: torch.Tensor, local_experts: dict, x: torch.Tensor, k: int, axis: str,
           num_experts: int, *, mesh: Optional[Any] = None) -> torch.Tensor:
    """The layer with experts split over ``axis``: rank ``i`` holds experts
    ``[i*E/n, (i+1)*E/n)`` (``local_experts``, stacked: :func:`ep_rule`'s pieces); ``x`` and
    the router are this rank's.

    Tokens go to their experts' ranks in one ``all_to_all`` (uneven counts), are computed
    there, and come back in another; the top-k weights combine them where they started.

    Args:
        router: The router weights [D, E], data-parallel: its gradient here is this rank's
            tokens' (reduce it over the data-parallel ranks as any parameter's).
        local_experts: This rank's experts, stacked (``{"w_gate": [E/n, D, H], ...}``).
        x: This rank's tokens [T, D].
        k: Experts per token.
        axis: The expert-parallel mesh axis.
        num_experts: ``E``.
        mesh: The mesh (default: the innermost ``use_mesh``).

    Returns:
        This rank's output [T, D], as :func:`moe_reference` computes it for these tokens.

    Raises:
        ValueError: ``E`` is not a multiple of the axis size, or the wrong number of local
            experts.
    """
    n = lax.axis_size(axis, mesh=mesh)
    have = local_experts["w_up"].shape[0]
    if num_experts % n or have != num_experts // n:
        raise ValueError(f"moe_ep: {num_experts} experts over {n} ranks need "
                         f"{num_experts // n if num_experts % n == 0 else '?'} local experts "
                         f"each (and E a multiple of {n}); got {have}")
    per = num_experts // n
    first = lax.axis_index(axis, mesh=mesh) * per
    # The router is data-parallel: its gradient stays this rank's (FSDP or DDP reduces it).
    ids, weights = route(x, router, k)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)          # token-choices by expert, so by rank
    tok = order // k
    sent_ids = flat_ids[order]
    counts = torch.bincount(sent_ids // per, minlength=n)
    # How many token-choices each rank sends here (for the way back).
    got = lax.all_to_all(counts, axis, 0, 0, split_sizes=[1] * n, mesh=mesh)
    sizes, back_sizes = counts.tolist(), got.tolist()
    recv_x = lax.all_to_all(x[tok], axis, 0, 0, split_sizes=sizes, mesh=mesh)
    recv_ids = lax.all_to_all(sent_ids, axis, 0, 0, split_sizes=sizes, mesh=mesh)
    # recv_x stays in the graph even where no token came (skewed routing): its backward's
    # all_to_all must run on every rank, or the others wait in it (+ an empty sum: 0).
    out = torch.zeros_like(recv_x) + recv_x[:0].sum()
    for j in range(per):
        pos = (recv_ids == first + j).nonzero(as_tuple=True)[0]
        if pos.numel():
            out = out.index_copy(0, pos, expert(local_experts, recv_x[pos], j))
    back = lax.all_to_all(out, axis, 0, 0, split_sizes=back_sizes, mesh=mesh)
    w = weights.reshape(-1)[order]
    return torch.zeros_like(x).index_add(0, tok, back * w[:, None])
