"""A small LLaMA-style decoder (RMSNorm, rotary, SwiGLU, GQA; optional MoE layers) as plain
functions over a parameter pytree (``benchmarks/gpt_module.py`` holds it as ``nn.Module`` s for
FSDP2 comparisons).

Parameters::

    {"io": {"embed": [V, D], "norm": [D], "head": [D, V]},
     "layers": [{"attn_norm": [D], "wq": [D, H*hd], "wk": [D, KV*hd], "wv": [D, KV*hd],
                 "wo": [H*hd, D], "mlp_norm": [D],
                 "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]}          # dense, or
                 "router": [D, E], "experts": [{"w_gate", "w_up", "w_down"} * E]}  # MoE
                ...]}

With ``experts`` the mixture is dense and soft (every expert computes every token, weighted by
the router's softmax: the same compute in every system, which the FSDP2 benchmarks rely on).
With ``top_k > 0`` it is a real top-k routed MoE (:mod:`vfsdp.testing.moe`) whose experts are
stacked on dim 0: ``"experts": {"w_gate": [E, D, Fe], "w_up": [E, D, Fe], "w_down": [E, Fe, D]}``.

Each element of ``layers`` is one unit under the planner's default rule and ``io`` is the root.
The tensor- and expert-parallel versions of :func:`block` are in
:mod:`vfsdp.testing.models_tp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from vfsdp.interop import init as vinit
from vfsdp.testing import moe


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    seq: int = 64
    experts: int = 0          # > 0: MoE layers with this many small experts
    expert_ffn: int = 32
    top_k: int = 0            # 0: dense soft mixture; > 0: top-k routing, stacked experts

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def meta_params(cfg: GPTConfig) -> dict:
    """The parameter tree on the ``meta`` device (shapes and dtypes only)."""
    def m(*shape):
        return torch.empty(shape, device="meta")

    def mlp(f, *lead):  # SwiGLU weights of hidden size f (stacked on dims ``lead``)
        return {"w_gate": m(*lead, cfg.dim, f), "w_up": m(*lead, cfg.dim, f), "w_down": m(*lead, f, cfg.dim)}

    hd = cfg.head_dim

    def layer() -> dict:
        attn = {"attn_norm": m(cfg.dim), "wq": m(cfg.dim, cfg.heads * hd),
                "wk": m(cfg.dim, cfg.kv_heads * hd), "wv": m(cfg.dim, cfg.kv_heads * hd),
                "wo": m(cfg.heads * hd, cfg.dim), "mlp_norm": m(cfg.dim)}
        if not cfg.experts:
            return {**attn, **mlp(cfg.ffn)}
        return {**attn, "router": m(cfg.dim, cfg.experts),  # stacked for top-k routing, else one per expert
                "experts": mlp(cfg.expert_ffn, cfg.experts) if cfg.top_k else
                [mlp(cfg.expert_ffn) for _ in range(cfg.experts)]}

    return {"io": {"embed": m(cfg.vocab, cfg.dim), "norm": m(cfg.dim), "head": m(cfg.dim, cfg.vocab)},
            "layers": [layer() for _ in range(cfg.layers)]}


def init_rule(cfg: GPTConfig):
    """Norms start at one, everything else Normal(0, 0.02) (output projections scaled)."""
    scaled = vinit.normal(0.02 / math.sqrt(2 * max(cfg.layers, 1)))

    def resolve(path, shape):
        name = str(path[-1])
        return vinit.constant(1.0) if name.endswith("norm") else scaled if name in ("wo", "w_down") \
            else vinit.normal(0.02)

    return resolve


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over (batch, heads, seq, head_dim)."""
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _heads(h: torch.Tensor, p: dict, cfg: GPTConfig, heads: int, kv_heads: int) -> torch.Tensor:
    """Causal GQA over ``heads`` query and ``kv_heads`` key/value heads (all of them, or one
    tensor-parallel rank's): the attention output before ``wo``, ``(batch, seq, heads * hd)``."""
    b, t, _ = h.shape
    hd = cfg.head_dim
    q, k, v = ((h @ p[w]).view(b, t, n, hd).transpose(1, 2)
               for w, n in (("wq", heads), ("wk", kv_heads), ("wv", kv_heads)))
    q, k = _rotary(q), _rotary(k)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, heads * hd)


def block(p: dict, x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """One decoder block on ``(batch, seq, dim)``."""
    x = x + _heads(_rms(x, p["attn_norm"]), p, cfg, cfg.heads, cfg.kv_heads) @ p["wo"]
    h = _rms(x, p["mlp_norm"])
    return x + (mixture(p, h, cfg) if "experts" in p else moe.swiglu(h, p))


def example_layer(tokens: int = 64, device: Optional[torch.device] = None) -> tuple:
    """One :func:`block` of the default config at ``tokens`` tokens, seeded: ``(fn, params,
    inputs)`` for :func:`vfsdp.estimation.calibrate.calibrate`."""
    cfg = GPTConfig()
    g = torch.Generator().manual_seed(0)
    params = {k: (torch.randn(v.shape, generator=g) * 0.02).to(device or "cpu")  # cpu: seeded
              for k, v in meta_params(cfg)["layers"][0].items()}
    seq = min(tokens, cfg.seq)
    x = torch.randn(max(tokens // seq, 1), seq, cfg.dim, generator=g)  # cpu: seeded, moved
    return (lambda p, h: block(p, h, cfg)), params, (x.to(device or "cpu"),)


def mixture(p: dict, h: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """The MoE part of a block on ``(batch, seq, dim)``: the dense soft mixture, or with
    ``cfg.top_k`` the top-k routed layer (:func:`vfsdp.testing.moe.moe_reference` over the
    ``batch * seq`` tokens).

    Args:
        p: One layer's parameters (``router`` and ``experts``; full, not sharded).
        h: The normalised input, ``(batch, seq, dim)``.
        cfg: The model's configuration (``experts``, ``top_k``).

    Returns:
        The mixture's output, shaped like ``h``.

    Raises:
        KeyError: ``p`` has no router or experts.

    Example:
        >>> cfg = GPTConfig(dim=8, heads=2, kv_heads=1, experts=4, expert_ffn=6, top_k=2)
        >>> p = vfsdp.init.full_tree(init_rule(cfg), meta_params(cfg))["layers"][0]
        >>> mixture(p, torch.randn(2, 3, 8), cfg).shape
        torch.Size([2, 3, 8])
    """
    if cfg.top_k:
        return moe.moe_reference({"router": p["router"], "experts": p["experts"]},
                                 h.reshape(-1, h.shape[-1]), cfg.top_k).view_as(h)
    # dense soft mixture: deterministic, same compute in every system
    gates = torch.softmax(h @ p["router"], dim=-1)
    return sum(gates[..., e:e + 1] * moe.swiglu(h, ex) for e, ex in enumerate(p["experts"]))


def embed(io: dict, tokens: torch.Tensor) -> torch.Tensor:
    return io["embed"][tokens]


def head_loss(io: dict, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = _rms(x, io["norm"]) @ io["head"]
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def loss_fn(params: dict, tokens: torch.Tensor, targets: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """The whole model on one process (the reference)."""
    x = embed(params["io"], tokens)
    for p in params["layers"]:
        x = block(p, x, cfg)
    return head_loss(params["io"], x, targets)
