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

:func:`moe_etp` cuts the stacks on another dim instead (expert tensor parallelism): every rank
of the axis holds a slice of every expert's hidden units (:func:`etp_rule`: ``w_gate`` and
``w_up`` ``Shard(2)``, ``w_down`` ``Shard(1)``); the axis' tokens are gathered, each rank
computes its slice of every expert, and the partial outputs are summed back to the tokens'
ranks. A checkpoint of either cut loads into the other (the boxes are the global tensor's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from vfsdp.spmd import lax


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
    return Shard(0) if path and path[-1] in ("w_gate", "w_up", "w_down") else Replicate()


def etp_rule(path: tuple) -> Any:
    """The expert-tensor-parallel placement of :func:`moe_params`' tensors: every expert's
    hidden units split over the axis, so the stacks are cut on dims 2 (``w_gate``, ``w_up``:
    ``[E, D, H]``) and 1 (``w_down``: ``[E, H, D]``); the router ``Replicate()``. Gradients
    as for :func:`ep_rule`: gather with ``grad_reduce="sum"``, the loss divided by the world
    size.

    Example:
        >>> etp_rule(("experts", "w_up")), etp_rule(("experts", "w_down")), etp_rule(("router",))
        (Shard(dim=2), Shard(dim=1), Replicate())
    """
    return {"w_gate": Shard(2), "w_up": Shard(2), "w_down": Shard(1)}.get(path[-1] if path else None,
                                                                        Replicate())


def route(x: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert ids [T, k], weights [T, k])``: the top-k of the router's softmax, renormalised."""
    top, ids = F.softmax(x @ router, dim=-1).topk(k, dim=-1)
    return ids, top / top.sum(-1, keepdim=True)


def swiglu(t: torch.Tensor, p: dict) -> torch.Tensor:
    """The SwiGLU MLP of ``p`` (``w_gate``, ``w_up``, ``w_down``; one expert's or a dense layer's)
    on ``t``."""
    return (F.silu(t @ p["w_gate"]) * (t @ p["w_up"])) @ p["w_down"]


def moe_reference(params: dict, x: torch.Tensor, k: int) -> torch.Tensor:
    """The layer on one process: every expert computes only the tokens routed to it.

    Example:
        >>> p = moe_params(8, 16, 4)
        >>> moe_reference(p, torch.randn(5, 8), 2).shape
        torch.Size([5, 8])
    """
    return _routed(params["experts"], x, *route(x, params["router"], k), torch.zeros_like(x))


def _routed(p: dict, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            out: torch.Tensor) -> torch.Tensor:
    """``out`` plus each of the stacked experts ``p`` on the tokens of ``x`` routed to it
    (``ids``, ``weights``: :func:`route`'s), weighted."""
    for e in range(p["w_up"].shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = swiglu(x[tok], {k: w[e] for k, w in p.items()})  # expert e's tokens
            out = out.index_add(0, tok, y * weights[tok, slot, None])
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
    out = _routed(local_experts, recv_x, (recv_ids - first)[:, None], recv_x.new_ones(len(recv_ids), 1),
                  torch.zeros_like(recv_x) + recv_x[:0].sum())
    back = lax.all_to_all(out, axis, 0, 0, split_sizes=back_sizes, mesh=mesh)
    return torch.zeros_like(x).index_add(0, tok, back * weights.reshape(-1)[order, None])


def moe_etp(router: torch.Tensor, local_experts: dict, x: torch.Tensor, k: int, axis: str, *,
            mesh: Optional[Any] = None) -> torch.Tensor:
    """The layer with every expert's hidden units split over ``axis`` (:func:`etp_rule`'s
    pieces: ``{"w_gate": [E, D, H_i], "w_up": [E, D, H_i], "w_down": [E, H_i, D]}``); ``x``
    and the router are this rank's.

    Each rank routes its own tokens; the axis' tokens, expert ids and weights are gathered
    (:func:`vfsdp.lax.all_gather`, uneven counts), each rank computes its hidden slice of
    every token's experts (a SwiGLU MLP is a sum over its hidden units), and the partial
    outputs go back to the tokens' ranks and are summed there (an ``all_to_all``).

    Args:
        router: The router weights [D, E], data-parallel (its gradient: this rank's tokens').
        local_experts: Every expert's slice of hidden units, stacked.
        x: This rank's tokens [T, D] (``T`` may differ between ranks, 0 included).
        k: Experts per token.
        axis: The expert-tensor-parallel mesh axis.
        mesh: The mesh (default: the innermost ``use_mesh``).

    Returns:
        This rank's output [T, D], as :func:`moe_reference` computes it for these tokens.

    Raises:
        ValueError: pieces whose shapes do not fit one another (naming them).

    Example:
        >>> p = moe_params(8, 6, 4)
        >>> def body():
        ...     n, r = dist.get_world_size(), dist.get_rank()
        ...     x = torch.randn(3 + r, 8, generator=torch.Generator().manual_seed(r))
        ...     local = {name: v.tensor_split(n, dim=etp_rule(("experts", name)).dim)[r]
        ...              for name, v in p["experts"].items()}
        ...     y = moe_etp(p["router"], local, x, 2, "etp", mesh=vfsdp.mesh(("etp", n)))
        ...     return torch.allclose(y, moe_reference(p, x, 2), atol=1e-6)
        >>> vfsdp.testing.simulate(2, body)
        [True, True]
    """
    gate, up, down = (local_experts[n] for n in ("w_gate", "w_up", "w_down"))
    if not (gate.shape == up.shape and down.shape == (gate.shape[0], gate.shape[2], gate.shape[1])
            and router.shape[-1] == gate.shape[0]):
        raise ValueError(f"moe_etp: the pieces do not fit: router {tuple(router.shape)}, w_gate "
                         f"{tuple(gate.shape)}, w_up {tuple(up.shape)}, w_down "
                         f"{tuple(down.shape)}; expected [D, E], [E, D, h], [E, D, h], [E, h, D] "
                         f"(etp_rule's pieces)")
    n = lax.axis_size(axis, mesh=mesh)
    ids, weights = route(x, router, k)
    sizes = lax.all_gather(torch.tensor([x.shape[0]], device=x.device), axis, mesh=mesh)
    xs, all_ids, all_w = (lax.all_gather(t, axis, mesh=mesh) for t in (x, ids, weights))
    # Every gathered tensor stays in the graph where no token reaches an expert here: the
    # all_gathers' backwards run on every rank (+ empty sums: 0).
    out = _routed(local_experts, xs, all_ids, all_w,
                  torch.zeros_like(xs) + xs[:0].sum() + all_w[:0].sum())
    return lax.all_to_all(out, axis, 0, 0, split_sizes=sizes.tolist(), mesh=mesh).view(n, *x.shape).sum(0)
