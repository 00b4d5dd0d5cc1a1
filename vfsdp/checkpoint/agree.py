"""``agree`` / ``agreed`` (see :mod:`vfsdp.collectives.agree`) raising ``CheckpointError`` on
the ranks that did not fail themselves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from vfsdp.checkpoint.storage import CheckpointError
from vfsdp.collectives.agree import agree as _agree
from vfsdp.collectives.agree import agreed as _agreed

__all__ = ["agree", "agreed"]


def agree(error: Optional[BaseException], group=None) -> None:
    """Collective: raise ``error`` here, or a CheckpointError if another rank had one."""
    _agree(error, group, CheckpointError)


def agreed(fn: Callable[..., Any], *args: Any, group=None, **kwargs: Any) -> Any:
    """Collective: ``fn(*args, **kwargs)``; if it raises on any rank, every rank raises."""
    return _agreed(fn, *args, group=group, error_type=CheckpointError, **kwargs)
