"""global_norm_of / clip_grad_norm_of: one norm over trees on different meshes."""

import pytest
import torch

import vfsdp
from vfsdp.testing import simulate


def _norms():
    m = vfsdp.mesh(("dp", 2), ("tp", 2))
    dp = m["dp"]
    # A tree FSDP-sharded over "dp" whose gradients are the same on both "tp" ranks.
    params = {"w": torch.ones(6)}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec, mesh=dp)
    vfsdp.grads(shards, spec)["w"].fill_(2.0)  # norm^2 = 6 * 4 = 24
    grads = vfsdp.grads(shards, spec)
    once = float(vfsdp.optim.global_norm_of(
        [vfsdp.optim.GradTree(grads, spec, dp, replicated=m.get_group("tp"))]))
    twice = float(vfsdp.optim.global_norm_of([(grads, spec, dp)]))
    before = float(vfsdp.optim.clip_grad_norm_of(
        [vfsdp.optim.GradTree(grads, spec, dp, m.get_group("tp"))], 1.0))
    after = float(vfsdp.optim.global_norm_of(
        [vfsdp.optim.GradTree(grads, spec, dp, m.get_group("tp"))]))
    return once, twice, before, after


def test_a_replicated_tree_counts_once():
    for once, twice, before, after in simulate(4, _norms):
        assert once == pytest.approx(24 ** 0.5) and twice == pytest.approx(48 ** 0.5)
        assert before == pytest.approx(24 ** 0.5) and after == pytest.approx(1.0, rel=1e-5)


def test_errors():
    def body():
        with pytest.raises(ValueError, match="at least one GradTree"):
            vfsdp.optim.global_norm_of([])
        with pytest.raises(ValueError, match="max_norm must be a finite number"):
            vfsdp.optim.clip_grad_norm_of([], float("nan"))
        return True

    assert simulate(1, body) == [True]


def test_grad_tree_is_the_planned_record_and_its_tuple_form_is_deprecated():
    from vfsdp.functional.pieces import Planned

    spec = vfsdp.plan({"w": torch.ones(4)}, 1)
    grads, group = {"w": torch.ones(4)}, object()
    tree = vfsdp.optim.GradTree(grads, spec, None, group)
    assert isinstance(tree, Planned) and tree.grads is grads is tree.tree
    assert (tree.spec, tree.mesh, tree.replicated, tree.name) == (spec, None, group, None)
    assert tree == vfsdp.optim.GradTree(grads=grads, spec=spec, replicated=group)
    with pytest.warns(DeprecationWarning, match="no longer a tuple") as caught:
        g, s, m, r = tree
        last = tree[3]
    assert (g, s, m, r) == (grads, spec, None, group) and last is group
    assert all(w.filename == __file__ for w in caught)
