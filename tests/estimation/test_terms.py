"""The workload terms: checkpointing modes, micro-batches with and without gradient sync,
float8, and the rails a contiguous multi-node ring runs on."""

import dataclasses

import pytest
import torch

import vfsdp
from vfsdp.cli import main
from vfsdp.estimation import costs, hardware
from vfsdp.estimation.hardware import Hardware
from vfsdp.estimation.memory import baseline_sizes
from vfsdp.estimation.timing import links

GiB = 2**30


def _llama(layers=4, d=256, vocab=1000):
    return {"embed": torch.empty(vocab, d, device="meta"),
            "layers": [{"wq": torch.empty(d, d, device="meta"),
                        "w1": torch.empty(4 * d, d, device="meta"),
                        "w2": torch.empty(d, 4 * d, device="meta")} for _ in range(layers)]}


def test_selective_checkpointing_lies_between_none_and_full():
    spec = vfsdp.plan(_llama(), 8)
    est = {mode: vfsdp.estimate(spec, tokens_per_rank=8192, seq=2048, recompute=mode)
           for mode in (False, "selective", "full", True)}
    acts = {m: e.memory["activations"] for m, e in est.items()}
    comp = {m: e.compute_s for m, e in est.items()}
    assert acts[True] == acts["full"] < acts["selective"] < acts[False]
    assert comp[False] < comp["selective"] < comp["full"] == comp[True]
    assert est[False].mfu > est["selective"].mfu  # recomputed FLOPs are not the model's


def test_micro_batches_regather_and_reduce_each_unless_grad_sync_is_off():
    spec = vfsdp.plan(_llama(), 8)
    one = vfsdp.estimate(spec, tokens_per_rank=8192, reduce_dtype=torch.float32)
    small = vfsdp.estimate(spec, tokens_per_rank=2048, reduce_dtype=torch.float32)
    sync = vfsdp.estimate(spec, tokens_per_rank=8192, micro_batches=4,
                          reduce_dtype=torch.float32)
    nosync = vfsdp.estimate(spec, tokens_per_rank=8192, micro_batches=4, grad_sync=False,
                            reduce_dtype=torch.float32)
    assert sync.memory["activations"] == small.memory["activations"]
    assert sync.comm_bytes["all_gather"] == 4 * one.comm_bytes["all_gather"]
    assert sync.comm_bytes["reduce_scatter"] == 4 * one.comm_bytes["reduce_scatter"]
    assert nosync.comm_bytes["reduce_scatter"] == one.comm_bytes["reduce_scatter"]
    # without sync every unit's whole gradient is held: in vfsdp in the parameters' dtype
    # (as torch's .grad; the accumulator keeps no shard of its own), in FSDP2 in the
    # reduce dtype (fp32 here)
    units = spec.units.values()
    held = sum(u.padded_numel * u.dtype.itemsize for u in units)
    assert nosync.memory["gradients"] - sync.memory["gradients"] == held
    fsdp2 = [vfsdp.estimate(spec, tokens_per_rank=8192, micro_batches=4, grad_sync=s,
                            reduce_dtype=torch.float32, baseline="fsdp2") for s in (True, False)]
    padded = sum(u.world_size * baseline_sizes(spec.units, "fsdp2")[k] for k, u in spec.units.items())
    assert fsdp2[1].memory["gradients"] - fsdp2[0].memory["gradients"] == 4 * padded
    assert sync.tokens_per_rank == nosync.tokens_per_rank == 8192
    assert small.step_s * 4 == pytest.approx(sync.step_s, rel=0.3)
    assert nosync.step_s <= sync.step_s
    with pytest.raises(ValueError, match="micro_batches=3 does not divide"):
        vfsdp.estimate(spec, tokens_per_rank=8192, micro_batches=3)


