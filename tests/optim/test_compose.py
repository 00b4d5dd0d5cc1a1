"""partition and chain nest in any order: bitwise equal to their members applied by hand."""

import math
import os
import shutil
import tempfile

import pytest
import torch

import vfsdp
from tests.optim import compose_bodies as cb
from vfsdp.optim import adamw, adamw8bit, chain, clip_by_global_norm, muon, partition
from vfsdp.planner.granularity import block_elements, combine, rows, whole
from vfsdp.testing import simulate, spawn

KINDS = ["partition_of_chains", "chain_of_partition", "nested_partition"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_nested_composition_equals_members_by_hand(kind, world):
    composed = simulate(world, cb.run, kind, False)
    by_hand = simulate(world, cb.run, kind, True)
    assert composed == by_hand  # bitwise: the same ops in the same order
    assert composed[0] != simulate(world, cb.run, kind, False, 0)[0]  # the updates did something


def test_nested_composition_on_gloo_and_hsdp():
    kind = "partition_of_chains"
    assert spawn(cb.run, 2, kind, False) == spawn(cb.run, 2, kind, True)
    assert simulate(4, cb.run, kind, False, 3, (2, 2)) == simulate(4, cb.run, kind, True, 3, (2, 2))


@pytest.mark.parametrize("world", [1, 3])
def test_clip_under_a_mask_uses_the_subset_norm_and_scales_only_it(world):
    want = cb.subset_norm()
    for norm, untouched, scaled, coef in simulate(world, cb.masked_clip, 0.1):
        assert math.isclose(norm, want, rel_tol=1e-5)
        assert untouched
        assert coef < 1 and scaled  # the subset was clipped, by torch's coefficient


def test_composed_state_checkpoints_and_reshards():
    tmp = tempfile.mkdtemp(prefix="vfsdp-compose-")
    try:
        for kind in KINDS:
            path = os.path.join(tmp, kind)
            saved = simulate(2, cb.save_composed, path, kind, 2)[0]
            loaded = simulate(3, cb.load_composed, path, kind)[0]
            assert saved.keys() == loaded.keys() and saved == loaded
            assert any(".exp_avg." in k for k in saved)  # states under their labels
    finally:
        shutil.rmtree(tmp)


def test_chain_granularity_keeps_every_members_blocks():
    stripes = vfsdp.optim.Optimizer(lambda s, spec, mask=None: None, lambda g, st, s, spec: st,
                                    lambda path, t: rows(48))
    opt = chain(clip_by_global_norm(1.0), adamw8bit(), stripes)
    w = torch.empty(96, 64)
    assert opt.granularity(("w",), w) == rows(96)          # lcm(32, 48)
    assert opt.granularity(("n",), torch.empty(64)) == rows(48)  # 8-bit needs nothing there
    # the plan keeps the 8-bit tiles and the 48-row stripes whole, so init accepts it
    params = {"w": torch.randn(96, 64)}
    spec = vfsdp.plan(params, 3, granularity=opt.granularity)
    assert spec.tensor(("w",)).block == 96 * 64
    assert simulate(3, _init_ok, params, opt)


def _init_ok(params, opt):
    spec = vfsdp.plan(params, 3, granularity=opt.granularity)
    opt.init(vfsdp.shard(params, spec), spec)
    return True


@pytest.mark.parametrize("a, b, shape, want", [
    (None, rows(2), (8, 4), rows(2)),
    (rows(2), rows(3), (12, 4), rows(6)),
    (4, 6, (24,), 12),
    (rows(2), 3, (6, 4), rows(6)),          # 3-element blocks inside 2-row (8-element) blocks
    (rows(4), whole, (8, 4), whole),
])
def test_combine_granularities(a, b, shape, want):
    got = combine(a, b)
    value = got(("w",), torch.empty(shape)) if callable(got) else got
    assert value == want
    numel = math.prod(shape)
    blk = block_elements(value, ("w",), shape, numel, None)
    for member in (a, b):
        if member is not None:
            mb = block_elements(member, ("w",), shape, numel, None)
            assert blk % mb == 0 or blk >= numel  # every member block lies inside one block


def test_members_must_accept_a_mask():
    def init(shards, spec):          # a 0.1-style optimizer: no mask parameter
        return None

    legacy = vfsdp.optim.Optimizer(init, lambda g, s, sh, spec: s)

    def body():
        params = cb.params()
        spec = vfsdp.plan(params, 1)
        shards = vfsdp.shard(params, spec)
        chain(legacy).init(shards, spec)  # no mask: works
        try:
            partition({"m": legacy, "a": adamw()}, cb.label).init(shards, spec)
        except TypeError as exc:
            return str(exc)

    msg = simulate(1, body)[0]
    assert "takes no mask=" in msg and "mask=None parameter" in msg


def test_partition_of_clip_and_adamw_used_to_raise():
    opt = partition({"a": chain(clip_by_global_norm(1.0), adamw())}, lambda p: "a")

    def body():
        params = cb.params()
        spec = vfsdp.plan(params, 2)
        shards = vfsdp.shard(params, spec)
        state = opt.init(shards, spec)
        vfsdp.grads(shards, spec)
        state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        return state["a"][1].step

    assert simulate(2, body) == [1, 1]


def test_chain_rejects_non_optimizers():
    with pytest.raises(TypeError, match="chain takes Optimizers"):
        chain(muon(), "adamw")
    with pytest.raises(ValueError, match="finite"):
        clip_by_global_norm(float("nan"))


def _shift(deprecated=False):
    """A gradient transform that adds 1 to the gradients its mask selects (a shift, since
    AdamW's update does not see a scale): in place, the one update form; or, deprecated,
    returning new tensors through ``gradient_transform``."""
    if deprecated:
        with pytest.warns(FutureWarning, match="gradient_transform is deprecated"):
            return vfsdp.optim.gradient_transform(
                lambda shards, spec, mask=None: None,
                lambda g, state, shards, spec: ({k: v + 1.0 for k, v in g.items()}, state))

    def update(grads, mask, shards, spec):
        for k, g in grads.items():
            if mask is None or mask((k,)):
                g.add_(1.0)
        return mask

    return vfsdp.optim.Optimizer(lambda shards, spec, mask=None: mask, update)


def _threaded(how, shift_opt=None):
    import torch.distributed as dist

    torch.manual_seed(0)
    params = {"a": torch.randn(6), "b": torch.randn(5)}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    label = lambda path: path[0]
    shift = {"a": 1.0, "b": 1.0}
    shift_opt = shift_opt or _shift()
    if how == "chain":
        opt = chain(shift_opt, adamw(0.1))
    elif how == "partition":    # a's gradients shifted, b's handed on as they are
        opt = chain(partition({"a": shift_opt, "b": clip_by_global_norm(1e9)}, label),
                    adamw(0.1))
    else:                        # by hand: the shifted gradients (only a's for a partition)
        opt = adamw(0.1)
        shift = {"a": 1.0, "b": 0.0 if how == "by_hand_partition" else 1.0}
    state = opt.init(shards, spec)
    for step in range(2):
        grads = vfsdp.grads(shards, spec)
        with torch.no_grad():
            grads["a"].copy_(torch.arange(grads["a"].numel()) + 1.0 + step)
            grads["b"].copy_(torch.arange(grads["b"].numel()) - 2.0 - step)
            if how.startswith("by_hand"):
                for k, g in grads.items():
                    g.add_(shift[k])
        state = opt.update(grads, state, shards, spec)
    return {k: v.tolist() for k, v in shards.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_chain_hands_a_transforms_gradients_to_the_next_member(world):
    """One update form: a transform writes the gradients in place and the next member of a
    chain reads them; inside a partition only its own label's. The deprecated
    gradient_transform (new tensors returned) gives the same, copied in place."""
    deprecated = _shift(deprecated=True)
    chained = simulate(world, _threaded, "chain")
    assert chained == simulate(world, _threaded, "by_hand")      # bitwise
    assert simulate(world, _threaded, "chain", deprecated) == chained
    partitioned = simulate(world, _threaded, "partition")
    assert partitioned == simulate(world, _threaded, "by_hand_partition")
    assert simulate(world, _threaded, "partition", deprecated) == partitioned
    assert chained != partitioned
