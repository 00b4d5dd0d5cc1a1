"""vfsdp.functionalize: a module's parameters as a tree (its own naming, a tie once, buffers
apart) and its forward as a function of any tree of that shape, whole or block by block."""

import os
import threading

import optree
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import vfsdp
from vfsdp.testing import simulate


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, d)

    def forward(self, h, scale):
        return h + torch.tanh(self.fc(self.norm(h))) * scale


class TinyLM(torch.nn.Module):
    """An embedding tied to the head (the embedding registered first), blocks in a module
    list, a buffer."""

    def __init__(self, vocab=11, d=6, n=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, scale=self.scale)
        return self.head(h)


def test_tree_follows_the_module_tie_once_under_its_first_name_buffers_apart():
    torch.manual_seed(0)
    model = TinyLM()
    params, apply = vfsdp.functionalize(model)
    assert sorted(params) == ["embed", "layers"]            # no "head": its weight is the tie
    assert isinstance(params["layers"], list) and len(params["layers"]) == 3
    assert params["embed"]["weight"] is model.embed.weight   # the module's own tensors
    assert params["layers"][1]["fc"]["bias"] is model.layers[1].fc.bias
    assert apply.ties == {"head.weight": "embed.weight"}
    assert apply.buffers == {"scale": model.scale}
    assert apply.blocks == ("layers",)
    spec = vfsdp.plan(params, 2)
    assert list(spec.units) == [(), ("layers", 0), ("layers", 1),
                                 ("layers", 2)]


def test_apply_is_the_forward_and_its_gradients_with_the_tie():
    torch.manual_seed(0)
    model = TinyLM()
    params, apply = vfsdp.functionalize(model)
    tokens = torch.randint(0, 11, (2, 5))
    copy = optree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    out = apply(copy, tokens)
    assert torch.equal(out, model(tokens))
    out.square().mean().backward()
    model(tokens).square().mean().backward()
    for (a, b) in zip(optree.tree_leaves(copy), optree.tree_leaves(params)):
        assert torch.equal(a.grad, b.grad)      # the tie's gradient: both uses, as in torch


def test_run_layers_over_the_blocks_equals_the_module():
    """Each rank its own module (threads cannot share one); the blocks run through
    vfsdp.run_layers; the loss and every gradient equal one process's."""
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))

    def body():
        torch.manual_seed(0)
        params, apply = vfsdp.functionalize(TinyLM())
        spec = vfsdp.plan(params, dist.get_world_size(), granularity=vfsdp.rows(1))
        shards = vfsdp.shard(params, spec)
        out = apply.run_layers(shards, spec, tokens)
        out.square().mean().backward()
        rank = dist.get_rank()
        mine = [(t.local_range(rank), g.detach().reshape(-1).clone())
                for t, g in zip(optree.tree_leaves(spec.tree), optree.tree_leaves(
                    vfsdp.grads(shards, spec)))]
        return out.detach(), mine

    torch.manual_seed(0)
    model = TinyLM()
    want = model(tokens)
    want.square().mean().backward()
    params, _ = vfsdp.functionalize(model)
    for out, grads in simulate(2, body):
        assert torch.equal(out, want.detach())
        for ((lo, hi), g), p in zip(grads, optree.tree_leaves(params)):
            torch.testing.assert_close(g, p.grad.reshape(-1)[lo:hi], rtol=1e-6, atol=1e-7)


def test_a_meta_module_plans_with_no_memory_and_init_fn_fills_the_shards():
    with torch.device("meta"):
        model = TinyLM(vocab=1000, d=64)
    params, apply = vfsdp.functionalize(model)
    assert all(t.device.type == "meta" for t in optree.tree_leaves(params))
    spec = vfsdp.plan(params, 4, granularity=vfsdp.rows(1))
    rule = vfsdp.init.rule(vfsdp.init.normal(0.02), ones=lambda path: "norm" in str(path))

    def body():
        shards = vfsdp.shard(params, spec, init_fn=vfsdp.init.sharded(rule, seed=0))
        return sum(t.numel() for t in optree.tree_leaves(shards))

    assert sum(simulate(4, body)) == sum(t.numel() for t in optree.tree_leaves(params))
    with pytest.raises(ValueError, match=r"buffer scale is on the meta device.*apply.buffers"):
        apply(params, torch.zeros(1, 1, dtype=torch.long))


