"""``vfsdp.plan(..., tp=rule)``: the model-axis split (StridedRaggedShard) against a loop over
(model index, data rank), its checkpoint boxes, and the errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

import vfsdp
from tests.placements.reference import strided_assemble_reference, strided_split_reference
from vfsdp.collectives.piece import tensor_piece
from vfsdp.placements import StridedRaggedShard, split_lengths
from vfsdp.testing.strategies import shapes


@st.composite
def cases(draw):
    shape = draw(shapes(max_dims=3, max_side=9))
    dim = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1))) if shape else None
    return (shape, dim, draw(st.integers(1, 4)), draw(st.integers(1, 5)),
            draw(st.sampled_from([None, "rows"])))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_pieces_equal_a_loop_over_model_index_and_data_rank(case):
    """Each rank's flat range of each index's piece is exactly what the reference loop (cut
    with tensor_split, then RaggedShard) gives; the pieces reassemble the global tensor; and
    the checkpoint boxes of each range cover exactly those global elements."""
    shape, dim, n, m, gran = case
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    rule = (lambda p: Replicate()) if dim is None else (lambda p: Shard(dim))
    kw = {"granularity": vfsdp.rows(1)} if gran and len(shape) > 1 else {}
    specs = [vfsdp.plan({"w": full}, (("dp", m), ("tp", n)), tp=rule, tp_index=i, **kw)
             for i in range(n)]
    ts = [s.tensor(("w",)) for s in specs]
    assert all(s.mesh_shape == (m,) and s.mesh_dim_names == ("dp",) for s in specs)
    assert all(t.global_shape == tuple(shape) for t in ts)
    ref = strided_split_reference(full, n, dim, [t.placement for t in ts])
    pieces = {}
    for i, t in enumerate(ts):
        st_ = t.strided
        piece = full if dim is None else full.tensor_split(n, dim)[i]
        assert tuple(piece.shape) == st_.local_shape == tuple(t.shape)
        for r in range(m):
            lo, hi = t.local_range(r)
            mine = piece.reshape(-1)[lo:hi]
            assert torch.equal(mine, ref[(i, r)].reshape(-1))
            pieces[(i, r)] = mine
            p = tensor_piece(t, mine.clone(), r)
            covered = torch.cat([full[tuple(slice(o, o + z) for o, z in zip(offs, sizes))]
                                 .reshape(-1) for offs, sizes in p.boxes()]) \
                if p.boxes() and mine.numel() else torch.zeros(0)
            assert torch.equal(covered, mine)  # boxes in flat order, data = the range
            assert p.writer == (dim is not None or i == 0)
    back = strided_assemble_reference(pieces, n, dim, [t.placement for t in ts], shape)
    assert torch.equal(back, full)


def test_a_tie_stays_one_tensor_and_plans_are_deterministic():
    w = torch.empty(8, 6, device="meta")
    a = vfsdp.plan({"embed": w, "head": w}, (("dp", 2), ("tp", 2)), tp=lambda p: Shard(0),
                   tp_index=1)
    b = vfsdp.plan({"embed": w, "head": w}, (("dp", 2), ("tp", 2)), tp=lambda p: Shard(0),
                   tp_index=1)
    assert a == b and hash(a) == hash(b) and dict(a.ties) == {("head",): ("embed",)}
    other = vfsdp.plan({"embed": w, "head": w}, (("dp", 2), ("tp", 2)), tp=lambda p: Shard(0),
                       tp_index=0)
    assert other != a and a.model_axis == ("tp", 2, 1)
    assert "the tp=1 piece of a 2-way tp split" in repr(a)


def test_split_lengths_are_tensor_splits():
    for n in range(12):
        for k in range(1, 5):
            assert split_lengths(n, k) == tuple(len(c) for c in torch.arange(n).tensor_split(k))


@pytest.mark.parametrize("kwargs, mesh, match", [
    ({"tp": lambda p: "cols"}, (("dp", 2), ("tp", 2)), r"returned 'cols' for w; return"),
    ({"tp": lambda p: Shard(2)}, (("dp", 2), ("tp", 2)), r"Shard\(2\) for w of shape \(4, 6\)"),
    ({"tp": lambda p: Shard(0)}, (2, 2), r"splits over the mesh axis 'tp', but the mesh has"),
    ({"tp": lambda p: Shard(0), "tp_axis": "ep"}, (("dp", 2), ("tp", 2)), r"axis 'ep'"),
    ({"tp": lambda p: Shard(0)}, (("tp", 2),), r"no data axis besides 'tp'"),
])
def test_errors_name_the_path_and_the_fix(kwargs, mesh, match):
    kwargs = {"tp_index": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        vfsdp.plan({"w": torch.empty(4, 6)}, mesh, **kwargs)


def test_tp_index_is_needed_without_a_device_mesh():
    with pytest.raises(ValueError, match="say which 'tp' index"):
        vfsdp.plan({"w": torch.empty(4, 6)}, (("dp", 2), ("tp", 2)), tp=lambda p: Shard(0))
    with pytest.raises(ValueError, match="tp_index= without tp="):
        vfsdp.plan({"w": torch.empty(4, 6)}, 2, tp_index=0)
    with pytest.raises(ValueError, match=r"tp_index must be an int in \[0, 2\)"):
        vfsdp.plan({"w": torch.empty(4, 6)}, (("dp", 2), ("tp", 2)), tp=lambda p: Shard(0),
                   tp_index=2)


def test_strided_shard_is_validated_data():
    with pytest.raises(ValueError, match="index 2 outside an axis of 2 ranks"):
        StridedRaggedShard("tp", 2, 2, 0, (4,))
    with pytest.raises(ValueError, match="dim 1 outside shape"):
        StridedRaggedShard("tp", 2, 0, 1, (4,))


def test_a_tie_with_two_placements_is_refused_naming_both_paths():
    """A tied tensor whose paths the tp= rule places differently was planned with the first
    path's placement, silently."""
    w = torch.empty(8, 4, device="meta")
    mesh = (("dp", 2), ("tp", 2))
    with pytest.raises(ValueError, match=r"head is the same tensor as embed \(a tie\), but tp= "
                                         r"places it Shard\(0\) there and Replicate\(\) here"):
        vfsdp.plan({"embed": w, "head": w}, mesh, tp_index=0,
                   tp=lambda p: Shard(0) if p[0] == "embed" else Replicate())
    spec = vfsdp.plan({"embed": w, "head": w}, mesh, tp_index=0, tp=lambda p: Shard(0))
    assert spec.ties == {("head",): ("embed",)}
