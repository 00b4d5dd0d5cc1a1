"""vfsdp.estimate against what a step measures: vfsdp's buffers' peak and every collective's
bytes, exactly; the profiles and the errors."""

import pytest
import torch

import vfsdp
from tests.estimation import bodies
from vfsdp.estimation import LayerCost, hardware, layer_cost, shape_costs
from vfsdp.estimation.memory import split_units
from vfsdp.testing import simulate


@pytest.mark.parametrize("world,optimizer,dtype,prefetch,reshard", [
    (2, "adamw", None, True, True),
    (2, "adamw8bit", torch.bfloat16, True, True),
    (2, "muon", None, False, True),
    (4, "adamw", torch.bfloat16, True, False),
    (4, "adamw8bit", None, False, True),
    (4, "muon", torch.bfloat16, True, True),
])
def test_buffer_peak_and_collective_bytes_are_what_the_step_measures(world, optimizer, dtype,
                                                                     prefetch, reshard):
    for r in simulate(world, bodies.step, optimizer, dtype, prefetch, reshard):
        assert abs(r["predicted_peak"] - r["measured_peak"]) <= 0.03 * r["measured_peak"], r
        assert r["measured_bytes"] == r["predicted_bytes"]


def test_hsdp_bytes_and_peak():
    for r in simulate(4, bodies.step, "adamw", torch.bfloat16, True, True, 2, (2, 2)):
        assert abs(r["predicted_peak"] - r["measured_peak"]) <= 0.03 * r["measured_peak"], r
        assert r["measured_bytes"] == r["predicted_bytes"]


@pytest.mark.parametrize("micro,dtype,reduce_dtype", [
    (2, None, None), (2, torch.bfloat16, torch.float32), (3, torch.bfloat16, None),
    (2, None, torch.bfloat16),
])
def test_buffer_peak_of_micro_batches_reduced_only_by_the_last(micro, dtype, reduce_dtype):
    # each unit's accumulator (its own shard kept) freed as it reduces, in place or staged
    for r in simulate(2, bodies.accum_step, micro, dtype, reduce_dtype):
        assert abs(r["predicted_peak"] - r["measured_peak"]) <= 1e-3 * r["measured_peak"], r


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_tp_by_fsdp_buffers_and_bytes_the_layers_all_reduces_included(dtype):
    for r in simulate(4, bodies.tp_step, dtype):
        assert abs(r["predicted_peak"] - r["measured_peak"]) <= 0.03 * r["measured_peak"], r
        assert r["measured_bytes"] == r["predicted_bytes"]
    spec = vfsdp.plan({"w": torch.empty(8, 8, device="meta")}, 2)
    with pytest.raises(ValueError, match="needs 'tp' and a plan with a model axis"):
        vfsdp.estimate(spec, model_parallel="tp")


def test_the_layers_are_the_longest_run_of_indexed_units():
    spec = vfsdp.plan({"io": {"e": torch.empty(8, 4, device="meta")},
                       "layers": [{"w": torch.empty(4, 4, device="meta")} for _ in range(3)]}, 2)
    layers, rest = split_units(spec.units)
    assert layers == [("layers", 0), ("layers", 1), ("layers", 2)] and rest == [()]


def test_layer_cost_traces_flops_and_saved_activations_on_meta():
    w, x = torch.empty(64, 32), torch.empty(128, 64)
    c = layer_cost(lambda p, x: torch.relu(x @ p["w"]) * 2, {"w": w}, x)
    assert c.flops == 3 * 2 * 128 * 64 * 32           # forward, and twice it backward
    assert c.activation_bytes == 128 * 32 * 4          # relu's output (for its backward)


