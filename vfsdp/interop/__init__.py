"""Adapters between vfsdp's pytrees and the rest of PyTorch: ``functionalize`` for ``nn.Module``
(HF models included), DTensor conversion, ``init`` on meta trees and ``visualize``.

Imports ``functional`` and ``spmd`` and below, never ``optim``, ``checkpoint`` or ``testing``.
"""

from vfsdp.interop import init
from vfsdp.interop.dtensor import dtensor_placement, from_dtensor, to_dtensor
from vfsdp.interop.module import ModuleApply, functionalize
from vfsdp.interop.visualize import visualize

__all__ = ["ModuleApply", "dtensor_placement", "from_dtensor", "functionalize", "init", "to_dtensor",
           "visualize"]
