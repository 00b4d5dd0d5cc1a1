"""Checkpoints of TP x FSDP and EP x FSDP plans reshard across model-axis degrees bitwise:
tp 2 -> 1 -> 4, ep 2 -> 4, and expert stacks cut on their hidden dim to whole experts per
rank, parameters and AdamW moments (a StridedRaggedShard piece is stored as boxes of the global
tensor)."""

import os

import optree
import torch
from torch.distributed.tensor import Replicate, Shard

import vfsdp
from vfsdp.testing import moe, simulate


def _mlp():
    g = torch.Generator().manual_seed(0)
    return {"w_up": torch.randn(6, 10, generator=g), "w_down": torch.randn(10, 6, generator=g),
            "norm": torch.randn(6, generator=g), "scale": torch.randn((), generator=g)}


def _mlp_rule(path):
    return {"w_up": Shard(1), "w_down": Shard(0)}.get(path[-1], Replicate())


MODELS = {"tp": (_mlp, _mlp_rule), "ep": (lambda: moe.moe_params(8, 12, 4), moe.ep_rule),
          "etp": (lambda: moe.moe_params(8, 12, 4), moe.etp_rule)}


def _piece(t, s, rank):
    """Rank ``rank``'s flat range of the tensor ``t`` (global) under the TensorSpec ``s``."""
    st = s.strided
    if st is not None and st.dim is not None:
        t = t.narrow(st.dim, st.start, st.lengths[st.index])
    return t.reshape(-1)[slice(*s.local_range(rank))]


def _setup(model, axis, dp, n, zero=False):
    make, rule = MODELS[model]
    mesh = vfsdp.mesh(("dp", dp), (axis, n))
    params = make()
    if zero:
        params = optree.tree_map(torch.zeros_like, params)
    spec = vfsdp.plan(params, mesh, tp=rule, tp_axis=axis)
    shards = vfsdp.shard(params, spec, mesh=mesh)
    opt = vfsdp.optim.adamw(lr=1e-2, weight_decay=0.1)
    return mesh, make(), spec, shards, opt, opt.init(shards, spec)


def _train_save(model, axis, dp, n, path):
    mesh, params, spec, shards, opt, state = _setup(model, axis, dp, n)
    rank = mesh.get_local_rank("dp")
    for step in range(1, 3):
        g = torch.Generator().manual_seed(7 + step)
        full_g = optree.tree_map(lambda t: torch.randn(t.shape, generator=g), params)
        state = opt.update(optree.tree_map(lambda t, s: _piece(t, s, rank), full_g, spec.tree),
                           state, shards, spec)
    if path is not None:
        vfsdp.checkpoint.save(path, {"params": shards, "opt": state}, spec, overwrite=True)
    return _local_state(shards, state, spec)


def _local_state(shards, state, spec):
    tree = state.checkpoint_tree(spec)
    return {"params": optree.tree_map(lambda t: t.detach().clone().reshape(-1), shards),
            "m": optree.tree_map(lambda t: t.detach().clone().reshape(-1), tree["exp_avg"]),
            "v": optree.tree_map(lambda t: t.detach().clone().reshape(-1), tree["exp_avg_sq"])}


def _load(model, axis, dp, n, path, resave=None):
    mesh, _, spec, shards, _opt, state = _setup(model, axis, dp, n, zero=True)
    tree = vfsdp.checkpoint.load(path, {"params": shards, "opt": state}, spec)
    if resave is not None:
        vfsdp.checkpoint.save(resave, tree, spec, overwrite=True)
    return mesh.get_local_rank("dp"), spec, _local_state(shards, tree["opt"], spec)


def _expect(model, axis, got_runs):
    """Each rank's pieces equal the single-process run's global tensors, sliced."""
    (want,) = simulate(1, _train_save, model, axis, 1, 1, None)
    for rank, spec, got in got_runs:
        for kind in ("params", "m", "v"):
            w = optree.tree_map(lambda t, s: _piece(t.reshape(s.global_shape), s, rank),
                                want[kind], spec.tree)
            for a, b in zip(optree.tree_leaves(got[kind]), optree.tree_leaves(w)):
                assert torch.equal(a, b), kind


def test_tp_2_to_1_to_4_bitwise(tmp_path):
    a, b = os.path.join(tmp_path, "tp2"), os.path.join(tmp_path, "tp1")
    simulate(4, _train_save, "tp", "tp", 2, 2, a)
    _expect("tp", "tp", simulate(2, _load, "tp", "tp", 2, 1, a, b))   # tp 1, saved again
    _expect("tp", "tp", simulate(4, _load, "tp", "tp", 1, 4, b))      # tp 4: 10 -> 3,3,2,2


def test_ep_2_to_4_bitwise(tmp_path):
    a = os.path.join(tmp_path, "ep2")
    simulate(4, _train_save, "ep", "ep", 2, 2, a)
    _expect("ep", "ep", simulate(4, _load, "ep", "ep", 1, 4, a))
    _expect("ep", "ep", simulate(2, _load, "ep", "ep", 1, 2, a))


def test_expert_stacks_cut_on_their_hidden_dim_reshard_to_any_cut_bitwise(tmp_path):
    """[E, D, H] stacks cut on dim 2 (and [E, H, D] on dim 1) at (dp, ep) = (2, 2) load at
    (1, 4) with the same cut, and with whole experts per rank (dim 0), and back."""
    a, b = os.path.join(tmp_path, "etp2"), os.path.join(tmp_path, "ep4")
    simulate(4, _train_save, "etp", "ep", 2, 2, a)
    _expect("etp", "ep", simulate(4, _load, "etp", "ep", 1, 4, a))
    _expect("ep", "ep", simulate(4, _load, "ep", "ep", 1, 4, a, b))   # saved again, dim 0
    _expect("etp", "ep", simulate(2, _load, "etp", "ep", 1, 2, b))


def _save_8bit(path, n):
    mesh = vfsdp.mesh(("dp", 4 // n), ("tp", n))
    opt = vfsdp.optim.adamw8bit(lr=1e-2, min_8bit_numel=16)
    params = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    spec = vfsdp.plan(params, mesh, tp=lambda p: Shard(1), granularity=opt.granularity)
    shards = vfsdp.shard(params, spec, mesh=mesh)
    state = opt.init(shards, spec)
    state = opt.update({"w": torch.ones_like(shards["w"])}, state, shards, spec)
    try:
        tree = vfsdp.checkpoint.load(path, {"params": shards, "opt": state}, spec) \
            if os.path.exists(path) else None
    except Exception as exc:  # noqa: BLE001 - the message is the point
        return str(exc)
    if tree is None:
        vfsdp.checkpoint.save(path, {"params": shards, "opt": state}, spec)
    return "ok"


def test_8bit_state_reloads_at_its_tp_degree_and_names_the_entry_at_another(tmp_path):
    path = os.path.join(tmp_path, "q")
    assert simulate(4, _save_8bit, path, 2) == ["ok"] * 4
    assert simulate(4, _save_8bit, path, 2) == ["ok"] * 4      # the same degree reloads
    msg = simulate(4, _save_8bit, path, 4)[0]                  # its tiles are per TP piece
    assert "scales_m.w" in msg, msg
    assert "the mesh changed (saved on data mesh (2,), tp=2, loading on data mesh (1,), tp=4)" \
        in msg   # what differs
    assert "load the parameters alone" in msg