def test_shape_costs_count_routed_experts_by_top_k_and_refuse_without_it():
    p = {"embed": torch.empty(100, 8, device="meta"),
         "layers": [{"experts": [{"w": torch.empty(8, 8, device="meta")} for _ in range(4)],
                     "o": torch.empty(8, 8, device="meta")} for _ in range(2)]}
    spec = vfsdp.plan(p, 2)
    with pytest.raises(ValueError, match="pass experts_per_token"):
        shape_costs(spec, 10)
    c = shape_costs(spec, 10, experts_per_token=1)
    assert c[("layers", 0)].flops == 6 * 10 * (64 + 64)   # one of the 4 experts, and o


def test_estimate_is_pure_and_plausible_at_scale():
    params = {"embed": torch.empty(32000, 4096, device="meta"),
              "layers": [{"wq": torch.empty(4096, 4096, device="meta"),
                          "w1": torch.empty(11008, 4096, device="meta"),
                          "w2": torch.empty(4096, 11008, device="meta"),
                          "norm": torch.empty(4096, device="meta")} for _ in range(8)]}
    small = vfsdp.estimate(vfsdp.plan(params, 8), hw="h100", tokens_per_rank=4096, seq=4096)
    big = vfsdp.estimate(vfsdp.plan(params, (16, 8)), hw="h100", tokens_per_rank=4096,
                         seq=4096)
    assert small.gpus == 8 and big.gpus == 128 and big.replicas == 16
    assert big.memory_per_rank == small.memory_per_rank  # HSDP: the same shards per rank
    assert big.step_s >= small.step_s                    # and an all-reduce across nodes
    assert 0 < small.mfu < hardware("h100").compute_efficiency
    assert "fits" in str(small) and small.record()["gpus"] == 8


def test_bad_input_is_refused():
    spec = vfsdp.plan({"w": torch.empty(8, 8, device="meta")}, 2)
    with pytest.raises(ValueError, match="neither a profile"):
        vfsdp.estimate(spec, hw="tpu9")
    with pytest.raises(ValueError, match="unknown optimizer"):
        vfsdp.estimate(spec, optimizer="sgd")
    with pytest.raises(ValueError, match="tokens_per_rank must be an int >= 1"):
        vfsdp.estimate(spec, tokens_per_rank=0)


def test_declared_costs_replace_the_shapes_by_key_prefix():
    params = {"layers": [{"w": torch.empty(64, 64, device="meta")} for _ in range(2)]}
    spec = vfsdp.plan(params, 2)
    declared = vfsdp.estimate(spec, costs={("layers",): LayerCost(1e12, 2**20)})
    assert declared.memory["activations"] == 2 * 2**20
    assert declared.compute_s > vfsdp.estimate(spec).compute_s


def _llama(layers=4, width=256):
    meta = lambda *s: torch.empty(*s, device="meta")
    return {"embed": meta(1000, width),
            "layers": [{"w1": meta(4 * width, width), "w2": meta(width, 4 * width),
                        "norm": meta(width)} for _ in range(layers)]}


def test_a_root_cost_is_the_root_units_alone():
    spec = vfsdp.plan(_llama(), 2)
    est = vfsdp.estimate(spec, costs={(): LayerCost(1e15, 0)})
    alone = vfsdp.estimate(spec, costs={(): LayerCost(1e15, 0), ("layers",): LayerCost(0, 0)})
    assert est.compute_s > alone.compute_s  # the layers kept their shape costs


def test_recompute_costs_the_forward_again_and_holds_a_layer_during_its_backward():
    spec = vfsdp.plan(_llama(), 2)
    plain = vfsdp.estimate(spec, tokens_per_rank=4096)
    again = vfsdp.estimate(spec, tokens_per_rank=4096, recompute=True)
    flops = shape_costs(spec, 4096)[("layers", 0)].flops
    cost = shape_costs(spec, 4096, recompute=True)[("layers", 0)]
    assert cost.flops == flops and cost.recompute_flops == flops / 3  # MFU counts flops
    assert again.compute_s > plain.compute_s and again.mfu < plain.mfu
    assert again.memory["activations"] < plain.memory["activations"]
    assert again.memory["activations"] >= 4096 * 256 * 34  # one layer, recomputed


