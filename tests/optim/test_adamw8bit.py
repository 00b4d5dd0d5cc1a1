"""8-bit AdamW: bitwise equal across world sizes, no collective but the ranks' agreement (a
host flag, one per update), 2 bytes of state per parameter."""

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from tests.optim.reference import dequantize, quantize, tile_ids
from vfsdp.optim.quant import dynamic_map, span_tiles
from vfsdp.testing import CopyCounter, simulate, spawn


def _params():
    g = torch.Generator().manual_seed(0)
    return {"layers": [{"w": torch.randn(70, 40, generator=g) * 0.1,     # ragged tiles both ways
                        "up": torch.randn(96, 64, generator=g) * 0.1,
                        "experts": torch.randn(3, 40, 32, generator=g) * 0.1,  # R % 32 != 0
                        "norm": torch.ones(40)} for _ in range(2)],
            "head": torch.randn(64, 128, generator=g) * 0.1,
            "small": torch.randn(8, 8, generator=g)}


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return optree.tree_map(lambda t: torch.randn(t.shape, generator=g) * (0.5 + step), _params())


def _train(mesh_shape=None, steps=3, count=False, frozen=None):
    world = dist.get_world_size()
    opt = vfsdp.optim.adamw8bit(lr=1e-2, weight_decay=0.1,
                                weight_decay_mask=lambda p: p[-1] != "norm")
    params = _params()
    spec = vfsdp.plan(params, mesh_shape or world, granularity=opt.granularity)
    shards = vfsdp.shard(params, spec)
    state = opt.init(shards, spec)
    collectives = 0
    for step in range(1, steps + 1):
        for i, x in enumerate(optree.tree_leaves(shards)):
            x.requires_grad_(i not in (frozen or {}).get(step, ()))
        rank = dist.get_rank() % spec.world_size
        full_g = _grads(step)
        local = optree.tree_map(
            lambda t, s: t.reshape(-1)[slice(*s.local_range(rank))], full_g, spec.tree)
        with CopyCounter() as c:
            state = opt.update(local, state, shards, spec)
        collectives += c.collectives
    full = vfsdp.gather(shards, spec)
    nbytes, elems = state.state_bytes()
    return ([t.detach().reshape(-1).tolist() for t in optree.tree_leaves(full)], collectives,
            nbytes, elems)


def test_dynamic_maps_and_nearest_rounding():
    q = dynamic_map(True)
    u = dynamic_map(False)
    assert q.numel() == u.numel() == 256 and float(q.max()) == 1.0 and float(u.min()) == 0.0
    assert float(q[q > 0].min()) == pytest.approx(5.5e-7, rel=1e-3)
    assert float(u[u > 0].min()) == pytest.approx(3.25e-7, rel=1e-3)
    x = torch.linspace(-1, 1, 1001)
    codes, scales = quantize(x, torch.zeros(1001, dtype=torch.long), 1, q)
    back = dequantize(codes, scales, torch.zeros(1001, dtype=torch.long), q)
    nearest = q[(x[:, None] - q[None, :]).abs().argmin(1)]
    assert torch.allclose(back, nearest)


def test_tile_ids_respect_matrices_and_ragged_edges():
    ids, n = tile_ids((70, 40), 0, 70 * 40)
    assert n == 3 * 2 and ids.reshape(70, 40)[64, 39] == 5
    ids, n = tile_ids((3, 40, 32), 40 * 32, 3 * 40 * 32)  # the last two matrices
    assert n == 2 * 2 and ids.reshape(80, 32)[40, 0] == 2
    with pytest.raises(ValueError, match="stripe"):
        tile_ids((70, 40), 16 * 40, 70 * 40)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_8bit_steps_are_bitwise_the_single_process_steps(world):
    one = simulate(1, _train)[0][0]
    for params, collectives, _, _ in simulate(world, _train):
        assert params == one and collectives == 3  # the ranks' agreement, one per update


def test_hsdp_2x2_bitwise():
    one = simulate(1, _train)[0][0]
    assert all(r[0] == one for r in simulate(4, _train, (2, 2)))