def test_misuse_is_refused_with_the_fix():
    model = TinyLM()
    params, apply = vfsdp.functionalize(model)
    with pytest.raises(TypeError, match=r"takes an nn\.Module"):
        vfsdp.functionalize(params)
    with pytest.raises(ValueError, match="not shaped as the module's"):
        apply({"embed": params["embed"]}, torch.zeros(1, 1, dtype=torch.long))
    apply(params, torch.zeros(1, 1, dtype=torch.long))
    errors = []

    def other():
        try:
            apply(params, torch.zeros(1, 1, dtype=torch.long))
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "functionalize it inside the rank's function" in errors[0]
    _, no_blocks = vfsdp.functionalize(torch.nn.Linear(2, 2))
    assert no_blocks.blocks is None
    with pytest.raises(ValueError, match="no module list of blocks"):
        no_blocks.run_layers({}, vfsdp.plan({}, 1), torch.zeros(2))


def test_units_mixing_blocks_and_the_rest_are_refused():
    def body():
        params, apply = vfsdp.functionalize(TinyLM())
        spec = vfsdp.plan(params, 2, units=0)          # one unit for everything
        shards = vfsdp.shard(params, spec)
        with pytest.raises(ValueError, match="each block a unit of its own"):
            apply.run_layers(shards, spec, torch.zeros(1, 2, dtype=torch.long))

    simulate(2, body)


class Between(TinyLM):
    """Work between the blocks, each block its own argument."""

    def forward(self, tokens):
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h, scale=self.scale * (i + 1)))
        return h


class Shared(TinyLM):
    """ALBERT-style sharing: one block at two positions of the list."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([self.layers[0], self.layers[1], self.layers[0]])


class AuxBlock(Block):
    def forward(self, h, scale):
        out = super().forward(h, scale)
        return out, out.square().mean()


class Aux(TinyLM):
    """Blocks that return ``(h, aux)``; the forward adds the auxiliary losses up."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(AuxBlock(6) for _ in range(3))

    def forward(self, tokens):
        h, total = self.embed(tokens), 0.0
        for layer in self.layers:
            h, aux = layer(h, scale=self.scale)
            total = total + aux
        return self.head(h) + total


class Plain(torch.nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class Timm(torch.nn.Module):
    """Blocks in an nn.Sequential, called as one (timm's ``self.blocks(x)``)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(4, 6)
        self.blocks = torch.nn.Sequential(*(Plain() for _ in range(3)))

    def forward(self, x):
        return self.blocks(self.stem(x))


class TiedInside(torch.nn.Module):
    """A block whose two layers share one weight (a tie inside the block), the second read
    in a checkpoint of the block's own."""

    def __init__(self, d=6):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.b.weight = self.a.weight

    def forward(self, h):
        return h + checkpoint(lambda t: self.b(torch.tanh(self.a(t))), h, use_reentrant=False)


def _encoder():
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                             batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


MODELS = {  # name: (model, input, how the loss is made of the output)
    "between": (Between, lambda: torch.randint(0, 11, (2, 5), generator=_gen()), torch.sum),
    "shared": (Shared, lambda: torch.randint(0, 11, (2, 5), generator=_gen()), torch.sum),
    "aux": (Aux, lambda: torch.randint(0, 11, (2, 5), generator=_gen()), torch.sum),
    "sequential": (lambda: torch.nn.Sequential(*(Plain() for _ in range(3))),
                   lambda: torch.randn(3, 6, generator=_gen()), torch.sum),
    "timm": (Timm, lambda: torch.randn(3, 4, generator=_gen()), torch.sum),
    "encoder": (_encoder, lambda: torch.randn(2, 3, 8, generator=_gen()), torch.sum),
    "tied_inside": (lambda: torch.nn.Sequential(*(TiedInside() for _ in range(3))),
                    lambda: torch.randn(3, 6, generator=_gen()), torch.sum),
}


def _gen():
    return torch.Generator().manual_seed(1)


def _make(kind):
    torch.manual_seed(0)
    return MODELS[kind][0]()


def _rank_grads(net, x, loss, policy=None):
    """On each rank: apply.run_layers' output and this rank's pieces of every gradient."""
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=vfsdp.rows(1))
    shards = vfsdp.shard(params, spec)
    out = apply.run_layers(shards, spec, x, policy=policy)
    loss(out.square()).backward()
    rank = dist.get_rank()
    return out.detach(), [(t.local_range(rank), g.detach().reshape(-1).clone())
                          for t, g in zip(optree.tree_leaves(spec.tree),
                                          optree.tree_leaves(vfsdp.grads(shards, spec)))]


