"""The examples run end to end in their smallest configuration."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_gather_demo_simulated_and_spawned():
    out = _run("examples/gather_demo.py", "--world-size", "3")
    assert out.returncode == 0, out.stderr
    assert "max |gradient error|" in out.stdout and "over 3 rank(s)" in out.stdout
    out = _run("examples/gather_demo.py", "--world-size", "2", "--spawn")
    assert out.returncode == 0, out.stderr


def _train_gpt_vs_one_process(tmp_path, *args):
    """Run the example with --png; return its max |loss - single-process loss|."""
    out = _run("examples/train_gpt.py", *args, "--png", str(tmp_path / "loss.png"),
               "--out", str(tmp_path / "run.json"))
    assert out.returncode == 0, out.stderr
    assert "loss curve saved" in out.stdout and (tmp_path / "loss.png").exists()
    return float(out.stdout.split("single-process loss| = ")[1].split(";")[0])


def test_train_gpt_smallest_config_matches_single_process(tmp_path):
    assert _train_gpt_vs_one_process(tmp_path, "--world-size", "2", "--steps", "3", "--dim", "32",
                                     "--layers", "2", "--ffn", "64") < 1e-5
    out = _run("examples/train_gpt.py", "--world-size", "2", "--steps", "2", "--dim", "32",
               "--layers", "1", "--experts", "3", "--simulate", "--param-dtype", "bf16",
               "--out", str(tmp_path / "moe.json"))
    assert out.returncode == 0, out.stderr


def test_train_gpt_with_8bit_adamw(tmp_path):
    assert _train_gpt_vs_one_process(tmp_path, "--world-size", "2", "--steps", "2", "--dim", "64",
                                     "--layers", "1", "--optim", "adamw8bit") < 1e-4


def test_train_gpt_with_muon(tmp_path):
    assert _train_gpt_vs_one_process(tmp_path, "--world-size", "3", "--steps", "2", "--dim", "64",
                                     "--layers", "2", "--optim", "muon") < 1e-4


def test_train_gpt_checkpoints_and_resumes_on_another_world_size(tmp_path):
    """Save at step 3 on 2 ranks, resume on 3 ranks: the same losses as running straight."""
    small = ["--steps", "5", "--dim", "32", "--layers", "2", "--ffn", "64", "--batch", "6"]
    ckpt = str(tmp_path / "ckpt")

    def losses(*extra):
        out = _run("examples/train_gpt.py", *small, *extra, "--simulate",
                   "--out", str(tmp_path / "run.json"))
        assert out.returncode == 0, out.stderr
        import json
        with open(tmp_path / "run.json") as f:
            return json.load(f)["losses"]

    straight = losses("--world-size", "2", "--ckpt", ckpt, "--save-every", "3", "--async-save")
    assert sorted(os.listdir(ckpt)) == ["step-3", "step-5"]
    resumed = losses("--world-size", "2", "--resume", os.path.join(ckpt, "step-3"))
    assert resumed == straight[3:]
    other = losses("--world-size", "3", "--resume", os.path.join(ckpt, "step-3"), "--batch", "4")
    assert len(other) == 2


# Tensor and expert parallelism against plain data parallelism over the same data ranks. Both
# run in fp32 from the same global weights (vfsdp.init.sharded gives each TP/EP piece the global
# tensor's values) on the same batches, so they differ only in the order of floating-point sums
# (row-parallel partial products summed over "tp", tokens' expert outputs computed on other
# ranks, gradients reduced over other groups): a few fp32 ulps per op, which 3 AdamW steps at
# lr 3e-3 keep near 1e-7 (observed: 0 for tp, <5e-7 for ep, at losses ~5.5 whose ulp is 4.8e-7).
# 1e-5 (about 20 ulps) leaves room for other BLAS builds while a real error fails: a gradient
# reduced over the wrong group changes the gradient norm by far more than 1e-5 relative (counting
# TP pieces twice made it 14% larger), and the losses follow within a step or two.
_PAR = ["--steps", "3", "--dim", "32", "--layers", "2", "--ffn", "64", "--batch", "4", "--seq",
        "32"]


def _train_gpt_record(tmp_path, name, *args):
    """Run train_gpt.py (or, after ``-m``, a launcher of it); return its JSON record."""
    path = tmp_path / f"{name}.json"
    launcher = () if args[0] == "-m" else ("examples/train_gpt.py",)
    out = _run(*launcher, *args, "--out", str(path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    record = json.loads(path.read_text())
    assert f"mesh: {record['mesh']} " in out.stdout  # the run says which mesh it used
    return record


def _assert_same_training(a, b):
    assert len(a["losses"]) == len(b["losses"]) == 3
    for key in ("losses", "grad_norms"):
        for x, y in zip(a[key], b[key]):
            assert abs(x - y) <= 1e-5 * max(1.0, abs(y)), (key, a[key], b[key])


def test_train_gpt_tensor_parallel_trains_like_data_parallel(tmp_path):
    """--tp 2 on 4 gloo processes (dp=2 x tp=2: the two ranks of a tp group read their dp
    rank's batch) against --tp 1 on 2 simulated ranks (dp=2): the same 2 batches per step."""
    plain = _train_gpt_record(tmp_path, "tp1", *_PAR, "--world-size", "2", "--simulate")
    tp = _train_gpt_record(tmp_path, "tp2", *_PAR, "--world-size", "4", "--tp", "2")
    assert (plain["mesh"], tp["mesh"]) == ("dp=2", "dp=2 x tp=2")
    _assert_same_training(tp, plain)


def test_train_gpt_expert_parallel_trains_like_data_parallel(tmp_path):
    """--ep 2 under torchrun (4 gloo processes, dp=2 x ep=2: 2 of the 4 top-2 routed experts
    per rank, every rank its own batch) against --ep 1 on 4 simulated ranks (dp=4, the same
    routed model whole on every rank)."""
    moe = ["--experts", "4", "--top-k", "2"]
    plain = _train_gpt_record(tmp_path, "ep1", *_PAR, *moe, "--world-size", "4", "--simulate")
    ep = _train_gpt_record(tmp_path, "ep2", "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", "examples/train_gpt.py", *_PAR, *moe,
                           "--ep", "2")
    assert (plain["mesh"], ep["mesh"]) == ("dp=4", "dp=2 x ep=2")
    _assert_same_training(ep, plain)


def _train_gpt_module():
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples",
                                                                            "train_gpt.py"))
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    return train_gpt