def test_no_collective_but_the_agreement_in_the_step_on_gloo_and_state_memory():
    results = spawn(_train, 2)
    one = simulate(1, _train)[0][0]
    for params, collectives, nbytes, elems in results:
        assert params == one
        assert collectives == 3  # counted at the dispatcher on real gloo processes: one per
        # update, the ranks' agreement (vfsdp.optim.base.atomic: a flag over a gloo group)
        assert nbytes / elems <= 2.01


def test_init_refuses_a_plan_that_cuts_tiles():
    def body():
        opt = vfsdp.optim.adamw8bit()
        params = {"w": torch.zeros(70, 64)}
        spec = vfsdp.plan(params, 3)  # element granularity: boundaries fall mid-stripe
        try:
            opt.init(vfsdp.shard(params, spec), spec)
        except ValueError as exc:
            return str(exc)
        return "no error"

    msgs = simulate(3, body)
    assert any("w (70, 64) is split across ranks inside a 32x32 tile" in m and
               "granularity=opt.granularity" in m for m in msgs)


# ---------------------------------------------------------------- fast path vs reference

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.optim.reference import dequantize_tiles, quantize_tiles, step8  # noqa: E402
from vfsdp.functional.tiles import TILE, tile_view  # noqa: E402
from vfsdp.optim.quant import midpoints, step8_flat  # noqa: E402


@st.composite
def _tile_ranges(draw):
    """A tensor shape (matrix or stack, ragged or not) and a rank's range of whole stripes
    (or whole matrices of a ragged stack), possibly empty."""
    rows = draw(st.integers(1, 100))
    cols = draw(st.integers(1, 70))
    stack = draw(st.integers(0, 3))
    shape = (stack, rows, cols) if stack else (rows, cols)
    if stack and rows % TILE:
        unit, count = rows * cols, stack
    else:
        total_rows = rows * max(stack, 1)
        unit, count = TILE * cols, -(-total_rows // TILE)
    a = draw(st.integers(0, count))
    b = draw(st.integers(a, count))
    numel = rows * cols * max(stack, 1)
    return shape, min(a * unit, numel), min(b * unit, numel)


@settings(max_examples=60, deadline=None)
@given(_tile_ranges(), st.booleans(), st.integers(0, 2 ** 16))
def test_fast_tiles_are_bitwise_the_reference(case, signed, seed):
    shape, start, stop = case
    qmap = dynamic_map(signed)
    x = torch.randn(stop - start, generator=torch.Generator().manual_seed(seed))
    if not signed:
        x = x.abs()
    ids, n = tile_ids(shape, start, stop)
    want_codes, want_scales = quantize(x, ids, n, qmap)
    view = tile_view(shape, start, stop)
    codes = torch.empty(view, dtype=torch.uint8)
    scales = torch.empty(n)
    quantize_tiles(x.view(view), midpoints(qmap), codes, scales)
    assert torch.equal(codes.reshape(-1), want_codes) and torch.equal(scales, want_scales)
    assert torch.equal(dequantize_tiles(codes, scales, qmap).reshape(-1),
                       dequantize(want_codes, want_scales, ids, qmap))


@st.composite
def _spans(draw):
    """A unit's flat span: 1-4 tensors (ranges of whole stripes, some empty, some not updated
    this step) with gaps of other elements between them."""
    pieces = []
    for _ in range(draw(st.integers(1, 4))):
        shape, start, stop = draw(_tile_ranges())
        pieces.append((draw(st.integers(0, 40)), shape, start, stop, draw(st.booleans())))
    return pieces, draw(st.integers(0, 2 ** 16)), draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(_spans())
def test_the_flat_pass_over_a_unit_is_bitwise_the_per_tensor_step(case):
    """step8_flat (one pass over every quantized tensor of a unit) against step8 per tensor:
    the same parameters, codes and scales bit for bit; gaps and skipped tensors untouched."""
    pieces, seed, tensor_scalars = case
    gen = torch.Generator().manual_seed(seed)
    qm, qv = dynamic_map(True), dynamic_map(False)
    layout, at, t0 = [], 0, 0
    for gap, shape, start, stop, skip in pieces:
        view = tile_view(shape, start, stop)
        n_tiles = view[0] * -(-view[1] // TILE) * -(-view[2] // TILE)
        layout.append((at + gap, stop - start, view, t0, n_tiles, skip))
        at, t0 = at + gap + stop - start, t0 + n_tiles
    numel = at + 3
    p = torch.randn(numel, generator=gen)
    g = torch.randn(numel, generator=gen) * 3
    cm = torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8)
    cv = torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8)
    sm = torch.cat([torch.rand(t0, generator=gen), torch.zeros(1)])
    sv = torch.cat([torch.rand(t0, generator=gen), torch.zeros(1)])
    scalars = (1e-2, 0.1, 0.999 ** 0.5)  # lr, bias correction 1, sqrt of bias correction 2
    if tensor_scalars:  # as the optimizer's step counter gives them (0-d float64 tensors)
        scalars = (1e-2, *(torch.tensor(x, dtype=torch.float64) for x in scalars[1:]))
    want = [x.clone() for x in (p, cm, cv, sm, sv)]
    for lo, n, view, first, n_tiles, skip in layout:
        if skip or n == 0:
            continue
        sl, tl = slice(lo, lo + n), slice(first, first + n_tiles)
        m_s, v_s = want[3][tl].clone(), want[4][tl].clone()
        codes = [want[1][sl].view(view).clone(), want[2][sl].view(view).clone()]
        step8(want[0][sl].view(view), g[sl].view(view), *codes, m_s, v_s, qm, qv,
              midpoints(qm), midpoints(qv), 0.9, 0.999, 1e-8, *scalars)
        want[1][sl], want[2][sl] = codes[0].view(-1), codes[1].view(-1)
        want[3][tl], want[4][tl] = m_s, v_s
    spans = []
    end = 0
    for lo, n, view, first, _n_tiles, skip in layout:
        spans += [(lo - end, None, None), (n, None if skip else view, first)]
        end = lo + n
    spans.append((numel - end, None, None))
    keep = tuple((first, n_tiles) for _lo, _n, _v, first, n_tiles, skip in layout if skip)
    tiles = span_tiles(spans, t0, "cpu", keep)
    step8_flat(p, g, cm, cv, sm, sv, tiles, qm, qv, midpoints(qm), midpoints(qv), 0.9, 0.999,
               1e-8, *scalars)
    for got, ref in zip((p, cm, cv, sm, sv), want):
        assert torch.equal(got, ref)


