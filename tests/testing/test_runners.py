import pytest
import torch.distributed as dist

from vfsdp.testing import RankError, simulate, spawn


def _rank_times(x):
    return dist.get_rank() * x


def _fails_on_one(bad):
    if dist.get_rank() == bad:
        raise ValueError(f"boom on {bad}")
    import torch
    t = torch.ones(1)
    dist.all_reduce(t)  # the others block here until the failure releases them
    return float(t)


def test_simulate_and_spawn_return_per_rank_results():
    assert simulate(4, _rank_times, 10) == [0, 10, 20, 30]
    assert simulate(1, _rank_times, 3) == [0]
    assert spawn(_rank_times, 2, 10) == [0, 10]


def test_decorator_form():
    @simulate(3)
    def body(k):
        return dist.get_world_size() * k

    assert body(2) == [6, 6, 6]


def test_failures_name_the_rank_and_keep_the_traceback():
    with pytest.raises(RankError) as info:
        simulate(3, _fails_on_one, 1)
    assert list(info.value.failures) == [1] and "boom on 1" in info.value.failures[1]
    # simulation still works afterwards
    assert simulate(2, _rank_times, 1) == [0, 1]
    with pytest.raises(RankError, match="boom on 0"):
        spawn(_fails_on_one, 2, 0, timeout=60)


def test_the_message_shows_the_rank_that_failed_by_itself():
    """Ranks whose collective broke because a peer died come after the root cause."""
    err = RankError({0: "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by "
                        "peer [127.0.0.1]:1234", 1: "ValueError: boom on 1"})
    assert str(err).startswith("rank(s) [0, 1] failed; rank 1:\nValueError: boom on 1")
    assert err.root_cause() == 1
    both = RankError({0: "Connection reset by peer", 2: "Broken pipe"})
    assert both.root_cause() == 0  # nothing better to show: the first
    with pytest.raises(RankError, match=r"failed; rank 1:\n(.|\n)*boom on 1"):
        spawn(_fails_on_one, 2, 1, timeout=60)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        simulate(0, _rank_times, 1)
    with pytest.raises(ValueError, match="world_size"):
        spawn(_rank_times, 0, 1)


def _rank1_skips_the_all_reduce():
    import torch

    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))


def test_a_hang_names_the_collective_and_the_user_code_that_called_it():
    """Every torch call of a rank thread passes through simulate's per-rank RNG mode; the
    report named that frame (rank_rng.py) instead of the caller."""
    with pytest.raises(RankError) as info:
        simulate(2, _rank1_skips_the_all_reduce, timeout=1.0)
    why = info.value.failures[0]
    assert "waiting in the collective all_reduce" in why
    assert "called from _rank1_skips_the_all_reduce (" in why and "rank_rng" not in why