def test_train_gpt_expert_parallel_checkpoints_and_resumes(tmp_path):
    """--ep 2 --ckpt saves the two plans (the rest over every rank, the experts over dp x ep)
    as one checkpoint; --resume at --ep 2 continues bit for bit, and at --ep 4 (dp=1) the
    experts reshard. In-process, simulated, a tiny model: a few seconds."""
    train_gpt = _train_gpt_module()
    tiny = ["--world-size", "4", "--simulate", "--steps", "3", "--dim", "16", "--layers", "1",
            "--ffn", "16", "--heads", "2", "--kv-heads", "1", "--batch", "2", "--seq", "8",
            "--experts", "4", "--out", str(tmp_path / "run.json")]
    ckpt = str(tmp_path / "ckpt")

    def record(*extra):
        assert train_gpt.main([*tiny, *extra]) == 0
        return json.loads((tmp_path / "run.json").read_text())

    straight = record("--ep", "2", "--ckpt", ckpt, "--save-every", "2")
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-3"]
    with open(os.path.join(ckpt, "step-2", "vfsdp.json")) as f:
        assert list(json.load(f)["parts"]) == ["rest", "experts"]
    resumed = record("--ep", "2", "--resume", os.path.join(ckpt, "step-2"))
    assert resumed["losses"] == straight["losses"][2:]          # bitwise: the same floats
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    other = record("--ep", "4", "--resume", os.path.join(ckpt, "step-2"))
    assert other["mesh"] == "dp=1 x ep=4" and len(other["losses"]) == 1
    # another ep degree routes the same tokens to the same experts; only sums reorder
    assert abs(other["losses"][0] - straight["losses"][2]) < 1e-5


def test_train_gpt_refuses_parallel_degrees_it_cannot_run(capsys):
    train_gpt = _train_gpt_module()
    for argv, says in [(["--tp", "3"], "must be a multiple of --hsdp 1 x --tp 3"),
                       (["--tp", "4", "--kv-heads", "2"], "--kv-heads 2 must both be multiples"),
                       (["--tp", "2", "--ep", "2"], "--tp and --ep together"),
                       (["--ep", "2"], "give --experts E, a multiple of 2"),
                       (["--ep", "2", "--experts", "3"], "a multiple of 2 (got 3)"),
                       (["--experts", "2", "--top-k", "3"], "1 <= k <= E")]:
        with pytest.raises(SystemExit):
            train_gpt.parse(["--world-size", "4", *argv])
        assert says in capsys.readouterr().err, argv
    assert train_gpt.parse(["--ep", "2", "--experts", "4"]).top_k == 2  # routed by default


