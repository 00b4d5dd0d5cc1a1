"""``torch.compile(step, fullgraph=True)`` over vfsdp: the compiled step equals the eager one,
never recompiles across steps, compiles once more for a new spec, and re-gathers in backward
instead of saving the gathered parameters.

Whole steps (backward inside the compiled function) run on gloo processes (``spawn``): in
threads (``simulate``) a compiled whole step left dynamo unable to compile other functions
later in the process, so there the forward is compiled and the backward runs eagerly through
the compiled graph.

What a compiled step means is dynamo's and AOTAutograd's graph, which ``backend="aot_eager"``
runs as traced; inductor only generates code for it. So the tests of meaning (HSDP, gradient
accumulation, grad_sync, compiled forwards, refusals) use ``aot_eager``, and inductor's code is
checked by the whole step that never recompiles and 8-bit AdamW here, the float8 gathers
(test_lowp.py) and the compiled benchmarks (test_examples.py): a cold inductor compile takes
about 40 s per test on two cores, ``aot_eager`` about 9 s.
"""

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import simulate, spawn

D, L = 8, 3
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# torch 2.11 (the GPU machine's) crashes compiling in simulate's threads.
THREADS = pytest.mark.skipif(TORCH < (2, 13), reason="dynamo in threads crashes torch < 2.13")


def _params(width=D):
    g = torch.Generator().manual_seed(0)
    # "embed" and "head" share the root unit, and on 2 ranks each rank holds only one of
    # them: gathering one of them alone leaves a rank with nothing of it (the anchors' case).
    return {"embed": torch.randn(width, width, generator=g) / 3,
            "layers": [{"w": torch.randn(width, width, generator=g) / 3,
                        "b": torch.randn(width, generator=g)} for _ in range(L)],
            "head": torch.randn(width, width, generator=g) / 3}


def _layer(p, h):
    return torch.tanh(h @ p["w"] + p["b"])


def _batch(step, micro, width=D):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, width, generator=g)


def _make_step(spec, opt, micro):
    def step(shards, state, xs):
        vfsdp.zero_grads(shards, spec)
        for x in xs:  # gradient accumulation: the .grad sums the micro-batches
            io = vfsdp.gather(shards["embed"], spec["embed"], accumulate_grads=True)
            h = vfsdp.run_layers(_layer, shards["layers"], spec["layers"], x @ io,
                                 accumulate_grads=True)
            head = vfsdp.gather(shards["head"], spec["head"], accumulate_grads=True)
            ((h @ head).pow(2).mean() / micro).backward()
        grads = vfsdp.grads(shards, spec)
        norm = vfsdp.clip_grad_norm(grads, spec, 0.05)
        opt.update(grads, state, shards, spec)
        return norm
    return step


def _compiled_vs_eager(steps=4, micro=1, mesh_shape=None, respec=True, backend="inductor"):
    """``respec``: also compile for a new spec (another width), and count its graphs."""
    from torch._dynamo.utils import counters

    spec = vfsdp.plan(_params(), mesh_shape or dist.get_world_size())
    opt = vfsdp.optim.adamw(lr=vfsdp.optim.warmup_cosine(1e-2, 2, 10), weight_decay=0.1,
                            weight_decay_mask=lambda p: p[-1] != "b")
    eager, compiled = vfsdp.shard(_params(), spec), vfsdp.shard(_params(), spec)
    se, sc = opt.init(eager, spec), opt.init(compiled, spec)
    step = _make_step(spec, opt, micro)
    fast = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)
    norms = []
    for s in range(steps):
        xs = [_batch(s, j) for j in range(micro)]
        norms.append((float(step(eager, se, xs)), float(fast(compiled, sc, xs))))
    graphs = counters["stats"]["unique_graphs"]
    more = None
    if respec:  # a new spec (another width) compiles once more, then runs without recompiling
        spec2 = vfsdp.plan(_params(12), mesh_shape or dist.get_world_size())
        other = vfsdp.shard(_params(12), spec2)
        # (how many graphs is dynamo's count: the second spec's code need not be inductor's)
        step2 = torch.compile(_make_step(spec2, opt, micro), fullgraph=True, dynamic=False,
                              backend="aot_eager")
        s2 = opt.init(other, spec2)
        for s in range(2):
            step2(other, s2, [_batch(s, j, 12) for j in range(micro)])
        more = counters["stats"]["unique_graphs"] - graphs
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0
               for a, b in zip(optree.tree_leaves(eager), optree.tree_leaves(compiled)))
    return norms, diff, graphs, more, se.sync_step(), sc.sync_step()


