"""Doctest namespace: docstring examples may use torch, dist, vfsdp and the core names."""

import pytest
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.collectives import DBuffer, Unit, resolve_groups, slot_of
from vfsdp.placements import RaggedShard, flat_range


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(torch=torch, dist=dist, vfsdp=vfsdp, RaggedShard=RaggedShard,
                             flat_range=flat_range, DBuffer=DBuffer, Unit=Unit,
                             resolve_groups=resolve_groups, slot_of=slot_of)
