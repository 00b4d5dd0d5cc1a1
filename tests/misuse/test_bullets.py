"""One test per bullet of the "Safe by default" issue that the table's rows do not already cover.

(The gradient-semantics property over every option combination lives in
``tests/functional/test_grad_semantics.py``.)
"""

import os

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
import vfsdp.checkpoint as ckpt
from tests.misuse import bodies as b
from vfsdp.testing import RankError, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------ gradients


def _retain_and_autograd():
    spec = vfsdp.plan({"w": torch.ones(8)}, dist.get_world_size())
    shards = vfsdp.shard({"w": torch.ones(8)}, spec)
    full = vfsdp.gather(shards, spec, free_after_backward=True)
    loss = (full["w"] ** 2).sum()
    loss.backward(retain_graph=True)
    loss.backward()                                   # the retained graph runs again
    twice = shards["w"].grad.tolist()
    full = vfsdp.gather(shards, spec, grads="buffer")
    none = torch.autograd.grad(full["w"].sum(), [shards["w"]], allow_unused=True)[0]
    return twice, none, vfsdp.grads(shards, spec)["w"].tolist()


def test_retain_graph_and_autograd_grad_follow_torch():
    for twice, none, buffered in simulate(2, _retain_and_autograd):
        assert twice == [4.0] * 4          # 2 * w, twice
        assert none is None                # grads="buffer" hands autograd nothing ...
        assert buffered == [1.0] * 4       # ... the gradient is in the buffer


# ------------------------------------------------------------------ no use after free


def _views_after_free_after_backward():
    spec = vfsdp.plan({"w": torch.ones(8)}, dist.get_world_size())
    shards = vfsdp.shard({"w": torch.ones(8)}, spec)
    full = vfsdp.gather(shards, spec, free_after_backward=True)
    full["w"].sum().backward()
    try:
        full["w"] + 1
    except RuntimeError as exc:
        return type(full["w"]).__name__, str(exc)
    return "no error", ""


def _probe_released_views():
    spec = vfsdp.plan({"w": torch.ones(8)}, dist.get_world_size())
    shards = vfsdp.shard({"w": torch.ones(8)}, spec)
    with torch.no_grad():  # no graph keeps the memory past the release
        full = vfsdp.gather(shards, spec)
    mem = vfsdp.testing.LiveBytes().track(shards, full)
    with mem:
        vfsdp.release(shards, spec)
        torch.ones(4).add_(1.0)  # an op under the probe, which samples the released views
    t = full["w"]
    return (type(t).__name__, t.untyped_storage().nbytes(), t.stride(), t.storage_offset(),
            t.is_contiguous(), mem.peak > 0)


def test_memory_probes_read_where_released_views_point_without_reading_them():
    """Metadata that does not read memory works on a ReleasedTensor (vs_fsdp2's LiveBytes
    tracks gathered trees across releases)."""
    for kind, nbytes, stride, offset, contiguous, measured in simulate(2, _probe_released_views):
        assert (kind, nbytes, stride, offset, contiguous, measured) == (
            "ReleasedTensor", 0, (1,), 0, True, True)


def test_views_of_a_unit_freed_after_backward_raise_naming_the_unit():
    kind, msg = simulate(2, _views_after_free_after_backward)[0]
    assert kind == "ReleasedTensor"
    assert msg.startswith("w (unit <root>) was released; gather the unit again (vfsdp.gather)")


# ------------------------------------------------------------------ frozen


def _frozen_with(name):
    params = {"layers": [{"w": torch.randn(32, 32, generator=torch.Generator().manual_seed(i)),
                          "v": torch.randn(32, 32, generator=torch.Generator().manual_seed(9))}
                         for i in range(2)]}
    opt = {"adamw8bit": vfsdp.optim.adamw8bit(min_8bit_numel=16),
           "muon": vfsdp.optim.muon(lr=0.05, weight_decay=0.1)}[name]
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    shards["layers"][0]["v"].requires_grad_(False)
    state = opt.init(shards, spec)
    full = vfsdp.gather(shards, spec, grads="buffer")
    sum(((p["w"] @ p["v"]) ** 2).sum() for p in full["layers"]).backward()
    opt.update(vfsdp.grads(shards, spec), state, shards, spec)
    after = vfsdp.gather(shards, spec)
    return (torch.equal(after["layers"][0]["v"], params["layers"][0]["v"]),
            not torch.equal(after["layers"][0]["w"], params["layers"][0]["w"]),
            not torch.equal(after["layers"][1]["v"], params["layers"][1]["v"]))


