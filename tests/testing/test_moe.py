"""Top-k routed MoE: expert parallelism (and EP x FSDP) equals one process."""

import optree
import pytest
import torch
import torch.distributed as dist

import vfsdp
from vfsdp.testing import moe, simulate

D, H, E, K, T = 8, 12, 4, 2, 6


def _tokens(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _ep_forward_backward(params):
    n, r = dist.get_world_size(), dist.get_rank()
    per = E // n
    x, ct = _tokens(r)
    router = params["router"].clone().requires_grad_(True)
    local = {k: v[r * per:(r + 1) * per].clone().requires_grad_(True)
             for k, v in params["experts"].items()}
    y = moe.moe_ep(router, local, x, K, "ep", E, mesh=vfsdp.mesh(("ep", n)))
    (y * ct).sum().backward()
    return y.detach(), router.grad, {k: v.grad for k, v in local.items()}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_expert_parallel_layer_equals_the_reference_forward_and_backward(n):
    params = moe.moe_params(D, H, E)
    full = optree.tree_map(lambda t: t.clone().requires_grad_(True), params)
    total = 0
    outs, routers = [], []
    for r in range(n):
        x, ct = _tokens(r)
        y = moe.moe_reference(full, x, K)
        outs.append(y.detach())
        (g,) = torch.autograd.grad((y * ct).sum(), full["router"], retain_graph=True)
        routers.append(g)
        total = total + (y * ct).sum()
    total.backward()
    per = E // n
    for r, (y, g_router, g_local) in enumerate(simulate(n, _ep_forward_backward, params)):
        assert torch.allclose(y, outs[r], atol=1e-5)
        assert torch.allclose(g_router, routers[r], atol=1e-5)  # this rank's tokens only
        for name, g in g_local.items():  # every rank's tokens routed to these experts
            want = full["experts"][name].grad[r * per:(r + 1) * per]
            assert torch.allclose(g, want, atol=1e-5), (r, name)


def _etp_forward_backward(params, counts):
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(counts[r], D, generator=torch.Generator().manual_seed(r)).requires_grad_(True)
    router = params["router"].clone().requires_grad_(True)
    local = _local(params["experts"], "etp", n, r)
    y = moe.moe_etp(router, local, x, K, "etp", mesh=vfsdp.mesh(("etp", n)))
    y.pow(2).sum().backward()
    zero = lambda t, like: torch.zeros_like(like) if t is None else t
    return y.detach(), zero(x.grad, x), zero(router.grad, router), {
        k: zero(v.grad, v) for k, v in local.items()}


@pytest.mark.parametrize("n, hidden, counts", [(1, 10, [5]), (2, 10, [4, 0]),
                                               (4, 10, [3, 1, 0, 6]), (3, 2, [2, 2, 2])])
def test_experts_cut_on_their_hidden_dim_equal_the_reference(n, hidden, counts):
    """The 3-D stacks cut on dim 2 (``w_gate``, ``w_up``) and 1 (``w_down``) over ``n``
    ranks, unevenly (10 hidden units over 4: 3, 3, 2, 2; 2 over 3: one rank holds none),
    ranks with no token: outputs and the gradients of the tokens, the router and every
    expert's slice equal one process's."""
    params = moe.moe_params(D, hidden, E)
    full = optree.tree_map(lambda t: t.clone().requires_grad_(True), params)
    xs = [torch.randn(c, D, generator=torch.Generator().manual_seed(r)).requires_grad_(True)
          for r, c in enumerate(counts)]
    ys = [moe.moe_reference(full, x, K) for x in xs]
    sum(y.pow(2).sum() for y in ys).backward()
    got = simulate(n, _etp_forward_backward, params, counts)
    assert torch.allclose(sum(g[2] for g in got), full["router"].grad, atol=1e-5)
    for r, (y, x_grad, _, local) in enumerate(got):
        assert torch.allclose(y, ys[r].detach(), atol=1e-5)
        assert torch.allclose(x_grad, torch.zeros_like(x_grad) if xs[r].grad is None
                              else xs[r].grad, atol=1e-5)  # no token: no gradient
        for name, grad in local.items():
            dim = moe.etp_rule(("experts", name)).dim
            assert torch.allclose(grad, full["experts"][name].grad.tensor_split(n, dim)[r],
                                  atol=1e-5), (r, name)


# ---------------------------------------------------------------- EP x FSDP, trained

LR, STEPS = 1e-2, 3


RULES = {"ep": moe.ep_rule, "etp": moe.etp_rule}


def _ep_setup(dp: int, ep: int, cut: str = "ep"):
    """The router FSDP over every rank (over "dp" and "ep" together: no copy per "ep"
    index); the stacked experts split over "ep" (``cut``: "ep", whole experts, or "etp",
    every expert's hidden units), each index's pieces FSDP over its "dp" ranks."""
    world = dist.get_world_size()
    mesh = vfsdp.mesh(("dp", dp), ("ep", ep))
    params = moe.moe_params(D, H, E)
    per = E // ep
    first = mesh.get_local_rank("ep") * per
    r_spec = vfsdp.plan({"router": params["router"]}, world)
    r_shards = vfsdp.shard({"router": params["router"]}, r_spec)
    e_spec = vfsdp.plan(params["experts"], mesh, tp=RULES[cut], tp_axis="ep")
    e_shards = vfsdp.shard(params["experts"], e_spec, mesh=mesh)
    return mesh, params, per, first, r_spec, r_shards, e_spec, e_shards


def _step_tokens(step: int, r: int, empty=None):
    """Rank ``r``'s tokens and targets at ``step``; none on the rank ``empty``."""
    x, y = _tokens(100 * step + r)
    return (x[:0], y[:0]) if r == empty else (x, y)


def _ep_fsdp_train(dp: int, ep: int, clip=None, empty=None, cut="ep"):
    r = dist.get_rank()
    world = dist.get_world_size()
    total = D * T * (world - (empty is not None))  # the elements of the global mean
    mesh, _, _, _, r_spec, r_shards, e_spec, e_shards = _ep_setup(dp, ep, cut)
    dp_mesh = mesh["dp"]
    opt = vfsdp.optim.adamw(lr=LR, weight_decay=0.0)
    r_state, e_state = opt.init(r_shards, r_spec), opt.init(e_shards, e_spec)
    norms = []
    for step in range(STEPS):
        vfsdp.zero_grads(r_shards, r_spec)
        vfsdp.zero_grads(e_shards, e_spec)
        x, y = _step_tokens(step, r, empty)
        router = vfsdp.gather(r_shards, r_spec, grad_reduce="sum")["router"]
        experts = vfsdp.gather(e_shards, e_spec, grad_reduce="sum")
        out = (moe.moe_ep(router, experts, x, K, "ep", E, mesh=mesh) if cut == "ep" else
               moe.moe_etp(router, experts, x, K, "ep", mesh=mesh))
        loss = (out - y).pow(2).sum() / total  # the sum over ranks is the global mean
        loss.backward()
        if clip is not None:  # one norm over both trees: router on every rank, experts on "dp"
            norms.append(float(vfsdp.optim.clip_grad_norm_of(
                [(vfsdp.grads(r_shards, r_spec), r_spec),
                 (vfsdp.grads(e_shards, e_spec), e_spec, dp_mesh)], clip)))
        opt.update(vfsdp.grads(r_shards, r_spec), r_state, r_shards, r_spec)
        opt.update(vfsdp.grads(e_shards, e_spec), e_state, e_shards, e_spec)
    full_router = vfsdp.gather(r_shards, r_spec)["router"].detach().clone()
    full_local = {k: v.detach().clone()
                  for k, v in vfsdp.gather(e_shards, e_spec).items()}
    return mesh.get_local_rank("ep"), full_router, full_local, norms


def test_the_dense_part_is_sharded_over_dp_and_ep_together():
    """Planned over every rank (``vfsdp.plan(dense, world)``, as the tests and ``train_gpt
    --ep`` do), the router's shards, gradients and optimizer state are split over "dp" and
    "ep" together: a quarter per rank at (2, 2). Inside the experts' ``tp=`` plan it would be
    ``Replicate()`` over "ep": a whole copy per "ep" index, half per rank."""
    params = moe.moe_params(D, H, E)
    n = params["router"].numel()
    alone = vfsdp.plan({"router": params["router"]}, 4).tree["router"]
    assert [hi - lo for lo, hi in map(alone.local_range, range(4))] == [n // 4] * 4
    for index in range(2):
        inside = vfsdp.plan(params, (("dp", 2), ("ep", 2)), tp=moe.ep_rule, tp_axis="ep",
                            tp_index=index).tree["router"]
        assert sum(hi - lo for lo, hi in map(inside.local_range, range(2))) == n


def _reference_train(world: int, clip=None, empty=None):
    params = optree.tree_map(lambda t: t.clone().requires_grad_(True), moe.moe_params(D, H, E))
    leaves = optree.tree_leaves(params)
    opt = torch.optim.AdamW(leaves, lr=LR, weight_decay=0.0, foreach=False)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = 0
        for r in range(world):
            x, y = _step_tokens(step, r, empty)
            total = D * T * (world - (empty is not None))
            loss = loss + (moe.moe_reference(params, x, K) - y).pow(2).sum() / total
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(leaves, clip)))
        opt.step()
    return params, norms