def test_a_compiled_step_equals_the_eager_step_and_never_recompiles():
    """4 steps of gather + run_layers + backward + clipping + AdamW with a warm-up/cosine
    schedule, on 2 gloo processes. Within fp32 rounding, not bitwise: the compiler fuses the
    element-wise work, and the compiled AdamW takes its bias corrections as tensors."""
    for norms, diff, graphs, more, steps_e, steps_c in spawn(_compiled_vs_eager, 2):
        assert graphs == 1 and more == 1  # one graph for 4 steps; one more for a new spec
        assert steps_e == steps_c == 4
        for e, c in norms:
            assert c == pytest.approx(e, rel=1e-5) and e > 0.05  # it clipped
        assert diff < 1e-6


@pytest.mark.slow
def test_a_compiled_hsdp_step_equals_the_eager_step():
    """HSDP (2 replicas x 2 shards) on 4 gloo processes: the replicas' gradients summed in the
    backward, the norm over the shard group (a new spec's one more graph is the 2-process
    test's: four processes compiling on two cores are the suite's slowest)."""
    for norms, diff, graphs, _, steps_e, steps_c in spawn(_compiled_vs_eager, 4, 3, 1,
                                                          (2, 2), False, "aot_eager"):
        assert graphs == 1 and steps_e == steps_c == 3
        for e, c in norms:
            assert c == pytest.approx(e, rel=1e-5)
        assert diff < 1e-6


def _accumulated(steps=3, micro=2, how="accumulate"):
    """Gradient accumulation compiled: one compiled micro-step (forward and backward) per
    micro-batch, then one compiled update; the .grad sums the micro-batches. ``how="sync"``:
    ``grad_sync=False`` on all but the last micro-batch, whose backwards reduce nothing (the
    shards' .grad stays None until the synced one)."""
    from torch._dynamo.utils import counters

    spec = vfsdp.plan(_params(), dist.get_world_size())
    opt = vfsdp.optim.adamw(lr=1e-2, weight_decay=0.1)
    eager, compiled = vfsdp.shard(_params(), spec), vfsdp.shard(_params(), spec)
    se, sc = opt.init(eager, spec), opt.init(compiled, spec)

    def micro_step(shards, x, sync):
        opts = {"accumulate_grads": True} if how == "accumulate" else {"grad_sync": sync}
        io = vfsdp.gather(shards["embed"], spec["embed"], **opts)
        h = vfsdp.run_layers(_layer, shards["layers"], spec["layers"], x @ io, **opts)
        (h.pow(2).mean() / micro).backward()

    def update(shards, state):
        grads = vfsdp.grads(shards, spec)
        opt.update(grads, state, shards, spec)

    fast_micro, fast_update = (torch.compile(f, fullgraph=True, backend="aot_eager")
                               for f in (micro_step, update))
    unreduced = []
    for s in range(steps):
        for shards, state, m, u in ((eager, se, micro_step, update),
                                    (compiled, sc, fast_micro, fast_update)):
            if how == "accumulate":
                vfsdp.zero_grads(shards, spec, set_to_none=False)  # .grad kept: one graph
            else:
                vfsdp.zero_grads(shards, spec)
            for j in range(micro):
                m(shards, _batch(s, j), j == micro - 1)
                if shards is compiled and j < micro - 1 and how == "sync":
                    unreduced.append(all(x.grad is None for x in optree.tree_leaves(shards)))
            u(shards, state)
        if s == 0:
            warm = counters["stats"]["unique_graphs"]
    return (max(float((a - b).abs().max()) if a.numel() else 0.0
                for a, b in zip(optree.tree_leaves(eager), optree.tree_leaves(compiled))),
            counters["stats"]["unique_graphs"] - warm, all(unreduced))


def test_compiled_gradient_accumulation_equals_eager():
    """After the first step (whose first micro-batch finds no .grad yet: one more graph),
    nothing recompiles."""
    for diff, later, _ in spawn(_accumulated, 2):
        assert diff < 1e-6 and later == 0


def test_compiled_grad_sync_false_skips_the_reduce_scatter_as_eagerly():
    """Compiled, grad_sync=False was accepted and every backward still reduce-scattered; now
    those backwards reduce nothing (the full gradients add up unsharded) and the synced one
    reduces the sum, as eagerly."""
    for diff, later, unreduced in spawn(_accumulated, 2, 3, 3, "sync"):
        assert diff < 1e-5 and later == 0 and unreduced


