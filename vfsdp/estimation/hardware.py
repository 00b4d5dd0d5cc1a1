"""Hardware profiles: what one GPU (or one CPU process) can compute and move, as data.

A :class:`Hardware` holds peak rates from the vendor's datasheet and the fractions of them
that training kernels and NCCL reach in practice (stated assumptions, not measurements),
or, written by ``python -m vfsdp calibrate``, rates measured on this machine (fractions 1.0).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Union

from vfsdp.estimation.checks import count, fraction, rate

__all__ = ["Hardware", "PROFILES", "hardware"]


@dataclass(frozen=True)
class Hardware:
    """One accelerator's rates.

    Attributes:
        name: The profile's name.
        flops: Peak dense bf16 FLOP/s of one device.
        memory: Bytes of device memory (what ``nvidia-smi`` reports as the total).
        memory_bw: Device memory bandwidth, bytes/s (the optimizer's rate).
        gpus_per_node: Devices joined by the intra-node link.
        intra_bw: Intra-node bandwidth per device and direction (NVLink), bytes/s.
        intra_latency: Seconds per ring step inside a node.
        inter_bw: Inter-node bandwidth per device and direction (its NIC), bytes/s.
        inter_latency: Seconds per ring step across nodes.
        compute_efficiency: The fraction of ``flops`` a large GEMM reaches (the weight
            matmuls' rate; attention and the kernels between the matmuls are apart).
        comm_efficiency: The fraction of the link bandwidths a ring collective reaches.
        attention_efficiency: The fraction of ``flops`` the attention kernel (flash
            attention, forward and backward) reaches.
        float8_efficiency: The fraction of the dense float8 peak (``2 * flops``) a large
            float8 GEMM reaches (``float8=True``'s weight matmuls).
        float8_rowwise_efficiency: The same, with per-row scales (``float8_recipe="rowwise"``).
        contention: Seconds of compute lost per second of a collective running beside it
            (NCCL's ring kernels hold SMs and HBM bandwidth while they run).
        unit_overhead: Host seconds per unit per step that no FLOP or byte accounts for
            (vfsdp's bookkeeping, launching its collectives and the update's kernels):
            measured by ``calibrate``; 0 in the datasheet profiles, whose launches run
            ahead of the device.
        tensor_overhead: Host seconds per tensor of a unit per step, likewise.
        source: Where the figures come from.

    Raises:
        ValueError: a rate, size or latency that is not a finite positive number (latencies
            and overheads may be 0), an efficiency outside ``(0, 1]``, or ``gpus_per_node``
            below 1; the message names the field.

    Example:
        >>> hw = hardware("h800")
        >>> hw.flops / 1e12, hw.intra_bw / 1e9, hw.inter_bw / 1e9
        (989.0, 200.0, 50.0)
    """

    name: str
    flops: float
    memory: int
    memory_bw: float
    gpus_per_node: int
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    compute_efficiency: float = 0.6
    comm_efficiency: float = 0.8
    attention_efficiency: float = 0.4
    # float8 GEMMs on Hopper at about 60 % of the float8 peak, not bf16's 70 %: torchao's
    # compiled tensorwise float8 linear at M, K, N = 4096, 8192, 16384 measures 1.39x its bf16
    # one (torchao/float8/README.md at 8c81863), 1.45x here at 0.6 with the casts
    # (costs.FLOAT8_CASTS and the weight's 8 bytes). A bound, not a fit: the best float8 GEMMs
    # torchao lists on H100 run at 1,234-1,236 of 1,979 TFLOP/s (0.62; DeepGEMM's blockwise
    # forward and input-gradient GEMMs, pytorch/ao 36027d8, benchmarks/prototype/
    # blockwise_fp8_training/README.md), its weight-gradient GEMM at 457 (0.23)
    float8_efficiency: float = 0.6
    # rowwise float8's GEMMs (float8_recipe="rowwise": PyTorch's CUTLASS _scaled_mm forward,
    # aten/src/ATen/native/cuda/RowwiseScaledMM.cu; backward cuBLAS's and a rescale, pytorch/ao
    # torchao/float8/float8_ops.py at f5b5567) at 44 %: torchao's rowwise
    # table of the same benchmark and shape (LNLinearSigmoid fwd + bwd, M, K, N = 4096, 8192,
    # 16384) measures 1.07x bf16 (pytorch/ao fdddb2cfa, docs/static/fp8-rowwise-perf.png,
    # PyTorch 2.8.0a0), which with the rowwise casts (costs.FLOAT8_CASTS + 2 bytes) gives 0.44,
    # where tensorwise's 1.39x gives 0.57 (taken as 0.6 above). Measured on H100 only
    float8_rowwise_efficiency: float = 0.44
    contention: float = 0.0
    unit_overhead: float = 0.0
    tensor_overhead: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        where = f"hardware {self.name}"
        for name in ("flops", "memory", "memory_bw", "intra_bw", "inter_bw"):
            rate(where, name, getattr(self, name))
        for name in ("intra_latency", "inter_latency", "unit_overhead", "tensor_overhead",
                     "contention"):
            rate(where, name, getattr(self, name), zero=True)
        for name in ("compute_efficiency", "comm_efficiency", "attention_efficiency", "float8_efficiency",
                     "float8_rowwise_efficiency"):
            fraction(where, name, getattr(self, name))
        count(where, "gpus_per_node", self.gpus_per_node)

    def to_json(self, path: str) -> None:
        """Write the profile as JSON (what :func:`hardware` reads back)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)


_ASSUMED = ("comm_efficiency 0.8 is an assumption (NCCL ring bus bandwidth is typically 75-90 % "
            "of the link's); ring step latencies 4 us in a node and 12 us across nodes are "
            "assumptions too; contention 0.6: compute loses 0.6 s per second of a collective "
            "beside it, fitted on llm-foundry's H100 rows and torchtitan's 8-GPU rows "
            "(docs/estimate.md)")
# Hopper's bf16 GEMMs reach about 70 % of the dense peak (cuBLAS at sustained clocks, the
# power limit's throttling), FlashAttention-2 35 % (FlashAttention-3, arXiv 2407.08608, fig.
# 1: FA2 at 330-350 of 989 TFLOP/s)
_HOPPER = {"compute_efficiency": 0.7, "attention_efficiency": 0.35, "contention": 0.6}

PROFILES = {p.name: p for p in [
    # Ampere: cuBLAS reaches about 85 % of 312 TFLOP/s, FlashAttention-2 about 60 % forward
    # and backward (FlashAttention-2, arXiv 2307.08691, fig. 4-6: up to 225 TFLOP/s)
    Hardware("a100", 312e12, 81920 * 2**20, 2.039e12, 8, 300e9, 4e-6, 25e9, 12e-6, 0.85,
             attention_efficiency=0.6, contention=0.6,
             source="NVIDIA A100 datasheet (SXM4 80GB: 312 TFLOP/s bf16 dense, 2,039 GB/s "
                    "HBM2e, NVLink 600 GB/s both directions); DGX A100: one 200 Gb/s HDR NIC "
                    "per GPU. " + _ASSUMED),
    Hardware("h100", 989e12, 81559 * 2**20, 3.35e12, 8, 450e9, 4e-6, 50e9, 12e-6, **_HOPPER,
             source="NVIDIA H100 datasheet (SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, "
                    "NVLink 900 GB/s both directions); DGX H100: one 400 Gb/s NDR NIC per "
                    "GPU. " + _ASSUMED),
    Hardware("h100-500w", 912e12, 96 * 10**9, 2.4e12, 8, 450e9, 4e-6, 50e9, 12e-6, **_HOPPER,
             source="torchtitan's benchmark host (pytorch/torchtitan, benchmarks/"
                    "llama3_h100_202412_torchtitan.md: Grand Teton, 8 H100 with 96GB HBM2e at "
                    "2.4 TB/s, 500 W power limit, NVLink, 400 Gb/s RDMA per GPU); its peak "
                    "'between SXM and NVL' (989 and 835 TFLOP/s bf16 dense by NVIDIA's "
                    "datasheets) taken at the midpoint. " + _ASSUMED),
    Hardware("h800", 989e12, 81559 * 2**20, 3.35e12, 8, 200e9, 4e-6, 50e9, 12e-6, **_HOPPER,
             source="NVIDIA H800 SXM5 (H100 compute, NVLink 400 GB/s both directions); "
                    "DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.2: 400 Gb/s IB "
                    "(50 GB/s) per GPU, about 160 GB/s NVLink achieved. " + _ASSUMED),
    Hardware("h200", 989e12, 143771 * 2**20, 4.8e12, 8, 450e9, 4e-6, 50e9, 12e-6, **_HOPPER,
             source="NVIDIA H200 datasheet (SXM: 989 TFLOP/s bf16 dense, 141 GB HBM3e at "
                    "4.8 TB/s, NVLink 900 GB/s both directions); one 400 Gb/s NIC per GPU. "
                    + _ASSUMED),
    Hardware("b200", 2.25e15, 183359 * 2**20, 8e12, 8, 900e9, 4e-6, 50e9, 12e-6, **_HOPPER,
             source="NVIDIA DGX B200 datasheet (2.25 PFLOP/s bf16 dense per GPU, 180 GB "
                    "HBM3e at 8 TB/s, NVLink 5 1.8 TB/s both directions, one 400 Gb/s "
                    "ConnectX-7 NIC per GPU); Hopper's efficiencies assumed. " + _ASSUMED),
]}


def hardware(profile: Union[str, os.PathLike, Hardware]) -> Hardware:
    """A profile: one of :data:`PROFILES` by name, a JSON file ``calibrate`` wrote, or a
    :class:`Hardware` itself.

    Args:
        profile: ``"a100"``, ``"h100"``, ``"h100-500w"``, ``"h800"``, ``"h200"``,
            ``"b200"``, a path, or a profile.

    Returns:
        The :class:`Hardware`.

    Raises:
        ValueError: an unknown name, a file that is not a profile, or a profile with a rate
            that is not a positive number (naming the field).

    Example:
        >>> hardware("b200").memory // 2**30
        179
    """
    if isinstance(profile, Hardware):
        return profile
    name = os.fspath(profile)
    if name.lower() in PROFILES:
        return PROFILES[name.lower()]
    if not os.path.isfile(name):
        raise ValueError(f"hardware: {name!r} is neither a profile ({', '.join(PROFILES)}) nor "
                         f"a file; pass a name, or a JSON file that 'python -m vfsdp "
                         f"calibrate' wrote")
    with open(name, encoding="utf-8") as f:
        data = json.load(f)
    try:
        return Hardware(**data)  # a TypeError: a field missing, unknown, or no object at all
    except TypeError:
        fields = sorted(f.name for f in dataclasses.fields(Hardware))
        raise ValueError(f"hardware: {name} is not a profile (fields {fields}); write "
                         f"one with 'python -m vfsdp calibrate --out {name}'") from None
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}; fix the profile or write it again with 'python -m "
                         f"vfsdp calibrate --out {name}'") from None
