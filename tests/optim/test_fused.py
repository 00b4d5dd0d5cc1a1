"""AdamW as multi-tensor ops: bitwise equal to torch's foreach and fused AdamW, a constant op
count per step, a bounded temporary."""

import optree
import pytest
import torch

import vfsdp
from vfsdp._torch_private import TorchDispatchMode
from vfsdp.optim import base as fused_mod
from vfsdp.testing import CopyCounter, simulate


def _params(width: int = 16, layers: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(7, width, generator=g),
            "layers": [{"w": torch.randn(width, width, generator=g), "b": torch.randn(width, generator=g),
                        "norm": torch.ones(width)} for _ in range(layers)]}


def _decays(path) -> bool:
    return path[-1] not in ("b", "norm")


def _sharded_steps(world: int, fused, steps: int = 3, frozen=(), params_fn=_params):
    """vfsdp AdamW on ``world`` ranks; returns every rank's full parameters after ``steps``."""

    def body():
        params = params_fn()
        spec = vfsdp.plan(params, world)
        shards = vfsdp.shard(params, spec)
        for path in frozen:
            optree.tree_leaves(shards)[path].requires_grad_(False)
        opt = vfsdp.optim.adamw(lr=lambda s: 0.05 / s, betas=(0.9, 0.95), weight_decay=0.1,
                                weight_decay_mask=_decays, fused=fused)
        state = opt.init(shards, spec)
        g = torch.Generator().manual_seed(7)
        for _ in range(steps):
            full = [torch.randn(t.shape, generator=g) for t in optree.tree_leaves(params)]
            grads = vfsdp.scatter(optree.tree_unflatten(optree.tree_structure(params), full),
                                  spec)
            grads = optree.tree_map(lambda x: x.detach(), grads)
            state = opt.update(grads, state, shards, spec)
        return [t.detach().clone() for t in optree.tree_leaves(vfsdp.gather(shards, spec))]

    return simulate(world, body)


def _torch_steps(fused: bool, steps: int = 3, frozen=(), params_fn=_params):
    params = params_fn()
    leaves, paths = optree.tree_leaves(params), optree.tree_paths(params)
    live = [i for i in range(len(leaves)) if i not in frozen]
    groups = [{"params": [leaves[i] for i in live if _decays(paths[i])], "weight_decay": 0.1},
              {"params": [leaves[i] for i in live if not _decays(paths[i])], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.05, betas=(0.9, 0.95), fused=fused,
                            foreach=None if fused else False)
    g = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = 0.05 / step
        for i, p in enumerate(leaves):
            grad = torch.randn(p.shape, generator=g)
            p.grad = None if i in frozen else grad
        opt.step()
    return leaves


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("fused", [False, True])
def test_bitwise_equal_to_torch_adamw_of_the_same_kind(world, fused):
    """foreach (the CPU default) == torch.optim.AdamW(); fused == torch.optim.AdamW(fused=True)
    (same kernel), with a weight-decay mask and ranks cutting the tensors anywhere."""
    want = _torch_steps(fused)
    for got in _sharded_steps(world, fused):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("fused", [False, True])
def test_frozen_tensors_are_left_alone_and_the_rest_stays_bitwise(fused):
    frozen = (2, 4)  # layers[0]["norm"] and layers[0]["b"]... by leaf index
    want = _torch_steps(fused, frozen=frozen)
    for got in _sharded_steps(2, fused, frozen=frozen):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(want[2], optree.tree_leaves(_params())[2])


def test_the_two_kernels_round_differently_but_agree_closely():
    a, b = _torch_steps(False), _torch_steps(True)
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def _update_ops(width: int, layers: int, fused: bool) -> tuple[int, int]:
    """``(ops that compute, view ops)`` of the second update."""

    def body():
        params = _params(width, layers)
        spec = vfsdp.plan(params, 2)
        shards = vfsdp.shard(params, spec)
        opt = vfsdp.optim.adamw(lr=1e-3, weight_decay=0.1, weight_decay_mask=_decays,
                                fused=fused)
        state = opt.init(shards, spec)
        grads = vfsdp.grads(shards, spec)
        state = opt.update(grads, state, shards, spec)  # the first builds its slices
        with CopyCounter() as c:
            opt.update(grads, state, shards, spec)
        views = c.ops.pop("split_with_sizes", 0)
        return sum(c.ops.values()), views

    return simulate(2, body)[0]


@pytest.mark.parametrize("fused", [False, True])
def test_update_op_count_does_not_grow_with_parameters_tensors_or_units(fused):
    """foreach: 8 ops per step over the tensors (decay, lerp, mul, addcmul, sqrt, div, add,
    addcdiv) and 2 on the step counter (count, and its read: a CPU counter is host memory, so
    the bias corrections and step size are Python floats, as torch's foreach AdamW takes
    them; 0.4.0.dev0 took 7 device ops there), nothing per unit. fused: the step counter and one kernel
    per decay group; where a weight-decay mask cuts a unit, one view op per unit cuts its
    gradient (no kernel). Both: the ranks' agreement (vfsdp.optim.base.atomic), one exchange
    of a flag over a gloo group, on the host."""
    base, views = _update_ops(16, 3, fused)
    assert views == (0 if not fused else 3)
    assert base == (8 + 2 + 1 if not fused else 3 + 1)
    for width, layers in ((32, 3), (64, 3), (16, 12)):  # x4, x16 parameters; x4 tensors
        ops, more_views = _update_ops(width, layers, fused)
        assert ops == base
        assert more_views == (0 if not fused else layers)


class _SqrtOutputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] == "_foreach_sqrt":
            self.largest = max(self.largest, sum(t.numel() for t in out))
        return out