def _eight_bit(steps=4):
    """8-bit AdamW (quantized tensors and fp32-moment ones, weight decay on some) compiled
    with the step, against the same step eagerly."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 96, generator=g) / 8, "b": torch.randn(96, generator=g),
              "u": torch.randn(70, 40, generator=g) / 8}  # ragged tiles
    opt = vfsdp.optim.adamw8bit(lr=1e-2, weight_decay=0.1, min_8bit_numel=1024,
                                weight_decay_mask=lambda p: p[-1] != "b")
    spec = vfsdp.plan(params, dist.get_world_size(), granularity=opt.granularity)
    eager, compiled = vfsdp.shard(params, spec), vfsdp.shard(params, spec)
    se, sc = opt.init(eager, spec), opt.init(compiled, spec)

    def step(shards, state, x):
        vfsdp.zero_grads(shards, spec)
        f = vfsdp.gather(shards, spec)
        (torch.tanh(x @ f["w"] + f["b"]).sum() + (f["u"] ** 2).sum() * 0.01).backward()
        opt.update(vfsdp.grads(shards, spec), state, shards, spec)

    fast = torch.compile(step, fullgraph=True)
    for s in range(steps):
        x = _batch(s, 0, 64)
        step(eager, se, x)
        fast(compiled, sc, x)
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0
               for a, b in zip(optree.tree_leaves(eager), optree.tree_leaves(compiled)))
    return diff, counters["stats"]["unique_graphs"], se.sync_step(), sc.sync_step()


def test_compiled_8bit_adamw_equals_eager():
    """Within fp32 rounding (the bias corrections are tensors): codes land on the same map
    entries here, so parameters agree to 1e-6 after 4 steps, in one graph."""
    for diff, graphs, steps_e, steps_c in spawn(_eight_bit, 2):
        assert diff < 1e-6 and graphs == 1 and steps_e == steps_c == 4


def _regathers(reshard):
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    spec = vfsdp.plan(_params(), dist.get_world_size())
    shards = vfsdp.shard(_params(), spec)

    def step(shards, x):
        h = vfsdp.run_layers(_layer, shards["layers"], spec["layers"], x,
                             reshard_after_forward=reshard)
        h.pow(2).mean().backward()

    torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=keep))(
        shards, _batch(0, 0))
    return sum(1 for gm in graphs for n in gm.graph.nodes
               if "all_gather_into_tensor" in str(n.target))


def test_compiled_run_layers_regathers_in_backward_instead_of_saving():
    """reshard_after_forward: the forward gathers L units and the backward L - 1 again (the
    last unit's backward comes first, still gathered), as eager run_layers does; without it,
    L gathers and the full parameters are saved. torch 2.11 has no rematerialisation in a
    forward-loss-backward graph: there the compiled step saves them (L gathers) either way."""
    assert spawn(_regathers, 2, True) == [2 * L - 1 if TORCH >= (2, 13) else L] * 2
    assert spawn(_regathers, 2, False) == [L] * 2


def _forward_compiled(mesh_shape, use_run_layers):
    """Compiled forward, eager backward (what runs in threads): the gradients land on the
    shards' .grad and vfsdp.grads reads them."""
    spec = vfsdp.plan(_params(), mesh_shape)
    out = []
    for compiled in (False, True):
        shards = vfsdp.shard(_params(), spec)

        def fwd(shards, x):
            io = vfsdp.gather(shards["embed"], spec["embed"])
            if use_run_layers:
                h = vfsdp.run_layers(_layer, shards["layers"], spec["layers"], x @ io)
            else:
                full = vfsdp.gather(shards["layers"], spec["layers"])
                h = x @ io
                for p in full:
                    h = _layer(p, h)
            return h.pow(2).mean()

        run = torch.compile(fwd, fullgraph=True, backend="aot_eager") if compiled else fwd
        run(shards, _batch(0, 0)).backward()
        out.append([t.clone() for t in optree.tree_leaves(vfsdp.grads(shards, spec))])
    return all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*out)), len(out[0])


@THREADS
@pytest.mark.parametrize("mesh_shape, use_run_layers", [(2, True), (2, False), ((2, 2), True)])
def test_compiled_forward_gives_the_eager_gradients_under_simulate(mesh_shape, use_run_layers):
    """FSDP and HSDP (2 replicas x 2 shards: the replicas' gradients summed too)."""
    world = 4 if isinstance(mesh_shape, tuple) else 2
    assert simulate(world, _forward_compiled, mesh_shape, use_run_layers) == \
        [(True, 2 + 2 * L)] * world


