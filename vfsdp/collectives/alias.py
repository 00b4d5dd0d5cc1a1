"""Storage aliases: new leaf tensors over a buffer's memory, made with one op.

DBuffer hands out views of its shard and global buffer that are *not* autograd views of them:
each has its own version counter (a collective writing the buffer does not invalidate what
autograd saved) and survives the buffer's storage being resized to zero and back.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["alias", "contiguous_strides", "view_of"]


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple) -> tuple:
    """Row-major strides of ``shape`` (computed, no tensor made).

    Example:
        >>> contiguous_strides((2, 3, 4)), contiguous_strides(())
        ((12, 4, 1), ())
    """
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def alias(storage_tensor: torch.Tensor, offset: int, shape: tuple,
          stride: Optional[tuple] = None) -> torch.Tensor:
    """A leaf tensor sharing ``storage_tensor``'s storage at ``offset`` (elements, from its
    own offset): not an autograd view of it, with its own version counter. One op
    (``as_strided_`` on a ``.data`` alias).

    Example:
        >>> x = torch.arange(6.0)
        >>> a = alias(x, 2, (2, 2))
        >>> a.tolist(), a._base is None, a.untyped_storage().data_ptr() == x.data_ptr()
        ([[2.0, 3.0], [4.0, 5.0]], True, True)
    """
    out = storage_tensor.data
    out.as_strided_(shape, contiguous_strides(shape) if stride is None else stride,
                    storage_tensor.storage_offset() + offset)
    return out


def view_of(base: torch.Tensor, offset: int, shape: tuple,
            stride: Optional[tuple] = None) -> torch.Tensor:
    """An autograd view of ``base`` at ``offset`` (elements, from its own offset): one op
    (``as_strided``), sharing ``base``'s version counter and keeping ``base`` alive. For
    vfsdp's own views of a buffer that no autograd check reads the version of and that it
    drops at release (the saved parameters ``run_layers`` hands its backward, a compute
    copy's shard); :func:`alias` for views handed out.

    Example:
        >>> x = torch.arange(6.0)
        >>> v = view_of(x, 2, (2, 2))
        >>> v.tolist(), v._base is x
        ([[2.0, 3.0], [4.0, 5.0]], True)
    """
    return base.as_strided(shape, contiguous_strides(shape) if stride is None else stride,
                           base.storage_offset() + offset)