def _reference_8bit(steps=3, frozen=None):
    """One process, one tensor at a time, with the reference (per-element tile index) code."""
    params = _params()
    leaves, paths = optree.tree_leaves(params), optree.tree_paths(params)
    qm, qv = dynamic_map(True), dynamic_map(False)
    state = []
    for t in leaves:
        if t.dim() >= 2 and t.numel() >= vfsdp.optim.adamw8bit.__defaults__[5]:
            ids, n = tile_ids(tuple(t.shape), 0, t.numel())
            state.append(("q", ids, n, torch.zeros(t.numel(), dtype=torch.uint8),
                          torch.zeros(n), torch.zeros(t.numel(), dtype=torch.uint8),
                          torch.zeros(n)))
        else:
            state.append(("f", torch.zeros(t.numel()), torch.zeros(t.numel())))
    b1, b2, lr, wd, eps = 0.9, 0.999, 1e-2, 0.1, 1e-8
    for step in range(1, steps + 1):
        grads = optree.tree_leaves(_grads(step))
        bc1, bc2 = 1 - b1 ** step, (1 - b2 ** step) ** 0.5
        for i, (p, g, path) in enumerate(zip(leaves, grads, paths)):
            if i in (frozen or {}).get(step, ()):
                continue  # frozen: no update, no decay, its moments kept
            p, g = p.view(-1), g.reshape(-1)
            if path[-1] != "norm":
                p.mul_(1 - lr * wd)
            s = state[i]
            if s[0] == "q":
                _, ids, n, cm, sm, cv, sv = s
                m, v = dequantize(cm, sm, ids, qm), dequantize(cv, sv, ids, qv)
            else:
                m, v = s[1], s[2]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, v.sqrt().div_(bc2).add_(eps), value=-lr / bc1)
            if s[0] == "q":
                cm2, sm2 = quantize(m, ids, n, qm)
                cv2, sv2 = quantize(v, ids, n, qv)
                state[i] = ("q", ids, n, cm2, sm2, cv2, sv2)
    return [t.reshape(-1).tolist() for t in leaves]


