"""Step time: each unit's collectives from an alpha-beta model per link level, overlapped with
compute by the schedule ``run_layers`` runs, and the optimizer from the bytes it moves.

A ring collective over ``n`` ranks moving ``b`` bytes per rank per step takes
``(n - 1) * (latency + b / bandwidth)``. The bandwidth and latency are the intra-node link's
when the group's ranks share a node. A shard group of consecutive ranks over whole nodes runs
on the node's rails: NCCL gives each NIC its own channel, so the ring's node hops move through
every NIC of the node together (``gpus_per_node`` NICs' bandwidth, at most NVLink's). A strided
group (the replicas, or the shard group outside a model axis) has one NIC per ring, and so do
the experts' all-to-alls across nodes. A model axis (TP) takes consecutive ranks, the shard group strides over
it and the replicate group (HSDP) over both. An all-reduce is a reduce-scatter plus an
all-gather.

The schedule (:func:`step_schedule`) is a two-lane timeline, compute and communication, one lane
each (the collectives of one rank run one at a time on one stream):

* forward: the whole-step units are gathered first; layer ``i+1``'s gather is issued when layer
  ``i``'s compute starts (``prefetch``; else when it ends), and a compute waits for its gather;
* backward, in reverse: a layer released after forward is gathered again (issued when the layer
  after it starts its backward); each layer's reduce-scatter (and, with replicas, its
  all-reduce) is issued when its backward ends;
* the optimizer starts when the last reduction is done.
"""

from __future__ import annotations

from dataclasses import dataclass

from vfsdp.estimation.hardware import Hardware

__all__ = ["Link", "links", "ring", "step_schedule"]


@dataclass(frozen=True)
class Link:
    """A ring's effective rates: bytes/s per rank and direction, and seconds per step."""

    bandwidth: float
    latency: float


def links(hw: Hardware, shard: int, replicas: int, model: int = 1) -> tuple:
    """The shard group's, the replicate group's and the model axis's :class:`Link` on
    ``hw``. The mesh is ``(replicas, shard, model)`` from the outside in: the model axis
    (TP) takes consecutive ranks, the shard group strides over it, the replicate group over
    both."""
    intra = Link(hw.intra_bw * hw.comm_efficiency, hw.intra_latency)
    inter = Link(hw.inter_bw * hw.comm_efficiency, hw.inter_latency)
    node = hw.gpus_per_node
    # a ring over whole nodes of consecutive ranks: NCCL runs a channel per NIC (rail), so
    # each node's hop moves through all its NICs at once, up to the NVLink rate
    rails = Link(min(hw.intra_bw, hw.inter_bw * node) * hw.comm_efficiency, hw.inter_latency)
    return (intra if shard * model <= node else rails if model == 1 else inter,
            intra if shard * replicas * model <= node else inter,
            intra if model <= node else inter)


def ring(n: int, per_rank_bytes: float, link: Link) -> float:
    """Seconds of a ring all-gather or reduce-scatter over ``n`` ranks, ``per_rank_bytes``
    each (the shard's size)."""
    return 0.0 if n <= 1 else (n - 1) * (link.latency + per_rank_bytes / link.bandwidth)


def step_schedule(rest: list, layers: list, optimizer: float, prefetch: bool = True,
                  reshard_after_forward: bool = True) -> tuple:
    """The two-lane timeline (see the module docstring).

    Args:
        rest: The whole-step units as ``(gather_s, forward_s, backward_s, reduce_s)``: their
            forward runs before the layers' (half) and after (half), their backward likewise.
        layers: ``run_layers``' units, in order, as the same tuples.
        optimizer: Seconds of the update.
        prefetch: As ``run_layers``'.
        reshard_after_forward: As ``run_layers``'.

    Returns:
        ``(step, compute)``: seconds from the first gather to the end of the optimizer, and
        seconds of compute (forward and backward).
    """
    comm_free = 0.0  # when the communication lane is next free
    fwd, bwd = (sum(unit[k] for unit in rest) / 2 for k in (1, 2))  # the whole-step units' halves

    def issue(at: float, seconds: float) -> float:
        nonlocal comm_free
        comm_free = max(comm_free, at) + seconds
        return comm_free

    now = max([0.0] + [issue(0.0, g) for g, _, _, _ in rest]) + fwd  # the compute lane
    n = len(layers)
    done = {0: issue(now, layers[0][0])} if n else {}
    for i in range(n):  # forward
        start = max(now, done[i])
        now = start + layers[i][1]
        if i + 1 < n:
            done[i + 1] = issue(start if prefetch else now, layers[i + 1][0])
    now = now + fwd + bwd  # the head's forward, then backward (in this order)
    ready = dict.fromkeys(range(n), 0.0) if not reshard_after_forward else {n - 1: 0.0}
    last_reduce = 0.0
    for i in range(n - 1, -1, -1):  # backward
        if i not in ready:  # released after forward and not prefetched
            ready[i] = issue(now, layers[i][0])
        start = max(now, ready[i])
        if prefetch and i > 0 and i - 1 not in ready:
            ready[i - 1] = issue(start, layers[i - 1][0])
        now = start + layers[i][2]
        last_reduce = issue(now, layers[i][3])
    now += bwd  # the embedding's backward
    for _, _, _, r in rest:
        last_reduce = issue(now, r)
    return max(now, last_reduce) + optimizer, sum(f + b for _, f, b, _ in rest + layers)
