"""torch.utils.checkpoint written into a module's own forward, under ``apply(gather(...))`` and
``apply.run_layers``: the recompute (in the backward, after the call) reads the call's tensors,
so the gradients are one plain-torch process's."""

import optree
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import vfsdp
from vfsdp.testing import simulate, spawn
from vfsdp.testing.memory import GatheredProbe, LiveBytes


class Block(torch.nn.Module):
    """A block checkpointing a lambda that reads two of its submodules."""

    def __init__(self, d, reentrant):
        super().__init__()
        self.norm, self.up, self.down = (torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d),
                                         torch.nn.Linear(2 * d, d))
        self.reentrant = reentrant

    def forward(self, h):
        mlp = lambda t: self.down(torch.tanh(self.up(t)))
        return h + checkpoint(mlp, self.norm(h), use_reentrant=self.reentrant)


class Net(torch.nn.Module):
    """``inner``: the blocks checkpoint inside; ``outer``: the model checkpoints each block;
    ``stack``: the model checkpoints a function of every block and the work between them."""

    def __init__(self, how, reentrant=False, d=4, n=3):
        super().__init__()
        self.emb = torch.nn.Linear(3, d)
        self.layers = torch.nn.ModuleList(Block(d, reentrant and how == "inner") for _ in range(n))
        self.head = torch.nn.Linear(d, 2)
        self.how, self.reentrant = how, reentrant

    def forward(self, x):
        h = self.emb(x)
        if self.how == "stack":
            h = checkpoint(self.stack, h, use_reentrant=self.reentrant)
        for layer in self.layers if self.how != "stack" else ():
            h = checkpoint(layer, h, use_reentrant=self.reentrant) if self.how == "outer" else layer(h)
        return checkpoint(lambda t: self.head(t) * self.emb.bias.sum(), h,
                          use_reentrant=self.reentrant)  # a lambda reading two submodules

    def stack(self, h):
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def _make(how, reentrant):
    torch.manual_seed(0)
    return Net(how, reentrant)


def _inputs(k):
    return [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(k)]


def _rank(net, path, calls=1, recompute=None):
    """This rank's pieces of every gradient after ``calls`` forwards, then their backwards."""
    if isinstance(net, tuple):  # a process of its own (spawn): it builds the module
        net = _make(*net)
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=vfsdp.rows(1))
    shards = vfsdp.shard(params, spec)
    for p in optree.tree_leaves(params):
        p.data = torch.full_like(p, float("nan"))  # the module's own tensors: never to be read
    policy = vfsdp.Policy(recompute=recompute)  # under apply, call k: the weights * (k + 1)
    outs = [apply.run_layers(shards, spec, x, policy=policy) if path == "run_layers" else
            apply(optree.tree_map(lambda t: t * (k + 1), vfsdp.gather(shards, spec)), x)
            for k, x in enumerate(_inputs(calls))]
    for out in outs:
        out.square().sum().backward()
    rank = dist.get_rank()
    return [(t.local_range(rank), g.detach().reshape(-1).clone())
            for t, g in zip(optree.tree_leaves(spec.tree),
                            optree.tree_leaves(vfsdp.grads(shards, spec)))]


def _want(how, reentrant=False, calls=1, scaled=False):
    """Every parameter's gradient in one plain-torch process (the same checkpointing); call k
    with the weights times k + 1 where ``scaled``."""
    total = None
    for k, x in enumerate(_inputs(calls)):
        net, c = _make(how, reentrant), k + 1 if scaled else 1
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(c)
        net(x).square().sum().backward()
        grads = [p.grad * c for p in optree.tree_leaves(vfsdp.functionalize(net)[0])]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total


def _check(how, path, reentrant=False, calls=1):
    nets = [_make(how, reentrant) for _ in range(2)]  # built here: ranks (threads) share one RNG
    _compare(simulate(2, lambda: _rank(nets[dist.get_rank()], path, calls)),
             _want(how, reentrant, calls, scaled=path == "apply"))