def test_the_8bit_step_is_bitwise_the_reference_loop():
    assert simulate(1, _train)[0][0] == _reference_8bit()


@pytest.mark.parametrize("world", [1, 3])
def test_frozen_tensors_and_units_keep_their_moments_in_the_rank_wide_pass(world):
    """Tensors frozen at some steps (layers.0.up at steps 1-2, the whole of layers.1 at step 2,
    its experts at step 3) get no update and no decay, and keep their codes and tile scales
    (the one pass over the rank leaves other units' and frozen tensors' scales as they are):
    bitwise the one-process reference loop that skips them."""
    frozen = {1: {3}, 2: {3, 5, 6, 7, 8}, 3: {5}}  # leaves: head, layers.0.(experts, norm,
    want = _reference_8bit(frozen=frozen)             # up, w), layers.1.(...), small
    assert want != _reference_8bit()
    for got in simulate(world, _train, None, 3, False, frozen):
        assert got[0] == want


def _update_ops_8bit(scale: int):
    def body():
        g = torch.Generator().manual_seed(0)
        params = {"layers": [{"w": torch.randn(64 * scale, 64 * scale, generator=g),
                              "norm": torch.ones(64 * scale)} for _ in range(2)]}
        opt = vfsdp.optim.adamw8bit(lr=1e-2, min_8bit_numel=1024)
        spec = vfsdp.plan(params, 2, granularity=opt.granularity)
        shards = vfsdp.shard(params, spec)
        state = opt.init(shards, spec)
        grads = vfsdp.grads(shards, spec)
        state = opt.update(grads, state, shards, spec)
        with CopyCounter() as c:
            opt.update(grads, state, shards, spec)
        return sum(c.ops.values())

    return simulate(2, body)


def test_8bit_update_op_count_does_not_grow_with_parameters():
    assert _update_ops_8bit(1) == _update_ops_8bit(2) == _update_ops_8bit(4)  # x4, x16


