"""``vfsdp.shard_map`` against one plain-torch process, forward and backward.

TP x FSDP (``vfsdp.gather`` inside the body), the EP MoE and Ulysses sequence parallelism,
under ``simulate`` and on gloo processes; a hypothesis property over meshes of 1..4 ranks,
spec combinations and uneven dims; the specs that do not fit, and the replication check:
the forgotten ``pvary`` raises, and none of the examples raises a false alarm (``check_vma``
is on in every test here unless a test says otherwise).
"""

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

import vfsdp
from vfsdp import P, lax
from vfsdp.testing import RankError, simulate, spawn
from vfsdp.testing.moe import moe_ep, moe_params, moe_reference

TOL = 1e-6


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _close(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (what, i, a.shape, b.shape)
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        assert diff <= TOL, (what, i, diff)


# ------------------------------------------------------------------ TP x FSDP MLP

D, FF, T = 6, 8, 5


def _mlp_params():
    return {"w_up": _randn(D, FF, seed=1) / 3, "w_down": _randn(FF, D, seed=2) / 3,
            "norm": _randn(D, seed=3)}


def _tp_rule(path):
    return {"w_up": Shard(1), "w_down": Shard(0)}.get(path[-1], Replicate())


def _mlp(p, x, tp=None):
    if tp is None:
        h = torch.relu(x @ p["w_up"]) @ p["w_down"]
    else:
        h = lax.row_parallel(torch.relu(lax.column_parallel(x, p["w_up"], tp)), p["w_down"], tp)
    return (x + h) * p["norm"]


def _tp_fsdp(dp, tp):
    """The MLP on a (dp, tp) mesh: the batch split over dp, each TP piece FSDP-sharded over
    dp and gathered inside the body; returns the output, x's gradient and the full
    gradients of this rank's TP pieces (``gather(grads(shards, spec), spec)``)."""
    mesh = vfsdp.mesh(("dp", dp), ("tp", tp))
    spec = vfsdp.plan(_mlp_params(), mesh, tp=_tp_rule)
    shards = vfsdp.shard(_mlp_params(), spec, mesh=mesh)
    f = vfsdp.shard_map(lambda x: _mlp(vfsdp.gather(shards, spec, grad_reduce="sum"), x, "tp"),
                        mesh, P("dp"), P("dp"))
    (x,) = _leaves(_randn(T, D, seed=4))
    y = f(x)
    (y * _randn(T, D, seed=5)).sum().backward()
    full = vfsdp.gather(vfsdp.grads(shards, spec), spec, mesh=mesh)
    return y.detach(), x.grad, lax.axis_index("tp", mesh=mesh), {k: v.clone() for k, v in
                                                                 full.items()}


def _tp_fsdp_reference(tp):
    p = {k: v.requires_grad_(True) for k, v in _mlp_params().items()}
    (x,) = _leaves(_randn(T, D, seed=4))
    y = _mlp(p, x)
    (y * _randn(T, D, seed=5)).sum().backward()
    pieces = [{k: v.grad.tensor_split(tp, _tp_rule((k,)).dim)[i]
               if isinstance(_tp_rule((k,)), Shard) else v.grad for k, v in p.items()}
              for i in range(tp)]
    return y.detach(), x.grad, pieces


def _check_tp_fsdp(results, tp):
    want_y, want_gx, pieces = _tp_fsdp_reference(tp)
    for y, gx, index, grads in results:
        _close([y, gx], [want_y, want_gx], "TP x FSDP output, x.grad")
        _close([grads[k] for k in sorted(grads)], [pieces[index][k] for k in sorted(grads)],
               "TP x FSDP parameter gradients")


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 3), (3, 1)])
def test_tp_fsdp_mlp_equals_one_process(dp, tp):
    _check_tp_fsdp(simulate(dp * tp, _tp_fsdp, dp, tp), tp)


# ------------------------------------------------------------------ EP MoE

E, K, H = 4, 2, 6


