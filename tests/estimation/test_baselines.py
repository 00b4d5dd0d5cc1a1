"""The baselines by mechanism: Megatron-FSDP's kept compute-dtype shard, gradient buckets and
bucket padding beside FSDP2's copies, and the padding= ablations."""

import pytest
import torch

import vfsdp
from vfsdp.estimation.memory import baseline_sizes, unit_bytes


def _spec(world=4, layers=4, d=256):
    return vfsdp.plan({"embed": torch.empty(1000, d, device="meta"),
                       "layers": [{"wq": torch.empty(d, d, device="meta"),
                                   "w1": torch.empty(4 * d, d, device="meta"),
                                   "w2": torch.empty(d, 4 * d, device="meta"),
                                   "norm": torch.empty(d, device="meta")}
                                  for _ in range(layers)]}, world)


def test_megatron_gathers_in_place_and_copies_gradients_into_its_buckets():
    """No copy around its all-gathers: a compute-dtype shard is kept (params grow by it) and
    cast once per step; each gradient goes into its bucket and the reduce-scatter's output
    into the shard; the last layer is regathered."""
    spec = _spec()
    kw = {"hw": "h800", "tokens_per_rank": 512, "reduce_dtype": torch.float32}
    v, meg = vfsdp.estimate(spec, **kw), vfsdp.estimate(spec, baseline="megatron", **kw)
    sizes = baseline_sizes(spec.units, "megatron")
    ub = unit_bytes(spec.units, torch.bfloat16, torch.float32, sizes)
    kept = sum(u.gathered // 4 for u in ub)  # the bf16 shard
    assert meg.copy_bytes == sum(u.reduce_in + u.reduce_in // 4 for u in ub) + kept
    assert meg.memory["params"] == sum(u.shard for u in ub) + kept
    # the units are the embedding (gathered for the whole step), then the layers
    assert meg.comm_bytes["all_gather"] == sum(2 * u.gathered for u in ub[1:]) + ub[0].gathered
    # vfsdp casts each shard at each gather; Megatron once per step
    assert v.copy_bytes - sum(u.reduce_in for u in unit_bytes(spec.units, torch.bfloat16,
                                                               torch.float32)) > kept
    for e in (v, meg):
        assert e.step_s == pytest.approx(e.compute_s + e.copy_s + e.exposed_comm_s + e.optimizer_s)


def test_padding_separates_the_layout_from_the_copies():
    """padding= swaps only the padding: vfsdp's step over FSDP2's padding moves FSDP2's bytes
    (but for its regather of the last layer) with vfsdp's copies; FSDP2's copies over
    vfsdp's layout copy more than vfsdp and move vfsdp's bytes."""
    spec = _spec(world=8, d=202)
    kw = {"hw": "h800", "tokens_per_rank": 512}
    v, f = vfsdp.estimate(spec, **kw), vfsdp.estimate(spec, baseline="fsdp2", **kw)
    unplanned = vfsdp.estimate(spec, padding="fsdp2", **kw)
    no_dbuffer = vfsdp.estimate(spec, baseline="fsdp2", padding="vfsdp", **kw)
    assert unplanned.comm_bytes["reduce_scatter"] == f.comm_bytes["reduce_scatter"] > \
        v.comm_bytes["reduce_scatter"]
    assert unplanned.copy_bytes < f.copy_bytes
    assert no_dbuffer.comm_bytes["reduce_scatter"] == v.comm_bytes["reduce_scatter"]
    assert v.copy_bytes < no_dbuffer.copy_bytes < f.copy_bytes
    assert vfsdp.estimate(spec, padding="vfsdp", **kw) == v


def test_micro_batch_tokens_keep_the_micro_batch_at_every_count():
    """micro_batch_tokens: each count's micro-batches are its tokens over that size, so a
    fixed global batch at more GPUs runs fewer micro-batches of the same size (each row is
    the estimate with that count)."""
    from vfsdp.estimation import sweep

    params = {"layers": [{"w": torch.empty(512, 512, device="meta")} for _ in range(4)]}
    rows = sweep(params, [8, 16, 32], hw="h800", global_tokens=2**16, micro_batch_tokens=1024,
                 shard=8)
    for count, (_, e) in zip([8, 16, 32], rows):
        spec = vfsdp.plan(params, (count // 8, 8) if count > 8 else 8)
        again = vfsdp.estimate(spec, hw="h800", tokens_per_rank=2**16 // count,
                               micro_batches=2**16 // count // 1024)
        assert e == again
    assert rows[0][1].comm_bytes["all_gather"] == 2 * rows[1][1].comm_bytes["all_gather"]


def test_stacked_experts_on_more_ranks_than_experts_double_under_fsdp2():
    """FSDP2 shards each tensor on dim 0: 4 stacked experts over 8 ranks are padded to 8 rows,
    so its reduce-scatters move twice vfsdp's bytes (GPT-OSS's 128 experts on 256 ranks)."""
    tree = {"layers": [{"experts": {"w": torch.empty(4, 64, 64, device="meta")}}
                       for _ in range(2)]}
    spec = vfsdp.plan(tree, 8)
    kw = {"hw": "h800", "tokens_per_rank": 64, "experts_per_token": 1}
    v, f = vfsdp.estimate(spec, **kw), vfsdp.estimate(spec, baseline="fsdp2", **kw)
    assert f.comm_bytes["reduce_scatter"] == 2 * v.comm_bytes["reduce_scatter"]