def _refusals():
    spec = vfsdp.plan(_params(), 2)
    shards = vfsdp.shard(_params(), spec)
    q = vfsdp.optim.muon(lr=1e-3)
    state = q.init(shards, spec)
    out = []
    for fn in (lambda: vfsdp.gather(shards, spec, grads="buffer"),
               lambda: q.update(vfsdp.grads(shards, spec), state, shards, spec),
               lambda: vfsdp.gather(shards, spec, param_dtype=torch.bfloat16,
                                    reduce_dtype=torch.float32),
               lambda: vfsdp.run_layers(_layer, shards["layers"], spec["layers"],
                                        torch.ones(1, D), grads="buffer"),
               lambda: vfsdp.run_layers(_layer, shards["layers"], spec["layers"],
                                        torch.ones(1, D), param_dtpye=torch.bfloat16),
               lambda: vfsdp.gather(shards, spec, grad_reduce="max"),
               lambda: vfsdp.run_layers(_layer, shards["layers"], spec["layers"],
                                        torch.ones(1, D), async_reduce=True),
               lambda: vfsdp.gather_async(shards, spec).wait(),
               lambda: vfsdp.release(vfsdp.gather(shards, spec), spec)):
        try:
            torch.compile(fn, fullgraph=True, backend="aot_eager")()
            out.append("no error")
        except Exception as exc:  # noqa: BLE001 - dynamo wraps the ValueError
            out.append(str(exc))
    return out


@THREADS
def test_what_the_compiled_path_cannot_do_is_refused_by_name():
    buffer, muon, reduce, layers_buffer, misspelt, max_, async_, handle, release = \
        simulate(2, _refusals)[0]
    # one wording for what a path cannot honour, on every path
    assert "vfsdp.gather: grads='buffer' is not supported under torch.compile" in buffer
    # run_layers checks its options as eagerly, not ignoring them (it did before)
    assert "vfsdp.run_layers: grads='buffer' is not supported under torch.compile" in layers_buffer
    assert "vfsdp.run_layers got unexpected options ['param_dtpye']" in misspelt
    assert "grad_reduce must be one of ('sum', 'avg'), got 'max'" in max_  # summed before
    assert "vfsdp.run_layers: async_reduce=True is not supported under torch.compile" in async_
    assert "vfsdp.gather_async under torch.compile is not supported" in handle
    assert "vfsdp.release under torch.compile is not supported" in release  # dynamo's before
    assert "muon.update under torch.compile is not supported yet" in muon
    assert ("reduce_dtype=torch.float32 is not supported under torch.compile with a "
            "torch.bfloat16 gather" in reduce)


def _clip(shards, spec, mesh):
    return vfsdp.clip_grad_norm(vfsdp.grads(shards, spec), spec, 0.5, mesh=mesh)


def _clip_cases(cases):
    """Per case, the compiled clip (norm, clipped .grad) on one copy of the shards and the
    eager clip on another, or what each raised. The compiled gradients carry no unit: both
    add over ``mesh=`` (else the default group)."""
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g)}
    out = {}
    fast = torch.compile(_clip, fullgraph=True, dynamic=False, backend="aot_eager",
                         isolate_recompiles=True)  # this rank's graphs: one per spec and mesh
    for case in cases:
        if case == "fsdp":
            spec, on, given = vfsdp.plan(params, dist.get_world_size()), None, None
        elif case.startswith(("hsdp", "sub")):  # not named as the default mesh: not built
            m = vfsdp.mesh(("rep", 2), ("dp", 2))
            spec, on = (vfsdp.plan(params, 2), m["dp"]) if case == "sub" else (vfsdp.plan(params, m), m)
            given = m if case == "hsdp" else None
        else:
            m = vfsdp.mesh(("dp", 2), ("tp", 2))
            spec, on = vfsdp.plan(params, m, tp=lambda p: Shard(1) if p[-1] == "a" else Replicate()), m
            given = {"tp": m, "tp-no-mesh": None, "tp-data-mesh": m["dp"]}[case]
        got = []
        for run in (fast, _clip):
            shards = vfsdp.shard(params, spec, mesh=on)
            full = vfsdp.gather(shards, spec)
            sum(((dist.get_rank() + 1) * p).pow(2).sum() for p in optree.tree_leaves(full)).backward()
            try:
                norm = float(run(shards, spec, given))
                got.append((norm, [x.grad.clone() for x in optree.tree_leaves(shards)]))
            except Exception as exc:  # noqa: BLE001 - dynamo wraps the ValueError
                got.append(f"{exc} {exc.__cause__}")
        out[case] = got
    return out


