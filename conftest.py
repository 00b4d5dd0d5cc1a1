"""Doctest namespace: docstring examples may use torch, dist, vfsdp and the core names."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import vfsdp
from vfsdp.collectives import DBuffer, Unit, resolve_groups, slot_of
from vfsdp.placements import RaggedShard, flat_range


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(torch=torch, dist=dist, vfsdp=vfsdp, RaggedShard=RaggedShard,
                             flat_range=flat_range, DBuffer=DBuffer, Unit=Unit,
                             resolve_groups=resolve_groups, slot_of=slot_of, Shard=Shard,
                             Replicate=Replicate)


_START = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    """Print the suite's wall time (CI shows it; the README states the budget)."""
    minutes = (time.monotonic() - _START) / 60
    terminalreporter.write_line(f"vfsdp suite runtime: {minutes:.1f} min "
                                f"(budget: about 10 min on 2 CPU cores)")
