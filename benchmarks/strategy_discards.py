"""How many of the cases ``vfsdp.testing.strategies`` draw hypothesis discards itself.

Hypothesis counts a draw as *invalid* when the strategy gives up on it (a draw that runs
past its data, a rejected sample); the test body never sees it. This file runs each public
strategy ``--examples`` times under pytest with ``--hypothesis-show-statistics`` and prints
``invalid / (passing + invalid)`` per strategy:

    python benchmarks/strategy_discards.py
    python benchmarks/strategy_discards.py --examples 1000
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from hypothesis import given, settings

from vfsdp.testing import strategies as vst

EXAMPLES = int(os.environ.get("VFSDP_DISCARD_EXAMPLES", "300"))
S = settings(max_examples=EXAMPLES, deadline=None, database=None)


@S
@given(vst.plans())
def test_plans(case):
    pass


@S
@given(vst.param_trees())
def test_param_trees(case):
    pass


@S
@given(vst.ragged_cases())
def test_ragged_cases(case):
    pass


@S
@given(vst.shapes())
def test_shapes(case):
    pass


@S
@given(vst.granularities())
def test_granularities(case):
    pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    args = parser.parse_args()
    env = dict(os.environ, VFSDP_DISCARD_EXAMPLES=str(args.examples))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", "--hypothesis-show-statistics", __file__],
                         capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    name = None
    for line in out.splitlines():
        found = re.search(r"::test_(\w+):", line)
        if found:
            name = found.group(1)
        counts = re.search(r"(\d+) passing, (\d+) failing, and (\d+) invalid", line)
        if counts and name:
            passing, invalid = int(counts.group(1)), int(counts.group(3))
            print(f"{name:14s} {invalid:5d} invalid of {passing + invalid:5d} drawn: "
                  f"{100 * invalid / (passing + invalid):5.1f} % discarded")
            name = None


if __name__ == "__main__":
    main()