def _same(compiled, eager):
    return (compiled[0] == pytest.approx(eager[0], rel=1e-6) and compiled[0] > 0.5
            and all(torch.allclose(a, b, atol=1e-7) for a, b in zip(compiled[1], eager[1])))


@THREADS
def test_the_compiled_clip_adds_over_the_eager_clips_groups_or_refuses_as_it_does():
    """1-D over the default group; HSDP and TP with mesh=: the eager clip's norm and clipped
    gradients. Without the mesh they need, the eager clip's own refusals (a sub-mesh's spec
    on the whole world, a tp= spec), and for HSDP, whose default mesh would be built while
    tracing (this mesh is not named as it is), a refusal naming mesh= (never a norm over
    the wrong group)."""
    for compiled, eager in simulate(2, _clip_cases, ["fsdp"])[0].values():
        assert _same(compiled, eager)
    cases = ["hsdp", "hsdp-no-mesh", "sub", "tp", "tp-no-mesh", "tp-data-mesh"]
    for rank in simulate(4, _clip_cases, cases):
        assert _same(*rank["hsdp"]) and _same(*rank["tp"])
        compiled, eager = rank["hsdp-no-mesh"]
        assert "cannot make while torch.compile traces; pass mesh= the DeviceMesh" in compiled
        assert _same(rank["hsdp"][1], eager)  # eagerly: the default mesh, built
        for case, words in (("sub", "planned for mesh (2,) (2 ranks) but the default process "
                                    "group has 4"),
                            ("tp-no-mesh", "the spec is of one 'tp' index's pieces"),
                            ("tp-data-mesh", "pass mesh= the mesh with 'tp'")):
            assert all(words in r for r in rank[case]), (case, rank[case])


def _frozen_spec():
    """A spec's slots before and after shard, gather, a backward and a compiled forward with
    its backward: the plan's own data are the same objects; what filled in are caches of the
    spec's own data, equal to a fresh spec's, and no tensor, group or unit is reachable."""
    from vfsdp.planner.local import local_plan
    from vfsdp.planner.spec import ShardSpec

    params = {"layers": [{"w": torch.randn(4, 4), "b": torch.randn(4)} for _ in range(2)]}
    spec = vfsdp.plan(params, dist.get_world_size())
    spec.leaves(), spec.treespec  # made on first read: the plan's data from then on
    names = [n for n in ShardSpec.__slots__ if n != "__weakref__"]
    before = {n: getattr(spec, n) for n in names}
    shards = vfsdp.shard(params, spec)
    x = torch.ones(2, 4) * (dist.get_rank() + 1)
    loss = lambda full, x: sum((x @ p["w"] + p["b"]).sum() for p in full["layers"])
    loss(vfsdp.gather(shards, spec), x).backward()
    fast = torch.compile(lambda s, x: loss(vfsdp.gather(s, spec), x).backward(),
                         fullgraph=True, backend="aot_eager")
    fast(shards, x)  # a whole step, its backward inside
    after = {n: getattr(spec, n) for n in names}
    data = ("units", "mesh_shape", "mesh_dim_names", "_treespec", "_leaves")
    same_objects = all(after[n] is before[n] for n in data)
    fresh = vfsdp.plan(params, dist.get_world_size())
    caches_pure = (spec.fingerprint == fresh.fingerprint
                   and all(local_plan(spec, r) == local_plan(fresh, r) for r in spec._local))
    runtime = []

    def walk(x, depth=0):
        if isinstance(x, (torch.Tensor, dist.ProcessGroup)) or type(x).__name__ in (
                "Unit", "DBuffer", "MeshGroups"):
            runtime.append(type(x).__name__)
        elif depth < 6 and isinstance(x, (dict, list, tuple)):
            for v in (x.values() if isinstance(x, dict) else x):
                walk(v, depth + 1)
        elif depth < 6 and isinstance(x, ShardSpec):
            for n in names:
                walk(getattr(x, n), depth + 1)

    walk(spec)
    return set(names) == set(before), same_objects, caches_pure, runtime


def test_the_spec_stays_frozen_through_shard_gather_backward_and_a_compiled_step():
    assert spawn(_frozen_spec, 2) == [(True, True, True, [])] * 2