def test_fsdp2_drops_each_accumulated_gradient_as_its_unit_reduces():
    # nothing saved for the backward: the peak is at its reduces, where what is left of the
    # fp32 accumulated gradient meets a unit's reduce-scatter input and the shards reduced so
    # far (FSDP2 drops each unit's accumulated gradient once copied in), never all of them
    spec = vfsdp.plan(_llama(layers=6), 2)
    zero = {(): vfsdp.estimation.LayerCost(0.0, 0), ("layers",): vfsdp.estimation.LayerCost(0.0, 0)}
    est = vfsdp.estimate(spec, tokens_per_rank=8192, micro_batches=2, grad_sync=False,
                         reduce_dtype=torch.float32, baseline="fsdp2", costs=zero)
    sizes = baseline_sizes(spec.units, "fsdp2")
    held = sum(u.world_size * sizes[k] * 4 for k, u in spec.units.items())
    assert est.peak_at.startswith("reduce") and 0 < est.memory["gradients"] <= held


def test_float8_runs_the_weight_matmuls_at_its_own_rate_and_gathers_one_byte():
    spec = vfsdp.plan(_llama(layers=2, d=4096), 8)  # wide: narrow matmuls lose to the casts
    bf16, fp8 = (vfsdp.estimate(spec, tokens_per_rank=8192, seq=4096, compiled=True, **kw)
                 for kw in ({}, {"float8": True}))
    assert bf16.compute_s / 2 < fp8.compute_s < bf16.compute_s  # attention stays in bf16
    # eager, torchao's casts run as separate kernels: slower than bf16 (torchtitan PR #812:
    # 3,985 tokens/s against eager bf16's 5,605), unless fused (Transformer Engine)
    eager, fused = (vfsdp.estimate(spec, tokens_per_rank=8192, seq=4096, float8=True,
                                   float8_fused_casts=f).compute_s for f in (False, True))
    assert fused < vfsdp.estimate(spec, tokens_per_rank=8192, seq=4096).compute_s < eager
    # the layers' weights cross in one byte; the embedding in bf16
    embed = 8 * spec.units[()].shard_numel * 2
    assert fp8.comm_bytes["all_gather"] - embed == (bf16.comm_bytes["all_gather"] - embed) // 2
    assert fp8.comm_bytes["reduce_scatter"] == bf16.comm_bytes["reduce_scatter"]


def test_float8_keeps_the_unsharded_weights_in_one_byte_and_compile_may_save_them_again():
    # torchao's float8 all-gather: the unsharded weight is a Float8Tensor over the gathered
    # bytes; kept from the forward to the backward (reshard_after_forward=False) it weighs
    # one byte an element, not bf16's two. torchao from 2024-10 to 2025-06 without
    # force_recompute_fp8_weight_in_bwd: the compiled step saves each layer's unsharded
    # float8 weight (its transpose) for the backward as well, one byte an element more
    spec = vfsdp.plan(_llama(layers=4, d=512), 8)
    layers = sum(8 * u.shard_numel for k, u in spec.units.items() if k != ())
    kw = {"tokens_per_rank": 4096, "seq": 4096, "reshard_after_forward": False, "compiled": True,
          "baseline": "fsdp2"}
    bf16, fp8, saved = (vfsdp.estimate(spec, **kw, **extra) for extra in (
        {}, {"float8": True}, {"float8": True, "float8_saved_weights": True}))
    assert bf16.memory["buffers"] - fp8.memory["buffers"] == layers  # 2 bytes -> 1
    assert saved.memory["activations"] - fp8.memory["activations"] == layers
    assert saved.peak_allocated - fp8.peak_allocated == layers
    # float8 matmuls over bf16 all-gathers (torchao's rowwise recipe, Transformer Engine under
    # FSDP1): the weights cross and stay in bf16, the saved float8 copies still one byte
    matmuls, saved_bf16 = (vfsdp.estimate(spec, **kw, float8=True, float8_all_gather=False, **extra)
                           for extra in ({}, {"float8_saved_weights": True}))
    assert matmuls.memory["buffers"] == bf16.memory["buffers"]
    assert matmuls.comm_bytes["all_gather"] == bf16.comm_bytes["all_gather"]
    # and each rank casts every gathered weight to float8 (fused under compile: 6 bytes)
    casts = layers * 6 / hardware("h100").memory_bw
    assert matmuls.compute_s - fp8.compute_s == pytest.approx(casts, rel=0.01)
    assert saved_bf16.memory["activations"] - matmuls.memory["activations"] == layers
    # a checkpointed layer saves none (torchao: "If using outer activation checkpointing
    # context or SAC, you may disable this option"; torchtitan PR #833: 47.32 GiB both ways)
    for recompute in ("selective", "full"):
        a, b = (vfsdp.estimate(spec, **kw, float8=True, recompute=recompute, **extra)
                for extra in ({}, {"float8_saved_weights": True}))
        assert a.memory == b.memory and a.peak_allocated == b.peak_allocated