def test_gpu_benchmark_runs_on_cpu_and_writes_its_records(tmp_path):
    """benchmarks/gpu_vs_fsdp2.py with --cpu: every system in its own torchrun job (gloo),
    one JSON record per configuration with the figures the GPU run reports; the compiled
    vfsdp step against FSDP2 with one graph for every step. One run for all systems: each
    system's job starts its own processes, and the compiled one compiles."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_vs_fsdp2.py"), "--cpu", "--configs",
         "small", "--steps", "1", "--warmup", "1", "--opt-steps", "1", "--json", str(out),
         "--systems", "vfsdp", "fsdp2", "torch", "vfsdp_compiled"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (rec,) = json.loads(out.read_text())
    assert rec["config"] == "small" and rec["world"] == 2
    for system in ("vfsdp", "fsdp2"):
        r = rec[system]
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["launches"] > 0
        assert r["final_loss"] == r["final_loss"]  # not NaN
    assert set(rec["vfsdp"]["optimizer_s"]) == {"adamw", "adamw8bit", "muon"}
    assert set(rec["torch"]["optimizer_s"]) == {"adamw_fused", "muon_adamw"}
    assert "tokens/s" in proc.stdout and "kernel launches / step" in proc.stdout
    c = rec["vfsdp_compiled"]
    assert c["graphs"] == 1 and c["step_s"] > 0 and c["final_loss"] == c["final_loss"]
    assert "compiled vfsdp" in proc.stdout


def test_op_counts_benchmark_prints_equal_counts_at_both_sizes():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "op_counts.py"),
                           "--dims", "128", "256", "--layers", "2", "--unit-dim", "128"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes, tensors, units = proc.stdout.split("\n\n")
    rows = [line.split() for line in sizes.splitlines()[1:]]
    assert [r[0] for r in rows] == ["adamw", "adamw8bit", "muon", "offload(adamw)"]
    for r in rows:  # name, params -> params, update -> update, step -> step
        assert r[4] == r[6] and r[7] == r[9], r
    rows = [line.split() for line in tensors.splitlines()[1:]]  # name, ops -> ops (ratio)
    assert [r[0] for r in rows] == ["adamw8bit", "muon", "soap", "shampoo", "offload(adamw8bit)"]
    for r in rows:
        assert abs(int(r[3]) - int(r[1])) <= 0.1 * int(r[1]), r
    rows = [line.split() for line in units.splitlines()[1:]]  # the same, over 4x the units
    assert [r[0] for r in rows] == ["adamw", "adamw8bit", "clip"]
    for r in rows:
        assert int(r[3]) <= 1.1 * int(r[1]), r


def test_optim_benchmark_quick_prints_every_row():
    """benchmarks/optim_bench.py --quick: SOAP and Shampoo beside torch's AdamW and
    pytorch-optimizer's SOAP, a positive time in both layouts."""
    pytest.importorskip("pytorch_optimizer")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "optim_bench.py"),
                           "--quick"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line[:22].strip(): [float(x) for x in re.findall(r"([0-9.]+) s ", line[22:])]
            for line in proc.stdout.splitlines()[1:]}
    for name in ("torch AdamW", "vfsdp soap", "pytorch-optimizer SOAP", "vfsdp shampoo"):
        assert len(rows[name]) == 2 and min(rows[name]) > 0, (name, rows.get(name))


@pytest.mark.slow
def test_compile_benchmark_runs_and_compiles_one_graph():
    """The smallest run of benchmarks/compile_bench.py: it prints both rows and one graph."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_bench.py"),
                           "--steps", "3", "--dim", "32", "--layers", "1", "--ffn", "64",
                           "--seq", "16", "--batch", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "eager" in out and "compiled" in out
    assert "graphs compiled: 1 (1 = no recompiles)" in out, out


@pytest.mark.slow
def test_recompute_benchmark_rows_hold_less_with_checkpointing():
    """The smallest run of benchmarks/recompute_bench.py: every row printed, and each way of
    checkpointing holds less between forward and backward than none on the same path (Hugging
    Face's switch under apply.run_layers saved nothing before the run handed it the blocks'
    activations)."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "recompute_bench.py"),
                           "--hidden", "64", "--layers", "2", "--seq", "32", "--batch", "2",
                           "--vocab", "128", "--steps", "1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| apply")]
    assert len(rows) == 8, proc.stdout
    held = {(r[0], r[1]): float(r[3]) for r in rows}
    for (path, how), mib in held.items():
        if how != "none":
            assert mib < held[path, "none"], (path, how, held)


def test_train_hf_matches_one_process_and_exports_for_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    out = _run("examples/train_hf.py", "--model", "llama", "--world-size", "2", "--steps", "2",
               "--dim", "32", "--seq", "16", "--shard-bytes", "20000", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split("single-process loss| = ")[1].split()[0]) < 1e-5
    assert "from_pretrained logits differ by 0.0e+00" in out.stdout
    assert (tmp_path / "model.safetensors.index.json").exists()
