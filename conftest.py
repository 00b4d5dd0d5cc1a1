"""Doctest namespace: docstring examples may use torch, vfsdp and the placement names."""

import pytest
import torch

import vfsdp
from vfsdp.placements import RaggedShard, Replicate, flat_range


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(torch=torch, vfsdp=vfsdp, RaggedShard=RaggedShard,
                             Replicate=Replicate, flat_range=flat_range)