def test_foreach_temporary_is_bounded_and_the_bits_do_not_change(monkeypatch):
    want = _sharded_steps(1, False)[0]
    monkeypatch.setattr(fused_mod, "TEMP_ELEMS", 100)
    probe = _SqrtOutputs()

    def body():
        params = _params()
        spec = vfsdp.plan(params, 1)
        shards = vfsdp.shard(params, spec)
        opt = vfsdp.optim.adamw(lr=lambda s: 0.05 / s, betas=(0.9, 0.95), weight_decay=0.1,
                                weight_decay_mask=_decays, fused=False)
        state = opt.init(shards, spec)
        g = torch.Generator().manual_seed(7)
        for _ in range(3):
            full = [torch.randn(t.shape, generator=g) for t in optree.tree_leaves(params)]
            grads = vfsdp.scatter(optree.tree_unflatten(optree.tree_structure(params), full),
                                  spec)
            with probe:
                state = opt.update(optree.tree_map(lambda x: x.detach(), grads), state, shards,
                                   spec)
        return [t.detach().clone() for t in optree.tree_leaves(vfsdp.gather(shards, spec))]

    got = simulate(1, body)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    total = sum(t.numel() for t in optree.tree_leaves(_params()))
    assert total > 300 and 0 < probe.largest <= 100  # unbounded, it would be the whole shard


def test_batches_split_and_keep_every_element():
    a = torch.arange(23.0)
    parts = [a[:5], a[5:6], a[6:23]]
    for limit in (1, 4, 7, 100):
        out = fused_mod.batches((parts,), limit)
        assert all(sum(t.numel() for t in b[0]) <= limit for b in out)
        assert torch.equal(torch.cat([t for b in out for t in b[0]]), a)


def test_fused_true_refuses_parameters_of_another_dtype_than_the_state():
    def body():
        params = {"enc": {"w": torch.ones(4, 4, dtype=torch.bfloat16)}}
        spec = vfsdp.plan(params, 1)
        shards = vfsdp.shard(params, spec)
        with pytest.raises(ValueError, match=r"enc\.w.*share one dtype.*fused=False"):
            vfsdp.optim.adamw(fused=True).init(shards, spec)
        return True

    assert simulate(1, body) == [True]


def test_empty_lists_are_no_ops():
    from vfsdp import _torch_private as tp

    assert tp.foreach("lerp", [], [], scalar=0.5) == []
    assert tp.foreach("mul_", [], scalar=2.0) is None
    fused_mod.adamw_step([], [], [], [], [], count=fused_mod.new_count("cpu"), lr=0.1,
                         betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=False)


def test_muon_with_every_matrix_frozen_leaves_them_alone():
    def body():
        params = {"w": torch.randn(8, 8, generator=torch.Generator().manual_seed(0))}
        spec = vfsdp.plan(params, 2)
        shards = vfsdp.shard(params, spec)
        shards["w"].requires_grad_(False)
        opt = vfsdp.optim.muon(lr=0.1)
        state = opt.init(shards, spec)
        before = shards["w"].detach().clone()
        opt.update(vfsdp.grads(shards, spec), state, shards, spec)
        return torch.equal(before, shards["w"])

    assert simulate(2, body) == [True, True]