def test_a_tp_plan_counts_the_model_axis_in_gpus_and_links():
    from vfsdp.testing.models import GPTConfig, meta_params
    from vfsdp.testing.models_tp import tp_rule

    cfg = GPTConfig()
    spec = vfsdp.plan(meta_params(cfg), (("dp", 8), ("tp", 8)), tp=tp_rule(cfg),
                      tp_axis="tp", tp_index=0)
    est = vfsdp.estimate(spec, hw="h100", model_parallel="tp")
    assert est.gpus == 64 and est.shard == 8
    one_node = vfsdp.estimate(vfsdp.plan(meta_params(cfg), 8), hw="h100")
    assert est.exposed_comm_s > one_node.exposed_comm_s  # dp rings across 8 nodes, and TP


def test_layers_can_be_named_and_unknown_ones_are_refused():
    spec = vfsdp.plan(_llama(), 2)
    keys = [("layers", i) for i in range(4)]
    assert vfsdp.estimate(spec, layers=keys).step_s == vfsdp.estimate(spec).step_s
    assert vfsdp.estimate(spec, layers=[]).peak_at != vfsdp.estimate(spec).peak_at
    with pytest.raises(ValueError, match="layers= names units the plan does not have"):
        vfsdp.estimate(spec, layers=[("nope", 0)])


