"""Issue 25's collective misuses on gloo processes as on threads: the same clear error on
every rank, never one rank's result beside another's transport error, and never a hang."""

from tests.misuse import bodies as b
from vfsdp.testing import simulate, spawn


def test_collective_misuse_is_the_same_error_on_every_rank_on_gloo_and_threads():
    """psum over 2 and 3 elements gave, on gloo, one rank the sum and the other "Connection
    closed by peer"; threads hung."""
    threads = simulate(2, b.parallelism_errors, timeout=60)
    gloo = spawn(b.parallelism_errors, 2, timeout=120)
    assert gloo == threads
    for got in gloo:
        assert got["psum"].startswith("psum over 'x': the ranks' shapes [(2,), (3,)] differ")
        assert got["pmean"].startswith("pmean over 'x': the ranks' shapes [(2, 1), (2, 2)]")
        assert got["pvary"].startswith("pvary's backward (psum) over 'x': the ranks' shapes")
        assert got["muon"].startswith("muon: b is given to Muon") and "adamw" in got["muon"]
        assert got["scatter"] is True
        assert got["after"] == [2.0, 2.0, 2.0]
