"""calibrate, and a step predicted from its profile (the tight figures are the benchmark's:
benchmarks/estimate_validation.py; here a bound no noisy machine breaks, but a wrong model
does)."""

import json
import os
import tempfile

import pytest

from tests.estimation import bodies
from vfsdp.cli import main
from vfsdp.estimation import hardware
from vfsdp.estimation.calibrate import calibrate
from vfsdp.testing import simulate, spawn
from vfsdp.testing.models import example_layer


def test_a_step_predicted_from_a_calibrated_profile_is_within_2x_of_the_measured():
    for r in spawn(bodies.calibrated_step, 2, 3, 4, 7, timeout=200):
        assert 0.5 < r["predicted"] / r["measured"] < 2.0, r


def test_calibrate_refuses_bad_sizes_and_writes_a_profile_hardware_reads():
    with pytest.raises(ValueError, match="two increasing byte counts"):
        calibrate(example_layer(), sizes=(10,))
    hw = simulate(2, calibrate, example_layer(), (2**10, 2**14), 1)[0]
    assert hw.gpus_per_node == 2 and hw.flops > 0 and hw.intra_bw > 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hw.json")
        hw.to_json(path)
        assert hardware(path) == hw
        with open(path, "w") as f:
            json.dump({"nope": 1}, f)
        with pytest.raises(ValueError, match="is not a profile"):
            hardware(path)


def test_the_cli_prints_a_row_per_count_and_writes_json_and_png(capsys):
    shapes = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "shapes",
                          "llama2-7b.json")
    with tempfile.TemporaryDirectory() as tmp:
        out, png = os.path.join(tmp, "e.json"), os.path.join(tmp, "s.png")
        assert main(["estimate", shapes, "--gpus", "8,64", "--hw", "h800", "--recompute",
                     "--tokens-per-gpu", "4096", "--vs", "fsdp2", "--json", out,
                     "--png", png]) == 0
        with open(out) as f:
            rows = json.load(f)
        assert [(r["system"], r["gpus"]) for r in rows] == [
            ("vfsdp", 8), ("fsdp2", 8), ("vfsdp", 64), ("fsdp2", 64)]
        assert all(r["memory_per_rank"] > 0 and r["tokens_per_s"] > 0 for r in rows)
        assert os.path.getsize(png) > 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "MFU%" in text
    assert main(["estimate", shapes, "--gpus", "8", "--hw", "nope"]) == 2
    # a count that is not a power-of-two multiple of a node: the shard group divides it
    assert main(["estimate", shapes, "--gpus", "24", "--hw", "h100", "--json", os.devnull]) == 0


def test_the_calibrate_command_writes_a_profile_on_the_ranks_it_runs_on(tmp_path, capsys):
    """Under a process group (here simulate's) ``python -m vfsdp calibrate`` measures on it;
    rank 0 writes the profile and says so."""
    out = tmp_path / "hw.json"
    assert simulate(2, main, ["calibrate", "--tokens", "16", "--repeats", "1",
                              "--out", str(out)]) == [0, 0]
    assert hardware(str(out)).gpus_per_node == 2
    assert f"wrote {out}: measured by vfsdp calibrate on 2 rank(s)" in capsys.readouterr().out
