"""``vfsdp.shard_map`` misuse (issue 41's adversarial sweep): what JAX refuses, or what has no
JAX counterpart and would be silently wrong, is refused by name; JAX's own verdicts on the
replication cases are compared in tests/spmd/test_jax_parity.py."""

import pytest
import torch

import vfsdp
from vfsdp import P, lax
from vfsdp.testing import RankError, simulate


class _MatMul(torch.autograd.Function):
    """A custom Function whose backward gives each rank its own part of ``x``'s gradient."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        return gy @ w.T, x.T @ gy


def _custom(check, pvary):
    mesh = vfsdp.mesh(("tp", 2))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    up = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()

    def body(x, up):
        return lax.psum(_MatMul.apply(lax.pvary(x, "tp") if pvary else x, up).sum(1), "tp")

    vfsdp.shard_map(body, mesh, (P(), P(None, "tp")), P(), check_vma=check)(x, up).sum().backward()
    return x.grad


def test_a_forgotten_pvary_inside_a_custom_function_is_refused_not_silently_wrong():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    up = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    (x @ up).sum().backward()
    unchecked = simulate(2, _custom, False, False)[0]
    assert float((unchecked - x.grad).abs().max()) > 0.1  # what the check prevents
    for g in simulate(2, _custom, True, True):  # pvary before apply: right
        assert torch.allclose(g, x.grad, atol=1e-5)
    with pytest.raises(RankError, match=r"matmul mixes tensor 0 \(3, 4\), which requires grad "
                                        r"and is invariant over 'tp'.*before the custom "
                                        r"autograd.Function's apply"):
        simulate(2, _custom, True, False)


@pytest.mark.parametrize("check", [True, False])
def test_a_nested_shard_map_is_refused_with_or_without_the_check(check):
    def body():
        mesh = vfsdp.mesh(("sp", 2))
        inner = vfsdp.shard_map(lambda y: y * 2, mesh, P("sp"), P("sp"), check_vma=check)
        vfsdp.shard_map(lambda x: inner(x), mesh, P("sp"), P("sp"), check_vma=check)(
            torch.ones(4))

    with pytest.raises(RankError, match=r"inside a shard_map body over \('sp',\): nesting is "
                                        r"refused"):
        simulate(2, body)


def test_keyword_arguments_and_a_bad_check_vma_are_refused_by_name():
    def body(kind):
        mesh = vfsdp.mesh(("sp", 2))

        def fn(x, scale=1.0):
            return x * scale
        if kind == "kwargs":
            vfsdp.shard_map(fn, mesh, P("sp"), P("sp"))(torch.ones(4), scale=2.0)
        else:
            vfsdp.shard_map(fn, mesh, P("sp"), P("sp"), check_vma="yes")

    with pytest.raises(RankError, match=r"shard_map\(.*fn\): keyword arguments \['scale'\] are "
                                        r"not mapped"):
        simulate(2, body, "kwargs")
    with pytest.raises(RankError, match=r"check_vma='yes'; give True"):
        simulate(2, body, "check_vma")


def test_axis_index_varies_so_a_per_rank_value_under_p_is_refused():
    """It was a plain int: each rank returned its own "replicated" value, unchecked."""
    def body():
        mesh = vfsdp.mesh(("sp", 2))
        return vfsdp.shard_map(lambda x: x * (lax.axis_index("sp") + 1), mesh, P(), P())(
            torch.ones(2))

    with pytest.raises(RankError, match=r"output varies over 'sp' but its out_spec P\(\) "
                                        r"replicates it"):
        simulate(2, body)


@pytest.mark.parametrize("write", ["setitem", "out=", "add_"])
def test_a_buffer_written_with_a_piece_varies_so_returning_it_under_p_is_refused(write):
    """``buf[i] = piece`` returns None and ``out=`` returns its argument: the written tensor
    itself is marked (it was accepted: each rank returned its own buffer as "replicated")."""
    def body():
        mesh = vfsdp.mesh(("sp", 2))

        def fn(x):
            buf = torch.zeros(2)
            if write == "setitem":
                buf[0:1] = x[0:1]
            elif write == "out=":
                torch.mul(x, 2, out=buf)
            else:
                buf.add_(x)
            return buf
        vfsdp.shard_map(fn, mesh, P("sp"), P())(torch.arange(4.0))

    with pytest.raises(RankError, match=r"output varies over 'sp' but its out_spec P\(\)"):
        simulate(2, body)


@pytest.mark.parametrize("out_dims", [0, 1])
def test_a_vmap_result_keeps_its_pieces_replication(out_dims):
    """What ``torch.func.vmap`` returns is a new tensor (its batch dim moved for out_dims=1):
    it still varies, so returning it as P() is refused (it was untracked: "invariant")."""
    def body():
        mesh = vfsdp.mesh(("sp", 2))
        f = vfsdp.shard_map(lambda x: torch.func.vmap(lambda r: r.sin(), out_dims=out_dims)(x),
                            mesh, P("sp"), P())
        f(torch.ones(4, 3))

    with pytest.raises(RankError, match=r"output varies over 'sp' but its out_spec P\(\)"):
        simulate(2, body)
