"""One test per row of the "Safe by default" issue's table: each asserts the right answer or the
exact error. Cases that used to crash the process run in subprocesses and must exit cleanly."""

import json
import math
import os
import pickle
import signal
import subprocess
import sys

import optree
import pytest
import torch

import vfsdp
import vfsdp.checkpoint as ckpt
from tests.misuse import bodies as b
from vfsdp.testing import RankError, simulate, spawn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_row01_reused_shards_read_1_2_3_and_clip_sees_the_true_norm():
    for seen, norms in simulate(2, b.reused_shards_gradients):
        assert seen == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
        assert [round(n, 4) for n in norms] == [round(k * math.sqrt(8), 4) for k in (1, 2, 3)]


@pytest.mark.parametrize("mode, accumulate, want", [
    ("return", None, 3.0), ("return", True, 3.0),    # torch: gradients accumulate in .grad
    ("buffer", True, 3.0),                            # accumulate_grads adds into the buffer
    ("buffer", None, 3.0),                            # as torch: the second adds (0.2: 2.0)
])
def test_row02_two_backwards_without_zeroing(mode, accumulate, want):
    for got in simulate(2, b.two_backwards, accumulate, mode):
        assert got == [want] * 4


CRASHERS = {
    "read_after_release": "error RuntimeError: v (unit <root>) was released; gather the unit again",
    "release_before_backward": "result 128.0",
    "saved_tensor_after_free": "result 256.0",
    "grad_after_zero_grads": "its gradients were zeroed with set_to_none",
    "returned_grad_after_zero_grads": "result (8.0, None)",
    # tensors made from the views keep the memory they were made from, and its values
    "derived_views_after_release": "result ([16.0, 16.0, 12.0, 16.0], [16.0, 16.0, 12.0, 16.0])",
    "derived_grad_view_after_zero_grads": "result (24.0, 24.0, 8.0)",
    # d/dw (w^2 + w^3) = 2 + 3 at w = 1, over 8 elements; f1's tensors released after both
    "gathered_twice_freed_after_backward": "result (8.0, 40.0, 'ReleasedTensor')",
    "state_views_after_export": "error RuntimeError: v (unit <root>) was released",
    "update_with_grads_from_before_zero_grads": "its gradients were zeroed with set_to_none",
}