def _moe(ep):
    mesh = vfsdp.mesh(("ep", ep))
    params = moe_params(D, H, E, seed=7)
    router, gate, up, down, x = _leaves(params["router"], *params["experts"].values(),
                                        _randn(9, D, seed=8))

    def body(router, experts, x):  # router replicated: its gradient sums the ranks' (pvary)
        return moe_ep(lax.pvary(router, "ep"), experts, x, K, "ep", E)

    f = vfsdp.shard_map(body, mesh, (P(), P("ep"), P("ep")), P("ep"))
    y = f(router, {"w_gate": gate, "w_up": up, "w_down": down}, x)
    (y * _randn(9, D, seed=9)).sum().backward()
    return [y.detach()] + [t.grad for t in (router, gate, up, down, x)]


def _moe_reference():
    params = moe_params(D, H, E, seed=7)
    router, gate, up, down, x = _leaves(params["router"], *params["experts"].values(),
                                        _randn(9, D, seed=8))
    y = moe_reference({"router": router, "experts": {"w_gate": gate, "w_up": up,
                                                     "w_down": down}}, x, K)
    (y * _randn(9, D, seed=9)).sum().backward()
    return [y.detach()] + [t.grad for t in (router, gate, up, down, x)]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ep_moe_equals_one_process(ep):
    want = _moe_reference()
    for got in simulate(ep, _moe, ep):
        _close(got, want, "EP MoE")


# ------------------------------------------------------------------ Ulysses

HEADS, HD, S = 4, 3, 7  # 7 tokens: uneven over 2..4 ranks


def _attention(q, k, v):  # [heads, S, hd], causal
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _ulysses_body(x, wq, wk, wv, wo):
    """x: this rank's tokens [S/n, D]; all-to-all to all tokens of this rank's heads,
    causal attention, and back."""
    wq, wk, wv, wo = (lax.pvary(w, "sp") for w in (wq, wk, wv, wo))
    n = x.shape[0]

    def heads(w):  # [S/n, H, hd] -> [H/n, S, hd]
        local = (x @ w).view(n, HEADS, HD)
        return lax.all_to_all(local, "sp", 1, 0).transpose(0, 1)

    o = _attention(heads(wq), heads(wk), heads(wv)).transpose(0, 1)   # [S, H/n, hd]
    o = lax.all_to_all(o, "sp", 0, 1)                                  # [S/n, H, hd]
    return o.reshape(n, HEADS * HD) @ wo


def _ulysses_weights():
    return (_randn(S, D, seed=10), *(_randn(D, HEADS * HD, seed=11 + i) / 3 for i in range(3)),
            _randn(HEADS * HD, D, seed=14) / 3)


def _ulysses(n):
    mesh = vfsdp.mesh(("sp", n))
    leaves = _leaves(*_ulysses_weights())
    f = vfsdp.shard_map(_ulysses_body, mesh, (P("sp"), P(), P(), P(), P()), P("sp"))
    y = f(*leaves)
    (y * _randn(S, D, seed=15)).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


def _ulysses_reference():
    x, wq, wk, wv, wo = leaves = _leaves(*_ulysses_weights())

    def heads(w):
        return (x @ w).view(S, HEADS, HD).transpose(0, 1)

    o = _attention(heads(wq), heads(wk), heads(wv)).transpose(0, 1).reshape(S, HEADS * HD)
    y = o @ wo
    (y * _randn(S, D, seed=15)).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ulysses_sequence_parallel_attention_equals_one_process(n):
    want = _ulysses_reference()
    for got in simulate(n, _ulysses, n):
        _close(got, want, "Ulysses")


# ------------------------------------------------------------------ gloo processes

GLOO_SPECS = [((("a", 2), ("b", 2)), (5, 3), P("a", "b"), 1),
              ((("a", 2), ("b", 2)), (7,), P(("a", "b")), 2),
              ((("a", 2), ("b", 2)), (3, 0, 4), P(None, None, "b"), 3),
              ((("a", 4),), (2, 3), P(None, "a"), 4)]


def _all_on_gloo():
    return (_tp_fsdp(2, 2), _moe(4), _ulysses(4),
            [_spec_body(*case) for case in GLOO_SPECS], _jvps())