@pytest.mark.parametrize("name", ["adamw8bit", "muon"])
def test_every_optimizer_leaves_frozen_tensors_alone(name):
    for frozen_kept, trained, other_trained in simulate(2, _frozen_with, name):
        assert frozen_kept and trained and other_trained


# ------------------------------------------------------------------ tied


def test_ties_by_shared_storage_and_refused_overlaps():
    base = torch.zeros(10, 4)
    view_a, view_b = base[2:6], base[2:6]          # two objects, one view of one storage
    spec = vfsdp.plan({"a": view_a, "b": view_b, "c": base[6:]}, 2)
    assert dict(spec.ties) == {("b",): ("a",)}
    assert len(list(spec.tensors())) == 2
    with pytest.raises(ValueError, match="share memory but are different views of it"):
        vfsdp.plan({"a": base[2:6], "b": base[4:8]}, 2)


def _tied_under_torch_func():
    w = torch.arange(8.0)
    spec = vfsdp.plan({"embed": w, "head": w}, dist.get_world_size())
    shards = vfsdp.shard({"embed": w, "head": w}, spec)

    def loss(s):
        full = vfsdp.gather(s, spec)
        return (full["embed"] * 2).sum() + (full["head"] * 3).sum()

    g = torch.func.grad(loss)(shards)
    return g["embed"].tolist(), g["head"].tolist()


def test_a_tied_tensors_gradient_under_torch_func_sits_at_its_first_place():
    """As the docs say of tied parameters: the sum at the first place in the tree, zeros at the others."""
    for embed, head in simulate(2, _tied_under_torch_func):
        assert embed == [5.0] * len(embed) and head == [0.0] * len(head)


def _tied_checkpoint(path, save):
    w = torch.arange(24.0).reshape(6, 4)
    params = {"embed": w, "head": w}
    spec = vfsdp.plan(params, dist.get_world_size())
    if save:
        shards = vfsdp.shard(params, spec)
        opt = vfsdp.optim.adamw()
        ckpt.save(path, {"p": shards, "opt": opt.init(shards, spec)}, spec)
        return None
    zero = torch.zeros(6, 4)
    shards = vfsdp.shard({"embed": zero, "head": zero}, spec)
    ckpt.load(path, {"p": shards, "opt": vfsdp.optim.adamw().init(shards, spec)}, spec)
    full = vfsdp.gather(shards, spec)
    return full["embed"].tolist(), shards["embed"] is shards["head"]


def test_tied_tensors_checkpoint_and_reshard(tmp_path):
    path = str(tmp_path / "tied")
    simulate(2, _tied_checkpoint, path, True)
    for embed, same in simulate(3, _tied_checkpoint, path, False):
        assert same and embed == torch.arange(24.0).reshape(6, 4).tolist()


# ------------------------------------------------------------------ ranks agree


def _extra_gather_on_rank0():
    spec = vfsdp.plan({"w": torch.ones(8)}, dist.get_world_size())
    shards = vfsdp.shard({"w": torch.ones(8)}, spec)
    with torch.set_grad_enabled(dist.get_rank() == 0):  # differentiable on rank 0 only
        vfsdp.gather(shards, spec)["w"].sum()
    full = vfsdp.gather(shards, spec)
    try:
        full["w"].sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_gather_differently_raise_at_the_backward():
    for msg in simulate(2, _extra_gather_on_rank0):
        assert "ranks made different numbers of differentiable gathers" in msg, msg


def test_the_spec_is_checked_once_per_group():
    assert simulate(3, b.unit_probe) == [1, 1, 1]