def _check_against_torch(kind, policy=None):
    _, data, loss = MODELS[kind]
    x = data()
    want_net = _make(kind)
    want = want_net(x)
    loss(want.square()).backward()
    params, _ = vfsdp.functionalize(want_net)
    nets = [_make(kind) for _ in range(2)]  # built here: ranks (threads) share one RNG
    for out, grads in simulate(2, lambda: _rank_grads(nets[dist.get_rank()], x, loss, policy)):
        torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-6)
        for ((lo, hi), g), p in zip(grads, optree.tree_leaves(params)):
            torch.testing.assert_close(g, p.grad.reshape(-1)[lo:hi], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", list(MODELS))
def test_run_layers_runs_the_modules_own_forward_block_by_block(kind):
    """Work and per-block arguments between the blocks, a block at two positions, blocks
    returning (h, aux), blocks in a Sequential, a Sequential model, nn.TransformerEncoder, a
    tie inside each block (it read the module's own tensor: silently wrong): the output and
    every gradient as one plain-torch process's."""
    _check_against_torch(kind)


@pytest.mark.parametrize("recompute", ["full", "selective", "policy"])
def test_recompute_of_every_block_is_exact(recompute):
    from torch.utils.checkpoint import CheckpointPolicy

    def keep_mm(ctx, op, *args, **kwargs):  # a SAC policy: keep the matmuls, recompute the rest
        return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,
                                                    torch.ops.aten.addmm.default) \
            else CheckpointPolicy.PREFER_RECOMPUTE

    policy = vfsdp.Policy(recompute=keep_mm if recompute == "policy" else recompute)
    _check_against_torch("shared", policy)


def test_ranks_sharing_one_module_are_refused_before_any_collective():
    params, apply = vfsdp.functionalize(TinyLM())
    spec = vfsdp.plan(params, 2)

    def body():
        shards = vfsdp.shard(params, spec)
        apply.run_layers(shards, spec, torch.zeros(1, 2, dtype=torch.long))

    with pytest.raises(Exception, match="called from a second thread"):
        simulate(2, body, timeout=60)



def _frozen_net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    net[0].requires_grad_(False)  # a frozen submodule
    return net


def _frozen_body(net, path):
    """Shards of a module with a frozen submodule, by copy and through init_fn; a backward
    through vfsdp.gather; a safetensors save and a load."""
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    filled = vfsdp.shard(params, spec, init_fn=lambda p, local, t: local.zero_())
    flags = {n: (x.requires_grad, y.requires_grad) for n, x, y in zip(
        ["0.bias", "0.weight", "2.bias", "2.weight"], optree.tree_leaves(shards),
        optree.tree_leaves(filled))}
    apply(vfsdp.gather(shards, spec), torch.ones(3, 4)).square().sum().backward()
    none = {f"{m}.{w}": shards[m][w].grad is None for m in ("0", "2") for w in ("weight", "bias")}
    trained = {"w": shards["2"]["weight"].grad, "b": shards["2"]["bias"].grad}
    vfsdp.checkpoint.save_safetensors(path, shards, spec)
    vfsdp.checkpoint.load_safetensors(path, filled, spec)
    vfsdp.checkpoint.save(path + ".ckpt", {"p": shards}, spec)
    vfsdp.checkpoint.load(path + ".ckpt", {"p": filled}, spec)
    after = {n: x.requires_grad for n, x in zip(flags, optree.tree_leaves(filled))}
    return spec.frozen, flags, none, trained, after