def test_the_examples_and_specs_on_gloo_processes():
    """And torch.func.jvp through shard_map and every collective (here: forward AD's levels
    are per process, so simulated ranks would share them)."""
    results = spawn(_all_on_gloo, 4)
    for got in (r[4] for r in results):
        for name, (primal, tangent, want_primal, want_tangent) in got.items():
            _close([primal, tangent], [want_primal, want_tangent], f"jvp of {name}")
    _check_tp_fsdp([r[0] for r in results], 2)
    want_moe, want_uly = _moe_reference(), _ulysses_reference()
    want_specs = [_spec_reference(*case) for case in GLOO_SPECS]
    for _, moe, uly, specs, _ in results:
        _close(moe, want_moe, "EP MoE on gloo")
        _close(uly, want_uly, "Ulysses on gloo")
        for got, want in zip(specs, want_specs):
            _close(got, want, "a spec on gloo")


# ------------------------------------------------------------------ any spec (hypothesis)

MESHES = [(("a", 1),), (("a", 2),), (("a", 3),), (("a", 4),), (("a", 2), ("b", 2)),
          (("a", 1), ("b", 3)), (("a", 2), ("b", 1))]


@st.composite
def _spec_case(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    names = [n for n, _ in mesh_shape]
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    free = list(names)
    entries = []
    for _ in shape:
        pick = draw(st.lists(st.sampled_from(free), max_size=len(free), unique=True)
                    if free else st.just([]))
        pick = sorted(pick, key=names.index)
        free = [a for a in free if a not in pick]
        entries.append(None if not pick else pick[0] if len(pick) == 1 else tuple(pick))
    while entries and entries[-1] is None and draw(st.booleans()):
        entries.pop()  # trailing dims whole, left out
    return mesh_shape, shape, P(*entries), draw(st.integers(0, 2 ** 16))


def _spec_body(mesh_shape, shape, spec, seed):
    mesh = vfsdp.mesh(*mesh_shape)
    (x,) = _leaves(_randn(*shape, seed=seed))
    split = [d for d, e in enumerate(spec) if e is not None]
    order = [n for n, _ in mesh_shape]
    axes = tuple(sorted(spec.axes(), key=order.index))  # a tuple of axes: in the mesh's order

    def body(t):  # elementwise, and a sum over the split dims (psum over their axes)
        y = torch.sin(t) * 3
        s = t.pow(2).sum(split) if split else t.pow(2)
        return y, (lax.psum(s, axes) if axes else s)

    y, s = vfsdp.shard_map(body, mesh, P(*spec), (spec, P()))(x)
    ((y * _randn(*shape, seed=seed + 1)).sum() + s.sum()).backward()
    return y.detach(), s.detach(), x.grad


def _spec_reference(mesh_shape, shape, spec, seed):
    (x,) = _leaves(_randn(*shape, seed=seed))
    split = [d for d, e in enumerate(spec) if e is not None]
    y = torch.sin(x) * 3
    s = x.pow(2).sum(split) if split else x.pow(2)
    ((y * _randn(*shape, seed=seed + 1)).sum() + s.sum()).backward()
    return y.detach(), s.detach(), x.grad


@settings(max_examples=30, deadline=None)
@given(_spec_case())
def test_any_spec_splits_and_assembles_as_one_process(case):
    mesh_shape = case[0]
    y, s, gx_want = _spec_reference(*case)
    world = 1
    for _, n in mesh_shape:
        world *= n
    for gy, gs, gx in simulate(world, _spec_body, *case):
        assert torch.equal(gy, y)                 # split and assembled bitwise
        assert gs.shape == s.shape and torch.allclose(gs, s, atol=1e-5)
        assert torch.allclose(gx, gx_want, atol=1e-6)


# ------------------------------------------------------------------ specs that do not fit

@pytest.mark.parametrize("specs, match", [
    ((P("dp", None, None),), r"P\('dp', None, None\) has 3 entries but args\[0\] \(4, 2\) "
                             r"has 2 dims"),
    ((P("tq"),), r"P\('tq'\) of args\[0\] names axis 'tq', which the mesh does not have; its "
                 r"axes are \('dp', 'tp'\)"),
    ((P("dp", "dp"),), r"uses axis 'dp' twice"),
    (("dp",), r"the spec of args\[0\] is 'dp'; give a vfsdp.P"),
    ((P(), P()), r"in_specs .* do not match the inputs' structure")])
def test_specs_that_do_not_fit_are_refused_naming_the_input(specs, match):
    def body():
        mesh = vfsdp.mesh(("dp", 2), ("tp", 1))
        vfsdp.shard_map(lambda x: x, mesh, specs, P())(torch.ones(4, 2))

    with pytest.raises(RankError, match=match):
        simulate(2, body)


# ------------------------------------------------------------------ replication checking

def _mlp_grads(pvary, check):
    """The column- then row-parallel MLP of the issue, with or without the pvary."""
    mesh = vfsdp.mesh(("tp", dist.get_world_size()))

    def body(x, up, down):
        if pvary:
            x = lax.pvary(x, "tp")
        return lax.psum(torch.relu(x @ up) @ down, "tp")

    x, up, down = _leaves(_randn(3, 4, seed=20), _randn(4, 6, seed=21), _randn(6, 4, seed=22))
    f = vfsdp.shard_map(body, mesh, (P(), P(None, "tp"), P("tp")), P(), check_vma=check)
    try:
        y = f(x, up, down)
    except ValueError as exc:
        return str(exc)
    (y * _randn(3, 4, seed=23)).sum().backward()
    return x.grad


def test_the_forgotten_pvary_is_inserted_strict_mode_refuses_it_unchecked_is_wrong():
    x, up, down = _leaves(_randn(3, 4, seed=20), _randn(4, 6, seed=21), _randn(6, 4, seed=22))
    (torch.relu(x @ up) @ down * _randn(3, 4, seed=23)).sum().backward()
    for pvary, check in [(True, True), (False, True), (True, "strict")]:
        for g in simulate(2, _mlp_grads, pvary, check):  # the implicit pvary: JAX's numbers
            assert torch.allclose(g, x.grad, atol=TOL), (pvary, check)
    unchecked = simulate(2, _mlp_grads, False, False)
    assert float((unchecked[0] - x.grad).abs().max()) > 0.1    # the silent error it catches
    msg = simulate(2, _mlp_grads, False, "strict")[0]
    assert "matmul mixes tensor 0 (3, 4), which requires grad and is invariant over 'tp'" in msg
    assert "vfsdp.lax.pvary(x, 'tp')" in msg


def _replication_error(case):
    mesh = vfsdp.mesh(("dp", 2), ("tp", 2))
    x = torch.ones(4, 2, requires_grad=True)
    bodies = {
        "psum of invariant": (lambda t: lax.psum(t, "tp"), P("dp"), P("dp")),
        "pvary twice": (lambda t: lax.pvary(t, "dp"), P("dp"), P("dp")),
        "gather of invariant": (lambda t: lax.all_gather(t, "tp"), P("dp"), P("dp")),
        "varying output replicated": (lambda t: t * 2, P("dp"), P()),
        "invariant output split": (lambda t: t * 2, P(), P("tp")),
        "multi-axis psum": (lambda t: lax.psum(t, ("dp", "tp")), P("dp"), P()),
    }
    fn, i, o = bodies[case]
    try:
        vfsdp.shard_map(fn, mesh, i, o, check_vma="strict")(x)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case, match", [
    ("psum of invariant", "psum over 'tp' (check_vma='strict'): its input (2, 2) is invariant "
                          "over 'tp'"),
    ("pvary twice", "its input (2, 2) already varies over 'dp'; drop the pvary"),
    ("gather of invariant", "all_gather over 'tp' (check_vma='strict'): its input (2, 2) is "
                            "invariant"),
    ("varying output replicated", "output varies over 'dp' but its out_spec P() replicates"),
    ("invariant output split", "output is invariant over 'tp' (the same on every rank) but "
                               "its out_spec P('tp') splits it"),
    ("multi-axis psum", "psum over ('dp', 'tp') (check_vma='strict'): its input (2, 2) is "
                        "invariant over 'tp'")])
