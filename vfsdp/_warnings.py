"""Warnings that point at the user's line, not at vfsdp's internals."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside the vfsdp package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def refuse_mesh(what: str) -> None:
    """``mesh=`` with the shards of ``vfsdp.shard``, which carry their mesh: refused.

    Raises:
        ValueError: always, with the fix.
    """
    raise ValueError(f"{what}: mesh= is not taken with the shards (and gradients) of "
                     f"vfsdp.shard, which carry the mesh they were made on (removed in vfsdp "
                     f"0.4); drop it. It stays for plain-tensor shards")
