"""Published FSDP training measurements against ``vfsdp.estimation.sweep``'s projection.

``python benchmarks/published.py [--json OUT] [--round N ...]`` reads
``benchmarks/published/rows.json`` (each row: its source, repository, commit, path, table and
the row's text, the hardware, model, GPUs, micro-batch, accumulation, sequence, precision,
checkpointing and the measured tokens/s per GPU and memory), runs each through the estimator
with the settings the source states and nothing else (one profile per node type, no per-row
constant), and prints predicted against measured, then the share of rows within +-15 % on
tokens/s per GPU (bf16 and float8 apart) and within +-10 % on memory (what the source
measured: torchtitan's pages log the caching allocator's peak reserved bytes,
``Estimate.peak_reserved``; KempnerForge's reports the peak allocated,
``Estimate.peak_allocated``). Each row is estimated under the system it ran (``SYSTEMS``). The
bands are printed for every row and again for the held-out rows (``"held_out": true``: added
after the estimator was tuned, with the date added; nothing in ``vfsdp.estimation`` was
changed for them), and with ``--round N`` (repeatable) for the held-out rows of that round alone
(``"round": N``; rounds before the 4th carry none).

The models' shapes come from their configurations (``MODELS``: torchtitan's Llama 2 and 3
and Qwen3 model args, fms-fsdp's ``config_utils.py``, llm-foundry's MPT yamls, OLMo-core's
``TransformerConfig``); a shape list names the
embedding ``embed`` so the shape rules find the width and vocabulary (MPT's tied output head
is not counted in FLOPs: about 3 % of MPT-7B's). Where a source states its network per node,
``PROFILES`` derives a profile that shares it among the node's GPUs, changing nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optree
import torch

from vfsdp.estimation import sweep
from vfsdp.estimation.hardware import hardware
from vfsdp.optim import Optimizer
from vfsdp.planner.abstract import ShapeDtype

ROWS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published", "rows.json")
GiB = 2**30


def llama(layers: int, d: int, ffn: int, heads: int, kv: int, vocab: int,
          head_dim: int = 0, qk_norm: bool | str = False) -> dict:
    """A LLaMA-3 tree (torchtitan's names), fp32 master weights; ``head_dim`` when the heads
    are not ``d // heads`` wide, ``qk_norm`` for Qwen3's norms of each head's query and key
    (``"full"``: OLMo 2's, over all heads' queries and all keys)."""
    f32 = torch.float32
    hd = head_dim or d // heads
    qd, kvd = hd * heads, hd * kv

    def block() -> dict:
        attention = {"wq": ShapeDtype((qd, d), f32), "wk": ShapeDtype((kvd, d), f32),
                     "wv": ShapeDtype((kvd, d), f32), "wo": ShapeDtype((d, qd), f32)}
        if qk_norm:
            full = qk_norm == "full"
            attention.update(q_norm=ShapeDtype((qd if full else hd,), f32),
                             k_norm=ShapeDtype((kvd if full else hd,), f32))
        return {"attention_norm": ShapeDtype((d,), f32), "ffn_norm": ShapeDtype((d,), f32),
                "attention": attention,
                "feed_forward": {"w1": ShapeDtype((ffn, d), f32),
                                 "w2": ShapeDtype((d, ffn), f32),
                                 "w3": ShapeDtype((ffn, d), f32)}}

    return {"tok_embed": ShapeDtype((vocab, d), f32), "layers": [block() for _ in range(layers)],
            "norm": ShapeDtype((d,), f32), "output": ShapeDtype((vocab, d), f32)}


def mpt(layers: int, d: int, seq: int, vocab: int = 50368) -> dict:
    """An MPT tree (llm-foundry's: biases, learned positions, tied head), fp32 master."""
    f32 = torch.float32

    def w(*shape):
        return ShapeDtype(shape, f32)

    def block() -> dict:
        return {"norm_1": {"weight": w(d), "bias": w(d)}, "norm_2": {"weight": w(d), "bias": w(d)},
                "attn": {"Wqkv": {"weight": w(3 * d, d), "bias": w(3 * d)},
                         "out_proj": {"weight": w(d, d), "bias": w(d)}},
                "ffn": {"up_proj": {"weight": w(4 * d, d), "bias": w(4 * d)},
                        "down_proj": {"weight": w(d, 4 * d), "bias": w(d)}}}

    return {"embed": w(vocab, d), "pos_embed": w(seq, d), "layers": [block() for _ in range(layers)],
            "norm_f": {"weight": w(d), "bias": w(d)}}


MODELS = {
    "llama3-8b": lambda seq: llama(32, 4096, 14336, 32, 8, 128256),
    # torchtitan 157a12c, models/llama/__init__.py (FFN: 2/3 of 4d, times ffn_dim_multiplier,
    # rounded up to multiple_of); Llama 2's tokenizer 32,000 entries, Llama 3's 128,256
    "llama3-70b": lambda seq: llama(80, 8192, 28672, 64, 8, 128256),
    "llama2-13b": lambda seq: llama(40, 5120, 13824, 40, 40, 32000),
    "llama2-70b": lambda seq: llama(80, 8192, 28672, 64, 8, 32000),
    # fms-fsdp 5e522b4, fms_fsdp/utils/config_utils.py over fms's LLaMAConfig defaults
    # (vocab 32,000, 7b: 4096 wide, 32 heads and layers, FFN 8/3 rounded to 256: 11,008)
    "llama2-7b": lambda seq: llama(32, 4096, 11008, 32, 32, 32000),
    "fms-34b": lambda seq: llama(48, 8192, 22016, 64, 8, 32000),
    # torchtitan 6341d42, experiments/qwen3/__init__.py: 64 heads of 128 wider than the width
    "qwen3-32b": lambda seq: llama(64, 5120, 25600, 64, 8, 151936, head_dim=128, qk_norm=True),
    # llm-foundry 8c8dd48, scripts/train/yamls/pretrain/mpt-<size>.yaml (d_model, n_layers)
    "mpt-1b": lambda seq: mpt(24, 2048, seq),
    "mpt-3b": lambda seq: mpt(32, 2560, seq),
    # KempnerForge 01b461a, config/schema.py: FFN 8/3 of the width times 1.3, rounded up to 256
    "kf-13b": lambda seq: llama(40, 5120, 17920, 40, 8, 128256),
    "mpt-7b": lambda seq: mpt(32, 4096, seq),
    "mpt-13b": lambda seq: mpt(40, 5120, seq),
    "mpt-30b": lambda seq: mpt(48, 7168, seq),
    "mpt-70b": lambda seq: mpt(80, 8192, seq),
    # OLMo-core e27ba74, nn/transformer/config.py: olmo_1B/7B/13B are llama2_1B/7B/13B with
    # qk_norm (LayerNorms over all heads' queries and keys), llama3_8B; FFN int(8d/3), times
    # 1.3 for Llama 3, rounded up to 256 (Llama 3: 1,024); the dolma2 tokenizer's 100,278
    # entries padded to a multiple of 128: 100,352
    "olmo2-1b": lambda seq: llama(18, 2048, 5632, 16, 16, 100352, qk_norm="full"),
    "olmo2-7b": lambda seq: llama(32, 4096, 11008, 32, 32, 100352, qk_norm="full"),
    "olmo2-13b": lambda seq: llama(40, 5120, 13824, 40, 40, 100352, qk_norm="full"),
    "olmo-llama3-8b": lambda seq: llama(32, 4096, 14336, 32, 8, 100352),
}
# the system each project ran, as the estimator models it: FSDP2 (torchtitan), Megatron-FSDP,
# and llm-foundry's, fms-fsdp's, YaFSDP's baseline and VectorLM's FSDP1, whose flat parameters copy
# and allocate as vfsdp's buffers do (torchao's and AWS's rows ran torchtitan)
SYSTEMS = {"pytorch/torchtitan": "fsdp2", "NVIDIA-NeMo/Megatron-Bridge": "megatron",
           "mosaicml/llm-foundry": None, "foundation-model-stack/fms-fsdp": None,
           "pytorch/ao": "fsdp2", "aws-samples/awsome-distributed-training": "fsdp2",
           "KempnerInstitute/KempnerForge": "fsdp2", "allenai/OLMo-core": "fsdp2",
           "Lightning-AI/lightning-thunder": "fsdp2", "yandex/YaFSDP": None,
           "VectorInstitute/vectorlm": None}
COMPILE = {True: "yes", "blocks": "blk", False: "no"}


def _per_node_link(name: str, base: str, node_bits: float, source: str):
    """``base``'s profile with one node's stated network shared by its GPUs (no other change)."""
    hw = hardware(base)
    return dataclasses.replace(hw, name=name, inter_bw=node_bits / 8 / hw.gpus_per_node,
                               source=f"{source}; otherwise {hw.source}")


_FMS = "fms-fsdp README.md at 5e522b4"
PROFILES = {"h100-500w": "h100-500w", "h100": "h100", "h200": "h200", "a100": "a100",
            "a100-roce": "a100", "b200": "b200",
            "a100-400g": _per_node_link("a100-400g", "a100", 400e9,
                                        f"{_FMS}: 'A100 80G 128 GPUs with 400Gbps', per node"),
            "h100-800g": _per_node_link("h100-800g", "h100", 800e9,
                                        f"{_FMS}: 'H100 96 GPUs with 800 Gbps', per node"),
            # KempnerForge's reports: four H200s a node, each with the h200 profile's NIC
            "h200-4x": dataclasses.replace(
                hardware("h200"), name="h200-4x", gpus_per_node=4,
                source="KempnerForge benchmarks/config_validation/config_validation.md at 5666d0d: "
                       "'8 nodes, 4x NVIDIA H200 (141 GB) per node, NVLink intra-node, InfiniBand "
                       "(NDR 400Gbps) inter-node', read as one 400 Gb/s NIC per GPU; otherwise "
                       + hardware("h200").source)}


# torch.optim.AdamW's state: exp_avg and exp_avg_sq made by torch.zeros_like(param)
# (torch/optim/adamw.py, _init_group), so in the parameters' dtype: bf16 beside bf16 weights
TORCH_ADAMW = Optimizer(lambda shards, spec, mask=None: [
    (torch.zeros_like(x), torch.zeros_like(x)) for x in optree.tree_leaves(shards)], None)


def predict(row: dict):
    """The estimate of one row, from the settings its source states, under the system it ran
    (``compile``: ``true`` for the blocks and the loss, ``"blocks"`` for the blocks only; where
    a source differs from the usual, ``master: "bf16"`` for bf16 weights and optimizer state,
    ``grad_sync: false`` for accumulation without a reduce-scatter until the last micro-batch,
    ``logits: "bf16"`` for a loss over bf16 logits, ``reshard: false`` for weights kept
    unsharded from the forward to the backward: FSDP2's ``reshard_after_forward=False``,
    ``fp8_weights_saved: true`` for a compiled float8 run whose torchao saved each layer's
    unsharded float8 weights for its backward: before June 2025 without
    ``force_recompute_fp8_weight_in_bwd`` (added October 2024), ``fp8_all_gather: false``
    for float8 matmuls over weights gathered in bf16, ``fp8_fused_casts: true`` for float8 casts
    in fused kernels without torch.compile: Transformer Engine's, ``fp8_recipe: "rowwise"`` for
    torchao's per-row scales: ``--float8.recipe_name rowwise``)."""
    tree = MODELS[row["model"]](row["seq"])
    optimizer = "adamw"  # vfsdp's: fp32 moments
    if row.get("master") == "bf16":  # the weights and so the optimizer's state kept in bf16:
        tree = optree.tree_map(lambda s: ShapeDtype(s.shape, torch.bfloat16), tree)
        optimizer = TORCH_ADAMW
    tokens = row["micro_batch"] * row["seq"] * row["grad_accum"]
    system = SYSTEMS[row["repo"]]
    rows = sweep(tree, [row["gpus"]], hw=PROFILES[row["hw"]], shard=row["shard"], optimizer=optimizer,
                 tokens_per_gpu=tokens, micro_batches=row["grad_accum"], seq=row["seq"],
                 grad_sync=row.get("grad_sync", True), recompute=row["recompute"],
                 float8=row["precision"] == "float8", compiled=bool(row["compile"]),
                 fused_loss=row["compile"] is True, param_dtype=torch.bfloat16,
                 logits_dtype=torch.bfloat16 if row.get("logits") == "bf16" else torch.float32,
                 reshard_after_forward=row.get("reshard", True), vs=[system] if system else [],
                 float8_saved_weights=row.get("fp8_weights_saved", False),
                 float8_all_gather=row.get("fp8_all_gather"),
                 float8_fused_casts=row.get("fp8_fused_casts"),
                 float8_recipe=row.get("fp8_recipe"),
                 reduce_dtype=torch.float32 if row["reduce"] == "fp32" else torch.bfloat16)
    return rows[-1][1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write predicted and measured per row here")
    ap.add_argument("--round", type=int, action="append", default=[],
                    help="also the bands of this round's held-out rows alone (the rows' \"round\"; "
                         "repeat for several rounds)")
    args = ap.parse_args(argv)
    with open(ROWS, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    t0 = time.perf_counter()
    still = sum(r["held_out"] for r in rows)  # rows tuned on since they were added are not
    groups = {"all rows": lambda r: True, f"held-out rows ({still} still held out)": lambda r: r["held_out"]}
    for n in args.round:  # a round's rows that are still held out
        groups[f"held-out rows of round {n}"] = lambda r, n=n: r["held_out"] and r.get("round") == n
    bands = {title: {"bf16": [], "float8": [], "memory": []} for title in groups}
    out = []
    print(f"{'row':<24} {'hw':<9} {'gpus':>5} {'prec':<6} {'ckpt':<9} {'comp':<4} "
          f"{'tok/s meas':>10} {'pred':>8} {'ratio':>6}  {'GiB meas':>8} {'pred':>7} {'ratio':>6}")
    for row in rows:
        est = predict(row)
        tps = est.tokens_per_s / est.gpus
        ratio = tps / row["tokens_per_s_per_gpu"]
        mem = mem_ratio = None
        if row["memory_gib"] is not None:
            mem = (est.peak_reserved if row["memory_kind"] == "reserved"
                   else est.peak_allocated) / GiB
            mem_ratio = mem / row["memory_gib"]
        for title, keep in groups.items():
            if keep(row):
                bands[title][row["precision"]].append(ratio)
                if mem_ratio is not None:
                    bands[title]["memory"].append(mem_ratio)
        out.append({"id": row["id"], "held_out": row["held_out"],
                    "measured_tps": row["tokens_per_s_per_gpu"], "predicted_tps": tps,
                    "measured_gib": row["memory_gib"], "predicted_gib": mem,
                    "memory_kind": row["memory_kind"]})
        mem_text = f"{row['memory_gib']:>8.1f} {mem:>7.1f} {mem_ratio:>6.2f}" if mem else ""
        print(f"{row['id'] + '*' * row['held_out']:<24} {row['hw']:<9} {row['gpus']:>5} "
              f"{row['precision']:<6} {row['recompute']!s:<9} {COMPILE[row['compile']]:<4} "
              f"{row['tokens_per_s_per_gpu']:>10,.0f} {tps:>8,.0f} {ratio:>6.2f}  {mem_text}")
    print(f"\n{len(rows)} rows from {len({r['project'] for r in rows})} projects, estimated in "
          f"{time.perf_counter() - t0:.1f} s (* held out: added after the estimator was tuned, and "
          f"not tuned on since)")
    for title, got in bands.items():
        print(title)
        _print_bands(got)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


def _print_bands(bands: dict) -> None:
    for kind, band in (("bf16", 0.15), ("float8", 0.15), ("memory", 0.10)):
        got, name = bands[kind], kind + (" tokens/s" if kind != "memory" else "")
        if not got:
            print(f"  {name:<16} no rows")
            continue
        inside = sum(abs(r - 1) <= band for r in got)
        print(f"  {name:<16} within +-{band:.0%}: {inside} of {len(got)} ({inside / len(got):.0%}); "
              f"predicted/measured {min(got):.2f}-{max(got):.2f}")


if __name__ == "__main__":
    sys.exit(main())