# ------------------------------------------------------------------ inputs


def _meta_without_values():
    spec = vfsdp.plan({"w": torch.empty(4, device="meta")}, dist.get_world_size())
    try:
        vfsdp.shard({"w": torch.empty(4, device="meta")}, spec)
    except ValueError as exc:
        return str(exc)


def _wrong_init_size():
    spec = vfsdp.plan({"layers": [{"w": torch.empty(8, device="meta")}]}, dist.get_world_size())
    try:
        vfsdp.shard({"layers": [{"w": torch.empty(8, device="meta")}]}, spec,
                    init_fn=lambda path, local, t: torch.zeros(3))
    except ValueError as exc:
        return str(exc)


def test_bad_values_name_the_path_and_the_fix():
    msg = simulate(2, _meta_without_values)[0]
    assert "w is a meta tensor, which holds no values" in msg and "init_fn" in msg
    msg = simulate(2, _wrong_init_size)[0]
    assert "init_fn returned 3 values" in msg and "layers.0.w" in msg
    with pytest.raises(ValueError, match=r"x is torch\.complex64; complex tensors are not supported"):
        vfsdp.plan({"x": torch.zeros(3, dtype=torch.complex64)}, 2)
    with pytest.raises(TypeError, match="got a ShardSpec; plan takes the parameter tree"):
        vfsdp.plan(vfsdp.plan({"w": torch.ones(2)}, 1), 1)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: vfsdp.optim.adamw(lr=-1e-3), "adamw: lr must be >= 0, got -0.001"),
    (lambda: vfsdp.optim.adamw(eps=float("nan")), "adamw: eps must be >= 0, got nan"),
    (lambda: vfsdp.optim.adamw8bit(betas=(0.9, 1.0)), r"adamw8bit: betas must be in \[0, 1\)"),
    (lambda: vfsdp.optim.adamw8bit(weight_decay=-0.1), "adamw8bit: weight_decay must be >= 0"),
    (lambda: vfsdp.optim.muon(momentum=1.5), r"muon: momentum must be in \[0, 1\), got 1.5"),
    (lambda: vfsdp.optim.muon(lr=-0.02), "muon: lr must be >= 0, got -0.02"),
])
def test_every_optimizer_refuses_bad_hyperparameters_naming_itself(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ------------------------------------------------------------------ checkpoints, runners, docs


def _doc(name: str) -> str:
    with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
        return f.read()


def test_the_docs_state_what_a_load_verifies_and_the_spmd_contract():
    checkpoints = _doc("checkpoints.md")
    assert "## What a load verifies" in checkpoints and "No arbitrary unpickling" in checkpoints
    assert "## The SPMD contract" in _doc("concepts.md")
    import importlib

    sim = importlib.import_module("vfsdp.testing.simulate")
    assert "functional_call" in sim.__doc__ and "functional_call" in _doc("runners.md")


def test_old_checkpoints_load_with_a_warning(tmp_path):
    import json

    path = str(tmp_path / "c")

    def save():
        spec = vfsdp.plan({"w": torch.ones(4)}, 1)
        ckpt.save(path, {"p": vfsdp.shard({"w": torch.ones(4)}, spec)}, spec)

    simulate(1, save)
    manifest = os.path.join(path, "vfsdp.json")
    with open(manifest) as f:
        data = json.load(f)
    data["version"] = 1  # as vfsdp 0.1 wrote it: no checksum
    del data["checksum"]
    with open(manifest, "w") as f:
        json.dump(data, f)

    def load():
        spec = vfsdp.plan({"w": torch.zeros(4)}, 1)
        shards = vfsdp.shard({"w": torch.zeros(4)}, spec)
        ckpt.load(path, {"p": shards}, spec)
        return shards["w"].tolist()

    with pytest.warns(FutureWarning, match="saved by vfsdp 0.1"):
        assert simulate(1, load) == [[1.0] * 4]


def test_simulate_refuses_world_size_zero_and_reports_rank_errors():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        simulate(0, b.unit_probe)
    with pytest.raises(RankError):
        simulate(2, _meta_raises_everywhere)


def _meta_raises_everywhere():
    raise ValueError("boom")


def _shards_as_gradients():
    params = {"w": torch.ones(4, 2), "b": torch.ones(2)}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.adamw(lr=0.1)
    state = opt.init(shards, spec)
    opt8 = vfsdp.optim.adamw8bit()
    state8 = opt8.init(shards, spec)
    before = [t.detach().clone() for t in optree.tree_leaves(shards)]
    out = []
    for call in (lambda: vfsdp.clip_grad_norm(shards, spec, 0.5),
                 lambda: vfsdp.optim.global_norm(shards, spec),
                 lambda: opt.update(shards, state, shards, spec),
                 lambda: opt8.update(shards, state8, shards, spec)):
        with pytest.raises(ValueError, match=r"is a parameter shard, not a gradient: pass "
                                             r"vfsdp\.grads\(shards, spec\)") as info:
            call()
        out.append(str(info.value).split(":")[0])
    unchanged = all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves(shards)))
    return out, unchanged