def test_an_empty_plan_estimates_zero_not_a_division_error():
    est = vfsdp.estimate(vfsdp.plan({}, 4))
    assert est.tokens_per_s == 0 and est.mfu == 0


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "muon"])
def test_a_sweep_equals_an_estimate_of_each_plan(optimizer):
    """Each row of sweep() (one prepared tree, layouts per shard size, the state once per
    size) is estimate(plan(...)) at that count: the shard groups the default picks (the
    smallest at which it fits), a given one, HSDP, strong scaling, and a baseline."""
    import dataclasses

    from vfsdp.estimation import sweep
    from vfsdp.estimation.model import optimizer_for

    params = {"embed": torch.empty(96, 32, device="meta"), "norm": torch.empty(32, device="meta"),
              "layers": [{"w": torch.empty(32, 96, device="meta"),
                          "b": torch.empty(96, device="meta"),
                          "mlp": {"experts": [{"up": torch.empty(32, 16, device="meta")}
                                              for _ in range(3)]}} for _ in range(5)]}
    # 2**25 bytes for the communication library, and room for ~250 kB more: 2 ranks hold
    # 315 kB, 4 ranks 213 kB
    hw = dataclasses.replace(hardware("h100"), memory=2**25 + 250_000, gpus_per_node=2)
    opts = {"param_dtype": torch.bfloat16, "experts_per_token": 2, "seq": 8, "recompute": True,
            "comm_library_bytes": 2**25}
    gran = optimizer_for(optimizer, params).granularity
    for shard, tokens in ((None, {"tokens_per_gpu": 64}), (2, {"global_tokens": 4096})):
        rows = sweep(params, [1, 2, 4, 6, 8], hw=hw, optimizer=optimizer, shard=shard,
                     vs=("fsdp2", "megatron"), **tokens, **opts)
        assert [(s, e.gpus) for s, e in rows] == [
            (s, g) for g in (1, 2, 4, 6, 8) for s in ("vfsdp", "fsdp2", "megatron")]
        for system, got in rows:
            m, gpus = got.shard, got.gpus
            mesh = m if m == gpus else (gpus // m, m)
            want = vfsdp.estimate(vfsdp.plan(params, mesh, granularity=gran), hw=hw,
                                  optimizer=optimizer, baseline=None if system == "vfsdp"
                                  else system, tokens_per_rank=got.tokens_per_rank, **opts)
            assert got == want, (system, gpus)
        if shard is None:  # the smallest group at which the model fits, else the largest
            shards = [e.shard for s, e in rows if s == "vfsdp"]
            assert shards[:2] == [1, 2] and min(shards[2:]) > 2, shards
            for s, e in rows:  # (the baselines' buffers need more: their rows may not)
                assert e.fits or e.shard == e.gpus or s != "vfsdp"
                smaller = [d for d in (2, 4) if d < e.shard and e.gpus % d == 0]
                assert all(not vfsdp.estimate(
                    vfsdp.plan(params, (e.gpus // d, d), granularity=gran), hw=hw,
                    optimizer=optimizer, tokens_per_rank=64, **opts).fits for d in smaller)
    with pytest.raises(ValueError, match="does not divide 6 GPUs"):
        sweep(params, [6], shard=4)
    with pytest.raises(ValueError, match="not both"):
        sweep(params, [2], tokens_per_gpu=1, global_tokens=2)
    with pytest.raises(TypeError, match="baseline= is estimate"):
        sweep(params, [2], baseline="fsdp2")


def _moe(experts=4, layers=3):
    return {"embed": torch.empty(64, 16, device="meta"),
            "layers": [{"attn": torch.empty(16, 16, device="meta"),
                        "experts": [{"up": torch.empty(16, 24, device="meta"),
                                     "down": torch.empty(24, 16, device="meta")}
                                    for _ in range(experts)]} for _ in range(layers)]}


def test_expert_parallelism_gathers_a_share_and_moves_the_tokens():
    """estimate(rest, experts=share): both plans' buffers and state, each layer's experts
    gathered and reduced with it over their own group, and the routed tokens' all-to-alls;
    a sweep with ep= gives the same rows."""
    from vfsdp.estimation import sweep
    from vfsdp.estimation.sweep import expert_share

    rest, share = expert_share(_moe(), 2)
    opts = {"hw": "h800", "tokens_per_rank": 32, "experts_per_token": 2, "recompute": True}
    est = vfsdp.estimate(vfsdp.plan(rest, (2, 4)), experts=vfsdp.plan(share, 4), ep=2,
                         **opts)
    plain = vfsdp.estimate(vfsdp.plan(_moe(), (2, 4)), **opts)
    assert (est.gpus, est.ep, plain.ep) == (8, 2, 1)
    # each layer: 32 tokens x top-2 x width 16 x bf16, half of it to the other rank; two
    # all-to-alls forward, four backward (the recomputed forward's again)
    assert est.comm_bytes["all_to_all"] == 3 * 6 * (32 * 2 * 16 * 2) // 2
    assert plain.comm_bytes["all_to_all"] == 0
    # the share is gathered over 2 ranks, the whole model's experts over 4: half the bytes
    expert_bytes = 3 * 4 * 2 * 16 * 24 * 2  # layers x experts x matrices x elements x bf16
    assert plain.comm_bytes["all_gather"] - est.comm_bytes["all_gather"] == pytest.approx(
        (2 * 3 - 1) / 3 * expert_bytes / 2, rel=0.02)   # gathered twice but the last layer
    # the same routed FLOPs per rank: top-2 of 4 experts here, of the 2 held there
    assert est.compute_s == pytest.approx(plain.compute_s, rel=1e-9)
    rows = sweep(_moe(), [8], shard=4, ep=2, tokens_per_gpu=32, experts_per_token=2,
                 recompute=True, hw="h800")
    assert rows == [("vfsdp", est)]


def test_expert_parallelism_refuses_what_does_not_fit():
    from vfsdp.estimation.sweep import expert_share

    rest, share = expert_share(_moe(), 2)
    spec = vfsdp.plan(rest, 4)
    with pytest.raises(ValueError, match="ep=2 without experts="):
        vfsdp.estimate(spec, ep=2)
    with pytest.raises(ValueError, match="no expert-parallel axis and ep=None"):
        vfsdp.estimate(spec, experts=vfsdp.plan(share, 2), experts_per_token=2)
    with pytest.raises(ValueError, match=r"spans 4 x ep 2 = 8 GPUs and the model's 4"):
        vfsdp.estimate(spec, experts=vfsdp.plan(share, 4), ep=2, experts_per_token=2)
    with pytest.raises(ValueError, match="experts= holds no routed experts"):
        vfsdp.estimate(spec, experts=vfsdp.plan({"layers": [{"w": torch.empty(4, 4)}]}, 2),
                       ep=2, experts_per_token=2)
    with pytest.raises(ValueError, match="pass experts_per_token"):
        vfsdp.estimate(spec, experts=vfsdp.plan(share, 2), ep=2)
    other = {"blocks": list(share["layers"])}
    with pytest.raises(ValueError, match=r"unit \('blocks', 0\) is no unit of the model"):
        vfsdp.estimate(spec, experts=vfsdp.plan(other, 2), ep=2, experts_per_token=2)
    with pytest.raises(TypeError, match="experts= takes the experts' ShardSpec"):
        vfsdp.estimate(spec, experts=share, ep=2)
    with pytest.raises(ValueError, match="one of 4 experts, which ep=3 does not divide"):
        expert_share(_moe(), 3)
    with pytest.raises(ValueError, match="has no routed experts"):
        expert_share({"w": torch.empty(2, 2)}, 2)
    with pytest.raises(ValueError, match="that ep=2 divides"):
        from vfsdp.estimation import sweep
        sweep(_moe(), [6, 3], ep=2)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=r"ep must be an int >= 1"):
            expert_share(_moe(), bad)
        with pytest.raises(ValueError, match=r"ep must be an int >= 1"):
            sweep(_moe(), [4], ep=bad)
    scalar = {"layers": [{"experts": {"scale": torch.empty((), device="meta")}}]}
    with pytest.raises(ValueError, match=r"layers\.0\.experts\.scale is a scalar under"):
        expert_share(scalar, 2)


def test_expert_share_keeps_the_first_experts_by_number_from_0_or_from_1():
    from vfsdp.estimation.sweep import expert_share

    for base in (0, 1):
        tree = {"moe": {"experts": {str(base + e): torch.empty(2, 2, device="meta")
                                    for e in range(4)}}}
        _, share = expert_share(tree, 2)
        kept = [k for k, v in share["moe"]["experts"].items() if v is not None]
        assert sorted(kept, key=int) == [str(base), str(base + 1)]


def test_stacked_experts_planned_with_an_ep_rule_take_ep_from_the_plan():
    from vfsdp.testing.models import GPTConfig, meta_params
    from vfsdp.testing.models_tp import ep_rule, split_experts

    cfg = GPTConfig(layers=2, experts=4, top_k=2)
    rest, experts = split_experts(meta_params(cfg))
    mesh = (("dp", 2), ("ep", 2))
    e_spec = vfsdp.plan(experts, mesh, tp=ep_rule, tp_axis="ep", tp_index=0)
    est = vfsdp.estimate(vfsdp.plan(rest, 4), experts=e_spec, experts_per_token=2,
                         tokens_per_rank=64, param_dtype=None)
    assert est.ep == 2 and est.gpus == 4
    width = cfg.dim
    assert est.comm_bytes["all_to_all"] == 2 * 4 * (64 * 2 * width * 4) // 2
    whole = vfsdp.estimate(vfsdp.plan(meta_params(cfg), 4), experts_per_token=2,
                           tokens_per_rank=64, param_dtype=None)
    assert est.compute_s == pytest.approx(whole.compute_s, rel=1e-9)


@pytest.mark.parametrize("optimizer", ["soap", "shampoo"])
def test_soap_and_shampoo_estimate_without_a_process_group(optimizer):
    """As adamw and muon do: estimate needs no process group (a laptop's planning call)."""
    tree = {"w": torch.empty(64, 32, device="meta"), "b": torch.empty(64, device="meta")}
    adamw = vfsdp.estimate(vfsdp.plan(tree, 2), optimizer="adamw")
    est = vfsdp.estimate(vfsdp.plan(tree, 2), optimizer=optimizer)
    assert est.memory["optimizer"] > adamw.memory["optimizer"]
