"""Several plans in one checkpoint: an expert-parallel MoE's dense part (FSDP over every rank)
and its experts (dp x ep) saved as one atomic, checksummed checkpoint of named parts, each part
resharding on load on its own: (dp=2, ep=2) -> (dp=1, ep=4), (dp=2, ep=1) and one process,
parameters and AdamW moments bitwise. Tampering is caught per part, and mismatches name the
part, the tensor path and the fix."""

import json
import os
import shutil

import optree
import pytest
import torch

import vfsdp
from vfsdp.checkpoint import CheckpointError
from vfsdp.testing import moe, simulate


def _params():
    p = moe.moe_params(8, 12, 4)
    g = torch.Generator().manual_seed(3)
    return {"router": p["router"], "norm": torch.randn(8, generator=g)}, p["experts"]


def _setup(dp, ep, zero=False):
    """The two plans of one MoE layer: ``rest`` over every rank, ``experts`` over dp x ep."""
    rest, experts = _params()
    if zero:
        rest, experts = (optree.tree_map(torch.zeros_like, t) for t in (rest, experts))
    mesh = vfsdp.mesh(("dp", dp), ("ep", ep))
    r_spec = vfsdp.plan(rest, dp * ep)
    e_spec = vfsdp.plan(experts, mesh, tp=moe.ep_rule, tp_axis="ep")
    r, e = vfsdp.shard(rest, r_spec), vfsdp.shard(experts, e_spec, mesh=mesh)
    opt = vfsdp.optim.adamw(lr=1e-2, weight_decay=0.1)
    return mesh, (r, r_spec, opt.init(r, r_spec)), (e, e_spec, opt.init(e, e_spec)), opt


def _ranks(mesh):
    return torch.distributed.get_rank(), mesh.get_local_rank("dp")


def _piece(t, s, rank):
    """Rank ``rank``'s flat range of the global tensor ``t`` under the TensorSpec ``s``."""
    st = s.strided
    if st is not None and st.dim is not None:
        t = t.narrow(st.dim, st.start, st.lengths[st.index])
    return t.reshape(-1)[slice(*s.local_range(rank))]


def _train_save(dp, ep, path):
    """Two AdamW steps on fixed global gradients, then save both parts as one checkpoint."""
    mesh, (r, r_spec, r_st), (e, e_spec, e_st), opt = _setup(dp, ep)
    ranks = _ranks(mesh)
    full = _params()
    for step in range(1, 3):
        g = torch.Generator().manual_seed(7 + step)
        grads = optree.tree_map(lambda t: torch.randn(t.shape, generator=g), full)
        r_st = opt.update(optree.tree_map(lambda t, s: _piece(t, s, ranks[0]), grads[0],
                                          r_spec.tree), r_st, r, r_spec)
        e_st = opt.update(optree.tree_map(lambda t, s: _piece(t, s, ranks[1]), grads[1],
                                          e_spec.tree), e_st, e, e_spec)
    if path is not None:
        vfsdp.checkpoint.save(path, {"rest": ({"params": r, "opt": r_st, "step": 2}, r_spec),
                                     "experts": ({"params": e, "opt": e_st}, e_spec, mesh)})
    return _local(r, r_st, r_spec), _local(e, e_st, e_spec)


def _local(shards, state, spec):
    tree = state.checkpoint_tree(spec)
    flat = lambda t: t.detach().clone().reshape(-1)
    return {"params": optree.tree_map(flat, shards), "m": optree.tree_map(flat, tree["exp_avg"]),
            "v": optree.tree_map(flat, tree["exp_avg_sq"]), "step": state.step}