@pytest.mark.parametrize("case", sorted(CRASHERS))
def test_row03_no_use_after_free_is_ever_a_crash(case):
    out = subprocess.run([sys.executable, os.path.join(HERE, "crash_scripts.py"), case],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # never -11 (SIGSEGV)
    assert CRASHERS[case] in out.stdout, out.stdout + out.stderr[-2000:]
    assert "vfsdp" not in out.stderr, out.stderr[-2000:]  # nothing to warn about


def test_row04_frozen_tensors_get_no_gradient_update_or_decay():
    w_ref, _ = b.frozen_reference()
    for reduced, frozen_b, frozen_w, trained in simulate(2, b.frozen_layer):
        assert reduced == 1                    # the fully frozen unit is not reduce-scattered
        assert frozen_b == [1.0] * 4           # no update, no weight decay (was 0.99)
        assert frozen_w == [[1.0] * 4] * 4
        assert torch.allclose(torch.tensor(trained), w_ref, atol=1e-6)  # = torch AdamW


@pytest.mark.parametrize("mesh", [1, 2, 3, (2, 2)])
def test_row05_tied_embedding_and_head_stay_one_tensor(mesh):
    want = torch.tensor(b.tied_reference())
    world = mesh if isinstance(mesh, int) else 4
    for same_object, embed, head, n_states in simulate(world, b.tied, mesh):
        assert same_object and n_states == 1 and embed == head
        assert torch.allclose(torch.tensor(embed), want, atol=1e-6)


@pytest.mark.parametrize("how", ["layout", "size", "granularity", "replan"])
def test_row06_ranks_that_plan_differently_all_get_an_error(how):
    # replan: rank 1's plan equals the one both agreed on, rank 0's differs; the check is
    # remembered per spec object, so both run it again (not rank 0 alone: a hang)
    for msg in simulate(2, b.different_plans, how, timeout=60):
        assert "ranks hold different specs" in msg and "unit <root>" in msg, msg
        if how in ("granularity", "replan"):
            assert "same size" in msg and "different layout" in msg, msg


@pytest.mark.parametrize("mode", ["return", "buffer"])
def test_row07_a_unit_unused_on_some_ranks_does_not_hang(mode):
    results = simulate(2, b.unused_on_some_ranks, mode, timeout=60)
    # the mean over 2 ranks of d(loss)/dw: layers.1 only on rank 0 (5 / 2)
    for got in results:
        assert got == [[2.0] * 4, [2.5] * 4, [3.0] * 4]
    gloo = spawn(b.unused_on_some_ranks, 2, mode, timeout=120)
    assert gloo == results


UNUSED_CASES = [
    ("gather", skip, opts, False) for skip in b.SKIPS
    for opts in ({"grads": "return"}, {"grads": "buffer", "free_after_backward": True})
] + [
    ("run_layers", skip, opts, False) for skip in b.SKIPS if skip != "none"
    for opts in ({}, {"prefetch": False}, {"async_reduce": False},
                 {"reshard_after_forward": False})
] + [  # with an evaluation forward (gradients on, other skips, graph dropped) before each step
    ("gather", "middle_on_rank1", {"grads": "buffer"}, True),
    ("gather", "first_on_rank0", {"grads": "return", "free_after_backward": True}, True),
    ("run_layers", "middle_on_rank1", {}, True),
    ("run_layers", "last_on_all_but_rank0", {"prefetch": False}, True),
]


@pytest.mark.parametrize(("path", "skip", "options", "evaluate"), UNUSED_CASES,
                         ids=[f"{p}-{s}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              f"{'-after-eval' if e else ''}" for p, s, o, e in UNUSED_CASES])
def test_row07_units_unused_on_some_ranks_with_the_gathered_tree_dropped(path, skip, options,
                                                                          evaluate):
    """The tree is dropped before backward (a helper returns only the loss; run_layers drops
    each unit's tree): the unused units still reduce, in step with the other ranks; an
    evaluation forward whose graph is dropped changes nothing."""
    world = 4 if skip == "last_on_all_but_rank0" else 2
    results = simulate(world, b.unused_dropped, path, skip, options, evaluate, timeout=60)
    params = optree.tree_map(lambda t: t.clone().requires_grad_(), b.skip_params())
    loss = sum(b.skip_loss(params, r, b.SKIPS[skip]) for r in range(world)) / world
    loss.backward()
    spec = vfsdp.plan(b.skip_params(), world)
    got = vfsdp.testing.gather_reference(results, spec)
    for path_, g, p in zip(optree.tree_paths(params), optree.tree_leaves(got),
                           optree.tree_leaves(params)):
        assert torch.allclose(g, p.grad, atol=1e-6), path_


def test_rows_01_to_08_give_the_same_results_on_gloo_processes_as_on_threads():
    threads = simulate(2, b.rows_on_gloo, timeout=120)
    gloo = spawn(b.rows_on_gloo, 2, timeout=240)
    for row in threads[0]:
        assert [t[row] for t in gloo] == [t[row] for t in threads], row
    assert threads[0]["03"] == "w (unit <root>) was released"


@pytest.mark.parametrize("path", ["gather", "run_layers"])
def test_row08_changing_a_shard_between_forward_and_backward_raises(path):
    for msg in simulate(2, b.modified_between, path):
        assert "layers.0.w was modified in place after vfsdp.gather used it" in msg, msg


def test_row09_torch_func_grad_over_gather_on_gloo_processes():
    got = spawn(b.func_grad, 2)
    # plain torch: d/dw sum(w^2) = 2w, d/db sum(b) = 1, the same on both ranks (mean = itself),
    # cut into each rank's pieces by the reference split
    spec = vfsdp.plan({"w": torch.arange(8.0), "b": torch.ones(3)}, 2)
    want = vfsdp.testing.shard_reference({"w": 2 * torch.arange(8.0), "b": torch.ones(3)}, spec)
    assert got == [(p["w"].tolist(), p["b"].tolist()) for p in want]
    assert got == simulate(2, b.func_grad)  # threads agree with gloo processes


def test_row10_modules_and_generators_are_refused_with_the_fix():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"pass dict\(model\.named_parameters\(\)\)"):
        vfsdp.plan(model, 2)
    with pytest.raises(TypeError, match="iterator"):
        vfsdp.plan(model.parameters(), 2)
    spec = vfsdp.plan(dict(model.named_parameters()), 1)
    with pytest.raises(TypeError, match=r"pass dict\(model\.named_parameters\(\)\)"):
        vfsdp.shard(model, spec)


def test_row11_swapped_arguments_and_run_layers_with_the_sub_spec():
    spec = vfsdp.plan({"w": torch.ones(4)}, 1)
    with pytest.raises(TypeError, match=r"arguments are swapped: call vfsdp.gather\(tree, spec\)"):
        vfsdp.gather(spec, {"w": torch.ones(4)})
    with pytest.raises(TypeError, match="spec must be the ShardSpec"):
        vfsdp.gather({"w": torch.ones(4)}, {"w": torch.ones(4)})

    def body():
        params = {"layers": [{"w": torch.eye(3)} for _ in range(2)]}
        spec = vfsdp.plan(params, 2)
        shards = vfsdp.shard(params, spec)
        return vfsdp.run_layers(lambda p, h: h @ p["w"], shards["layers"], spec["layers"],
                                torch.ones(1, 3)).tolist()

    assert simulate(2, body) == [[[1.0, 1.0, 1.0]]] * 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_row12_clip_refuses_nan_inf_and_negative_max_norm(bad):
    spec = vfsdp.plan({"w": torch.ones(4)}, 1)
    with pytest.raises(ValueError, match="max_norm must be a finite number >= 0"):
        vfsdp.clip_grad_norm({"w": torch.ones(4)}, spec, bad)


def _save(path):
    def body():
        spec = vfsdp.plan({"w": torch.arange(8.0)}, 1)
        shards = vfsdp.shard({"w": torch.arange(8.0)}, spec)
        ckpt.save(path, {"p": shards, "step": 5}, spec)

    simulate(1, body)


def _load(path):
    def body():
        spec = vfsdp.plan({"w": torch.zeros(8)}, 1)
        shards = vfsdp.shard({"w": torch.zeros(8)}, spec)
        return ckpt.load(path, {"p": shards, "step": 0}, spec)["step"]

    return simulate(1, body)[0]


class _Payload:
    """What an attacker would put in a .metadata: unpickling it would create a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_row13_a_crafted_metadata_pickle_never_runs(tmp_path):
    from vfsdp.checkpoint.storage import manifest_checksum

    path = str(tmp_path / "c")
    _save(path)
    marker = str(tmp_path / "pwned")
    meta = pickle.dumps(_Payload(marker))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(meta)
    import zlib

    with open(os.path.join(path, "vfsdp.json")) as f:  # the attacker fixes sizes and CRCs
        manifest = json.load(f)
    manifest["files"][".metadata"] = len(meta)
    manifest["metadata_crc"] = zlib.crc32(meta)
    manifest["checksum"] = manifest_checksum(manifest)
    with open(os.path.join(path, "vfsdp.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(RankError, match=r"refers to \S*open, which a DCP metadata file never"):
        _load(path)
    assert not os.path.exists(marker)


def test_row14_an_edited_manifest_is_refused(tmp_path):
    path = str(tmp_path / "c")
    _save(path)
    assert _load(path) == 5
    manifest = os.path.join(path, "vfsdp.json")
    with open(manifest) as f:
        text = f.read()
    assert '"value": 5' in text
    with open(manifest, "w") as f:
        f.write(text.replace('"value": 5', '"value": 9'))
    with pytest.raises(RankError, match=r"vfsdp\.json was edited after the save"):
        _load(path)


def test_row15_concurrent_saves_never_delete_each_others_work(tmp_path):
    path = str(tmp_path / "c")
    live = tmp_path / "c.partial-live"
    dead = tmp_path / "c.partial-dead"
    foreign = tmp_path / "c.partial-nolock"
    import socket

    for d, pid in ((live, os.getpid()), (dead, _dead_pid())):
        d.mkdir()
        (d / "vfsdp.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                  "started": 0}))
    foreign.mkdir()
    _save(path)
    assert live.exists() and foreign.exists()  # maybe a save in progress: left alone
    assert not dead.exists()                   # provably dead: removed
    assert _load(path) == 5


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_row16_simulate_recovers_after_a_hang_and_restores_the_excepthook():
    hook = sys.excepthook
    with pytest.raises(RankError) as info:
        simulate(2, _waits_alone, timeout=3)
    assert "rank 1 did not finish within 3 s; waiting in the collective" in str(info.value) \
        or "waiting in the collective" in info.value.failures.get(1, "")
    assert sys.excepthook is hook
    assert simulate(2, _rank) == [0, 1]                     # no poisoned state afterwards
    first = simulate(2, _seeded_params)
    assert first[0] == first[1]                             # seeded alike: identical params
    ranks = simulate(2, _rank_seeded)
    assert ranks[0] != ranks[1]                             # seeded by rank: different


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _waits_alone():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(1))  # rank 0 never joins


def _waits_for_a_sleeper():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(1))  # rank 0 never joins: it is busy elsewhere
    else:
        time.sleep(60)


def _seeded_params():
    torch.manual_seed(0)
    return torch.randn(5).tolist()


def _rank_seeded():
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    return torch.randn(3).tolist()


def test_row16_per_rank_seeding_works_as_under_torchrun():
    a, c = simulate(2, _rank_seeded)
    assert a == torch.randn(3, generator=torch.Generator().manual_seed(0)).tolist()
    assert c == torch.randn(3, generator=torch.Generator().manual_seed(1)).tolist()


def test_row16_leftover_rank_threads_are_refused_with_a_message():
    import time

    t0 = time.monotonic()
    with pytest.raises(RankError, match="busy in"):  # raised after ~5 s: it waits for stacks
        simulate(2, _sleeps, 8.0, timeout=1)
    with pytest.raises(RuntimeError, match="of an earlier simulate are still running"):
        simulate(2, _rank)
    time.sleep(max(8.0 - (time.monotonic() - t0), 0.0))
    for _ in range(40):  # once the sleepers are done (a moment after 8 s), it runs again
        try:
            assert simulate(2, _rank) == [0, 1]
            break
        except RuntimeError as exc:
            assert "still running" in str(exc)
            time.sleep(0.25)
    else:
        raise AssertionError("simulate still refused 10 s after the sleepers should have ended")


def _sleeps(seconds):
    import time

    time.sleep(seconds)


def test_row17_spawn_explains_notebook_functions_and_names_signals(monkeypatch):
    import types

    def nested():
        return 1

    with pytest.raises(ValueError, match="lambda or a nested function"):
        spawn(nested, 2)
    fake_main = types.ModuleType("__main__")  # a notebook: __main__ has no __file__
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    f = types.FunctionType(_rank.__code__, {}, "cell_fn")
    f.__module__ = "__main__"
    f.__qualname__ = "cell_fn"
    with pytest.raises(ValueError, match="notebook or an interactive session"):
        spawn(f, 2)
    monkeypatch.undo()
    with pytest.raises(RankError) as info:
        spawn(_segfaults_on_rank1, 2, timeout=60)
    assert "rank 1 was killed by SIGSEGV" in info.value.failures[1]
    assert "Fatal Python error" in info.value.failures[1]  # its stderr: faulthandler's stack


def _segfaults_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return 0


def test_row17_spawn_names_the_collective_a_hung_rank_waits_in():
    with pytest.raises(RankError) as info:
        spawn(_waits_for_a_sleeper, 2, timeout=12)
    msg = info.value.failures[1]
    assert "rank 1 did not finish within 12 s" in msg
    assert "waiting in the collective all_reduce" in msg, msg


def test_row18_the_main_job_saves_its_curve_before_the_reference(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import train_gpt
    finally:
        sys.path.pop(0)

    def boom(args, world):
        raise RuntimeError("the reference run died")

    monkeypatch.setattr(train_gpt, "reference", boom)
    out = tmp_path / "curve.json"
    with pytest.raises(RuntimeError, match="the reference run died"):
        train_gpt.main(["--simulate", "--world-size", "2", "--steps", "3", "--dim", "32",
                        "--layers", "1", "--ffn", "64", "--seq", "16", "--batch", "2",
                        "--out", str(out), "--png", str(tmp_path / "curve.png")])
    saved = json.loads(out.read_text())
    assert len(saved["losses"]) == 3 and saved["reference"] is None
    assert (tmp_path / "curve.png").exists()
