"""Running and checking SPMD code: ``spawn`` (processes), ``simulate`` (threads), op counters."""

from vfsdp.testing.runners import RankError, simulate, spawn

__all__ = ["RankError", "simulate", "spawn"]