def test_compute_by_hand_matmuls_attention_and_the_memory_bound_rest():
    hw = Hardware("toy", 1e12, 2**40, 1e11, 8, 1e11, 0.0, 1e11, 0.0, compute_efficiency=0.5,
                  attention_efficiency=0.25, float8_efficiency=0.4)
    d, tokens, seq = 256, 4096, 1024
    bf16 = torch.bfloat16
    p = {"embed": torch.empty(1000, d, dtype=bf16, device="meta"),
         "layers": [{"w": torch.empty(d, d, dtype=bf16, device="meta")}]}
    spec = vfsdp.plan(p, 1)

    def compute(**kw):
        return vfsdp.estimate(spec, hw=hw, param_dtype=None, tokens_per_rank=tokens, seq=seq,
                              **kw).compute_s

    matmul, attention = 6 * tokens * d * d / 0.5e12, 12 * tokens * seq * d / 0.25e12
    rest = tokens * d * 3 / 1e11  # forward and backward (twice) of 128 bytes, eager; 64 compiled
    assert compute() == pytest.approx(matmul + attention + 128 * rest)
    assert compute(compiled=True) == pytest.approx(matmul + attention + 64 * rest)
    casts = tokens * d * 17 * 6 / 1e11  # float8 GEMMs at 0.4 of twice the bf16 peak
    fp8 = matmul * 0.5 / 0.8 + attention
    assert compute(float8=True, float8_fused_casts=True) == pytest.approx(fp8 + 128 * rest + casts)
    # eager torchao: 20 widths cast at 68 bytes; with bf16 all-gathers each weight too
    eager = tokens * d * 20 * 68 / 1e11
    assert compute(float8=True) == pytest.approx(fp8 + 128 * rest + eager)
    assert compute(float8=True, float8_all_gather=False) == pytest.approx(
        fp8 + 128 * rest + eager + d * d * 68 / 1e11)
    assert compute(float8=True, compiled=True) == pytest.approx(fp8 + 64 * rest + casts)
    # rowwise: its GEMMs at float8_rowwise_efficiency (0.44 by default), 2 bytes more an element
    # cast (the bf16 copy in the other layout), the weights too: it gathers in bf16
    rowwise = matmul * 0.5 / (2 * 0.44) + attention + tokens * d * 17 * 8 / 1e11 + d * d * 8 / 1e11
    assert compute(float8=True, compiled=True, float8_recipe="rowwise") == pytest.approx(
        64 * rest + rowwise)
    assert compute(float8=True, compiled=True, float8_recipe="tensorwise") == compute(
        float8=True, compiled=True)