def test_update_writes_the_shards_it_is_given_not_the_first_ones():
    """The step's slices are cached per unit: a second shards tree of the same spec must get
    its own (review finding: the cache once kept updating the first tree)."""

    def body():
        params = {"w": torch.ones(4, 4), "b": torch.ones(4)}
        spec = vfsdp.plan(params, 2)
        one, two = vfsdp.shard(params, spec), vfsdp.shard(params, spec)
        opt = vfsdp.optim.adamw(lr=0.1, weight_decay=0.0)
        s1, s2 = opt.init(one, spec), opt.init(two, spec)
        for shards, state in ((one, s1), (two, s2)):
            grads = vfsdp.grads(shards, spec)
            for g in grads.values():
                g.fill_(1.0)
            opt.update(grads, state, shards, spec)
        moved = [bool((t < 0.95).all()) for t in (*one.values(), *two.values())]
        return moved + [torch.equal(one[k], two[k]) for k in one]

    assert simulate(2, body) == [[True] * 6] * 2


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_weight_decay_of_bf16_parameters_rounds_as_the_single_tensor_op(name):
    """torch's CPU multi-tensor mul rounds a Python scalar to bf16 first (0.998 -> 0.996):
    the decay must still round like p.mul_(1 - lr * wd)."""

    def body():
        params = {"w": torch.full((64, 64), 1.5, dtype=torch.bfloat16)}
        opt = {"adamw": vfsdp.optim.adamw(lr=0.02, weight_decay=0.1),
               "adamw8bit": vfsdp.optim.adamw8bit(lr=0.02, weight_decay=0.1),
               "muon": vfsdp.optim.muon(lr=0.02, weight_decay=0.1)}[name]
        spec = vfsdp.plan(params, 2, granularity=opt.granularity)
        shards = vfsdp.shard(params, spec)
        state = opt.init(shards, spec)
        opt.update(vfsdp.grads(shards, spec), state, shards, spec)  # zero gradients
        want = torch.full((1,), 1.5, dtype=torch.bfloat16).mul_(1 - 0.02 * 0.1)
        return bool((shards["w"] == want).all())

    assert simulate(2, body) == [True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_device_form_of_the_step_agrees_with_the_host_form(dtype, monkeypatch):
    """adamw_step as a GPU or a compiled graph runs it (the step size divides the
    denominator; no scalar list read on the host) against the CPU form (torch.optim's
    ``addcdiv`` with the step size as a scalar), from one tensor counter each, a schedule's
    tensor learning rate included; float64 moments keep float64 scalars."""
    gen = torch.Generator().manual_seed(0)
    make = lambda: [torch.randn(n, generator=gen, dtype=dtype) for n in (5, 0, 7)]
    ps, gs = make(), make()
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    a = [[t.clone() for t in xs] for xs in (ps, gs, ms, vs)]
    b = [[t.clone() for t in xs] for xs in (ps, gs, ms, vs)]
    count_a, count_b = fused_mod.new_count("cpu"), fused_mod.new_count("cpu")
    schedule = lambda step: 1e-2 / step
    kw = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": False}
    for _ in range(3):
        count_a.add_(1)
        fused_mod.adamw_step(*a, a[0][:1], count=count_a,
                             lr=fused_mod.learning_rate(schedule, count_a), **kw)
        count_b.add_(1)
        with monkeypatch.context() as m:
            m.setattr(fused_mod.tp, "compiling", lambda: True)
            fused_mod.adamw_step(*b, b[0][:1], count=count_b,
                                 lr=fused_mod.learning_rate(schedule, count_b), **kw)
    assert float(count_a) == 3.0
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    for x, y in zip(a[0], b[0]):
        assert x.dtype == y.dtype == dtype
        assert torch.allclose(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["adamw", "adamw_fused", "adamw8bit", "muon"])
def test_an_update_reads_nothing_back_to_the_host(name, monkeypatch):
    """The step counter is a tensor of the state, and the bias corrections, the learning
    rate of a schedule and the step size are taken from it on the device: no op of an update
    reads a value back (``.item()``, a tensor's truth), which on a GPU would wait for the
    device; and the counter counts. (A CPU counter is host memory, which AdamW's foreach path
    reads as torch's does: the device path is checked here by saying the counter is not.)"""
    monkeypatch.setattr(fused_mod, "host_counter", lambda count: False)

    def body():
        schedule = vfsdp.optim.warmup_cosine(1e-2, 2, 10)
        opt = {"adamw": lambda: vfsdp.optim.adamw(lr=schedule, fused=False),
               "adamw_fused": lambda: vfsdp.optim.adamw(lr=schedule, fused=True),
               "adamw8bit": lambda: vfsdp.optim.adamw8bit(lr=schedule, min_8bit_numel=64,
                                                          compile=False),
               "muon": lambda: vfsdp.optim.muon(lr=schedule, weight_decay=0.1)}[name]()
        params = {"layers": [{"w": torch.randn(32, 16)} for _ in range(3)]}
        spec = vfsdp.plan(params, 2, granularity=opt.granularity)
        shards = vfsdp.shard(params, spec)
        state = opt.init(shards, spec)
        grads = vfsdp.grads(shards, spec)
        for g in optree.tree_leaves(grads):
            g.fill_(0.1)
        state = opt.update(grads, state, shards, spec)
        with CopyCounter() as c:
            state = opt.update(grads, state, shards, spec)
        return sorted(op for op in c.ops if op in ("_local_scalar_dense", "item", "is_nonzero")), \
            state.step

    assert simulate(2, body) == [([], 2), ([], 2)]


def test_a_schedules_learning_rate_reaches_the_fused_kernel_as_float32(monkeypatch):
    """torch's fused AdamW kernel takes a tensor lr as float32 on CUDA (a float64 one raises
    there: "expected scalar type Float but found Double"); a schedule's lr is float64."""
    import vfsdp._torch_private as tpriv

    seen = []
    real = torch._fused_adamw_

    def spy(*args, **kwargs):
        seen.append(kwargs["lr"])
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    p, g, m, v = torch.ones(4), torch.full((4,), 0.5), torch.zeros(4), torch.zeros(4)
    lr = torch.tensor(0.1, dtype=torch.float64)
    tpriv.fused_adamw([p], [g], [m], [v], [torch.ones(())], lr=lr, beta1=0.9, beta2=0.999,
                      weight_decay=0.0, eps=1e-8)
    assert [x.dtype for x in seen] == [torch.float32]