def test_strict_mode_names_the_axis_and_fix_where_jax_would_insert_a_pvary(case, match):
    """Strict mode (``check_vma="strict"``); the default inserts the pvary in all but two of
    these (their verdicts against JAX's: tests/spmd/test_jax_parity.py)."""
    assert match in simulate(4, _replication_error, case)[0]


def test_check_vma_false_checks_nothing():
    def body():
        mesh = vfsdp.mesh(("tp", 2))
        y = vfsdp.shard_map(lambda t: lax.psum(t, "tp"), mesh, P(), P(), check_vma=False)(
            torch.ones(2))
        return y.tolist()

    assert simulate(2, body) == [[2.0, 2.0], [2.0, 2.0]]


# ------------------------------------------------------------------ run_layers inside

def _layers_params():
    return {"layers": [{"w": _randn(4, 4, seed=30 + i) / 2} for i in range(3)]}


def _run_layers_body():
    mesh = vfsdp.mesh(("dp", dist.get_world_size()))
    spec = vfsdp.plan(_layers_params(), mesh, granularity=vfsdp.rows(1))
    shards = vfsdp.shard(_layers_params(), spec, mesh=mesh)

    def body(x):  # FSDP over the same axis that splits the batch
        return vfsdp.run_layers(lambda p, h: torch.tanh(h @ p["w"]), shards["layers"],
                                spec["layers"], x, grad_reduce="sum")

    (x,) = _leaves(_randn(5, 4, seed=33))
    y = vfsdp.shard_map(body, mesh, P("dp"), P("dp"))(x)
    (y * _randn(5, 4, seed=34)).sum().backward()
    # run_layers keeps them in the gradient buffer: gather copies of its views
    full = vfsdp.gather(optree.tree_map(torch.clone, vfsdp.grads(shards, spec)), spec)
    return [y.detach(), x.grad] + [layer["w"].clone() for layer in full["layers"]]