def _compare(results, want):
    for grads in results:
        for ((lo, hi), g), w in zip(grads, want):
            torch.testing.assert_close(g, w.reshape(-1)[lo:hi], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", ["inner", "outer", "stack"])
@pytest.mark.parametrize("path", ["apply", "run_layers"])
def test_checkpoint_in_the_forward_is_exact(how, path):
    """A block checkpointing a lambda over its submodules (``inner``), the model each block
    (``outer``) or all of them at once (``stack``: its recompute regathers each block around
    its call), and a lambda over two submodules; the module's own tensors are NaN."""
    _check(how, path)


@pytest.mark.parametrize("how", ["inner", "outer", "stack"])
@pytest.mark.parametrize("path", ["apply", "run_layers"])
def test_two_forwards_then_two_backwards(how, path):
    """Gradient accumulation: each recompute reads its own call's tensors (under ``apply``,
    the second call's weights are twice the first's)."""
    _check(how, path, calls=2)


@pytest.mark.parametrize("how", ["inner", "outer", "stack"])
@pytest.mark.parametrize("path", ["apply", "run_layers"])
def test_reentrant(how, path):
    """use_reentrant=True (run as a non-reentrant checkpoint: the same gradients)."""
    _check(how, path, reentrant=True, calls=2)


def test_reentrant_with_no_input_requiring_grad_gives_no_gradient_as_in_torch():
    def body():
        torch.manual_seed(0)
        net = torch.nn.Linear(2, 2)
        net.forward = lambda x: checkpoint(torch.nn.Linear.forward, net, x, use_reentrant=True)
        params, apply = vfsdp.functionalize(net)
        spec = vfsdp.plan(params, 2)
        shards = vfsdp.shard(params, spec)
        return apply(vfsdp.gather(shards, spec), torch.ones(1, 2)).requires_grad

    net = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        plain = checkpoint(net, torch.ones(1, 2), use_reentrant=True).requires_grad
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        assert simulate(2, body) == [plain, plain] == [False, False]


def test_gloo_processes():
    _compare(spawn(_rank, 2, ("inner", False), "run_layers"), _want("inner"))


def test_a_checkpoint_inside_a_block_the_run_checkpoints_is_exact_and_recomputed_once():
    """With ``recompute``, a block's own checkpoint nests in the run's: exact, and each MLP
    runs twice (forward, the run's recompute), not three times."""
    runs = []
    nets = [_make("inner", False) for _ in range(2)]
    for net in nets:
        for block in net.layers:
            block.up.register_forward_hook(lambda *_: runs.append(1))
    _compare(simulate(2, lambda: _rank(nets[dist.get_rank()], "run_layers", recompute="full")),
             _want("inner"))
    assert len(runs) == 2 * 3 * 2  # ranks x blocks x (forward + recompute)


def _memory(how, world=2):
    """Bytes live between the forward and the backward (what the graph keeps: activations,
    and under ``apply.run_layers`` the units left gathered), and the most units gathered at
    once under ``apply.run_layers``; ``world=None``: one plain-torch process."""
    torch.manual_seed(0)
    net = Net(how, d=32, n=4)
    x = torch.randn(256, 3, generator=torch.Generator().manual_seed(1))
    if world is None:
        with LiveBytes() as live:
            out = net(x)
        return live.current
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, world)
    shards = vfsdp.shard(params, spec)
    with LiveBytes() as live, GatheredProbe() as probe:
        out = apply.run_layers(shards, spec, x)
        kept = live.current
        out.square().sum().backward()
        del out
    return kept, probe.peak_units


def test_checkpoints_in_the_forward_save_activations_under_run_layers_as_in_torch():
    """A checkpoint of each block (``outer``) or of all of them (``stack``) keeps what it
    keeps in plain torch (the run's hooks hand the blocks' activations to it): the bytes
    between forward and backward differ from torch's by the units left gathered alone, the
    same in every mode; the recompute gathers no more units at once than the run."""
    torch_kept = {how: _memory(how, None) for how in ("inner", "outer", "stack")}
    assert torch_kept["stack"] < torch_kept["outer"] < torch_kept["inner"], torch_kept
    got = {how: simulate(2, _memory, how)[0] for how in torch_kept}
    units = {how: kept - torch_kept[how] for how, (kept, _) in got.items()}
    assert units["inner"] == units["outer"] == units["stack"] < torch_kept["stack"], got
    assert got["stack"][1] == got["outer"][1] == got["inner"][1] == 3, got  # rest, 2 blocks