def test_a_frozen_submodule_stays_frozen_and_gets_no_gradient_as_in_torch(tmp_path):
    want = _frozen_net()
    want(torch.ones(3, 4)).square().sum().backward()
    assert want[0].weight.grad is None and want[2].weight.grad is not None
    path = str(tmp_path / "m.safetensors")
    nets = [_frozen_net() for _ in range(2)]  # built here: ranks (threads) share one RNG
    results = simulate(2, lambda: _frozen_body(nets[dist.get_rank()], path))
    for frozen, flags, none, _, after in results:
        assert frozen == {("0", "weight"), ("0", "bias")}
        assert flags == {"0.bias": (False, False), "0.weight": (False, False),
                         "2.bias": (True, True), "2.weight": (True, True)}
        assert none == {"0.weight": True, "0.bias": True, "2.weight": False, "2.bias": False}
        assert after == {n: f[0] for n, f in flags.items()}  # checkpoint loads keep them
    w = torch.cat([r[3]["w"].reshape(-1) for r in results])
    b = torch.cat([r[3]["b"].reshape(-1) for r in results])
    torch.testing.assert_close(w, want[2].weight.grad.reshape(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(b, want[2].bias.grad, rtol=0, atol=1e-6)


def _batchnorm_body(net, path):
    """A train-mode step updates BatchNorm's running statistics; the export (to_state_dict,
    save_safetensors) of apply.state_tree holds them; a load fills another module's."""
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    apply(vfsdp.gather(shards, spec), torch.arange(12.0).reshape(4, 3)).sum().backward()
    sd = vfsdp.checkpoint.to_state_dict(apply.state_tree(shards), spec)
    vfsdp.checkpoint.save_safetensors(path, apply.state_tree(shards), spec)
    other, other_apply = vfsdp.functionalize(torch.nn.Sequential(
        torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)))
    back = vfsdp.shard(other, spec, init_fn=lambda p, local, t: local.zero_())
    vfsdp.checkpoint.load_safetensors(path, other_apply.state_tree(back), spec)
    return sd, {k: v.clone() for k, v in other_apply.buffers.items()}


def test_batchnorm_running_statistics_go_in_the_export_and_come_back():
    import tempfile

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))

    want = make()
    want(torch.arange(12.0).reshape(4, 3)).sum().backward()     # train mode: stats move
    nets = [make() for _ in range(2)]
    path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    (sd, bufs), (_, bufs1) = simulate(2, lambda: _batchnorm_body(nets[dist.get_rank()], path))
    assert set(sd) == set(want.state_dict())                   # num_batches_tracked included
    reloaded = make()
    reloaded.load_state_dict(sd)                                # strict
    for k, v in want.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-6)
    for b in (bufs, bufs1):
        assert all(torch.equal(b[k], sd[k]) for k in b)
    x = torch.linspace(-1, 1, 6).reshape(2, 3)
    want.eval()
    reloaded.eval()                                             # eval reads the statistics
    torch.testing.assert_close(reloaded(x), want(x), rtol=0, atol=1e-6)


def _layer(p, h):
    return h + torch.tanh(h @ p["w"]) * p["b"]