def _load(dp, ep, path):
    mesh, (r, r_spec, r_st), (e, e_spec, e_st), _ = _setup(dp, ep, zero=True)
    out = vfsdp.checkpoint.load(path, {"experts": ({"params": e, "opt": e_st}, e_spec, mesh),
                                       "rest": ({"params": r, "opt": r_st, "step": 0}, r_spec)})
    assert list(out) == ["experts", "rest"] and out["rest"]["step"] == 2
    return (_ranks(mesh), (r_spec, e_spec),
            (_local(r, out["rest"]["opt"], r_spec), _local(e, out["experts"]["opt"], e_spec)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("parts") / "ep2")
    simulate(4, _train_save, 2, 2, path)
    return path


@pytest.mark.parametrize("world, dp, ep", [(4, 1, 4), (2, 2, 1), (1, 1, 1)])
def test_each_part_reshards_bitwise(saved, world, dp, ep):
    """(dp=2, ep=2) -> another dp and ep: every rank's pieces equal the single-process run's
    tensors, sliced as the new plans cut them, bit for bit."""
    (want,) = simulate(1, _train_save, 1, 1, None)
    for ranks, specs, got in simulate(world, _load, dp, ep, saved):
        for i, (part, spec, rank) in enumerate(zip(got, specs, ranks)):
            assert part["step"] == 2
            for kind in ("params", "m", "v"):
                w = optree.tree_map(lambda t, s: _piece(t.reshape(s.global_shape), s, rank),
                                    want[i][kind], spec.tree)
                for a, b in zip(optree.tree_leaves(part[kind]), optree.tree_leaves(w)):
                    assert torch.equal(a, b), (i, kind)


def test_the_manifest_lists_the_parts_and_their_meshes(saved):
    with open(os.path.join(saved, "vfsdp.json")) as f:
        manifest = json.load(f)
    assert list(manifest["parts"]) == ["rest", "experts"]
    assert manifest["parts"]["experts"]["mesh"] == [["dp", 2], ["ep", 2]]
    assert manifest["parts"]["experts"]["model_axis"] == ["ep", 2]
    assert manifest["parts"]["rest"]["mesh"] is None
    names = [e["name"] for e in manifest["entries"]]
    assert "rest.params.router" in names and "experts.opt.exp_avg.w_up" in names


def _flip(saved, tmp_path, prefix):
    path = str(tmp_path / prefix)
    shutil.copytree(saved, path)
    with open(os.path.join(path, "vfsdp.json")) as f:
        items = json.load(f)["items"]
    _, (rel, offset, length, _) = next((k, v) for k, v in sorted(items.items())
                                       if k.startswith(prefix + "@"))
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(offset + length - 4)
        byte = f.read(1)
        f.seek(offset + length - 4)
        f.write(bytes([byte[0] ^ 0x10]))
    return path


def _try(fn, *args):
    try:
        return fn(*args)
    except (CheckpointError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("prefix", ["experts.params.w_down", "rest.opt.exp_avg.router"])
def test_tampering_is_caught_in_each_part(saved, tmp_path, prefix):
    path = _flip(saved, tmp_path, prefix)
    msg = simulate(4, _try, _load, 1, 4, path)[0]
    assert f"{prefix} is corrupt" in msg and "CRC-32" in msg, msg


def _bad_load(path, case):
    mesh, (r, r_spec, r_st), (e, e_spec, e_st), _ = _setup(2, 1, zero=True)
    rest, experts = ({"params": r, "opt": r_st, "step": 0}, r_spec), \
        ({"params": e, "opt": e_st}, e_spec, mesh)
    parts = {"one": {"rest": rest},
             "misnamed": {"rest": rest, "expert": experts},
             "subset": {"rest": rest},
             "as_one_tree": None,
             "swapped": {"rest": (rest[0], e_spec), "experts": experts},
             "list": [rest, experts],
             "not_a_tuple": {"rest": rest, "experts": [e, e_spec]},
             "dotted": {"rest": rest, "ex.perts": experts},
             "wrong_mesh": {"rest": rest, "experts": (*experts[:2], mesh["dp"])}}[case]
    if case == "as_one_tree":
        return _try(vfsdp.checkpoint.load, path, rest[0], r_spec)
    if case == "subset":
        out = vfsdp.checkpoint.load(path, parts, strict=False)
        return out["rest"]["step"], vfsdp.gather(r, r_spec)["norm"].detach().clone()
    return _try(vfsdp.checkpoint.load, path, parts)


@pytest.mark.parametrize("case, words", [
    ("one", ["holds part(s) ['experts'] that the load does not name", "strict=False"]),
    ("misnamed", ["has no part 'expert'", "holds parts ['rest', 'experts']",
                  "name the parts as they were saved"]),
    ("as_one_tree", ["holds parts ['rest', 'experts'], not one tree",
                     "load(path, {name: (tree, spec), ...})"]),
    ("swapped", ["ValueError", "part 'rest'", "rest.params.norm", "of another plan than the "
                 "part's spec", "pair each tree with the spec it was sharded with"]),
    ("list", ["has no part '0'", "name the parts as they were saved"]),
    ("not_a_tuple", ["TypeError", "part 'experts' is a list, not a (tree, spec)"]),
    ("dotted", ["part name 'ex.perts' is empty or holds a '.'"]),
    ("wrong_mesh", ["part 'experts''s mesh {'dp': 2} is not the one its spec was planned on "
                    "(2 data ranks x ep=1)", "pass the mesh its shards were made on"]),
])
def test_mismatches_name_the_part_and_the_fix(saved, case, words):
    msgs = simulate(2, _bad_load, saved, case)
    assert all(isinstance(m, str) for m in msgs), msgs   # every rank refuses
    for w in words:
        assert w in msgs[0], (w, msgs[0])


def test_strict_false_loads_a_subset_of_the_parts(saved):
    (want,) = simulate(1, _train_save, 1, 1, None)
    for step, norm in simulate(2, _bad_load, saved, "subset"):
        assert step == 2 and torch.equal(norm, want[0]["params"]["norm"])


def _one_tree(path):
    spec = vfsdp.plan({"w": torch.ones(6)}, 2)
    shards = vfsdp.shard({"w": torch.arange(6.0)}, spec)
    vfsdp.checkpoint.save(path, {"params": shards}, spec)
    return _try(vfsdp.checkpoint.load, path, {"model": ({"params": shards}, spec)})


def test_a_one_tree_checkpoint_loaded_as_parts_is_refused(tmp_path):
    msg = simulate(2, _one_tree, str(tmp_path / "one"))[0]
    assert "holds one tree (saved with a spec), not parts" in msg
    assert "load(path, tree, spec)" in msg


def _list_form(path):
    a_spec = vfsdp.plan({"w": torch.ones(5)}, 2)
    b_spec = vfsdp.plan({"v": torch.ones(3, 2)}, 2)
    a = vfsdp.shard({"w": torch.arange(5.0)}, a_spec)
    b = vfsdp.shard({"v": torch.arange(6.0).reshape(3, 2)}, b_spec)
    pending = vfsdp.checkpoint.save(path, [({"p": a, "n": 1}, a_spec), ({"p": b}, b_spec)],
                                    async_save=True)
    pending.wait()
    a2 = vfsdp.shard({"w": torch.zeros(5)}, a_spec)
    b2 = vfsdp.shard({"v": torch.zeros(3, 2)}, b_spec)
    out = vfsdp.checkpoint.load(path, [({"p": a2, "n": 0}, a_spec), ({"p": b2}, b_spec)])
    shape_err = _try(vfsdp.checkpoint.load, path,
                     [({"p": a2, "n": 0}, a_spec),
                      ({"p": vfsdp.shard({"v": torch.zeros(2, 3)},
                                         vfsdp.plan({"v": torch.ones(2, 3)}, 2))},
                       vfsdp.plan({"v": torch.ones(2, 3)}, 2))])
    return (out[0]["n"], vfsdp.gather(a2, a_spec)["w"].tolist(),
            vfsdp.gather(b2, b_spec)["v"].reshape(-1).tolist(), shape_err)


def test_the_list_form_saves_asynchronously_and_loads_back(tmp_path):
    n, w, v, err = simulate(2, _list_form, str(tmp_path / "list"))[0]
    assert (n, w, v) == (1, [0.0, 1.0, 2.0, 3.0, 4.0], [float(i) for i in range(6)])
    assert "1.p.v was saved as (3, 2) float32, the tree has (2, 3) float32" in err, err


def test_malformed_parts_are_refused_before_anything_is_written(tmp_path):
    def body(path):
        spec = vfsdp.plan({"w": torch.ones(4)}, 2)
        shards = vfsdp.shard({"w": torch.ones(4)}, spec)
        return [_try(vfsdp.checkpoint.save, path, bad) for bad in
                ({}, {"a": (shards,)}, {1: (shards, spec)}, {"a": (spec, shards)},
                 {"a": (shards, spec, "mesh")}, shards["w"])]
    path = str(tmp_path / "bad")
    msgs = simulate(2, body, path)[0]
    for m, w in zip(msgs, ["no parts given", "part 'a' is a tuple, not a (tree, spec)",
                           "part names must be strings", "has its spec where its tree goes",
                           "mesh must be the DeviceMesh", "got a Tensor"]):
        assert w in m, (w, m)
    assert not os.path.exists(path)


def _per_group(path, same):
    """Experts planned per ep group on its "dp" sub-mesh (no tp=): one name, and different
    tensors in the two groups unless ``same``."""
    m = vfsdp.mesh(("dp", 2), ("ep", 2))
    ep = m.get_local_rank("ep")
    mine = {"w": torch.arange(6.0) + (0 if same else 10 * ep)}
    spec = vfsdp.plan(mine, 2)
    e = vfsdp.shard(mine, spec, mesh=m["dp"])
    msg = _try(vfsdp.checkpoint.save, path, {"experts": (e, spec, m["dp"])})
    if msg is not None:
        return msg
    back = vfsdp.shard({"w": torch.zeros(6)}, spec, mesh=m["dp"])
    vfsdp.checkpoint.load(path, {"experts": (back, spec, m["dp"])})
    return vfsdp.gather(back, spec)["w"].tolist()


def test_different_tensors_under_one_name_are_refused_not_lost(tmp_path):
    """Each ep group's experts under one name would keep one group's (DCP stores one chunk per
    place): refused on every rank, naming the entry and the fix; equal copies save."""
    msgs = simulate(4, _per_group, str(tmp_path / "diff"), False)
    for m in msgs:
        assert "ranks write different data for the same elements of experts.w (6,)" in m, m
        assert "tp= over the axis that tells them apart" in m
    assert not os.path.exists(tmp_path / "diff")
    assert simulate(4, _per_group, str(tmp_path / "same"), True) == [list(range(6))] * 4
