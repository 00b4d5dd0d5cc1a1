"""The activation rule of the shapes (``saved_bytes``) against what autograd saves for a
tiny bf16 block of each kind, traced on CPU: LLaMA (GQA, SwiGLU), GPT/MPT (fused qkv, GELU)
and Mixtral (GQA, router, top-2 of stacked SwiGLU experts). Two kernels are stand-ins for
the fused ones a GPU runs, saving what those save: flash attention (q, k and v at their own
widths, its output and the log-sum-exp; the output laid out ``(batch, seq, heads, dim)`` as
SDPA's flash kernel lays it out, so the output projection reads it without a copy; eager
SDPA on CPU keeps the score matrix) and a
fused RMSNorm (its input and rstd). The rest (matmuls, SiLU, GELU, the gate product,
LayerNorm, routing, the experts' dispatch and combine) is torch's own."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F

import vfsdp
from vfsdp.estimation.costs import Shapes, saved_bytes
from vfsdp.testing import moe

H, HEADS, KV, T = 256, 4, 1, 64


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        rep = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ kr.transpose(-1, -2)).float() / q.shape[-1] ** 0.5
        lse = scores.logsumexp(-1)
        out = (scores - lse[..., None]).exp().to(q.dtype) @ vr  # laid out (b, t, heads, d) as
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # SDPA's flash lays it out
        ctx.save_for_backward(q, k, v, out, lse)
        return out


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        rstd = x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        ctx.save_for_backward(x, w, rstd)
        return (x.float() * rstd).to(x.dtype) * w


def _attention(p, h, heads, kv):
    hd = H // heads
    if "wqkv" in p:
        q, k, v = F.linear(h, p["wqkv"]).split([H, H, H], -1)
    else:
        q, k, v = F.linear(h, p["wq"]), F.linear(h, p["wk"]), F.linear(h, p["wv"])
    q, k, v = (t.view(1, T, -1, hd).transpose(1, 2) for t in (q, k, v))
    return F.linear(_Flash.apply(q, k, v).transpose(1, 2).reshape(1, T, H), p["wo"])


def _llama(p, x):
    x = x + _attention(p, _RMSNorm.apply(x, p["attn_norm"]), HEADS, KV)
    h = _RMSNorm.apply(x, p["mlp_norm"])
    if "router" in p:
        return x + moe.moe_reference(p, h.view(T, H), 2).view_as(h)
    return x + F.linear(F.silu(F.linear(h, p["w1"])) * F.linear(h, p["w3"]), p["w2"])


def _gpt(p, x):
    x = x + _attention(p, F.layer_norm(x, (H,), p["ln1"]), HEADS, HEADS)
    return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (H,), p["ln2"]), p["fc1"])), p["fc2"])


def _block(kind):
    f, kv = 688, KV * H // HEADS
    if kind == "gpt":
        return _gpt, {"ln1": (H,), "wqkv": (3 * H, H), "wo": (H, H), "ln2": (H,),
                      "fc1": (4 * H, H), "fc2": (H, 4 * H)}
    shapes = {"attn_norm": (H,), "wq": (H, H), "wk": (kv, H), "wv": (kv, H), "wo": (H, H),
              "mlp_norm": (H,)}
    if kind == "llama":
        return _llama, {**shapes, "w1": (f, H), "w3": (f, H), "w2": (H, f)}
    return _llama, {**shapes, "router": (H, 4), "experts": {  # as moe_reference holds them
        "w_gate": (4, H, 176), "w_up": (4, H, 176), "w_down": (4, 176, H)}}


def _tree(shapes, make):
    return optree.tree_map(make, shapes, is_leaf=lambda s: isinstance(s, tuple))


def _traced(fn, shapes):
    """Bytes per token and width autograd saves for ``fn(params, x)`` (each storage once,
    not the parameters' (or their views); the block's input counts: the block keeps it)."""
    torch.manual_seed(0)
    p = _tree(shapes, lambda s: (torch.randn(s) / H ** 0.5).to(torch.bfloat16).requires_grad_())
    known, saved = {t.untyped_storage().data_ptr() for t in optree.tree_leaves(p)}, {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(p, x)
    return sum(saved.values()) / (T * H)


@pytest.mark.parametrize("kind, rule", [("llama", 2 * (4 + 2.5 + 4 * 2.6875)),
                                        ("gpt", 32.0), ("mixtral", None)])
def test_the_rule_of_the_shapes_is_what_a_traced_block_saves(kind, rule):
    fn, shapes = _block(kind)
    tree = {"embed": torch.empty(100, H, device="meta"),
            "layers": [_tree(shapes, lambda s: torch.empty(s, device="meta"))]}
    dense, per_expert = Shapes.of(vfsdp.plan(tree, 1)).units[("layers", 0)][6]
    got = saved_bytes(dense, per_expert, H, 2 if kind == "mixtral" else 0)
    want = _traced(fn, shapes)
    if rule is not None:  # 41 for Llama-3 8B's widths; GPT-2's 34 less its dropout masks
        assert got == pytest.approx(rule)
    # the traced block's extra: rstd and the log-sum-exp (4 bytes a token and head), the
    # router's probabilities and the top-k's indices
    assert got == pytest.approx(want, rel=0.02), (got, want)


@pytest.mark.parametrize("recompute, kept, again", [(False, 42.5, 0), ("full", 2, 40.5),
                                                    ("selective", None, None)])
def test_shape_costs_keep_the_rule_or_hold_the_rest_again(recompute, kept, again):
    # eager (shape_costs' default): the rule's 34.5 and the RMSNorms' upcasts, 8
    from vfsdp.estimation import shape_costs

    tree = {"embed": torch.empty(100, H, device="meta"),
            "layers": [_tree(_block("llama")[1], lambda s: torch.empty(s, device="meta"))]}
    c = shape_costs(vfsdp.plan(tree, 1), tokens=T, recompute=recompute)[("layers", 0)]
    if kept is None:  # selective: what it keeps and holds again add up to the whole
        kept = c.activation_bytes / (T * H)
        again = 42.5 - kept
        assert 2 < kept < 42.5
    assert c.activation_bytes == pytest.approx(T * H * kept, abs=1)
    assert c.recompute_bytes == pytest.approx(T * H * again, abs=1)


def _rms_eager(x, w):  # torchtitan's RMSNorm (torch's rms_norm composite saves the same)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * w


def _q8(t):  # torchao's tensorwise cast: its scale from the amax
    s = 448 / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn), s.reciprocal()


class _Float8Linear(torch.autograd.Function):
    """torchao's float8 linear: the input and the weight cast, ``_scaled_mm``, the input's
    float8 kept for the weight's gradient."""

    @staticmethod
    def forward(ctx, x, w):
        (x8, sx), (w8, sw) = _q8(x.reshape(-1, x.shape[-1])), _q8(w)
        ctx.save_for_backward(x8, sx, w)
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw,
                                out_dtype=x.dtype).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        x8, sx, w = ctx.saved_tensors
        (g8, sg), (w8, sw) = _q8(g.reshape(-1, g.shape[-1])), _q8(w)
        gx = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=sg, scale_b=sw, out_dtype=g.dtype)
        gw = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=sg, scale_b=sx,
                              out_dtype=g.dtype)
        return gx.view(*g.shape[:-1], -1), gw