@pytest.mark.parametrize("dp, ep, clip, empty, cut", [
    (2, 2, None, None, "ep"), (1, 4, None, None, "ep"), (4, 1, None, None, "ep"),
    (2, 2, 0.05, None, "ep"), (1, 4, 0.05, None, "ep"), (2, 2, 0.05, 1, "ep"),
    (2, 2, None, None, "etp"), (1, 4, 0.05, None, "etp"), (2, 2, 0.05, 1, "etp")])
def test_ep_times_fsdp_trains_like_one_process(dp, ep, clip, empty, cut):
    """With clip: one norm over the router (FSDP over every rank) and the experts (FSDP over
    "dp", different pieces per "ep" index) equals torch's over the unsharded model. With
    ``empty``, that rank holds no token (it hung in the backward's all_to_all). ``cut="etp"``
    cuts the 3-D stacks on their hidden dim (``[E, D, H]`` on dim 2, ``[E, H, D]`` on dim 1)
    instead of dim 0."""
    want, want_norms = _reference_train(dp * ep, clip, empty)
    for index, router, local, norms in simulate(dp * ep, _ep_fsdp_train, dp, ep, clip, empty,
                                                cut, timeout=60):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        if clip is not None:
            assert all(n > clip for n in norms)  # it did clip
        assert torch.allclose(router, want["router"].detach(), atol=1e-5)
        for name, t in local.items():
            dim = RULES[cut](("experts", name)).dim
            piece = want["experts"][name].detach().tensor_split(ep, dim)[index]
            assert t.shape == piece.shape and torch.allclose(t, piece, atol=1e-5), name


