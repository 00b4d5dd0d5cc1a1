"""What each unit's layer costs: FLOPs and the activation bytes saved for backward.

Either traced from the user's layer function on ``meta`` tensors (:func:`layer_cost`: torch's
own ``FlopCounterMode`` for the FLOPs of forward and backward, and
``torch.autograd.graph.saved_tensors_hooks`` for what autograd keeps), or, for a shape list
without code, the usual rules (:func:`shape_costs`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

import optree
import torch

from vfsdp.estimation.options import Options
from vfsdp.planner.plan import Prepared
from vfsdp.planner.spec import ShardSpec

__all__ = ["LayerCost", "layer_cost", "shape_costs", "saved_bytes", "Shapes"]


@dataclass(frozen=True)
class LayerCost:
    """One unit's cost for one rank's tokens per step.

    Attributes:
        flops: FLOPs of its forward and backward (the model's: what MFU counts).
        activation_bytes: Bytes its forward saves for its backward.
        recompute_bytes: Bytes its backward holds while it runs beyond those (activation
            checkpointing: the activations it recomputes).
        recompute_flops: FLOPs of the forward run again in its backward (time, not MFU).
        attention_flops: The part of ``flops`` in attention's score and value products
            (not matrix multiplies by a weight: what float8 matmuls leave in bf16).
        elementwise_bytes: Bytes its kernels outside the matmuls (norms, activations,
            residual adds, casts, copies) read and write, forward, backward and recompute:
            they run at the memory bandwidth, not the FLOP rate.

    Example:
        >>> LayerCost(flops=6e9, activation_bytes=2**20).activation_bytes
        1048576
    """

    flops: float
    activation_bytes: int
    recompute_bytes: int = 0
    recompute_flops: float = 0.0
    attention_flops: float = 0.0
    elementwise_bytes: float = 0.0


def layer_cost(fn: Callable[..., torch.Tensor], params: Any, *inputs: Any) -> LayerCost:
    """Trace ``fn(params, *inputs)`` forward and backward on ``meta`` copies (no memory, no
    compute): the FLOPs torch's flop counter counts, and the bytes of the tensors autograd
    saves for backward that are not parameters or inputs.

    Args:
        fn: The layer, ``fn(params, *inputs) -> tensor`` (summed for the backward).
        params: Its parameters (a tree; real or ``meta``, full size: as gathered).
        *inputs: Its inputs for one rank's tokens (real or ``meta``).

    Returns:
        A :class:`LayerCost`.

    Raises:
        RuntimeError: ``fn`` does not run on ``meta`` tensors.

    Example:
        >>> w = torch.empty(64, 32, device="meta")
        >>> x = torch.empty(128, 64, device="meta")
        >>> c = layer_cost(lambda p, x: torch.tanh(x @ p["w"]), {"w": w}, x)
        >>> c.flops == 3 * 2 * 128 * 64 * 32, c.activation_bytes    # the tanh output, 16 KiB
        (True, 16384)
    """
    from torch.utils.flop_counter import FlopCounterMode

    p, xs = optree.tree_map(lambda x: torch.empty_like(x, device="meta").requires_grad_(
        x.requires_grad or x.is_floating_point()) if isinstance(x, torch.Tensor) else x,
        (params, list(inputs)))
    known = {id(t) for t in optree.tree_leaves([p, xs]) if isinstance(t, torch.Tensor)}
    saved: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in known and id(base) not in known:
            saved[id(base)] = base.untyped_storage().nbytes()
        return t

    with FlopCounterMode(display=False) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(p, *xs)
        out.float().sum().backward()
    return LayerCost(float(counter.get_total_flops()), int(sum(saved.values())))


# recompute -> the share of the forward's weight matmuls run again. None keeps what the layer
# saves (saved_bytes); full keeps the layer input (2 bytes per token and width) and runs the
# whole forward again; torchtitan's op-level selective policy keeps the layer input,
# attention's output and every other weight matmul's output (from the shapes, see Shapes) and
# runs the other half; the backward holds again what the forward did not keep
_RECOMPUTE = {False: 0.0, True: 1.0, "full": 1.0, "selective": 0.5}


def _outputs(mats: Iterable, width: int, again: int = 1) -> float:
    """Elements per token the matrices' outputs leave saved: each matrix's side that is not
    the width (its output, or its input when it reads a hidden layer), once, and for each
    three of one width (a gated FFN: gate, up, down) ``again`` times a third more: the
    activation's output (1), or what a compiled step recomputes of it (see
    :func:`saved_bytes`)."""
    by_width: Counter = Counter()
    for (a, b), c in mats:
        by_width[b if a == width else a] += c
    return sum(d * (c + again * (c // 3) * (c % 3 == 0)) for d, c in by_width.items())


def saved_bytes(mats: Iterable, expert_mats: Iterable, width: int, top_k: int,
                compiled: bool = False, float8: bool = False, rms: bool = False) -> float:
    """Bytes per token and width one block saves for its backward in bf16, from the shapes
    of its matrices (``((rows, cols), count)``, as :class:`Shapes` holds them): its two
    norms' inputs and outputs (fused norms: 4 widths), each matrix's output side once (what
    attention, the activation, the gate product or the next matmul keeps: q, k and v at
    their GQA widths, attention's output at o's, a GELU FFN's hidden layer twice), a gated
    FFN's activation output (a third of its three matrices again), and per routed expert
    of the ``top_k`` its own FFN's plus its input, output and weighted output (3 widths).
    Flash attention (no score matrix; its log-sum-exp, 4 bytes a head, left out), no
    dropout: GPT-2's block saves 32 (Korthikanti et al.'s 34 less its two dropout masks).
    A matrix's side that is not the width is read in either orientation; one with neither
    side the width counts its first. That is eager with fused norms; the step's mode
    changes it (see the comment below and ``docs/estimate.md``).

    Args:
        mats: The block's matrices other than routed experts'.
        expert_mats: One routed expert's (counts may be fractions: a unit's over its experts).
        width: The model's width (the embedding's second dim).
        top_k: Routed experts per token (0 without them).
        compiled: Under ``torch.compile``: its partitioner recomputes a gated FFN's
            activation output (and the norms' outputs and gate product with ``float8``).
        float8: Float8 weight matmuls (torchao's tensorwise linears).
        rms: The norms are RMSNorms that upcast (eager: their fp32 input and normalized
            value kept, 4 bytes per token and width a norm more).

    Returns:
        Bytes per token and width.

    Raises:
        ZeroDivisionError: ``width`` is 0.

    Example:
        >>> h = 64; gpt = [((3 * h, h), 1), ((h, h), 1), ((4 * h, h), 1), ((h, 4 * h), 1)]
        >>> saved_bytes(gpt, (), h, 0)
        32.0
        >>> llama = [((h, h), 4), ((4 * h, h), 2), ((h, 4 * h), 1)]  # attention, SwiGLU
        >>> saved_bytes(llama, (), h, 0, rms=True), saved_bytes(llama, (), h, 0, compiled=True)
        (56.0, 40.0)
    """
    # compiled: torch.compile's min-cut partitioner (pytorch/pytorch
    # torch/_functorch/partitioners.py at c28ba8e, min_cut_rematerialization_partition)
    # recomputes pointwise ops in the backward: a gated FFN's activation output from the
    # gate's; with float8 (torchao's input_fp8 saved, pytorch/ao torchao/float8/
    # float8_linear.py at e919558) the norms' outputs and the gate product too, their casts'
    # amax kept, and attention's output kept again as its float8 copy (half a width). Eager,
    # an RMSNorm (rms) that upcasts (pytorch/torchtitan torchtitan/models/norms.py at
    # 026e23a) keeps its fp32 input and normalized bf16 value: 4 bytes a norm more. Traced
    # in tests/estimation/test_saved_bytes.py (docs/estimate.md, fourth pass, memory).
    again = 1 - compiled - compiled * float8
    experts = 3 * width + _outputs(expert_mats, width, again) if top_k else 0.0
    norms = 4 - compiled * float8 * 1.5 + 4 * (rms and not compiled)
    return 2 * (norms * width + _outputs(mats, width, again) + top_k * experts) / width


# compiled -> bytes one layer's forward reads and writes outside its matmuls, per token and
# width (its backward twice that, a recomputed forward again). Eager runs each norm,
# activation, residual add, cast and layout copy as its own kernel, each reading its inputs
# from HBM and writing its output: about 30 passes of 2-byte elements, the FFN's 4x wide
# ones counted 4x, so 128; torch.compile fuses each chain into one kernel: half of it.
# Fitted with contention on llm-foundry's H100 rows and torchtitan's 8-GPU rows
ELEMENTWISE = {False: 128, True: 64}
# float8's casts, by whether they run fused: (widths of a LLaMA block's GEMM operands cast per
# token, bytes per element of each), each operand cast for the two GEMMs that take it, and with
# bf16 all-gathers each weight too. Fused (torch.compile, Transformer Engine): an amax read,
# then one kernel writing float8 in both layouts, 2 + 2 + 2 * 1 bytes (torchao's tensorwise
# recipe, torchao/testing/training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s), the
# inputs x (wq, wk, wv) and the FFN's (w1, w3) cast once each: 17 widths. Eager torchao
# (pytorch/ao 3eb18e7, torchao/float8): each Float8Linear casts its own input (20 widths), twice
# (float8_linear.py, matmul_with_hp_or_float8_args: dim0 forward, dim1 for the weight's
# gradient), each cast as six kernels (float8_utils.py tensor_to_amax's abs r2 w2 and max r2,
# float8_tensor.py's .to(float32) r2 w4, * scale r4 w4, to_fp8_saturated's clamp r4 w4 and
# .to(float8) r4 w1: 33 bytes), plus one layout copy r1 w1 (float8_ops.py, float8_mm's
# .contiguous() of a row-major b or a column-major a): 68 bytes. Rowwise (per-row scales along
# each GEMM's reduced dim): 2 bytes more an element, the bf16 copy in the other layout written
# and read back before its cast (roofline_utils.py at 36027d8, rowwise: 8 against 6, weights
# 10 against 8)
FLOAT8_CASTS = {True: (17, 6), False: (20, 68)}

EXPERT = re.compile(r"(^|\.)experts(\.(\d+))?(\.|$)")
# attention's query and output projections: their side that is not the width is its heads x
# head_dim, at which its score (QK^T) and value (AV) products run
QUERY = re.compile(r"(^|\.)(wq|q_proj|q_b_proj|query)(\.|$)")
OUTPUT = re.compile(r"(^|\.)(wo|o_proj|out_proj)(\.|$)")
NORM = re.compile(r"norm|(^|\.)ln")  # a norm's vector: an RMSNorm's where it has no bias


@dataclass(frozen=True)
class Shapes:
    """What :func:`shape_costs` reads of a plan, whatever its mesh and tokens: per unit key
    ``(weights, weights per routed expert, has routed experts, has the embedding, outputs
    kept by selective checkpointing, the same per routed expert, (its matrices, one routed
    expert's) as ``((rows, cols), count)`` of their last two dims, for :func:`saved_bytes`;
    the last two global dims of attention's query and output projections, or ``None``)``,
    and the embedding table's width and vocabulary (its second and first dims; 0 without one).

    Weights are those of matrices other than routed experts' and embedding tables (paths
    naming ``embed``); a matrix's outputs per token are its second-to-last dim (torch's
    ``(out, in)`` weights). A routed expert is a path through ``experts.<i>`` (one expert's
    tensors) or through ``experts`` with the experts stacked on dim 0; a unit's weights per
    expert are what it holds of them over the experts it holds, the same whether it holds
    all of them or an expert-parallel rank's share. A sweep reads them once
    (:func:`vfsdp.estimation.sweep`)."""

    units: Mapping
    width: int
    vocab: int

    @classmethod
    def of(cls, spec: ShardSpec) -> Shapes:
        """Read ``spec``'s tensors (in tree order: the first table naming ``embed`` is the
        embedding)."""
        return cls._read(spec.units, ((t.path, t.unit, tuple(t.shape), t.global_shape)
                                      for t in spec.tensors()))

    @classmethod
    def of_prepared(cls, prepared: Prepared) -> Shapes:
        """The same as :meth:`of` of any plan of ``prepared`` (the tree read once by
        :func:`vfsdp.planner.plan.prepare`), without laying one out."""
        first: dict = {}  # a tied tensor comes where its first leaf is, whichever name heads it
        for alias, head in prepared.tied.items():
            first[head] = min(first.get(head, head), alias)
        rows = sorted(((i, p, key, sh) for key, (idx, paths, shapes, *_) in
                       prepared.members.items() for i, p, sh in zip(idx, paths, shapes)),
                      key=lambda row: first.get(row[0], row[0]))
        st = prepared.strided
        return cls._read(prepared.members, (
            (p, key, tuple(sh), tuple(sh) if st is None or st[i] is None else st[i].global_shape)
            for i, p, key, sh in rows))

    @classmethod
    def _read(cls, keys: Iterable, tensors: Iterable) -> Shapes:
        """From the unit keys and ``(path, unit key, shape, global shape)`` per tensor, in
        tree order."""
        # [weights, stacked experts' per expert, indexed experts', their ids, has the
        # embedding], the same three of matmul outputs, and the count of the first kind
        # and the (rows, cols) of each matrix (its last two dims, local) with their counts:
        # weights, stacked experts', indexed experts'
        # and the query and output projections' global (rows, cols)
        rows: dict = {key: [0.0, 0.0, 0.0, set(), False, 0.0, 0.0, 0.0, 0, Counter(), Counter(),
                            Counter(), None, None, False, False] for key in keys}
        width = vocab = 0
        for path, unit, shape, global_shape in tensors:
            name = ".".join(map(str, path))
            row = rows[unit]
            found = EXPERT.search(name)
            if found and found.group(3):
                row[3].add(found.group(3))
            if "embed" in name:
                row[4] = True
                if not width and len(global_shape) == 2:
                    width, vocab = int(global_shape[1]), int(global_shape[0])
                continue
            if len(shape) == 1 and NORM.search(name):  # a norm's weight, or its bias
                row[14 + (path[-1] == "bias")] = True
            if len(shape) < 2:
                continue
            n, out = math.prod(shape), global_shape[-2]
            at = 0 if not found else 2 if found.group(3) else 1
            if at == 1 and shape[0]:
                n /= shape[0]
            row[at] += n
            row[5 + at] += out
            row[8] += at == 0
            row[9 + at][tuple(shape[-2:])] += 1
            for i, proj in ((12, QUERY), (13, OUTPUT)):
                if row[i] is None and not found and proj.search(name):
                    row[i] = tuple(global_shape[-2:])
        # the outputs selective checkpointing keeps: of n matmuls the 1st, 3rd, ... (their
        # mean width each), of each routed expert's half
        units = {k: (w, stacked + (indexed / len(ids) if ids else 0.0), bool(stacked or ids),
                     emb, -(-n // 2) * outs / n if n else 0.0,
                     (o_st + (o_ix / len(ids) if ids else 0.0)) / 2,
                     (tuple(sorted(mats.items())), tuple(sorted(
                         {**st, **{m: st[m] + c / len(ids) for m, c in ix.items()}}.items()))),
                     (q, o), norm and not bias)
                 for k, (w, stacked, indexed, ids, emb, outs, o_st, o_ix, n, mats, st, ix, q, o,
                         norm, bias) in rows.items()}
        return cls(MappingProxyType(units), width, vocab)

    def costs(self, tokens: int, o: Options) -> dict:
        """``{unit key: LayerCost}`` for ``tokens`` tokens per rank under ``o``'s
        ``experts_per_token``, ``seq``, ``recompute``, ``logits_dtype`` and ``fused_loss``
        (see :func:`shape_costs`)."""
        experts_per_token, seq, width, vocab = o.experts_per_token, o.seq, self.width, self.vocab
        s = o.logits_dtype.itemsize  # the loss's peak per token and vocabulary entry: fused,
        per_logit = 4 if o.fused_loss else max(2 + 2 * s, 3 * s)  # else eager (shape_costs)
        if experts_per_token is None and any(row[2] for row in self.units.values()):
            raise ValueError("estimate: the model has routed experts (paths "
                             "'...experts.<i>...' or stacked '...experts...'); pass "
                             "experts_per_token (top-k, e.g. 8 for DeepSeek-V3)")
        out = {}
        for key, (weights, per_expert, experts, has_embed, outs, expert_outs, mats, qo, rms) in \
                self.units.items():
            k = experts_per_token if experts else 0  # routed experts per token
            n = weights + per_expert * k
            layer = isinstance(key, tuple) and len(key) >= 2 and isinstance(key[-1], int)
            # QK^T at the query's heads x head_dim, AV at the output projection's (the width
            # where not found): 2 FLOPs a product forward, 4 backward
            inner = sum(width if sh is None else sh[1] if sh[0] == width else sh[0] for sh in qo)
            attn = 6 * tokens * seq * inner if layer and seq and width else 0
            share = _RECOMPUTE[o.recompute]
            # the forward's weight matmuls run again (a share of them), attention if full
            extra = share * 2 * tokens * n + (attn / 3 if share == 1.0 else 0.0) if layer else 0.0
            acts = again = ew = 0
            if layer and width:
                full = saved_bytes(*mats, width, k, o.compiled, o.float8, rms)
                # selective: the input, attention's output, every other output
                kept = full if not o.recompute else 2 if o.recompute != "selective" else \
                    2 * (2 + (outs + expert_outs * k) / width)
                acts, again = tokens * width * kept, tokens * width * max(full - kept, 0.0)
                ew = tokens * width * ELEMENTWISE[o.compiled] * (3 + share)
                if o.float8:
                    widths, per = FLOAT8_CASTS[o.float8_fused_casts]
                    per += 2 * (o.float8_recipe == "rowwise")  # its transposed bf16 copy
                    ew += per * (tokens * width * widths + n * (not o.float8_all_gather))
            if has_embed and vocab:
                acts += tokens * vocab * per_logit
            out[key] = LayerCost(float(6 * tokens * n + attn), int(acts), int(again), extra, float(attn), ew)
        return out


def shape_costs(spec: ShardSpec, tokens: int, experts_per_token: Optional[int] = None,
                seq: Optional[int] = None, recompute: Any = False,
                logits_dtype: torch.dtype = torch.float32, fused_loss: bool = False) -> dict:
    """Costs from the shapes alone, per unit key, for ``tokens`` tokens per rank:

    * FLOPs: ``6 * tokens`` per weight of a matrix (forward 2, backward 4), routed experts'
      weights counted ``experts_per_token / experts`` times (each token meets that many of
      them; see :class:`Shapes` for what is an expert), embedding tables (paths naming
      ``embed``) not at all; with ``seq``, attention's ``6 * seq * (q + o)`` per token and
      layer (PaLM's ``12 * seq * width`` where the heads are the width), ``q`` the query
      projection's heads x head_dim (QK^T), ``o`` the output projection's (AV): their side
      that is not the width (paths naming ``wq``, ``q_proj``, ``q_b_proj`` or ``query``, and
      ``wo``, ``o_proj`` or ``out_proj``), else the width (the embedding's second dim);
    * activations: what the layer saves for its backward, from its shapes
      (:func:`saved_bytes`: 32 bytes per token and width for GPT-2's block, 41 for Llama-3
      8B's), or with ``recompute`` the layer input only (2 bytes per token and width), the
      rest held again while its backward runs, and a third of
      the layer's FLOPs again (its forward, recomputed: time, not MFU); with
      ``recompute="selective"`` (torchtitan's op-level policy) the layer's input,
      attention's output and every other weight matmul's output (the 1st, 3rd, ... of its
      ``n`` matrices: ``ceil(n / 2)`` outputs of their mean width, a matrix's output its
      second-to-last dim; half of each routed expert's) in bf16; for the unit with the embedding, the
      loss's peak per token and vocabulary entry: eager, the larger of its forward's (bf16
      logits, their cast to ``logits_dtype`` and its softmax: 10 bytes in fp32) and its
      backward's (the softmax, its gradient and the logits' gradient before the cast back:
      12 in fp32, 6 in bf16); a fused loss (``fused_loss``, such as a compiled one) holds the
      bf16 logits and their gradient (4).

    Args:
        spec: The plan.
        tokens: Tokens per rank per step.
        experts_per_token: Routed experts per token (top-k), for a model with experts.
        seq: The sequence length (adds attention's FLOPs).
        recompute: Activation checkpointing: ``True`` or ``"full"`` (only each layer's input
            is kept), ``"selective"`` (torchtitan's op-level policy: every other output kept,
            half the forward's weight matmuls run again), ``False``.
        logits_dtype: The dtype the loss computes its softmax in.
        fused_loss: Whether the loss is one fused kernel (``torch.compile``'s, Liger's).

    Returns:
        ``{unit key: LayerCost}``.

    Raises:
        ValueError: the shapes hold routed experts and ``experts_per_token`` is not given, or
            ``recompute`` is none of its values.

    Example:
        >>> p = {"embed": torch.empty(1000, 64, device="meta"),
        ...      "layers": [{"w": torch.empty(64, 64, device="meta")} for _ in range(2)]}
        >>> c = shape_costs(vfsdp.plan(p, 2), tokens=10)
        >>> c[("layers", 0)].flops, c[()].flops
        (245760.0, 0.0)
    """
    return Shapes.of(spec).costs(tokens, Options(
        tokens_per_rank=tokens, experts_per_token=experts_per_token, seq=seq,
        recompute=recompute, logits_dtype=logits_dtype, fused_loss=fused_loss))
