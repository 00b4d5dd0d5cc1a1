"""The named-axis collectives against their reference loops, forward and backward.

Hypothesis draws axis sizes 1..4, shapes with 0-size and non-dividing dims, uneven pieces per
rank; each case runs on simulated ranks and is compared with ``lax_reference`` and with the
gradient of the reference (autograd over the loop): ``backward()``, ``autograd.grad`` and
``torch.func.grad`` all give it.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import vfsdp
from tests.spmd import lax_reference as ref
from vfsdp import lax
from vfsdp.testing import RankError, simulate

REPLICATED = {"psum", "pmean"}  # outputs replicated: one shared cotangent, counted once


def _reference(op: str, xs: list, cts: list, kwargs: dict):
    """Outputs and input gradients of the reference loop."""
    if op == "pvary":  # one replicated value: a single leaf that every rank reads
        shared = xs[0].detach().clone().requires_grad_(True)
        xs = [shared] * len(xs)
    else:
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
    fn = {"psum": ref.psum_reference, "pmean": ref.pmean_reference,
          "pvary": ref.pvary_reference,
          "all_gather": lambda v: ref.all_gather_reference(v, kwargs["dim"]),
          "psum_scatter": lambda v: ref.psum_scatter_reference(v, kwargs["dim"]),
          "all_to_all": lambda v: ref.all_to_all_reference(
              v, kwargs["split_dim"], kwargs["concat_dim"], kwargs.get("sizes"))}[op]
    ys = fn(xs)
    if op in REPLICATED:
        loss = sum((y * cts[0]).sum() for y in ys) / len(ys)
    else:
        loss = sum((y * c).sum() for y, c in zip(ys, cts))
    if op == "pvary":
        (g,) = torch.autograd.grad(loss, xs[0])
        return [y.detach() for y in ys], [g] * len(xs)
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    return ([y.detach() for y in ys],
            [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs)])


def _apply(op: str, x, kwargs: dict, mesh):
    r = dist.get_rank()
    if op in ("psum", "pmean", "pvary"):
        return getattr(lax, op)(x, "x", mesh=mesh)
    if op in ("all_gather", "psum_scatter"):
        return getattr(lax, op)(x, "x", kwargs["dim"], mesh=mesh)
    sizes = kwargs.get("sizes")
    return lax.all_to_all(x, "x", kwargs["split_dim"], kwargs["concat_dim"],
                          split_sizes=None if sizes is None else sizes[r], mesh=mesh)


def _rank_body(op: str, xs: list, cts: list, kwargs: dict, how: str):
    r = dist.get_rank()
    mesh = vfsdp.mesh(("x", dist.get_world_size()))
    x, ct = xs[r].clone(), cts[0 if op in REPLICATED else r]
    if how == "func":
        y = _apply(op, x, kwargs, mesh)
        g = torch.func.grad(lambda v: (_apply(op, v, kwargs, mesh) * ct).sum())(x)
        return y.detach(), g
    x.requires_grad_(True)
    y = _apply(op, x, kwargs, mesh)
    if how == "backward":
        (y * ct).sum().backward()
        return y.detach(), x.grad
    (g,) = torch.autograd.grad((y * ct).sum(), x)
    return y.detach(), g


def _check(op: str, xs: list, cts: list, kwargs: dict, how: str = "backward"):
    want_y, want_g = _reference(op, xs, cts, kwargs)
    got = simulate(len(xs), _rank_body, op, xs, cts, kwargs, how)
    for r, (y, g) in enumerate(got):
        assert y.shape == want_y[r].shape and torch.allclose(y, want_y[r], atol=1e-5), (r, y)
        assert torch.allclose(g, want_g[r], atol=1e-5), (r, g, want_g[r])


def _t(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@st.composite
def _same_shapes(draw):
    n = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    seed = draw(st.integers(0, 2 ** 16))
    return n, [_t(shape, seed + r) for r in range(n)], [_t(shape, seed + 100 + r) for r in range(n)]


@settings(max_examples=25, deadline=None)
@given(_same_shapes(), st.sampled_from(["psum", "pmean", "pvary"]),
       st.sampled_from(["backward", "grad", "func"]))
def test_psum_pmean_pvary_match_the_reference(case, op, how):
    _, xs, cts = case
    if op == "pvary":
        xs = [xs[0]] * len(xs)  # pvary's input is replicated
    _check(op, xs, cts, {}, how)


@st.composite
def _gather_case(draw):
    n = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    base = [draw(st.integers(0, 4)) for _ in range(ndim)]
    dim = draw(st.integers(-ndim, ndim - 1))
    d = dim % ndim
    seed = draw(st.integers(0, 2 ** 16))
    xs = []
    for r in range(n):  # uneven along dim, 0 allowed
        shape = list(base)
        shape[d] = draw(st.integers(0, 4))
        xs.append(_t(tuple(shape), seed + r))
    return n, xs, dim


@settings(max_examples=25, deadline=None)
@given(_gather_case(), st.sampled_from(["backward", "grad", "func"]))
def test_all_gather_of_uneven_pieces_matches_the_reference(case, how):
    n, xs, dim = case
    total = list(xs[0].shape)
    total[dim % len(total)] = sum(x.shape[dim] for x in xs)
    cts = [_t(tuple(total), 500 + r) for r in range(n)]
    _check("all_gather", xs, cts, {"dim": dim}, how)


@st.composite
def _scatter_case(draw):
    n = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 7)) for _ in range(ndim)]  # rarely divisible by n
    dim = draw(st.integers(-ndim, ndim - 1))
    seed = draw(st.integers(0, 2 ** 16))
    return n, [_t(tuple(shape), seed + r) for r in range(n)], dim


@settings(max_examples=25, deadline=None)
@given(_scatter_case(), st.sampled_from(["backward", "grad", "func"]))
def test_psum_scatter_of_non_dividing_dims_matches_the_reference(case, how):
    _, xs, dim = case
    outs = ref.psum_scatter_reference(xs, dim)
    cts = [_t(tuple(o.shape), 700 + r) for r, o in enumerate(outs)]
    _check("psum_scatter", xs, cts, {"dim": dim}, how)


@st.composite
def _a2a_case(draw):
    n = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    split_dim = draw(st.integers(0, ndim - 1))
    concat_dim = draw(st.integers(0, ndim - 1))
    base = [draw(st.integers(0, 3)) for _ in range(ndim)]
    seed = draw(st.integers(0, 2 ** 16))
    xs, sizes = [], []
    if concat_dim == split_dim:  # any split per rank
        for r in range(n):
            row = [draw(st.integers(0, 3)) for _ in range(n)]
            shape = list(base)
            shape[split_dim] = sum(row)
            xs.append(_t(tuple(shape), seed + r))
            sizes.append(row)
    else:  # receiver j gets the same size from every sender; concat sizes may differ
        col = [draw(st.integers(0, 3)) for _ in range(n)]
        for r in range(n):
            shape = list(base)
            shape[split_dim] = sum(col)
            shape[concat_dim] = draw(st.integers(0, 3))
            xs.append(_t(tuple(shape), seed + r))
            sizes.append(list(col))
    return n, xs, split_dim, concat_dim, sizes


@settings(max_examples=25, deadline=None)
@given(_a2a_case(), st.booleans(), st.sampled_from(["backward", "grad", "func"]))
def test_all_to_all_with_uneven_splits_matches_the_reference(case, default_split, how):
    _, xs, split_dim, concat_dim, sizes = case
    if default_split:  # torch.tensor_split on every rank: only when it gives such sizes
        sizes = None
        if split_dim != concat_dim and len({x.shape[split_dim] for x in xs}) > 1:
            return
    kwargs = {"split_dim": split_dim, "concat_dim": concat_dim, "sizes": sizes}
    outs = ref.all_to_all_reference(xs, split_dim, concat_dim, sizes)
    cts = [_t(tuple(o.shape), 900 + r) for r, o in enumerate(outs)]
    _check("all_to_all", xs, cts, kwargs, how)


# ---------------------------------------------------------------- sub-axes of a 2-D mesh

def _two_axes():
    r = dist.get_rank()
    m = vfsdp.mesh(("dp", 2), ("tp", 2))
    x = torch.tensor([float(r)], requires_grad=True)
    with lax.use_mesh(m):
        tp_sum = lax.psum(x, "tp")
        dp_gather = lax.all_gather(x, "dp")
        (tp_sum.sum() + (dp_gather * torch.tensor([1.0, 2.0])).sum()).backward()
        return (tp_sum.item(), dp_gather.tolist(), x.grad.item(), lax.axis_index("tp"),
                lax.axis_index("dp"), lax.axis_size("tp"))


def test_axes_of_a_2d_mesh_are_the_row_major_groups():
    # ranks (dp, tp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); tp groups {0,1} {2,3}, dp {0,2} {1,3}
    # grad: 1 from psum (identity) + the gathered position's weight summed over dp ranks (2x)
    assert simulate(4, _two_axes) == [
        (1.0, [0.0, 2.0], 1.0 + 2.0, 0, 0, 2), (1.0, [1.0, 3.0], 1.0 + 2.0, 1, 0, 2),
        (5.0, [0.0, 2.0], 1.0 + 4.0, 0, 1, 2), (5.0, [1.0, 3.0], 1.0 + 4.0, 1, 1, 2)]


def test_collectives_are_counted():
    def body():
        from vfsdp.collectives import counts, reset_counts

        reset_counts()
        m = vfsdp.mesh(("x", 2))
        lax.psum(torch.ones(3), "x", mesh=m)
        lax.psum_scatter(torch.ones(4), "x", mesh=m)
        return counts()["all_reduce"], counts()["reduce_scatter"]

    assert simulate(2, body) == [(1, 1), (1, 1)]


# ---------------------------------------------------------------- errors

def _error(fn):
    def body():
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    return simulate(2, body)[0]


def test_errors_name_the_axis_and_the_fix():
    assert "no mesh; pass mesh=vfsdp.mesh" in _error(lambda: lax.psum(torch.ones(1), "tp"))
    assert "has no axis 'tp'; its axes are ('dp',)" in _error(
        lambda: lax.psum(torch.ones(1), "tp", mesh=vfsdp.mesh(("dp", 2))))
    assert "hold 4 ranks, the process group has 2" in _error(
        lambda: vfsdp.mesh(("dp", 2), ("tp", 2)))
    assert "split_sizes [1] must be 2 sizes" in _error(
        lambda: lax.all_to_all(torch.ones(1), "x", 0, 0, split_sizes=[1],
                               mesh=vfsdp.mesh(("x", 2))))
    assert "0-d tensor has no dim" in _error(
        lambda: lax.all_gather(torch.tensor(1.0), "x", mesh=vfsdp.mesh(("x", 2))))


def test_the_shape_exchanges_refuse_more_than_8_dims_by_name():
    x = torch.ones((1,) * 9)
    assert "all_gather: tensors of up to 8 dims, got 9" in _error(
        lambda: lax.all_gather(x, "x", 0, mesh=vfsdp.mesh(("x", 2))))
    assert "all_to_all: tensors of up to 8 dims, got 9" in _error(
        lambda: lax.all_to_all(x, "x", 0, 0, mesh=vfsdp.mesh(("x", 2))))


def test_all_gather_refuses_shapes_that_differ_off_the_dim():
    def body():
        x = torch.ones(2, dist.get_rank() + 1)
        lax.all_gather(x, "x", 0, mesh=vfsdp.mesh(("x", 2)))

    with pytest.raises(RankError, match=r"shapes \[\(2, 1\), \(2, 2\)\] differ off that dim"):
        simulate(2, body)


# ------------------------------------------------------------ a TP MLP, as in the docs

def _tp_mlp(x, w_up, w_down):
    r, n = dist.get_rank(), dist.get_world_size()
    cols = w_up.shape[1] // n
    up = w_up[:, r * cols:(r + 1) * cols].clone().requires_grad_(True)
    down = w_down[r * cols:(r + 1) * cols].clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    with lax.use_mesh(vfsdp.mesh(("tp", n))):
        h = torch.relu(lax.pvary(x, "tp") @ up)
        y = lax.psum(h @ down, "tp")
    (y * torch.arange(float(y.numel())).view(y.shape)).sum().backward()
    return y.detach(), x.grad, up.grad, down.grad


@pytest.mark.parametrize("n", [1, 2, 4])
def test_column_then_row_parallel_mlp_equals_the_unsharded_one(n):
    g = torch.Generator().manual_seed(0)
    x, w_up, w_down = (torch.randn(3, 4, generator=g), torch.randn(4, 8, generator=g),
                       torch.randn(8, 4, generator=g))
    xs, us, ds = (t.clone().requires_grad_(True) for t in (x, w_up, w_down))
    y = torch.relu(xs @ us) @ ds
    (y * torch.arange(float(y.numel())).view(y.shape)).sum().backward()
    cols = 8 // n
    for r, (yr, gx, gu, gd) in enumerate(simulate(n, _tp_mlp, x, w_up, w_down)):
        assert torch.allclose(yr, y.detach(), atol=1e-5)
        assert torch.allclose(gx, xs.grad, atol=1e-5)
        assert torch.allclose(gu, us.grad[:, r * cols:(r + 1) * cols], atol=1e-5)
        assert torch.allclose(gd, ds.grad[r * cols:(r + 1) * cols], atol=1e-5)


def test_the_same_axes_give_the_same_mesh():
    def body():
        a, b = vfsdp.mesh(("dp", 2), ("tp", 1)), vfsdp.mesh(("dp", 2), ("tp", 1))
        return a is b and vfsdp.mesh(("x", 2)) is not a
    assert simulate(2, body) == [True, True]


def _mismatched(op):
    r = dist.get_rank()
    m = vfsdp.mesh(("x", 2))
    try:
        if op == "pvary":  # the backward's sum of cotangents of different shapes
            x = torch.ones(2 + r, requires_grad=True)
            lax.pvary(x, "x", mesh=m).sum().backward()
        else:
            getattr(lax, op)(torch.ones(2 + r), "x", mesh=m)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("op", ["psum", "pmean", "pvary"])
def test_a_sum_over_shapes_that_differ_is_the_same_error_on_every_rank(op):
    """2 elements on one rank, 3 on the other: the all-reduce gave one rank a result and the
    other a transport error (gloo), or hung (threads); now every rank raises, naming the
    shapes."""
    got = simulate(2, _mismatched, op, timeout=20)
    assert got[0] == got[1], got
    assert "the ranks' shapes [(2,), (3,)] differ" in got[0], got[0]
    assert got[0].startswith("pvary's backward" if op == "pvary" else f"{op} over 'x'"), got[0]


# ------------------------------------------------- double backward (a gradient penalty)

def _penalised_mlp(x, w_up, w_down, ct, extra):
    """``L + |dL/dx|^2 + |dL/dw_up|^2`` of the TP MLP (``column_parallel`` then
    ``row_parallel``), the gradients taken with ``create_graph=True``; ``extra``: ``L`` also
    has a term in ``x`` that needs no collective (it kept the graph alive, and the
    collectives' terms were dropped silently)."""
    r, n = dist.get_rank(), dist.get_world_size()
    cols = w_up.shape[1] // n
    up = w_up[:, r * cols:(r + 1) * cols].clone().requires_grad_(True)
    down = w_down[r * cols:(r + 1) * cols].clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    mesh = vfsdp.mesh(("tp", n))
    h = torch.tanh(lax.column_parallel(x, up, "tp", mesh=mesh))
    loss = (lax.row_parallel(h, down, "tp", mesh=mesh) * ct).sum()
    if extra:
        loss = loss + x.pow(3).sum()
    gx, gup = torch.autograd.grad(loss, (x, up), create_graph=True)
    # |dL/dw_up|^2 sums over every rank's columns: its sum over the axis, counted once
    penalty = gx.pow(2).sum() + lax.psum(gup.pow(2).sum().view(1), "tp", mesh=mesh).sum()
    (loss + penalty).backward()
    return x.grad, up.grad, down.grad


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("extra", [False, True])
def test_a_gradient_penalty_through_column_and_row_parallel_equals_one_process(n, extra):
    """Double backward: pvary's and psum's backwards are collectives too, now made of the
    differentiable ones. It raised "element 0 of tensors does not require grad" where the
    collective was the only path, and dropped its term where another kept the graph."""
    g = torch.Generator().manual_seed(0)
    x, w_up, w_down, ct = (torch.randn(3, 4, generator=g), torch.randn(4, 4, generator=g),
                           torch.randn(4, 2, generator=g), torch.randn(3, 2, generator=g))
    xs, us, ds = (t.clone().requires_grad_(True) for t in (x, w_up, w_down))
    loss = ((torch.tanh(xs @ us) @ ds) * ct).sum() + (xs.pow(3).sum() if extra else 0)
    gx, gu = torch.autograd.grad(loss, (xs, us), create_graph=True)
    (loss + gx.pow(2).sum() + gu.pow(2).sum()).backward()
    cols = 4 // n
    for r, (gx_r, gu_r, gd_r) in enumerate(
            simulate(n, _penalised_mlp, x, w_up, w_down, ct, extra, timeout=30)):
        assert torch.allclose(gx_r, xs.grad, atol=1e-4), (r, gx_r, xs.grad)
        assert torch.allclose(gu_r, us.grad[:, r * cols:(r + 1) * cols], atol=1e-4), r
        assert torch.allclose(gd_r, ds.grad[r * cols:(r + 1) * cols], atol=1e-4), r


def _penalised_move(op, xs, ct, with_loss):
    """``L + |dL/dx|^2`` (or the penalty alone: the collective's backward is then its only
    path) on each rank, for ``L = tanh(op(x)) . ct``: the gradient's backward is the op's
    transpose's (all_gather <-> psum_scatter, all_to_all <-> all_to_all)."""
    r = dist.get_rank()
    mesh = vfsdp.mesh(("x", dist.get_world_size()))
    x = xs[r].clone().requires_grad_(True)
    if op == "all_gather":
        y = lax.all_gather(x, "x", 0, mesh=mesh)
    elif op == "psum_scatter":
        y = lax.psum_scatter(x, "x", 0, mesh=mesh)
    else:
        y = lax.all_to_all(x, "x", 0, 1, mesh=mesh)
    loss = (torch.tanh(y) * ct[: y.shape[0], : y.shape[1]]).sum()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    (gx.pow(2).sum() + (loss if with_loss else 0)).backward()
    return x.grad


@pytest.mark.parametrize("with_loss", [True, False])
@pytest.mark.parametrize("op", ["all_gather", "psum_scatter", "all_to_all"])
def test_a_gradient_penalty_through_the_moving_collectives_equals_one_process(op, with_loss):
    n = 2
    g = torch.Generator().manual_seed(1)
    shape = {"all_gather": (2, 3), "psum_scatter": (4, 3), "all_to_all": (4, 3)}[op]
    xs = [torch.randn(shape, generator=g) for _ in range(n)]
    ct = torch.randn(8, 8, generator=g)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    if op == "all_gather":
        ys = [torch.cat(leaves)] * n
    elif op == "psum_scatter":
        ys = list(sum(leaves).tensor_split(n, 0))
    else:  # chunk j of rank i's rows goes to rank j, joined along dim 1
        ys = [torch.cat([x.tensor_split(n, 0)[j] for x in leaves], 1) for j in range(n)]
    loss = sum((torch.tanh(y) * ct[: y.shape[0], : y.shape[1]]).sum() for y in ys)
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    (sum(gr.pow(2).sum() for gr in grads) + (loss if with_loss else 0)).backward()
    for r, got in enumerate(simulate(n, _penalised_move, op, xs, ct, with_loss, timeout=30)):
        assert torch.allclose(got, leaves[r].grad, atol=1e-4), (r, got, leaves[r].grad)