def test_float8_casts_are_torchaos_kernels_over_a_llama_blocks_gemm_operands():
    # fused (torchao compiled: roofline_utils.py, get_tensor_memory_traffic_ovhd_s; Transformer
    # Engine's cast_transpose): an amax pass (read bf16) and one cast kernel (read bf16, write
    # float8 twice: row- and column-major), 6 bytes an element, over a Llama-3 8B block's
    # operands per token in widths: the inputs x (wq, wk, wv: one tensor, one cast once
    # compiled), attention's output, the FFN's input (w1, w3) and hidden layer, and every
    # matmul's output gradient
    d, ffn, kv = 4096, 14336, 1024
    inputs = d + d + d + ffn
    grad_outputs = d + kv + kv + d + ffn + ffn + d
    widths, per = costs.FLOAT8_CASTS[True]
    assert (inputs + grad_outputs) / d == widths and per == 2 + 2 + 2 * 1
    # eager torchao: every Float8Linear casts its own input (x 3 times, the FFN's twice), each
    # operand twice (dim0, dim1), each cast six kernels: abs, max, .to(float32), * scale,
    # clamp, .to(float8); and the weight gradient's operands copied to _scaled_mm's layouts
    widths, per = costs.FLOAT8_CASTS[False]
    assert (inputs + 2 * d + d + grad_outputs) / d == widths
    assert per == 2 * ((2 + 2) + 2 + (2 + 4) + (4 + 4) + (4 + 4) + (4 + 1)) + (1 + 1)


def test_collectives_slow_the_compute_beside_them_and_small_micro_batches_lose_to_them():
    spec = vfsdp.plan(_llama(d=1024), 8)
    h100 = hardware("h100")
    calm = vfsdp.estimate(spec, hw=dataclasses.replace(h100, contention=0.0), tokens_per_rank=8192)
    busy = vfsdp.estimate(spec, hw=h100, tokens_per_rank=8192)
    assert busy.compute_s == pytest.approx(calm.compute_s)  # the slowdown is exposed comm
    assert busy.exposed_comm_s > calm.exposed_comm_s and busy.step_s > calm.step_s
    # the same tokens in more micro-batches: more collectives per FLOP, a lower MFU
    mfu = [vfsdp.estimate(spec, tokens_per_rank=8192, micro_batches=n).mfu for n in (1, 4, 16)]
    assert mfu[0] > mfu[1] > mfu[2]
    # a slower memory holds the kernels between the matmuls longer
    slow = dataclasses.replace(h100, memory_bw=h100.memory_bw / 2)
    assert vfsdp.estimate(spec, hw=slow, tokens_per_rank=8192).compute_s > busy.compute_s


def test_a_contiguous_ring_over_nodes_runs_on_every_rail_a_strided_one_on_one_nic():
    h100 = hardware("h100")
    shard, replicas, _ = links(h100, 16, 4)
    assert shard.bandwidth == pytest.approx(min(450e9, 8 * 50e9) * 0.8)
    assert replicas.bandwidth == pytest.approx(50e9 * 0.8)
    assert links(h100, 8, 1)[0].bandwidth == pytest.approx(450e9 * 0.8)


def test_the_cli_takes_the_workload_options(tmp_path, capsys):
    import json

    path = tmp_path / "m.json"
    path.write_text(json.dumps({"params": [["embed", [1000, 256]], ["layers.0.w", [256, 256]],
                                           ["layers.1.w", [256, 256]]]}))
    argv = ["estimate", str(path), "--gpus", "8,16", "--tokens-per-gpu", "8192"]
    for extra in (["--recompute"], ["--recompute", "selective"],
                  ["--micro-batches", "4", "--no-grad-sync"], ["--float8"],
                  ["--reduce-dtype", "fp32"], ["--logits-dtype", "bf16"], ["--compiled"],
                  ["--compiled", "--eager-loss"], ["--float8", "--compiled", "--float8-saved-weights"]):
        assert main(argv + extra) == 0, extra
    capsys.readouterr()
    assert main(argv + ["--micro-batches", "3"]) == 2
    assert "micro_batches=3 does not divide" in capsys.readouterr().err
    assert main(argv + ["--micro-batches", "0"]) == 2


