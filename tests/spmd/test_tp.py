"""TP x FSDP: a Megatron MLP with its weights split over "tp" and FSDP-sharded over "dp"
trains like one process."""

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

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


def _tp_fsdp(dp, tp, replicas=1, tp_local=False, clip=None):
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
    if tp_local:  # TP-local tensors planned as any tree over the data mesh
        local = lax.tp_local(_params(), _rule, "tp", mesh=mesh)
        spec = vfsdp.plan(local, data_shape)
        shards = vfsdp.shard(local, spec, mesh=data_mesh)
    else:  # the global tensors, split by the plan (StridedRaggedShard); runs on the full mesh
        spec = vfsdp.plan(_params(), mesh, tp=_rule)
        shards = vfsdp.shard(_params(), spec, mesh=mesh)
        data_mesh = mesh
    opt = vfsdp.optim.adamw(lr=LR, weight_decay=0.0)
    state = opt.init(shards, spec)
    norms = []
    for step in range(STEPS):
        vfsdp.zero_grads(shards, spec)
        x, y = _data(step, group)
        full = vfsdp.gather(shards, spec, grad_reduce="sum")
        loss = (_mlp(full, x, mesh) - y).pow(2).mean() / groups  # summed: the mean
        loss.backward()
        if clip is not None:  # the norm adds the tp pieces, counts "norm" (replicated) once
            norms.append(float(vfsdp.clip_grad_norm(vfsdp.grads(shards, spec), spec, clip,
                                                    mesh=data_mesh)))  # .grad: plain pieces
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    full = vfsdp.gather(shards, spec)
    out = {k: v.detach().clone() for k, v in full.items()}
    return (out, norms) if clip is not None else out


def _reference(dp, clip=None):
    params = optree.tree_map(lambda t: t.clone().requires_grad_(True), _params())
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.0, foreach=False)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum((_mlp(params, _data(step, g)[0]) - _data(step, g)[1]).pow(2).mean() / dp
                   for g in range(dp))
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), clip)))
        opt.step()
    out = {k: v.detach() for k, v in params.items()}
    return (out, norms) if clip is not None else out


@pytest.mark.parametrize("replicas, dp, tp, tp_local", [
    (1, 2, 2, False), (1, 1, 4, False), (1, 4, 1, False), (2, 2, 2, False), (1, 2, 2, True),
    (2, 2, 2, True)])
def test_tp_times_fsdp_trains_like_one_process(replicas, dp, tp, tp_local):
    """(2, 2, 2): HSDP (replicate x shard) times TP, 8 simulated ranks. tp_local: the pieces
    cut by lax.tp_local and planned as a plain tree, instead of vfsdp.plan(..., tp=rule)."""
    want = _reference(replicas * dp)
    for rank, got in enumerate(simulate(replicas * dp * tp, _tp_fsdp, dp, tp, replicas,
                                        tp_local)):
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
        full = vfsdp.gather(shards, spec, grad_reduce="sum")
        ((_mlp(full, x, mesh) - y).pow(2).mean() / dp).backward()
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    (unit,) = spec.units.values()
    return dict(counts()), unit.shard_numel


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 4)])
def test_communication_per_step_is_the_analytic_count(dp, tp):
    """Per rank and step: FSDP gathers and reduce-scatters the TP-local unit over "dp"
    (m * S * 4 bytes each); TP sums the row-parallel output (T * D * 4 bytes; the input
    needs no gradient, so pvary's backward sum does not run), after the ranks agree on its
    shape (one all-gather of 9 int64s per rank); the backward's agreement on
    which units ran is two small all-reduces (24 + 1 bytes)."""
    for got, s in simulate(dp * tp, _step_counts, dp, tp):
        assert got == {"all_gather": 1, "all_gather_bytes": dp * s * 4,
                       "reduce_scatter": 1, "reduce_scatter_bytes": dp * s * 4,
                       "all_reduce": 1, "all_reduce_bytes": T * D * 4,
                       "shape_exchange": 1, "shape_exchange_bytes": tp * 9 * 8,
                       "backward_marks": 2, "backward_marks_bytes": 24 + 2 * 64}