def _llama_plain(float8):
    """A LLaMA block as torchtitan writes it (eager RMSNorm, SDPA; MHA), its linears bf16 or
    float8."""
    lin = _Float8Linear.apply if float8 else F.linear

    def block(p, x):
        h = _rms_eager(x, p["attn_norm"])
        q, k, v = (lin(h, p[n]).view(1, T, HEADS, -1).transpose(1, 2) for n in ("wq", "wk", "wv"))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, T, H)
        x = x + lin(a, p["wo"])
        h = _rms_eager(x, p["mlp_norm"])
        return x + lin(F.silu(lin(h, p["w1"])) * lin(h, p["w3"]), p["w2"])
    return block


def _partitioned(fn, shapes):
    """Bytes per token and width the forward graph of ``fn`` keeps for its backward after
    torch.compile's partitioner (``min_cut_rematerialization_partition``), the parameters'
    (and what is cast from them alone) not counted, nor the block's input."""
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

    torch.manual_seed(0)
    p = _tree(shapes, lambda s: (torch.randn(s) / H ** 0.5).to(torch.bfloat16).requires_grad_())
    leaves, kept = optree.tree_leaves(p), []

    def forward(gm, _):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        kept.extend(n.meta["val"] for n in out[1:] if n.op != "placeholder"
                    and isinstance(n.meta.get("val"), torch.Tensor))
        return make_boxed_func(gm)

    f = aot_function(lambda x, *w: fn(optree.tree_unflatten(optree.tree_structure(p), list(w)), x),
                     forward, lambda gm, _: make_boxed_func(gm),
                     partition_fn=min_cut_rematerialization_partition)
    f(torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True), *leaves).float().sum().backward()
    weights = {tuple(sorted(w.shape)) for w in leaves}
    return sum(t.numel() * t.element_size() for t in kept
               if tuple(sorted(t.shape)) not in weights) / (T * H)


