import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.collectives.reference import all_gather_reference, all_reduce_reference
from vfsdp.collectives import reduce_scatter_reference


@given(st.integers(1, 9), st.integers(0, 5), st.sampled_from(["sum", "avg"]))
def test_reduce_scatter_then_gather_equals_all_reduce(m, s, op):
    gen = torch.Generator().manual_seed(m * 10 + s)
    bufs = [torch.randn(m * s, generator=gen, dtype=torch.float64) for _ in range(m)]
    shards = reduce_scatter_reference(bufs, op)
    assert all(x.numel() == s for x in shards)
    assert torch.allclose(all_gather_reference(shards), all_reduce_reference(bufs, op))


def test_errors():
    with pytest.raises(ValueError, match="rank 1"):
        all_gather_reference([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="op"):
        reduce_scatter_reference([torch.zeros(2)], "max")
    with pytest.raises(ValueError, match="split"):
        reduce_scatter_reference([torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError, match="none"):
        all_reduce_reference([])