def test_the_logits_take_the_loss_dtype_and_a_fused_loss_holds_the_least():
    # eager: the softmax, its gradient and the logits' before the cast (3 x 4 bytes in fp32,
    # 3 x 2 in bf16); fused (compiled): the bf16 logits and their gradient (4)
    spec = vfsdp.plan(_llama(vocab=32000), 8)
    acts = {kw: vfsdp.estimate(spec, tokens_per_rank=4096, **dict(kw)).memory["activations"]
            for kw in ((), (("logits_dtype", torch.bfloat16),), (("fused_loss", True),),
                       (("compiled", True),), (("compiled", True), ("fused_loss", False)))}
    fp32, bf16, fused, compiled, blocks = acts.values()
    assert fp32 - bf16 == 4096 * 32000 * 6 and fp32 - fused == 4096 * 32000 * 8
    assert compiled == fused and blocks == fp32
    with pytest.raises(ValueError, match="logits_dtype"):
        vfsdp.estimate(spec, logits_dtype="bf16")


def test_selective_keeps_the_input_attention_and_every_other_matmul_output():
    from vfsdp.estimation import shape_costs

    d, tokens = 256, 1024
    costs = shape_costs(vfsdp.plan(_llama(d=d), 8), tokens, recompute="selective")
    outs = d + 4 * d + d  # wq, w1, w2: the 1st and 3rd kept, of their mean width
    assert costs[("layers", 0)].activation_bytes == tokens * 2 * (2 * d + 2 * outs // 3)


def test_fsdp2_reserves_each_streams_peak_and_vfsdp_its_allocation():
    """vfsdp allocates on the compute stream only: it reserves its peak allocation. FSDP2's
    reduce-scatter stream keeps its own pool (the sharded gradients are views of its
    outputs), which the compute stream's activations cannot reuse: at a forward's peak, with
    no gradient allocated, the reservation holds them beyond the allocation."""
    spec = vfsdp.plan(_llama(), 2)
    kw = {"tokens_per_rank": 4096, "reduce_dtype": torch.float32}
    v, f = vfsdp.estimate(spec, **kw), vfsdp.estimate(spec, baseline="fsdp2", **kw)
    grads = sum(u.shard_numel for u in spec.units.values()) * 4
    assert v.peak_at.startswith("forward") and f.peak_at.startswith("forward")
    assert v.peak_reserved == v.peak_allocated and v.memory["cached"] == 0
    assert f.peak_reserved - f.peak_allocated == f.memory["cached"] > 0
    assert f.peak_reserved >= v.peak_allocated + grads  # the gradients' pool, beside
    for e in (v, f):
        assert e.memory_per_rank == e.peak_reserved + e.memory["comm_library"]


@pytest.mark.parametrize("world, copy_ratio, peak_ratio", [(2, 0.222, 0.845), (4, 0.267, 0.729)])
def test_fsdp2_is_modelled_by_its_copies_as_vs_fsdp2_measures_them(world, copy_ratio,
                                                                    peak_ratio):
    """FSDP2 copies each all-gather's input out of the parameters and its output into them,
    and the reduce-scatter's input and output; vfsdp only the gradient into its buffer. The
    measured ratios (vfsdp / FSDP2, the dense model, fp32) are benchmarks/vs_fsdp2.py's on
    this machine ("added by system" and "peak"); the estimate lands within 25 %."""
    from vfsdp.testing.models import GPTConfig, meta_params

    cfg = GPTConfig(dim=256, layers=4, heads=8, kv_heads=4, ffn=688, seq=64)
    spec = vfsdp.plan(meta_params(cfg), world)
    kw = {"hw": "h100", "param_dtype": None, "tokens_per_rank": 2 * cfg.seq}
    v, f = vfsdp.estimate(spec, **kw), vfsdp.estimate(spec, baseline="fsdp2", **kw)
    params = sum(u.padded_numel for u in spec.units.values()) * 4
    assert v.copy_bytes == params  # each gradient into its reduce-scatter buffer, once
    assert f.copy_bytes > 3 * params and f.copy_s > v.copy_s > 0
    assert v.copy_bytes / f.copy_bytes == pytest.approx(copy_ratio, rel=0.25)
    peak = [e.peak_allocated for e in (v, f)]
    assert peak[0] / peak[1] == pytest.approx(peak_ratio, rel=0.25)
    assert v.step_s == pytest.approx(v.compute_s + v.copy_s + v.exposed_comm_s + v.optimizer_s)
