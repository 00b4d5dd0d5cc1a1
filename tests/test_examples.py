"""The examples run end to end in their smallest configuration."""

import json
import os
import subprocess
import sys

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


def test_gpu_benchmark_runs_on_cpu_and_writes_its_records(tmp_path):
    """benchmarks/gpu_vs_fsdp2.py with --cpu: every system in its own torchrun job (gloo),
    one JSON record per configuration with the figures the GPU run reports."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_vs_fsdp2.py"), "--cpu", "--configs",
         "small", "--steps", "1", "--warmup", "1", "--opt-steps", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
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


def test_op_counts_benchmark_prints_equal_counts_at_both_sizes():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "op_counts.py"),
                           "--dims", "128", "256", "--layers", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["adamw", "adamw8bit", "muon"]
    for r in rows:  # name, params -> params, update -> update, step -> step
        assert r[4] == r[6] and r[7] == r[9], r
