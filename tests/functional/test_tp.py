"""TP x FSDP: a Megatron MLP with its weights split over "tp" and FSDP-sharded over "dp"
trains like one process."""

import optree
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import vfsdp
from vfsdp import lax
from vfsdp.testing import simulate

D, F, T, LR, STEPS = 6, 10, 5, 1e-2, 3  # F % 4 != 0: uneven TP pieces at tp=4


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w_up": torch.randn(D, F, generator=g) / D ** 0.5,
            "w_down": torch.randn(F, D, generator=g) / F ** 0.5,
            "norm": torch.ones(D)}


def _rule(path):
    return {"w_up": Shard(1), "w_down": Shard(0)}.get(path[-1], Replicate())


def _data(step, group):
    g = torch.Generator().manual_seed(1000 * step + group)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _mlp(p, x, mesh=None):
    if mesh is None:
        h = torch.relu(x @ p["w_up"]) @ p["w_down"]
    else:
        h = lax.row_parallel(torch.relu(lax.column_parallel(x, p["w_up"], "tp", mesh=mesh)),
                             p["w_down"], "tp", mesh=mesh)
    return (x + h) * p["norm"]


def _tp_fsdp(dp, tp, replicas=1):
    """(replicas x dp) data-parallel ranks (HSDP when replicas > 1) times tp."""
    if replicas > 1:
        mesh = vfsdp.mesh(("rep", replicas), ("dp", dp), ("tp", tp))
        data_mesh, data_shape = mesh["rep", "dp"], (replicas, dp)
        group = mesh.get_local_rank("rep") * dp + mesh.get_local_rank("dp")
    else:
        mesh = vfsdp.mesh(("dp", dp), ("tp", tp))
        data_mesh, data_shape = mesh["dp"], dp
        group = mesh.get_local_rank("dp")  # tp ranks of one dp group see the same batch
    groups = replicas * dp
    local = lax.tp_local(_params(), _rule, "tp", mesh=mesh)
    spec = vfsdp.plan(local, data_shape)
    shards = vfsdp.shard(local, spec, mesh=data_mesh)
    opt = vfsdp.optim.adamw(lr=LR, weight_decay=0.0)
    state = opt.init(shards, spec)
    for step in range(STEPS):
        vfsdp.zero_grads(shards, spec)
        x, y = _data(step, group)
        full = vfsdp.gather(shards, spec, mesh=data_mesh, grad_reduce="sum")
        loss = (_mlp(full, x, mesh) - y).pow(2).mean() / groups  # summed: the mean
        loss.backward()
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    full = vfsdp.gather(shards, spec, mesh=data_mesh)
    return {k: v.detach().clone() for k, v in full.items()}


def _reference(dp):
    params = optree.tree_map(lambda t: t.clone().requires_grad_(True), _params())
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.0, foreach=False)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum((_mlp(params, _data(step, g)[0]) - _data(step, g)[1]).pow(2).mean() / dp
                   for g in range(dp))
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize("replicas, dp, tp", [(1, 2, 2), (1, 1, 4), (1, 4, 1), (2, 2, 2)])
def test_tp_times_fsdp_trains_like_one_process(replicas, dp, tp):
    """(2, 2, 2): HSDP (replicate x shard) times TP, 8 simulated ranks."""
    want = _reference(replicas * dp)
    for rank, got in enumerate(simulate(replicas * dp * tp, _tp_fsdp, dp, tp, replicas)):
        i = rank % tp  # this rank's index along "tp"
        pieces = {k: (want[k].tensor_split(tp, _rule((k,)).dim)[i]
                      if isinstance(_rule((k,)), Shard) else want[k]) for k in want}
        for k, v in got.items():
            assert torch.allclose(v, pieces[k], atol=1e-5), (rank, k)


def test_tp_local_names_the_path_when_the_rule_is_wrong():
    def body():
        m = vfsdp.mesh(("tp", 2))
        try:
            lax.tp_local({"w": torch.ones(2)}, lambda p: "split", "tp", mesh=m)
        except ValueError as exc:
            return str(exc)
        return "no error"

    assert "returned 'split' for w; return torch.distributed.tensor.Shard" in \
        simulate(2, body)[0]


def _step_counts(dp, tp):
    from vfsdp.collectives import counts, reset_counts

    mesh = vfsdp.mesh(("dp", dp), ("tp", tp))
    local = lax.tp_local(_params(), _rule, "tp", mesh=mesh)
    spec = vfsdp.plan(local, dp)
    shards = vfsdp.shard(local, spec, mesh=mesh["dp"])
    opt = vfsdp.optim.adamw(lr=LR, weight_decay=0.0)
    state = opt.init(shards, spec)
    for step in range(2):  # the second step: nothing left from set-up
        vfsdp.zero_grads(shards, spec)
        x, y = _data(step, 0)
        reset_counts()
        full = vfsdp.gather(shards, spec, mesh=mesh["dp"], grad_reduce="sum")
        ((_mlp(full, x, mesh) - y).pow(2).mean() / dp).backward()
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    (unit,) = spec.units.values()
    return dict(counts()), unit.shard_numel


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 4)])
def test_communication_per_step_is_the_analytic_count(dp, tp):
    """Per rank and step: FSDP gathers and reduce-scatters the TP-local unit over "dp"
    (m * S * 4 bytes each); TP sums the row-parallel output (T * D * 4 bytes; the input
    needs no gradient, so pvary's backward sum does not run); the backward's agreement on
    which units ran is two small all-reduces (24 + 1 bytes)."""
    for got, s in simulate(dp * tp, _step_counts, dp, tp):
        assert got == {"all_gather": 1, "all_gather_bytes": dp * s * 4,
                       "reduce_scatter": 1, "reduce_scatter_bytes": dp * s * 4,
                       "all_reduce": 1, "all_reduce_bytes": T * D * 4,
                       "backward_marks": 2, "backward_marks_bytes": 24 + 1}