def test_the_compiled_8bit_step_compiles_once_for_every_step_and_shape(monkeypatch):
    """The step's bias corrections and rate change every step: passed to the compiled graph
    as Python floats they would recompile it at every update (seen on an H200: 9.4 s per
    update of an 886M model). They go in as a tensor, so one graph serves every step. (In the
    main thread, as on a GPU, and before this file's compile in simulate's threads: torch 2.11
    crashes compiling in the main thread after that.)"""
    import importlib

    mod = importlib.import_module("vfsdp.optim.adamw8bit")
    graphs = []
    real_compile = torch.compile

    def counting(fn, **kwargs):
        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward
        return real_compile(fn, backend=backend, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    step = mod.compiled_step8()
    qm, qv = dynamic_map(True), dynamic_map(False)
    per_shape = []
    for rows, cols in ((64, 64), (96, 32)):  # two units: other sizes, other tables
        n = rows * cols
        p = torch.randn(n + 5) * 0.1
        cm = torch.zeros(n + 5, dtype=torch.uint8)
        cv = torch.zeros(n + 5, dtype=torch.uint8)
        tiles = span_tiles([(n, (1, rows, cols), 0), (5, None, None)], n // 1024, "cpu")
        sm, sv = torch.zeros(n // 1024 + 1), torch.zeros(n // 1024 + 1)
        for t in range(1, 5):
            step(p, torch.randn(n + 5), cm, cv, sm, sv, tiles, qm, qv, midpoints(qm),
                 midpoints(qv), 0.9, 0.999, 1e-8, 1e-3 * t, 1 - 0.9 ** t,
                 (1 - 0.999 ** t) ** 0.5)
            per_shape.append(len(graphs))
    # One graph at the first step, none added by the three later steps (a new shape may add
    # one: dynamic shapes still guard on some properties, e.g. tile divisibility).
    assert per_shape[:4] == [1] * 4 and per_shape[4:] == [per_shape[4]] * 4, per_shape


def test_compiled_8bit_step_matches_the_eager_one():
    """torch.compile (inductor's C++ backend here, Triton on a GPU) fuses step8; the result
    may differ in the last bit of a few moments, never more."""

    def body(compile_):
        opt = vfsdp.optim.adamw8bit(lr=1e-2, compile=compile_)
        params = {"w": torch.randn(70, 40, generator=torch.Generator().manual_seed(0)) * 0.1,
                  "x": torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 0.1}
        spec = vfsdp.plan(params, 1, granularity=opt.granularity)
        shards = vfsdp.shard(params, spec)
        state = opt.init(shards, spec)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            state = opt.update(grads, state, shards, spec)
        return {k: v.detach().clone() for k, v in shards.items()}, state.codes_m[()].shard.clone()

    import warnings

    eager, codes_e = simulate(1, body, False)[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused, codes_c = simulate(1, body, True)[0]
    assert not [w for w in seen if "adamw8bit" in str(w.message)]  # no fallback to eager
    for k in eager:
        assert torch.allclose(eager[k], fused[k], rtol=1e-5, atol=1e-7)
    assert (codes_e.int() - codes_c.int()).abs().max() <= 1


def test_a_failing_compile_warns_and_runs_the_eager_step(monkeypatch):
    import importlib

    mod = importlib.import_module("vfsdp.optim.adamw8bit")

    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no backend for this device\nmore")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    step = mod.compiled_step8()
    p = torch.zeros(1024)
    args = (p, torch.ones(1024), torch.zeros(1024, dtype=torch.uint8),
            torch.zeros(1024, dtype=torch.uint8), torch.zeros(2), torch.zeros(2),
            span_tiles([(1024, (1, 32, 32), 0)], 1, "cpu"),
            dynamic_map(True), dynamic_map(False), midpoints(dynamic_map(True)),
            midpoints(dynamic_map(False)), 0.9, 0.999, 1e-8, 0.1, 0.1, 0.999 ** 0.5)
    with pytest.warns(UserWarning, match=r"compile of the 8-bit step failed \(RuntimeError: no "
                                         r"backend for this device\).*compile=False"):
        step(*args)
    assert float(p[0]) < 0  # the eager step ran


def _tp_rule(path):
    from torch.distributed.tensor import Replicate, Shard

    # Cuts on 32-element tile edges (and between matrices of the stacked experts: 2 + 1), so
    # every TP piece's tiles are tiles of the global tensor; each piece is on the same side
    # of the 8-bit threshold (MIN_8BIT_NUMEL, which applies per piece) as its tensor.
    return {"head": Shard(1), "experts": Shard(0)}.get(path[-1], Replicate())


def _train_tp(dp, tp, steps=3):
    mesh = vfsdp.mesh(("dp", dp), ("tp", tp))
    opt = vfsdp.optim.adamw8bit(lr=1e-2, weight_decay=0.1,
                                weight_decay_mask=lambda p: p[-1] != "norm")
    params = _params()
    spec = vfsdp.plan(params, mesh, tp=_tp_rule, granularity=opt.granularity)
    shards = vfsdp.shard(params, spec, mesh=mesh)
    state = opt.init(shards, spec)
    rank = mesh.get_local_rank("dp")
    for step in range(1, steps + 1):
        def local(t, s):
            st = s.strided
            if st.dim is not None:
                t = t.narrow(st.dim, st.start, st.lengths[st.index])
            return t.reshape(-1)[slice(*s.local_range(rank))]

        state = opt.update(optree.tree_map(local, _grads(step), spec.tree), state, shards, spec)
    full = vfsdp.gather(shards, spec)
    return [t.detach().clone() for t in optree.tree_leaves(full)]


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 2)])
def test_8bit_on_tp_x_fsdp_is_bitwise_the_single_process_step(dp, tp):
    one = simulate(1, _train)[0][0]
    paths = optree.tree_paths(_params())
    shapes = [t.shape for t in optree.tree_leaves(_params())]
    for rank, got in enumerate(simulate(dp * tp, _train_tp, dp, tp)):
        for path, shape, want, t in zip(paths, shapes, one, got):
            w = torch.tensor(want).view(shape)
            place = _tp_rule(path)
            if hasattr(place, "dim"):
                w = w.tensor_split(tp, place.dim)[rank % tp]
            assert torch.equal(t, w), (rank, path)
