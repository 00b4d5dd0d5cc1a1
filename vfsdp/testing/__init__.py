"""Running and checking SPMD code: ``spawn`` (processes), ``simulate`` (threads), op counters."""

from vfsdp.testing.counters import CopyCounter
from vfsdp.testing.memory import GatheredProbe, LiveBytes
from vfsdp.testing.runners import RankError, simulate, spawn

__all__ = ["CopyCounter", "GatheredProbe", "LiveBytes", "RankError", "simulate", "spawn"]
