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
    layers, rest = split_units(spec)
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
    with pytest.raises(ValueError, match="tokens_per_rank must be at least 1"):
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
