"""Views of released memory raise instead of crashing.

Releasing a buffer lets go of its memory: the views handed out earlier (the full tensors
``vfsdp.gather`` returned, the gradient pieces ``vfsdp.grads`` returned) are pointed at a
zero-byte storage (:func:`let_go`), and reading them would crash the process. Instead, on
release every view a DBuffer handed out turns into a :class:`ReleasedTensor`: any torch
operation on it raises a ``RuntimeError`` that names the tensor, the unit and what to do. The
next gather (or backward) hands out new views of fresh memory; the released ones stay released.
Only released views pay anything: live ones are ordinary ``torch.Tensor`` s.

Metadata that does not read memory (shape, dtype, device, ``requires_grad``, ``repr``, where
the memory is: ``untyped_storage``, ``stride``, ``data_ptr``) stays available, so debuggers,
memory probes and error messages still work.

Tensors made *from* those views (``x.T``, ``x.view(...)``, slices, ``x.detach()``) are not
vfsdp's to change; they keep the memory they were made from, as torch views do, for as long as
they live, and read the values it held. They never point at freed memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vfsdp import _torch_private as tp

__all__ = ["ReleasedTensor", "let_go", "poison", "revive"]

_WHY = "_vfsdp_released"  # on a released view: the sentence explaining what happened

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__,
    torch.Tensor.grad_fn.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.ndim.__get__, torch.Tensor._base.__get__, torch.Tensor.grad.__get__,
    torch.Tensor.layout.__get__, torch.Tensor.is_cuda.__get__,
    # where the memory is (memory probes ask), without reading it
    torch.Tensor.untyped_storage, torch.Tensor.storage_offset, torch.Tensor.stride,
    torch.Tensor.element_size, torch.Tensor.is_contiguous, torch.Tensor.data_ptr,
    torch.Tensor.nbytes.__get__, torch.Tensor.itemsize.__get__,
}


class ReleasedTensor(torch.Tensor):
    """A view of memory vfsdp released: torch operations on it raise ``RuntimeError``.

    Example:
        >>> def body():
        ...     spec = vfsdp.plan({"w": torch.ones(8)}, 2)
        ...     shards = vfsdp.shard({"w": torch.ones(8)}, spec)
        ...     full = vfsdp.gather(shards, spec)
        ...     vfsdp.release(shards, spec)
        ...     try:
        ...         full["w"].sum()
        ...     except RuntimeError as exc:
        ...         return type(full["w"]).__name__, str(exc).split(";")[0]
        >>> vfsdp.testing.simulate(2, body)[0]
        ('ReleasedTensor', 'w (unit <root>) was released')
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.__repr__:
            t = args[0]
            return (f"ReleasedTensor(shape={tuple(t.shape)}, dtype={t.dtype}: "
                    f"{getattr(t, _WHY, 'released')})")
        why = next((getattr(a, _WHY) for a in _flat(args, kwargs) if isinstance(a, ReleasedTensor)
                    and hasattr(a, _WHY)), "this tensor's memory was released by vfsdp; it "
                   "cannot be read")
        raise RuntimeError(why)


def _flat(args, kwargs) -> Iterable[Any]:
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def poison(views: Iterable[torch.Tensor], why: str) -> None:
    """Turn live views into :class:`ReleasedTensor` s that raise ``why`` when used."""
    for v in views:
        if type(v) is torch.Tensor:
            v.__class__ = ReleasedTensor
        if type(v) is ReleasedTensor:
            setattr(v, _WHY, why)


def revive(views: Iterable[torch.Tensor]) -> None:
    """Turn released views back into plain tensors: their memory was kept (a graph still
    read it) and the unit is gathered again before it went."""
    for v in views:
        if type(v) is ReleasedTensor:
            v.__class__ = torch.Tensor


def let_go(view: torch.Tensor, dead: torch.Tensor) -> None:
    """Point ``view`` at ``dead`` (a zero-byte storage, the same shape), with no op: ``view``
    no longer holds its memory, which tensors made from it keep as long as they live."""
    tp.set_data(view, dead)
