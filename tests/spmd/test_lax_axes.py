"""The collectives over several mesh axes at once against the reference loops over each group
of ranks (``lax_reference.over_axes``), forward and backward.

Hypothesis draws meshes of 2-3 axes and 1..4 ranks (sizes 1 included), a tuple of axes in the
mesh's order, shapes with 0-size and non-dividing dims, uneven pieces for ``all_gather``.
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

MESHES = [((("a", 2), ("b", 2))), (("a", 1), ("b", 4)), (("a", 4), ("b", 1)),
          (("a", 2), ("b", 1), ("c", 2)), (("a", 3), ("b", 1)), (("a", 1), ("b", 2)),
          (("a", 1), ("b", 1))]
REFS = {"psum": ref.psum_reference, "pmean": ref.pmean_reference, "pvary": ref.pvary_reference,
        "all_gather": ref.all_gather_reference, "psum_scatter": ref.psum_scatter_reference,
        "all_to_all": ref.all_to_all_reference}
REPLICATED = {"psum", "pmean"}


def _t(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@st.composite
def _case(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    names = [n for n, _ in mesh_shape]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names),
                           unique=True))
    axes = tuple(sorted(chosen, key=names.index))
    op = draw(st.sampled_from(sorted(REFS)))
    world = 1
    for _, s in mesh_shape:
        world *= s
    groups = ref.axis_groups(mesh_shape, axes)
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 5)) for _ in range(ndim)]
    dim = draw(st.integers(0, ndim - 1))
    seed = draw(st.integers(0, 2 ** 16))
    xs = []
    for r in range(world):
        s = list(shape)
        if op == "all_gather":  # uneven along dim, 0 allowed
            s[dim] = draw(st.integers(0, 4))
        xs.append(_t(tuple(s), seed + r))
    if op == "pvary":  # replicated over the axes: one value per group
        for g in groups:
            for r in g:
                xs[r] = xs[g[0]]
    return mesh_shape, axes, op, dim, xs, groups


def _outputs(op, leaves, mesh_shape, axes, dim):
    extra = {"all_gather": (dim,), "psum_scatter": (dim,), "all_to_all": (dim, 0)}.get(op, ())
    return ref.over_axes(REFS[op], leaves, mesh_shape, axes, *extra)


def _reference(case):
    mesh_shape, axes, op, dim, xs, groups = case
    if op == "pvary":
        shared = {g[0]: xs[g[0]].clone().requires_grad_(True) for g in groups}
        leaves = [None] * len(xs)
        for g in groups:
            for r in g:
                leaves[r] = shared[g[0]]
    else:
        leaves = [x.clone().requires_grad_(True) for x in xs]
    ys = _outputs(op, leaves, mesh_shape, axes, dim)
    cts = [_t(tuple(y.shape), 900 + r) for r, y in enumerate(ys)]
    if op in REPLICATED:  # one cotangent per group, counted once
        for g in groups:
            for r in g:
                cts[r] = cts[g[0]]
        loss = sum((ys[r] * cts[r]).sum() / len(g) for g in groups for r in g)
    else:
        loss = sum((y * c).sum() for y, c in zip(ys, cts))
    uniq = list({id(v): v for v in leaves}.values())
    grads = dict(zip(map(id, uniq), torch.autograd.grad(loss, uniq, allow_unused=True)))
    want_g = [grads[id(v)] if grads[id(v)] is not None else torch.zeros_like(v) for v in leaves]
    return [y.detach() for y in ys], want_g, cts


def _body(case, cts, how):
    mesh_shape, axes, op, dim, xs, _ = case
    r = dist.get_rank()
    mesh = vfsdp.mesh(*mesh_shape)

    def apply(v):
        if op in ("psum", "pmean", "pvary"):
            return getattr(lax, op)(v, axes, mesh=mesh)
        if op == "all_to_all":
            return lax.all_to_all(v, axes, dim, 0, mesh=mesh)
        return getattr(lax, op)(v, axes, dim, mesh=mesh)

    x = xs[r].clone()
    if how == "func":
        return apply(x).detach(), torch.func.grad(lambda v: (apply(v) * cts[r]).sum())(x)
    x.requires_grad_(True)
    y = apply(x)
    (y * cts[r]).sum().backward()
    return y.detach(), x.grad


@settings(max_examples=40, deadline=None)
@given(_case(), st.sampled_from(["backward", "func"]))
def test_collectives_over_several_axes_match_the_reference_loops(case, how):
    want_y, want_g, cts = _reference(case)
    got = simulate(len(case[4]), _body, case, cts, how)
    for r, (y, g) in enumerate(got):
        assert y.shape == want_y[r].shape and torch.allclose(y, want_y[r], atol=1e-5), (r, y)
        assert torch.allclose(g, want_g[r], atol=1e-5), (r, g, want_g[r])


def test_a_tuple_is_one_axis_row_major_over_its_names():
    def body():
        m = vfsdp.mesh(("a", 2), ("b", 1), ("c", 2))
        x = torch.tensor([float(dist.get_rank())])
        return (lax.axis_index(("a", "c"), mesh=m), lax.axis_size(("a", "c"), mesh=m),
                lax.all_gather(x, ("a", "c"), mesh=m).tolist(),
                lax.psum(x, ("b", "c"), mesh=m).item(), lax.axis_index(("c",), mesh=m))

    assert simulate(4, body) == [(0, 4, [0.0, 1.0, 2.0, 3.0], 1.0, 0),
                                 (1, 4, [0.0, 1.0, 2.0, 3.0], 1.0, 1),
                                 (2, 4, [0.0, 1.0, 2.0, 3.0], 5.0, 0),
                                 (3, 4, [0.0, 1.0, 2.0, 3.0], 5.0, 1)]


@pytest.mark.parametrize("axes, match", [
    (("tp", "dp"), r"not in the mesh's order \('dp', 'tp'\); name them as \('dp', 'tp'\)"),
    (("dp", "dp"), "a name repeats"),
    (("dp", "pp"), r"has no axis 'pp'; its axes are \('dp', 'tp'\)")])
def test_bad_tuples_are_refused_naming_the_fix(axes, match):
    def body():
        lax.psum(torch.ones(1), axes, mesh=vfsdp.mesh(("dp", 2), ("tp", 1)))

    with pytest.raises(RankError, match=match):
        simulate(2, body)
