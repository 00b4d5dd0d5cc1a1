"""The silent failures found by trying 0.2 as a user would (issue "Core v3"): each is now right
or refused, on threads and, where processes behave differently, on gloo processes too."""

import gc
import weakref

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vfsdp
from tests.misuse import bodies
from vfsdp._torch_private import TorchDispatchMode, storage_id
from vfsdp.testing import RankError, simulate, spawn

# ------------------------------------------------------------------ per-rank seeding


def _module_built_in_rank():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Embedding(5, 2))
    w = torch.empty(3, 3)
    torch.nn.init.orthogonal_(w)
    return [p.detach().clone() for p in layer.parameters()] + [w]


def test_nn_init_draws_from_the_rank_generator():
    """An nn.Module built inside the rank function after the same seed has the same weights on
    every rank, and those of one process (it had different weights on each rank)."""
    torch.manual_seed(0)
    want = _module_built_in_rank()
    for got in simulate(2, _module_built_in_rank):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _dropouts(seed_by_rank):
    torch.manual_seed(dist.get_rank() if seed_by_rank else 3)
    x = torch.ones(2, 3, 4, 4)
    d = torch.nn.Dropout(0.5)(torch.ones(64))
    d2 = F.dropout2d(x, 0.5)
    channels = all(bool((d2[n, c] == d2[n, c, 0, 0]).all()) for n in range(2) for c in range(3))
    a = F.alpha_dropout(torch.randn(20000), 0.2, training=True)
    eval_mode = F.dropout(torch.ones(4), 0.5, training=False)
    return d, d2, channels, a, eval_mode, torch.dropout(torch.ones(64), 0.25, True)


def test_dropout_draws_from_the_rank_generator():
    (d0, c0, ch0, a0, e0, t0), (d1, c1, ch1, _a1, _e1, t1) = simulate(2, _dropouts, False)
    assert torch.equal(d0, d1) and torch.equal(c0, c1) and torch.equal(t0, t1)  # same seed
    assert set(d0.tolist()) == {0.0, 2.0} and {round(v, 5) for v in t0.tolist()} == {0.0, 1.33333}
    assert ch0 and ch1                                     # dropout2d zeroes whole channels
    assert abs(a0.mean().item()) < 0.05 and abs(a0.std().item() - 1.0) < 0.05  # alpha: SELU
    assert e0.tolist() == [1.0] * 4                        # eval: untouched
    (d0, *_), (d1, *_) = simulate(2, _dropouts, True)
    assert not torch.equal(d0, d1)                         # seeded per rank: different masks


# ------------------------------------------------------------------ update before backward


@pytest.mark.parametrize("path", ["gather", "run_layers"])
def test_an_update_between_forward_and_backward_is_refused(path):
    """The optimizers write the unit's flat shard: its version is checked too (the backward
    ran, mixing old and new parameters: 3.8 instead of 4.0)."""
    for msg in simulate(2, bodies.modified_between, path, "update"):
        assert "were updated in place (an optimizer update" in msg, msg
        assert f"after vfsdp.{path} used them" in msg, msg


# ------------------------------------------------------------------ dropped graphs


