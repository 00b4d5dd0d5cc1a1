"""The optimizer's state counted by its own ``init`` on ``meta`` shards: over only a rank's
tensors where the optimizer declares its state local (``Optimizer.local_state``), the same
count as over all of them, in a space of trees, meshes and plans: shard groups up to 17
(primes, ranks of pure padding), HSDP up to 3 replicas, four dtypes, 0-size and 1-element
tensors, 3-d stacks, granularities, ties, ``units=``, and ``tp=`` plans with uneven splits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

import vfsdp
from vfsdp.estimation.memory import optimizer_bytes

_OPTS = {"adamw": lambda: vfsdp.optim.adamw(),
         "adamw8bit": lambda: vfsdp.optim.adamw8bit(min_8bit_numel=64),
         "muon": lambda: vfsdp.optim.muon()}


def _both(opt, spec, rank, replicas=1):
    return (optimizer_bytes(opt, spec.units, rank, replicas),
            optimizer_bytes(opt._replace(local_state=False), spec.units, rank, replicas))


def test_which_optimizers_declare_a_local_state():
    assert vfsdp.optim.adamw().local_state and vfsdp.optim.adamw8bit().local_state
    assert not vfsdp.optim.muon().local_state  # see test_muon_counts_over_every_tensor
    chained = vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0), vfsdp.optim.adamw())
    assert not chained.local_state  # a combinator reads every tensor: exact, if slower


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_a_rank_that_holds_no_tensor_still_counts_its_state_buffers(name):
    opt = _OPTS[name]()
    spec = vfsdp.plan({"w": torch.empty(2, device="meta")}, 4)
    u = spec.units[()]
    assert u.tensors_per_rank()[-1] == 0  # rank 3 is all padding
    local, full = _both(opt, spec, 3)
    assert local == full >= 2 * u.shard_numel  # the unit's S-element buffers, all the same


def test_muon_counts_over_every_tensor():
    """Muon keeps a unit's momentum on every rank when the unit has a matrix anywhere: a
    rank holding only a vector of it still has the buffer, which a count over that rank's
    tensors alone would miss. So Muon declares no local state, and its count reads all."""
    tree = {"layers": [{"w": torch.empty(16, 16, device="meta"),
                        "b": torch.empty(300, device="meta")}]}
    opt = _OPTS["muon"]()
    assert not opt.local_state
    spec = vfsdp.plan(tree, 2, granularity=opt.granularity)
    u = spec.units[("layers", 0)]
    held = [{t.path[-1] for t in u.tensors if r in t.ranks()} for r in range(2)]
    assert "w" not in held[0] or "w" not in held[1]  # one rank holds no matrix
    full = [optimizer_bytes(opt, spec.units, r) for r in range(2)]
    assert full == [4 * u.shard_numel + 4] * 2  # the momentum buffer, and the step counter
    wrong = [optimizer_bytes(opt._replace(local_state=True), spec.units, r) for r in range(2)]
    assert 4 in wrong  # the step counter alone: the momentum buffer missed


def test_soap_and_shampoo_count_a_matrix_state_on_its_owner_alone():
    """SOAP keeps a matrix's moments, statistics and eigenbases whole on its owner, a 1-D
    tensor's moments whole on its owner too (the ``"soap"`` name: 1-D and 2-D tensors on SOAP);
    Shampoo its statistics and inverse roots, a vector's too (Shampoo's 1-D rule, as
    ``shampoo()`` does by default)."""
    tree = {"w": torch.empty(16, 24, device="meta"), "b": torch.empty(16, device="meta")}
    spec = vfsdp.plan(tree, 2)
    opt = vfsdp.estimation.model.optimizer_for("soap", spec)
    got = [optimizer_bytes(opt, spec.units, r) for r in range(2)]
    matrix = 4 * (2 * 16 * 24 + 2 * 16 * 16 + 2 * 24 * 24)  # m, v; L, QL; R, QR
    vector = 2 * 4 * 16  # b's two moments, on its owner
    steps = 8  # SOAP's and AdamW's step counters, on every rank
    assert sorted(got) == sorted([steps + matrix, steps + vector]), got
    opt = vfsdp.estimation.model.optimizer_for("shampoo", spec)  # b on Shampoo's 1-D rule
    got = [optimizer_bytes(opt, spec.units, r) for r in range(2)]
    matrix = 4 * (2 * 16 * 16 + 2 * 24 * 24)  # L, its inverse root; R, its inverse root
    vector = 4 * 2 * 16 * 16  # b's one 16 x 16 statistic and its inverse root, on its owner
    steps = 8  # Shampoo's and AdamW's step counters, on every rank
    assert sorted(got) == sorted([steps + matrix, steps + vector]), got


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_SHAPES = st.one_of(
    st.just(()),
    st.tuples(st.sampled_from([0, 1, 3, 33, 70])),
    st.tuples(st.sampled_from([0, 1, 3, 32, 33, 64, 65]), st.sampled_from([0, 1, 8, 32, 40])),
    st.tuples(st.sampled_from([0, 1, 3]), st.sampled_from([1, 5, 32, 40]),
              st.sampled_from([1, 8, 32])))


@st.composite
def _trees(draw):
    tree: dict = {"layers": []}
    for _ in range(draw(st.integers(0, 3))):
        dt = draw(st.sampled_from(_DTYPES))
        tree["layers"].append({f"t{j}": torch.empty(draw(_SHAPES), dtype=dt, device="meta")
                               for j in range(draw(st.integers(1, 5)))})
    dt = draw(st.sampled_from(_DTYPES))
    tree["root"] = {f"r{j}": torch.empty(draw(_SHAPES), dtype=dt, device="meta")
                    for j in range(draw(st.integers(0 if tree["layers"] else 1, 4)))}
    if tree["root"] and draw(st.booleans()):
        tree["a_tied"] = next(iter(tree["root"].values()))  # a tie, its alias sorted first
    return tree


def _opt(draw):
    if draw(st.booleans()):
        return vfsdp.optim.adamw(), draw(st.sampled_from([None, vfsdp.rows(1), vfsdp.rows(2),
                                                          vfsdp.whole]))
    opt = vfsdp.optim.adamw8bit(min_8bit_numel=draw(st.sampled_from([1, 16, 64, 1024])))
    return opt, opt.granularity


def _same_on_every_rank(opt, spec):
    for rank in range(spec.world_size):
        local = optimizer_bytes(opt, spec.units, rank, spec.replicas)
        full = optimizer_bytes(opt._replace(local_state=False), spec.units, rank,
                               spec.replicas)
        assert local == full, (rank, local, full)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), tree=_trees(), m=st.sampled_from([1, 2, 3, 5, 7, 8, 13, 17]),
       replicas=st.integers(1, 3), units=st.sampled_from([None, 1, 2, "byname"]))
def test_local_count_equals_full_count(data, tree, m, replicas, units):
    opt, gran = _opt(data.draw)
    if units == "byname":
        units = lambda path: str(path[-1])[:1]  # units across layers, by letter
    try:
        spec = vfsdp.plan(tree, m if replicas == 1 else (replicas, m), granularity=gran,
                          units=units)
    except ValueError as exc:
        assume("mixes dtypes" not in str(exc))
        raise
    _same_on_every_rank(opt, spec)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), dp=st.sampled_from([1, 2, 3, 7]), tp=st.sampled_from([2, 3]),
       rows=st.sampled_from([5, 33, 64, 65]), cols=st.sampled_from([3, 32, 40]),
       n=st.sampled_from([0, 1, 7, 33]))
def test_local_count_equals_full_count_under_tp(data, dp, tp, rows, cols, n):
    tree = {"embed": torch.empty(33, 13, device="meta"),
            "layers": [{"q": torch.empty(rows, cols, device="meta"),
                        "b": torch.empty(n, device="meta"),
                        "experts": torch.empty(2, 40, 16, device="meta")} for _ in range(2)]}
    placements = {k: data.draw(st.sampled_from([Shard(0), Shard(1), Replicate()]))
                  for k in ("embed", "q", "experts")}
    placements["b"] = data.draw(st.sampled_from([Shard(0), Replicate()]))
    opt, gran = _opt(data.draw)
    if gran is not None and gran is not opt.granularity:
        gran = None
    for index in range(tp):
        spec = vfsdp.plan(tree, (("dp", dp), ("tp", tp)), tp=lambda p: placements[p[-1]],
                          tp_index=index, granularity=gran)
        _same_on_every_rank(opt, spec)


@pytest.mark.parametrize("shape", [(0, 64), (64, 0)])
@pytest.mark.parametrize("m", [3, 5])
def test_an_empty_matrix_with_no_size_floor_is_counted_not_a_division_by_zero(shape, m):
    """``adamw8bit(min_8bit_numel=0)`` took a 0-size matrix for tiles, and its ``init``
    divided by the empty side; it keeps fp32 moments (of no elements) now."""
    opt = vfsdp.optim.adamw8bit(min_8bit_numel=0)
    tree = {"a": torch.empty(100, device="meta"), "z": torch.empty(shape, device="meta"),
            "zz": torch.empty(300, device="meta")}
    spec = vfsdp.plan(tree, m, granularity=opt.granularity)
    for rank in range(m):
        local, full = _both(opt, spec, rank)
        assert local == full > 0


@settings(max_examples=40, deadline=None)
@given(tree=_trees(), m=st.sampled_from([1, 2, 3, 8, 13]), gran=st.sampled_from(
    [None, vfsdp.rows(1), vfsdp.whole]))
def test_units_alike_in_the_tree_are_laid_out_alike_at_any_size(tree, m, gran):
    """What a sweep groups once from the tree (alike_members) never puts together units that
    a plan lays out differently (alike_units), so their state is counted once for all."""
    from vfsdp.estimation.memory import alike_members, alike_units
    from vfsdp.planner.plan import prepare

    try:
        spec = vfsdp.plan(tree, m, granularity=gran)
    except ValueError as exc:
        assume("mixes dtypes" not in str(exc))
        raise
    by_layout = {k: i for i, keys in enumerate(alike_units(spec.units)) for k in keys}
    for keys in alike_members(prepare(tree, gran)):
        assert len({by_layout[k] for k in keys}) == 1, keys


def test_tables_the_optimizer_shares_between_units_are_counted_once():
    """8-bit AdamW's code maps are made once per optimizer: counted per unit, small units'
    state was counted up to twice over."""
    opt = vfsdp.optim.adamw8bit(min_8bit_numel=64)

    def state(n):
        params = {"layers": [{"w": torch.empty(32, 32, device="meta")} for _ in range(n)]}
        return optimizer_bytes(opt, vfsdp.plan(params, 2, granularity=opt.granularity).units)

    per_unit = state(2) - state(1)
    shared = state(1) - per_unit
    assert shared > 0 and state(4) == 4 * per_unit + shared