@pytest.mark.parametrize("mode", ["eager", "compiled", "compiled float8"])
def test_eager_and_compiled_blocks_save_what_the_rule_says(mode):
    """Eager: an upcasting RMSNorm keeps its fp32 input and normalized bf16 value (4 bytes a
    norm more); compiled, the partitioner recomputes the SiLU, and with float8 the norms'
    outputs and the gate product (from their casts' saved scales), keeping attention's
    output's float8 copy too. The partitioned graph does not count the block's input (2
    bytes a token and width); compiled bf16, CPU's SDPA lays its output out (b, heads, t,
    d) and the output projection reads a copy of it (2) that the flash kernel's layout
    makes a view: the two cancel (float8's cast reads the strided output, no copy)."""
    fn, shapes = _llama_plain("float8" in mode), _block("llama")[1]
    shapes = {**shapes, "wk": (H, H), "wv": (H, H)}
    tree = {"embed": torch.empty(100, H, device="meta"),
            "layers": [_tree(shapes, lambda s: torch.empty(s, device="meta"))]}
    row = Shapes.of(vfsdp.plan(tree, 1)).units[("layers", 0)]
    assert row[8] is True  # norms without a bias: RMSNorms
    got = saved_bytes(*row[6], H, 0, mode != "eager", "float8" in mode, row[8])
    want = _traced(fn, shapes) if mode == "eager" else _partitioned(fn, shapes) + 2 * ("8" in mode)
    assert got == pytest.approx(want, rel=0.02), (got, want)


def test_a_norm_with_a_bias_is_a_layernorm_not_an_rmsnorm():
    """Eager, only an RMSNorm upcasts (+8 bytes a token and width): a norm with a bias is
    read as a LayerNorm, which saves its bf16 input as the fused rule does."""
    def tree(norm):
        return {"embed": torch.empty(100, H, device="meta"), "layers": [
            {"ln1": norm, "wqkv": torch.empty(3 * H, H, device="meta"),
             "fc1": torch.empty(4 * H, H, device="meta"), "fc2": torch.empty(H, 4 * H, device="meta")}]}
    def vec():
        return torch.empty(H, device="meta")
    rms = [Shapes.of(vfsdp.plan(tree(n), 1)).units[("layers", 0)][8]
           for n in (vec(), {"weight": vec(), "bias": vec()})]
    assert rms == [True, False]