class _Census(TorchDispatchMode):
    """Weak references to every tensor an op makes: ``live()`` sums the bytes of the storages
    still alive (cheap: nothing is sampled per op)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t))
        return out

    def live(self):
        self.made = [r for r in self.made if r() is not None]
        return sum({storage_id(t): t.untyped_storage().nbytes()
                    for t in (r() for r in self.made) if t is not None}.values())


def _dropped_graphs(how, n):
    params = {"layers": [{"w": torch.full((16, 16), 1 / 16)} for _ in range(3)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)

    def layer(p, a):
        if how == "layer_fn" and p["w"].shape[0] and a.shape[0] == 7:
            raise ValueError("boom")
        return torch.tanh(a @ p["w"])   # tanh saves its own output

    census, seen = _Census(), []
    with census:
        for step in range(n):
            x = torch.randn(7 if how == "layer_fn" else 8, 16)
            try:
                h = vfsdp.run_layers(layer, shards["layers"], spec["layers"], x)
                if how == "loss":
                    raise ValueError(f"a loss that raises ({h.shape})")
            except ValueError:
                pass
            h = None  # the graph is dropped without a backward
            if step in (9, n - 1):
                gc.collect()
                seen.append(census.live())
    # then a normal step still trains every unit on every rank
    vfsdp.run_layers(lambda p, a: torch.tanh(a @ p["w"]), shards["layers"], spec["layers"],
                     torch.ones(2, 16)).sum().backward()
    return seen, [g["w"].abs().sum().item() > 0 for g in vfsdp.grads(shards, spec)["layers"]]


@pytest.mark.parametrize("how", ["eval", "loss", "layer_fn"])
def test_a_dropped_run_layers_graph_frees_what_it_held(how):
    """100 evaluations with grad mode on (or steps that raise in the loss or in layer_fn):
    memory flat (it grew by a graph per call: the saved output of tanh made a cycle)."""
    for (after_10, after_100), trained in simulate(2, _dropped_graphs, how, 100):
        assert after_100 == after_10, (after_10, after_100)
        assert trained == [True] * 3


def test_a_dropped_run_layers_graph_frees_what_it_held_on_gloo():
    for (after_10, after_30), trained in spawn(_dropped_graphs, 2, "eval", 30):
        assert after_30 == after_10 and trained == [True] * 3


# ------------------------------------------------------------------ accumulation


def _micro_batches(accumulate, zero_between):
    torch.manual_seed(0)
    params = {"layers": [{"w": torch.randn(4, 4)} for _ in range(2)]}
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=vfsdp.rows(1))
    shards = vfsdp.shard(params, spec)
    opts = {} if accumulate is None else {"accumulate_grads": accumulate}
    for k in range(2):                                 # two micro-batches, no zeroing
        if zero_between:
            vfsdp.zero_grads(shards, spec)
        x = torch.full((1, 4), 1.0 + k + dist.get_rank())
        vfsdp.run_layers(lambda p, a: torch.tanh(a @ p["w"]), shards["layers"],
                         spec["layers"], x, **opts).sum().backward()
    return [g["w"] for g in vfsdp.grads(shards, spec)["layers"]], spec


def _torch_micro_batches(world, batches):
    torch.manual_seed(0)
    ws = [torch.randn(4, 4).requires_grad_() for _ in range(2)]
    for k in batches:
        for r in range(world):
            h = torch.full((1, 4), 1.0 + k + r)
            for w in ws:
                h = torch.tanh(h @ w)
            (h.sum() / world).backward()                # "avg" over the ranks
    return [w.grad for w in ws]


def _assert_pieces(out, want):
    """Each rank's gradient pieces are its ranges of the one-process gradients."""
    for r, (got, spec) in enumerate(out):
        for g, w, t in zip(got, want, spec.tensors()):
            lo, hi = t.local_range(r)
            assert torch.allclose(g.reshape(-1), w.reshape(-1)[lo:hi], atol=1e-6)


@pytest.mark.parametrize("accumulate", [None, True])
def test_two_run_layers_micro_batches_sum_as_in_torch(accumulate):
    """run_layers kept only the last micro-batch's gradients; now they add as in torch,
    with no warning."""
    want = _torch_micro_batches(2, [0, 1])
    with _no_future_warning():
        out = simulate(2, _micro_batches, accumulate, False)
    _assert_pieces(out, want)


def test_zero_grads_between_micro_batches_starts_afresh_without_a_warning():
    want = _torch_micro_batches(2, [1])
    with _no_future_warning():
        out = simulate(2, _micro_batches, None, True)
    _assert_pieces(out, want)


def test_accumulate_grads_false_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"accumulate_grads=False was removed in vfsdp 0\.4"):
        vfsdp.Policy(accumulate_grads=False)
    with pytest.raises(RankError, match=r"Call vfsdp\.zero_grads"):
        simulate(2, _micro_batches, False, False)