def _export(dp, tp):
    mesh = vfsdp.mesh(("dp", dp), ("tp", tp))
    p = {"w_up": torch.randn(6, 8), "w_down": torch.randn(8, 6), "odd": torch.randn(4, 10)}
    rule = {"w_up": Shard(1), "w_down": Shard(0), "odd": Shard(1)}
    spec = vfsdp.plan(p, mesh, tp=lambda path: rule[path[-1]], units=lambda path: path,
                      granularity=vfsdp.rows(1))
    shards = vfsdp.shard(p, spec, mesh=mesh)
    kept = vfsdp.to_dtensor(shards, spec, mesh=mesh, ragged="keep")
    out = {k: (tuple(v.placements), torch.equal(v.full_tensor(), p[k]))
           if isinstance(v, DTensor) else "kept" for k, v in kept.items()}
    try:
        vfsdp.to_dtensor(shards, spec, mesh=mesh)
    except ValueError as exc:
        out["error"] = str(exc)
    out["text"] = vfsdp.visualize(spec, unit=("w_up",))
    return out


def test_to_dtensor_exports_tp_x_fsdp_where_dtensor_can_and_says_why_not():
    got = simulate(4, _export, 2, 2)[0]
    # columns over tp, rows over dp: [Shard(0), Shard(1)] on (dp, tp), the global tensor
    assert got["w_up"] == ((Shard(0), Shard(1)), True)
    assert got["odd"] == ((Shard(0), Shard(1)), True)
    # rows over tp, then the piece's rows over dp (tp-major): DTensor orders mesh dims
    # data-major, so it has no placement for this
    assert got["w_down"] == "kept"
    assert "w_down has no DTensor layout: the data axes split its tp-piece by rows too" \
        in got["error"]
    assert "Shard(1) over tp" in got["text"] and "the tp=0 piece" in got["text"]
    # 10 columns over 4: tensor_split gives (3, 3, 2, 2), DTensor's chunk (3, 3, 3, 1)
    got = simulate(4, _export, 1, 4)[0]
    assert got["odd"] == "kept"
    assert "(3, 3, 2, 2), DTensor's Shard(1) (torch.chunk) (3, 3, 3, 1)" in got["error"]


def _misuse():
    mesh = vfsdp.mesh(("dp", 2), ("tp", 2))
    spec = vfsdp.plan(_params(), mesh, tp=_rule)
    errors = []
    for call in (lambda: vfsdp.shard(_params(), spec),                      # no mesh
                 lambda: vfsdp.shard({**_params(), "w_up": torch.ones(6, 7)}, spec, mesh=mesh)):
        try:
            call()
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_a_tp_plan_without_its_mesh_or_with_a_wrong_shape_says_what_to_pass():
    no_mesh, shape = simulate(4, _misuse)[0]
    assert "pass the mesh it was planned on (mesh=vfsdp.mesh(..., ('tp', 2)))" in no_mesh
    assert "w_up has shape (6, 7); the spec wants the global (6, 10) or this rank's " \
           "Shard(1) over tp: 5 of 10 at 0 (index 0/2) piece (6, 5)" in shape


@pytest.mark.parametrize("replicas, dp, tp", [(1, 2, 2), (1, 1, 4), (2, 2, 2)])
def test_clip_grad_norm_of_a_tp_plan_equals_torch_over_the_whole_model(replicas, dp, tp):
    want, want_norms = _reference(replicas * dp, clip=0.05)
    for rank, (got, norms) in enumerate(simulate(replicas * dp * tp, _tp_fsdp, dp, tp,
                                                 replicas, False, 0.05)):
        assert norms == pytest.approx(want_norms, rel=1e-5) and min(norms) > 0.05
        i = rank % tp
        for k, v in got.items():
            w = want[k].tensor_split(tp, _rule((k,)).dim)[i] \
                if isinstance(_rule((k,)), Shard) else want[k]
            assert torch.allclose(v, w, atol=1e-5), (rank, k)
