"""The examples run end to end in their smallest configuration."""

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