def test_shards_passed_as_gradients_are_refused_before_anything_changes():
    """clip_grad_norm(shards, ...), torch's clip_grad_norm_(params) habit, scaled the
    parameters silently; an update read them as gradients."""
    for names, unchanged in simulate(2, _shards_as_gradients):
        assert names == ["vfsdp.clip_grad_norm", "vfsdp.global_norm", "adamw.update",
                         "adamw8bit.update"]
        assert unchanged


def _three_dim_int_mesh():
    spec = vfsdp.plan({"w": torch.ones(8)}, (2, 2, 2))
    with pytest.raises(ValueError, match=r"planned for \(2, 2, 2\): plan for \(4, 2\) "
                                         r"\(replicate, shard\)"):
        vfsdp.shard({"w": torch.ones(8)}, spec)
    return True


def test_a_three_dim_int_mesh_is_refused_by_vfsdp_naming_the_2d_plan():
    """It failed inside torch's DeviceMesh ("mesh_shape and mesh_dim_names should have same
    length")."""
    assert all(simulate(8, _three_dim_int_mesh))


def _conflicting_tie_labels():
    w = torch.randn(64, 8)
    params = {"io": {"embed": w, "head": w}, "b": torch.zeros(8)}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    adamw, adamw8bit = vfsdp.optim.adamw, vfsdp.optim.adamw8bit
    out = []
    for opt in (vfsdp.optim.partition({"d": adamw(), "n": adamw(weight_decay=0.0)},
                                      lambda p: "d" if p[-1] == "embed" else "n"),
                adamw(weight_decay_mask=lambda p: p[-1] == "embed"),
                adamw8bit(weight_decay_mask=lambda p: p[-1] == "head"),
                # only= of the matrix optimizers: the tied tensor was never updated
                *(getattr(vfsdp.optim, kind)(only=lambda p: p[-1] == "head")
                  for kind in ("muon", "soap", "shampoo")),
                vfsdp.optim.chain(adamw()),
                ):
        try:
            opt.init(shards, spec)
            out.append("ok")
        except ValueError as exc:
            out.append(str(exc).split(",")[0])
    agreeing = vfsdp.optim.partition({"d": adamw(), "n": adamw(weight_decay=0.0)},
                                     lambda p: "d" if p[-1] in ("embed", "head") else "n")
    agreeing.init(shards, spec)
    return out


def test_a_tied_tensor_gets_one_answer_from_labels_and_masks():
    """The optimizers ask about a tied tensor at its first place; a different label or mask at
    the repeat was ignored silently (found by a fresh reader)."""
    for out in simulate(2, _conflicting_tie_labels):
        assert out == ["partition: labels gives 'd' at io.embed but 'n' at io.head",
                       "adamw.init: weight_decay_mask gives True at io.embed but False at io.head",
                       "adamw8bit.init: weight_decay_mask gives False at io.embed but True at "
                       "io.head", *(f"{kind}.init: only gives False at io.embed but True at "
                                    f"io.head" for kind in ("muon", "soap", "shampoo")), "ok"]
