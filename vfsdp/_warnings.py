"""Warnings that point at the user's line, not at vfsdp's internals."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_user", "warn_mesh_ignored"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside the vfsdp package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def warn_mesh_ignored(what: str) -> None:
    """The one deprecation of ``mesh=`` where the shards carry their mesh (0.3, gone in 0.4)."""
    warn_user(f"{what}: mesh= is ignored for the shards (and gradients) of vfsdp.shard, which "
              f"carry the mesh they were made on; drop it (deprecated in vfsdp 0.3, it goes in "
              f"0.4; it stays for plain-tensor shards)", FutureWarning)