def _ep_step_counts(dp: int, ep: int):
    from vfsdp.collectives import counts, reset_counts

    r, world = dist.get_rank(), dist.get_world_size()
    mesh, params, per, _, r_spec, r_shards, e_spec, e_shards = _ep_setup(dp, ep)
    x, y = _tokens(r)
    reset_counts()
    router = vfsdp.gather(r_shards, r_spec, grad_reduce="sum")["router"]
    experts = vfsdp.gather(e_shards, e_spec, grad_reduce="sum")
    out = moe.moe_ep(router, experts, x, K, "ep", E, mesh=mesh)
    ((out - y).pow(2).mean() / world).backward()
    got = dict(counts())
    # What this rank sent and received (token-choices), from the routing itself.
    sent = T * K
    all_ids = [moe.route(_tokens(q)[0], params["router"], K)[0] for q in range(world)]
    mine = mesh.get_local_rank("ep")
    peers = [q for q in range(world) if q // ep == r // ep]  # this rank's "ep" group
    received = sum(int(((all_ids[q] // per) == mine).sum()) for q in peers)
    (r_unit,) = r_spec.units.values()
    return got, sent, received, r_unit.shard_numel, [u.shard_numel for u in e_spec.units.values()]


@pytest.mark.parametrize("dp, ep", [(2, 2), (1, 4)])
def test_ep_communication_per_step_is_the_analytic_count(dp, ep):
    """Per rank and step: FSDP gathers and reduce-scatters the router over every rank and
    each expert's unit over "dp"; the MoE layer exchanges the counts (ep int64s), the tokens
    and their expert ids out (s rows sent), the results back (r rows), and in the backward
    the results' gradients out again (s rows; the tokens need none, so that exchange's
    backward does not run); each forward exchange first sends its chunks' shapes (ep x 8
    int64s); the backward's agreement is 24 bytes plus one per unit."""
    world = dp * ep
    for got, s, r, rs, es in simulate(world, _ep_step_counts, dp, ep):
        fsdp = (world * rs + dp * sum(es)) * 4  # the router's unit, each expert's unit
        assert got == {
            "all_gather": 1 + len(es), "all_gather_bytes": fsdp,
            "reduce_scatter": 1 + len(es), "reduce_scatter_bytes": fsdp,
            "all_to_all": 5,
            "all_to_all_bytes": ep * 8 + s * D * 4 + s * 8 + r * D * 4 + s * D * 4,
            "shape_exchange": 4, "shape_exchange_bytes": 4 * ep * 8 * 8,
            "backward_marks": 2, "backward_marks_bytes": 24 + 2 * 64}, got


# ---------------------------------------------------------------- skewed routing

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _local(experts: dict, cut: str, n: int, r: int) -> dict:
    """Rank ``r``'s pieces of the stacked experts under ``cut``'s rule, as leaves."""
    return {name: v.tensor_split(n, RULES[cut](("experts", name)).dim)[r].clone()
            .requires_grad_(True) for name, v in experts.items()}


def _skewed(params, tokens, k, cut="ep"):
    n, r = dist.get_world_size(), dist.get_rank()
    e = params["router"].shape[1]
    x = tokens[r].clone().requires_grad_(True)
    router = params["router"].clone().requires_grad_(True)
    local = _local(params["experts"], cut, n, r)
    mesh = vfsdp.mesh(("ep", n))
    y = (moe.moe_ep(router, local, x, k, "ep", e, mesh=mesh) if cut == "ep" else
         moe.moe_etp(router, local, x, k, "ep", mesh=mesh))
    y.pow(2).sum().backward()
    return y.detach(), x.grad, router.grad, {name: v.grad for name, v in local.items()}


@st.composite
def _routings(draw):
    """ep 1..4, 1-2 experts per rank, top-1 or top-2, 0-4 tokens per rank, a router that
    is random, sends every token to one expert, or favours one of two, and the stacks cut on
    dim 0 (whole experts per rank) or on their hidden dim (``etp``)."""
    n = draw(st.integers(1, 4))
    e = n * draw(st.integers(1, 2))
    k = draw(st.integers(1, min(2, e)))
    counts = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    kind = draw(st.sampled_from(["random", "one", "two"]))
    seed = draw(st.integers(0, 2 ** 16))
    cut = draw(st.sampled_from(["ep", "etp"]))
    return n, e, k, counts, kind, seed, cut


@settings(max_examples=25, deadline=None)
@given(_routings())
def test_any_routing_skew_gives_the_reference_outputs_and_gradients(case):
    """Every token to one expert, ranks with no token, experts no token reaches: the layer's
    outputs and the gradients of its input, router and experts equal the one-process
    reference's (every token to expert 0 hung in the backward's all_to_all: the rank whose
    experts got nothing skipped it)."""
    _, e, k, counts, kind, seed, cut = case
    g = torch.Generator().manual_seed(seed)
    params = moe.moe_params(D, H, e, seed=seed)
    if kind != "random":  # positive tokens, one (or two) dominant router columns
        params["router"] = torch.randn(D, e, generator=g) * 0.01
        params["router"][:, seed % e] += 5.0
        if kind == "two":
            params["router"][:, (seed + 1) % e] += 4.0
    tokens = [torch.rand(c, D, generator=g) + 0.1 for c in counts]
    _check_against_reference(params, tokens, k, cut)


def _check_against_reference(params, tokens, k, cut):
    """The layer on ``len(tokens)`` ranks (rank ``r`` holding ``tokens[r]``) against one
    process: outputs, and the gradients of the tokens, the router and every expert piece."""
    n = len(tokens)
    full = optree.tree_map(lambda t: t.clone().requires_grad_(True), params)
    xs = [x.clone().requires_grad_(True) for x in tokens]
    ys = [moe.moe_reference(full, x, k) for x in xs]
    leaves = [*xs, full["router"], *full["experts"].values()]
    loss = sum(y.pow(2).sum() for y in ys)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else (
        [None] * len(leaves))  # no token anywhere: every gradient is zero
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads)]
    x_grads, router_grad, expert_grads = grads[:n], grads[n], dict(zip(full["experts"],
                                                                       grads[n + 1:]))
    zero = lambda t, like: torch.zeros_like(like) if t is None else t
    got = simulate(n, _skewed, params, tokens, k, cut, timeout=60)
    assert torch.allclose(sum(zero(r[2], router_grad) for r in got), router_grad, atol=1e-5)
    for r, (y, x_grad, _, local) in enumerate(got):
        assert torch.allclose(y, ys[r].detach(), atol=1e-5)
        assert torch.allclose(zero(x_grad, xs[r]), x_grads[r], atol=1e-5)
        for name, grad in local.items():
            want = expert_grads[name].tensor_split(n, RULES[cut](("experts", name)).dim)[r]
            assert torch.allclose(zero(grad, want), want, atol=1e-5), (r, name)


@st.composite
def _assignments(draw):
    """Top-k assignments drawn directly, each token's k experts in order: any, or every
    token to the same k experts; 0-4 tokens per rank; ep 1..4; top-1..3; both cuts."""
    n = draw(st.integers(1, 4))
    e = n * draw(st.integers(1, 2))
    k = draw(st.integers(1, min(3, e)))
    counts = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    choice = st.permutations(range(e)).map(lambda p: tuple(p[:k]))
    if draw(st.booleans()):  # degenerate: one assignment for every token of every rank
        same = draw(choice)
        picks = [[same] * c for c in counts]
    else:
        picks = [draw(st.lists(choice, min_size=c, max_size=c)) for c in counts]
    return n, e, k, picks, draw(st.integers(0, 2 ** 16)), draw(st.sampled_from(["ep", "etp"]))


@settings(max_examples=25, deadline=None)
@given(_assignments())
def test_any_top_k_assignment_gives_the_reference_outputs_and_gradients(case):
    """The router made the identity and each token its logits, so the drawn assignment is
    the routing: every token to the same experts, experts no token reaches, ranks with no
    token, over ep 1..4 and both cuts of the stacks."""
    _, e, k, picks, seed, cut = case
    params = moe.moe_params(D, H, e, seed=seed)
    params["router"] = torch.eye(D, e)  # x @ router: the token's first e features
    g = torch.Generator().manual_seed(seed)
    tokens = []
    for rank_picks in picks:
        x = torch.rand(len(rank_picks), D, generator=g) * 0.1  # below every chosen logit
        for t, chosen in enumerate(rank_picks):
            for place, expert in enumerate(chosen):
                x[t, expert] = 3.0 - 0.5 * place  # distinct: the order of the choice
        assert moe.route(x, params["router"], k)[0].tolist() == [list(c) for c in rank_picks]
        tokens.append(x)
    _check_against_reference(params, tokens, k, cut)


@pytest.mark.parametrize("n, e, counts, hot", [
    (2, 2, [5, 5], 0),         # top-1, every token to expert 0
    (4, 4, [0, 3, 0, 3], 3),   # two ranks with no token, every other token to expert 3
])
def test_the_skews_that_hung_give_the_reference_outputs_and_gradients(n, e, counts, hot):
    """The routings of the adversarial sweep, top-1: the ranks whose experts got no token left
    the tokens they received out of their loss, so they skipped that all_to_all's backward
    and the others waited in it (now they keep them in the graph)."""
    g = torch.Generator().manual_seed(0)
    params = moe.moe_params(D, H, e)
    params["router"] = torch.randn(D, e, generator=g) * 0.01
    params["router"][:, hot] += 5.0
    tokens = [torch.rand(c, D, generator=g) + 0.1 for c in counts]
    full = optree.tree_map(lambda t: t.clone().requires_grad_(True), params)
    xs = [x.clone().requires_grad_(True) for x in tokens]
    ys = [moe.moe_reference(full, x, 1) for x in xs]
    sum(y.pow(2).sum() for y in ys).backward()
    per = e // n
    got = simulate(n, _skewed, params, tokens, 1, timeout=30)
    routers = [torch.zeros(D, e) if r[2] is None else r[2] for r in got]
    assert torch.allclose(sum(routers), full["router"].grad, atol=1e-5)
    for r, (y, x_grad, _, local) in enumerate(got):
        assert torch.allclose(y, ys[r].detach(), atol=1e-5)
        want_x = torch.zeros_like(xs[r]) if xs[r].grad is None else xs[r].grad
        assert torch.allclose(torch.zeros_like(want_x) if x_grad is None else x_grad, want_x)
        for name, grad in local.items():  # None: no token reached these experts
            want = full["experts"][name].grad[r * per:(r + 1) * per]
            assert torch.allclose(torch.zeros_like(want) if grad is None else grad, want,
                                  atol=1e-5), (r, name)
