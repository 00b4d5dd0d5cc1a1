"""Running and checking SPMD code: ``simulate`` (threads), ``spawn`` (processes), probes, and the
reference semantics every primitive is tested against.

* runners: :func:`simulate`, :func:`spawn`, :class:`RankError`;
* probes: :class:`CopyCounter` (copies and ops at the dispatcher), :class:`GatheredProbe`
  (units gathered at once), :class:`LiveBytes` (peak live storage);
* references (loops over ranks, no process group): placements (``split_reference``,
  ``assemble_reference``), pytrees (``shard_reference``,
  ``gather_reference``, ``unit_buffer_reference``) and the reduce-scatter
  (``reduce_scatter_reference``);
* ``vfsdp.testing.strategies``: hypothesis strategies (needs ``hypothesis``; import it
  explicitly).
"""

from vfsdp.collectives.reference import reduce_scatter_reference
from vfsdp.functional.reference import (
    gather_reference,
    shard_reference,
    unit_buffer_reference,
)
from vfsdp.placements.reference import assemble_reference, split_reference
from vfsdp.testing.counters import CopyCounter
from vfsdp.testing.memory import GatheredProbe, LiveBytes
from vfsdp.testing.runners import RankError
from vfsdp.testing.simulate import simulate
from vfsdp.testing.spawn import spawn

__all__ = [
    "CopyCounter",
    "GatheredProbe",
    "LiveBytes",
    "RankError",
    "assemble_reference",
    "gather_reference",
    "reduce_scatter_reference",
    "shard_reference",
    "simulate",
    "spawn",
    "split_reference",
    "unit_buffer_reference",
]