def _layers_grads(how):
    """vfsdp.run_layers over 3 layers with torch.utils.checkpoint inside the layer function
    (non-reentrant, the full tensors passed as an argument) or around the run, or recompute=
    a SAC policy; this rank's gradient pieces."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint

    def keep_mm(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default \
            else CheckpointPolicy.PREFER_RECOMPUTE

    params = {"layers": [{"w": torch.linspace(-1, 1, 16).reshape(4, 4) * (i + 1),
                          "b": torch.linspace(0, 1, 4) + i} for i in range(3)]}
    spec = vfsdp.plan(params, 2, granularity=vfsdp.rows(1))
    shards = vfsdp.shard(params, spec)
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    if how == "checkpoint":
        fn = lambda p, h: checkpoint(_layer, p, h, use_reentrant=False)
        h = vfsdp.run_layers(fn, shards["layers"], spec["layers"], x)
    elif how == "around":
        h = checkpoint(lambda t: vfsdp.run_layers(_layer, shards["layers"], spec["layers"], t),
                       x, use_reentrant=False)
    else:
        h = vfsdp.run_layers(_layer, shards["layers"], spec["layers"], x, recompute=keep_mm)
    h.square().sum().backward()
    return [{k: v.clone() for k, v in g.items()} for g in vfsdp.grads(shards, spec)["layers"]]


@pytest.mark.parametrize("how", ["checkpoint", "around", "sac"])
def test_activation_checkpointing_inside_vfsdp_run_layers_is_exact(how):
    """The recompute reads the regathered tensors, not the released ones of the forward
    (around the run: the ones its gathers again)."""
    params = [{"w": (torch.linspace(-1, 1, 16).reshape(4, 4) * (i + 1)).requires_grad_(),
               "b": (torch.linspace(0, 1, 4) + i).requires_grad_()} for i in range(3)]
    h = torch.linspace(-1, 1, 8).reshape(2, 4)
    for p in params:
        h = _layer(p, h)
    h.square().sum().backward()
    ranks = simulate(2, _layers_grads, how)
    for i, p in enumerate(params):
        for k in ("w", "b"):
            got = torch.cat([ranks[0][i][k], ranks[1][i][k]])
            torch.testing.assert_close(got, p[k].grad, rtol=1e-6, atol=1e-6)


class Early(TinyLM):
    """A forward that stops before the last block (the prefetch of it goes unused)."""

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers[:2]:
            h = layer(h, scale=self.scale)
        return h


def _early():
    net = Early()
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    for _ in range(2):  # twice: the unused unit is gathered again as the second forward starts
        vfsdp.zero_grads(shards, spec)
        apply.run_layers(shards, spec, torch.ones(1, 3, dtype=torch.long)).sum().backward()
    grads = vfsdp.grads(shards, spec)["layers"]
    return [u.state.value for u in _units(shards)], float(grads[2]["fc"]["weight"].abs().sum())


def _units(shards):
    from vfsdp.collectives.dbuffer import slot_of
    return [slot_of(b["fc"]["weight"]).unit for b in shards["layers"]]


def test_a_block_the_forward_never_calls_is_not_left_gathered():
    for states, unused in simulate(2, _early):
        assert states[2] != "gathered" and states[2] != "gathering", states
        assert unused == 0.0


def _bf16_grads(recompute):
    params = {"layers": [{"w": torch.linspace(-1, 1, 16).reshape(4, 4) * (i + 1),
                          "b": torch.linspace(0, 1, 4) + i} for i in range(3)]}
    spec = vfsdp.plan(params, 2, granularity=vfsdp.rows(1))
    shards = vfsdp.shard(params, spec)
    h = vfsdp.run_layers(_layer, shards["layers"], spec["layers"],
                         torch.ones(2, 4, dtype=torch.bfloat16), recompute=recompute,
                         param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    h.float().square().sum().backward()
    return [g.clone() for g in optree.tree_leaves(vfsdp.grads(shards, spec))]


def test_recompute_of_a_low_precision_gather_regathers_the_compute_copy():
    want = simulate(2, _bf16_grads, None)
    for recompute in ("full", "selective"):
        got = simulate(2, _bf16_grads, recompute)
        assert all(torch.equal(a, b) for r, s in zip(got, want) for a, b in zip(r, s))
