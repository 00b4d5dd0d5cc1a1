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
    """``inner``: the blocks checkpoint inside; ``outer``: the model checkpoints each block."""

    def __init__(self, how, reentrant=False, d=4, n=3):
        super().__init__()
        self.emb = torch.nn.Linear(3, d)
        self.layers = torch.nn.ModuleList(Block(d, reentrant and how == "inner") for _ in range(n))
        self.head = torch.nn.Linear(d, 2)
        self.how, self.reentrant = how, reentrant

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=self.reentrant) if self.how == "outer" else layer(h)
        return checkpoint(lambda t: self.head(t) * self.emb.bias.sum(), h,
                          use_reentrant=self.reentrant)  # a lambda reading two submodules


def _make(how, reentrant):
    torch.manual_seed(0)
    return Net(how, reentrant)


def _inputs(k):
    return [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(k)]


def _rank(net, path, calls=1):
    """This rank's pieces of every gradient after ``calls`` forwards, then their backwards."""
    if isinstance(net, tuple):  # a process of its own (spawn): it builds the module
        net = _make(*net)
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=vfsdp.rows(1))
    shards = vfsdp.shard(params, spec)
    for p in optree.tree_leaves(params):
        p.data = torch.full_like(p, float("nan"))  # the module's own tensors: never to be read
    outs = [apply.run_layers(shards, spec, x) if path == "run_layers" else
            apply(vfsdp.gather(shards, spec), x) for x in _inputs(calls)]
    for out in outs:
        out.square().sum().backward()
    rank = dist.get_rank()
    return [(t.local_range(rank), g.detach().reshape(-1).clone())
            for t, g in zip(optree.tree_leaves(spec.tree),
                            optree.tree_leaves(vfsdp.grads(shards, spec)))]


def _want(how, reentrant=False, calls=1):
    """Every parameter's gradient in one plain-torch process (the same checkpointing)."""
    want = _make(how, reentrant)
    for x in _inputs(calls):
        want(x).square().sum().backward()
    return [p.grad for p in optree.tree_leaves(vfsdp.functionalize(want)[0])]


def _check(how, path, reentrant=False, calls=1):
    nets = [_make(how, reentrant) for _ in range(2)]  # built here: ranks (threads) share one RNG
    _compare(simulate(2, lambda: _rank(nets[dist.get_rank()], path, calls)),
             _want(how, reentrant, calls))


def _compare(results, want):
    for grads in results:
        for ((lo, hi), g), w in zip(grads, want):
            torch.testing.assert_close(g, w.reshape(-1)[lo:hi], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", ["inner", "outer"])
@pytest.mark.parametrize("path", ["apply", "run_layers"])
@pytest.mark.filterwarnings("ignore:apply.run_layers. torch.utils.checkpoint of a whole block")
def test_checkpoint_in_the_forward_is_exact(how, path):
    """A block checkpointing a lambda over its submodules (``inner``) or the model each block
    (``outer``), and a lambda over two submodules; the module's own tensors are NaN."""
    _check(how, path)


@pytest.mark.parametrize("path", ["apply", "run_layers"])
def test_two_forwards_then_two_backwards(path):
    _check("inner", path, calls=2)


@pytest.mark.parametrize("how", ["inner", "outer"])
def test_reentrant_under_apply(how):
    """use_reentrant=True: the recompute differentiates the gathered tensors again."""
    _check(how, "apply", reentrant=True)


def test_gloo_processes():
    _compare(spawn(_rank, 2, ("inner", False), "run_layers"), _want("inner"))