@pytest.mark.parametrize("n", [1, 3])
def test_run_layers_inside_shard_map_equals_one_process(n):
    ws = _leaves(*(layer["w"] for layer in _layers_params()["layers"]))
    (x,) = _leaves(_randn(5, 4, seed=33))
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    (h * _randn(5, 4, seed=34)).sum().backward()
    want = [h.detach(), x.grad] + [w.grad for w in ws]
    for got in simulate(n, _run_layers_body):
        _close(got, want, "run_layers in shard_map")


# ------------------------------------------------------------------ double backward

def _penalised(x0, w0):
    mesh = vfsdp.mesh(("dp", dist.get_world_size()))
    x, w = _leaves(x0, w0)
    f = vfsdp.shard_map(lambda x, w: torch.tanh(x @ lax.pvary(w, "dp")), mesh,
                        (P("dp"), P()), P("dp"))
    loss = f(x, w).pow(2).sum()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + gx.pow(2).sum()).backward()
    return x.grad, w.grad


def test_a_gradient_penalty_through_shard_map_equals_one_process():
    """The split's and the assembly's backwards are each other (differentiable), so
    create_graph=True differentiates through them."""
    x0, w0 = _randn(5, 3, seed=40), _randn(3, 3, seed=41)
    x, w = _leaves(x0, w0)
    loss = torch.tanh(x @ w).pow(2).sum()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + gx.pow(2).sum()).backward()
    for got in simulate(3, _penalised, x0, w0):
        _close(list(got), [x.grad, w.grad], "double backward")


# ------------------------------------------------------------------ the adversarial sweep
# (issue 41: each gives JAX's outcome; the refusals are in tests/misuse/test_shard_map_misuse.py)

def _write_into_invariant():
    """A varying row written in place into an invariant tensor that requires grad: an
    implicit pvary in place, so its gradient sums every rank's (JAX: ``.at[].set``)."""
    mesh = vfsdp.mesh(("tp", 2))
    x, w = _leaves(_randn(4, 3, seed=50), _randn(4, 3, seed=51))

    def body(x, w):
        h = w * 2
        h[0] = x[0]  # __setitem__ returns None: the tracking marks h itself
        return lax.psum((h * h).sum(), "tp")

    vfsdp.shard_map(body, mesh, (P("tp"), P()), P())(x, w).backward()
    return x.grad, w.grad


def test_a_write_in_place_is_tracked_and_the_gradients_are_one_processs():
    x, w = _leaves(_randn(4, 3, seed=50), _randn(4, 3, seed=51))
    total = 0
    for piece in x.split(2):
        h = (w * 2).clone()
        h[0] = piece[0]
        total = total + (h * h).sum()
    total.backward()
    for gx, gw in simulate(2, _write_into_invariant):
        _close([gx, gw], [x.grad, w.grad], "in-place writes")