def _uneven_micro_batches(swallow):
    params = {"layers": [{"w": torch.ones(4, 4)} for _ in range(2)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    for _ in range(1 if swallow else 1 + dist.get_rank()):   # rank 1 runs one more
        try:
            h = vfsdp.run_layers(lambda p, a: torch.tanh(a @ p["w"]), shards["layers"],
                                 spec["layers"], torch.ones(1, 4), accumulate_grads=True)
            if swallow and dist.get_rank() == 0:
                raise ValueError("a bad batch")                  # rank 0 skips the backward
            h.sum().backward()
        except ValueError:
            pass
    return "finished"


@pytest.mark.parametrize("swallow", [False, True], ids=["micro_batches", "swallowed"])
def test_ranks_that_run_different_run_layers_calls_are_reported_naming_the_user_line(swallow):
    """Different numbers of run_layers micro-batches (or a rank that swallows its loss's
    exception and skips the backward) leave one rank waiting in a collective no other rank
    starts. That cannot be told before it waits; simulate reports it, naming the collective
    and the user's line (it named a vfsdp lambda, or torch's threaded group raised IndexError)."""
    with pytest.raises(RankError) as info:
        simulate(2, _uneven_micro_batches, swallow, timeout=3)
    why = info.value.failures[1]          # rank 1 runs the backward, or one more micro-batch
    # (the backward's agreement runs on a side group and waits for nothing it does not need,
    # so the rank waits where the data path does: the unit's all-gather)
    assert "waiting in the collective all_gather" in why, why
    assert f"from your code at _uneven_micro_batches ({__file__}:" in why, why
    assert "IndexError" not in str(info.value)


class _no_future_warning:
    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings(record=True)
        self.seen = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self.seen if issubclass(w.category, FutureWarning)], \
            [str(w.message) for w in self.seen]


# ------------------------------------------------------------------ eager and compiled mixed


def _mixed_orders(orders):
    """Each order is a sequence of steps: ``e`` all eager; ``c`` eager forward and backward,
    compiled clip and update; ``b`` compiled forward and backward, eager clip and update;
    ``B`` all compiled but as two calls; ``W`` one compiled step."""
    torch.manual_seed(0)
    params = {"layers": [{"w": torch.randn(4, 4) / 2} for _ in range(2)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    opt = vfsdp.optim.adamw(0.05, weight_decay=0.1)

    def upd(shards, state):
        g = vfsdp.grads(shards, spec)
        n = vfsdp.clip_grad_norm(g, spec, 1.0)
        opt.update(g, state, shards, spec)
        return n

    def fwd_bwd(shards, x):
        vfsdp.zero_grads(shards, spec)
        h = vfsdp.run_layers(lambda p, a: torch.tanh(a @ p["w"]), shards["layers"],
                             spec["layers"], x)
        h.sum().backward()

    def whole(shards, state, x):
        fwd_bwd(shards, x)
        return upd(shards, state)

    # the graph's meaning, as traced (inductor's code: tests/functional/test_compiled.py)
    cupd, cfb, cwhole = (torch.compile(f, fullgraph=True, backend="aot_eager")
                         for f in (upd, fwd_bwd, whole))
    out = {}
    for order in orders:
        shards = vfsdp.shard(params, spec)
        state = opt.init(shards, spec)
        norms = []
        for s, kind in enumerate(order):
            x = torch.full((1, 4), 1.0 + s + dist.get_rank())
            if kind == "W":
                n = cwhole(shards, state, x)
            else:
                (cfb if kind in "bB" else fwd_bwd)(shards, x)
                n = (cupd if kind in "cB" else upd)(shards, state)
            norms.append(float(n))
        state.sync_step()
        out[order] = (norms, [t.detach().clone() for t in optree.tree_leaves(shards)],
                      state.step)
    return out


def test_eager_and_compiled_backward_clip_and_update_mix_in_any_order():
    """Under compile vfsdp.grads read the shards' .grad (None after a grads='buffer' eager
    backward: the compiled update did not move the parameters, a compiled clip read 0.0), and
    the compiled step counter restarted at 0. Every order now gives the all-eager result."""
    # e: eager; c: eager backward, compiled clip and update; b: compiled backward, eager
    # update; B: both compiled apart; W: one compiled whole step. Every switch between them
    # happens in one of these (each order compiles anew: new shards)
    orders = ["eeee", "cece", "bBee", "WeWe", "eWbc"]
    for got in spawn(_mixed_orders, 2, orders, timeout=600):
        norms, params, steps = got["eeee"]
        assert steps == 4
        for order in orders[1:]:
            n, p, k = got[order]
            assert k == 4, order
            assert all(abs(a - b) < 1e-5 for a, b in zip(n, norms)), (order, n, norms)
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(p, params)), order



def test_an_estimate_that_finds_no_layers_says_so_and_layers_names_them():
    # units= with string keys: nothing says which units run_layers runs, and taking them all
    # as gathered for the whole step overstates the peak; it warns, and layers= fixes it
    import warnings

    params = {"blocks": {f"b{i}": {"w": torch.empty(64, 64, device="meta")} for i in range(4)}}
    spec = vfsdp.plan(params, 2, units=lambda path: path[:2])
    with pytest.warns(UserWarning, match="pass layers= with the unit keys"):
        held = vfsdp.estimate(spec)
    keys = list(spec.units)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        named = vfsdp.estimate(spec, layers=keys)
    assert named.memory["buffers"] < held.memory["buffers"]


def _attention(seed):
    torch.manual_seed(seed)
    q, k, v = (torch.ones(1, 2, 4, 8) for _ in range(3))
    causal = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
    plain = F.scaled_dot_product_attention(q, k, v)          # no dropout: torch's own kernel
    return causal, plain, torch.randn(2)


def test_attention_dropout_draws_from_the_rank_generator():
    """SDPA's dropout (Hugging Face's default attention) took the shared generator: a
    different mask per rank and per run with one seed."""
    (c0, p0, r0), (c1, _, r1) = simulate(2, _attention, 0)
    again = simulate(2, _attention, 0)[0][0]
    assert torch.equal(c0, c1) and torch.equal(c0, again) and torch.equal(r0, r1)
    assert torch.equal(p0, torch.ones(1, 2, 4, 8))
    rows = c0[0, 0]                 # causal, ones: row i averages i + 1 ones, half kept, x2
    assert set(rows[0].tolist()) <= {0.0, 2.0} and not torch.equal(c0, torch.ones_like(c0))
    other = simulate(2, _attention, 1)[0][0]
    assert not torch.equal(c0, other)                      # the seed decides the mask


# ------------------------------------------------------------------ apply.run_layers


class _HeadReadsABlock(torch.nn.Module):
    """A forward that reads a block's parameter outside that block's call."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x) * self.layers[0].bias.sum()


def _head_reads_a_block():
    net = _HeadReadsABlock()
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    try:
        apply.run_layers(shards, spec, torch.ones(3, 4))
    except RuntimeError as exc:
        msg = str(exc)
    out = apply(vfsdp.gather(shards, spec), torch.ones(3, 4))  # the module is as it was
    return msg, out.shape, type(net.layers[0].bias).__name__


def test_a_block_parameter_read_outside_its_call_under_apply_run_layers_is_refused():
    """It read the module's own tensor (not the shards'), so its gradient was lost: the
    gradients were 2.5 off one process's. Outside their calls the blocks' parameters read
    as released, naming the parameter and the fix."""
    for msg, shape, kind in simulate(2, _head_reads_a_block):
        assert msg.startswith("apply.run_layers: layers.0.bias is a block's parameter, read "
                              "outside that block's call"), msg
        assert "call apply(vfsdp.gather(shards, spec), ...)" in msg
        assert shape == (3, 1) and kind == "Parameter"


def _reduce_scatter_keys():
    spec = vfsdp.plan({"w": torch.ones(8), "b": torch.ones(2)}, 2)
    messages = []
    for grads in ({"w": torch.ones(8), "c": torch.ones(2)},  # as many leaves, another name
                  {"w": torch.ones(8)}, {"w": torch.ones(8), "b": None}):
        try:
            vfsdp.reduce_scatter(grads, spec)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_reduce_scatter_refuses_gradients_under_other_names_with_as_many_leaves():
    """A gradient tree with the spec's leaf count but another key was taken by position: the
    gradient of ``c`` went to ``b``. It is refused naming the path; a ``None`` gradient keeps
    its place and is accepted."""
    for got in simulate(2, _reduce_scatter_keys):
        assert "unexpected c" in got[0] and "missing b" in got[1], got
        assert got[2] is None, got
