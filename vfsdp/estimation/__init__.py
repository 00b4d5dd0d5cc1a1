"""Scale on paper: memory and step time from the plan, before anything is launched.

``vfsdp.estimate(spec, hw="h800", optimizer="adamw", tokens_per_rank=8192)`` predicts one rank
of one step: memory per rank (exact for vfsdp's own buffers and the optimizer's state),
step time split into compute, exposed communication and the optimizer, tokens/s and MFU.
See ``docs/estimate.md``.
"""

from vfsdp.estimation.costs import LayerCost, layer_cost, shape_costs
from vfsdp.estimation.hardware import PROFILES, Hardware, hardware
from vfsdp.estimation.model import Estimate, estimate
from vfsdp.estimation.sweep import sweep

__all__ = ["estimate", "sweep", "Estimate", "Hardware", "hardware", "PROFILES", "LayerCost",
           "layer_cost", "shape_costs"]