def _transforms():
    """torch.func.grad and vmap on split pieces inside the body, and shard_map under
    torch.compile (aot_eager) with the check on."""
    mesh = vfsdp.mesh(("tp", 2))
    x, w = _randn(4, 3, seed=60), _randn(3, 3, seed=61)

    def body(x, w):
        gx = torch.func.grad(lambda x: torch.tanh(x @ w).sum())(x)  # grad of a piece: varies
        rows = torch.func.vmap(lambda r: torch.sin(r @ w))(x)
        return gx, lax.psum(rows.sum(0), "tp")

    inside = vfsdp.shard_map(body, mesh, (P("tp"), P()), (P("tp"), P()))(x, w)
    try:  # a gradient of a piece varies: returning it as P() is refused, as by JAX
        vfsdp.shard_map(body, mesh, (P("tp"), P()), (P(), P()))(x, w)
        refused = False
    except ValueError as exc:
        refused = "output[0] varies over 'tp' but its out_spec P()" in str(exc)
    g = vfsdp.shard_map(lambda x, w: lax.psum(torch.sin(x @ w).sum(0), "tp"), mesh,
                        (P("tp"), P()), P())
    wc = w.clone().requires_grad_()
    step = torch.compile(lambda x, w: g(x, w).pow(2).sum(), backend="aot_eager")
    loss = step(x, wc)
    loss.backward()
    return inside, refused, (loss.detach(), wc.grad)


def test_torch_func_transforms_and_compile_compose_with_the_check():
    x, w = _randn(4, 3, seed=60), _randn(3, 3, seed=61)
    want_gx = torch.func.grad(lambda x: torch.tanh(x @ w).sum())(x)
    want_rows = torch.sin(x @ w).sum(0)
    wc = w.clone().requires_grad_()
    loss = torch.sin(x @ wc).sum(0).pow(2).sum()
    loss.backward()
    for inside, refused, (got_loss, got_gw) in simulate(2, _transforms):
        _close(list(inside), [want_gx, want_rows], "inside")
        assert refused
        _close([got_loss, got_gw], [loss.detach(), wc.grad], "compiled step")


def _jvps():
    """torch.func.jvp through shard_map and each collective, and inside the body: each is
    linear, so its tangent is its value at the tangent (run on gloo processes, above)."""
    mesh = vfsdp.mesh(("tp", dist.get_world_size()))
    x, t = _randn(4, 8, seed=70), _randn(4, 8, seed=71)
    bodies = {
        "psum": (lambda x: lax.psum(x, "tp"), P("tp"), P()),
        "pmean": (lambda x: lax.pmean(x, "tp"), P("tp"), P()),
        "pvary": (lambda x: lax.pvary(x, "tp") * (lax.axis_index("tp") + 1), P(), P("tp")),
        "all_gather": (lambda x: lax.all_gather(x, "tp", 1), P("tp"), P("tp")),
        "psum_scatter": (lambda x: lax.psum_scatter(x, "tp", 1), P("tp"), P("tp")),
        "all_to_all": (lambda x: lax.all_to_all(x, "tp", 1, 0), P("tp"), P("tp")),
        "jvp inside": (lambda x: torch.func.jvp(lambda y: lax.psum(y * 3, "tp"), (x,),
                                                (torch.ones_like(x),))[1] * x, P("tp"), P("tp"))}
    out = {}
    for name, (body, i, o) in bodies.items():
        f = vfsdp.shard_map(body, mesh, i, o)
        primal, tangent = torch.func.jvp(f, (x,), (t,))
        out[name] = (primal, tangent, f(x), f(t))  # each is linear: its tangent is f(t)
    return out



def _strict(case):
    mesh = vfsdp.mesh(("tp", 2))
    w = torch.ones(2, 3, requires_grad=True)

    def body(x, w):
        if case == "no_grad":  # no gradient recorded: nothing to sum, nothing refused
            with torch.no_grad():
                return lax.psum(x * w, "tp")
        h = w * 1
        h[0] = x[0]  # a write in place: the pvary it needs is refused too
        return lax.psum(h, "tp")
    try:
        return vfsdp.shard_map(body, mesh, (P("tp"), P()), P(), check_vma="strict")(
            torch.ones(4, 3), w).tolist()
    except ValueError as exc:
        return str(exc)


def test_strict_mode_refuses_only_where_a_gradient_would_be_summed():
    assert simulate(2, _strict, "no_grad")[0] == [[2.0] * 3] * 2
    assert "__setitem__ mixes tensor 0 (2, 3), which requires grad and is invariant over " \
           "'tp'" in simulate(2, _strict, "setitem")[0]
