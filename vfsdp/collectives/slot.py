"""What a tensor handed out by vfsdp carries: its :class:`Slot` (buffer, index, view, unit).

Every view a :class:`~vfsdp.collectives.DBuffer` hands out (a shard, a gathered full tensor, a
gradient piece) carries a ``Slot`` attribute naming the buffer, the tensor's index in the unit,
the kind of view, and the :class:`~vfsdp.collectives.Unit`. Code that receives the tensor finds
its buffers from it (:func:`slot_of`): no registry, no lookup by address. :class:`Role` says
what a buffer holds.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Role", "View", "Slot", "slot_of", "SLOT"]

SLOT = "_vfsdp_slot"  # the attribute name on views


class Role(enum.Enum):
    """What a DBuffer holds.

    Example:
        >>> Role.PARAM.holds_params, Role.GRAD.holds_params
        (True, False)
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     return slot_of(shards["w"]).buffer.role, slot_of(vfsdp.grads(shards, spec)["w"]).buffer.role
        >>> vfsdp.testing.simulate(2, body)[0]
        (<Role.PARAM: 'param'>, <Role.GRAD: 'grad'>)
    """

    PARAM = "param"      #: the parameters' master shard; gathered: the full parameters
    COMPUTE = "compute"  #: a low-precision copy of the parameters, gathered for compute
    GRAD = "grad"        #: the sharded gradients (persistent between backward and update)
    ACCUM = "accum"      #: unsharded gradients accumulated without reducing (grad_sync=False)
    STAGE = "stage"      #: the reduce-scatter input, in the reduction dtype
    STATE = "state"      #: optimizer state with the parameters' layout

    @property
    def holds_params(self) -> bool:
        """``PARAM`` and ``COMPUTE``: gathering one of them gathers parameters."""
        return self in (Role.PARAM, Role.COMPUTE)


class View(enum.Enum):
    """Which memory a view aliases.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     shard, full = slot_of(shards["w"]), slot_of(vfsdp.gather(shards, spec)["w"])
        ...     return shard.view, full.view
        >>> vfsdp.testing.simulate(2, body)[0]
        (<View.LOCAL: 'local'>, <View.FULL: 'full'>)
    """

    LOCAL = "local"  #: the rank's shard
    FULL = "full"    #: the gathered global buffer


@dataclass(frozen=True, eq=False)
class Slot:
    """Where a tensor handed out by a DBuffer lives. Read it with :func:`slot_of`.

    Attributes:
        buffer: The DBuffer.
        index: The tensor's position in the unit's buffer order.
        view: :attr:`View.LOCAL` or :attr:`View.FULL`.
        unit: The :class:`~vfsdp.collectives.Unit` the buffer belongs to, if any.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     shard, full = slot_of(shards["w"]), slot_of(vfsdp.gather(shards, spec)["w"])
        ...     return shard.index, shard.buffer is full.buffer, shard.unit is full.unit
        >>> vfsdp.testing.simulate(2, body)[0]         # one buffer: its shard and its gathered view
        (0, True, True)
    """

    buffer: Any  # the DBuffer
    index: int
    view: View
    owner: Any = None  # the Unit, or a weak reference to it (views the unit itself keeps)

    @property
    def unit(self) -> Any:
        """The :class:`~vfsdp.collectives.Unit` (``None`` if none, or if it is gone)."""
        owner = self.owner
        return owner() if isinstance(owner, weakref.ref) else owner

    def __reduce__(self):
        # A pickled tensor (torch.save, spawn results) is plain data: it carries no buffer.
        return (_no_slot, ())


def _no_slot() -> None:
    return None


def slot_of(t: Any) -> Optional[Slot]:
    """The :class:`Slot` of a tensor a DBuffer handed out, or ``None`` for any other value.

    Args:
        t: Any value: a shard, a gathered view, a gradient piece, a plain tensor, ...

    Returns:
        The tensor's :class:`Slot`; ``None`` for a plain tensor or a non-tensor.

    Raises:
        TypeError: never: any value is accepted (a non-tensor has no slot).

    Example:
        >>> slot_of(torch.zeros(2)) is None, slot_of("w") is None
        (True, True)
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     return slot_of(vfsdp.shard({"w": torch.ones(8)}, spec)["w"]).view
        >>> vfsdp.testing.simulate(2, body)
        [<View.LOCAL: 'local'>, <View.LOCAL: 'local'>]
    """
    return getattr(t, SLOT, None) if isinstance(t, torch.Tensor) else None
