"""The model of :mod:`vfsdp.testing.models` as a plain ``nn.Module`` (the tests load
``vfsdp.checkpoint.to_state_dict``'s output into it)."""

from __future__ import annotations

import optree
import torch

from vfsdp.testing.models import GPTConfig, loss_fn, meta_params


class TorchGPT(torch.nn.Module):
    """The model as a plain ``nn.Module`` whose ``state_dict`` keys are the parameter tree's
    dotted paths (``io.embed``, ``layers.0.wq``, ...): what ``vfsdp.checkpoint.to_state_dict``
    exports loads into it with ``load_state_dict``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        tree = meta_params(cfg)
        self.io = _holder(tree["io"])
        self.layers = torch.nn.ModuleList(_holder(p) for p in tree["layers"])
        paths, _, self.treespec = optree.tree_flatten_with_path(tree)
        self.names = [".".join(map(str, path)) for path in paths]

    def tree(self) -> dict:
        return optree.tree_unflatten(self.treespec, [self.get_parameter(n) for n in self.names])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.tree(), tokens, targets, self.cfg)


def _holder(node: dict) -> torch.nn.Module:
    mod = torch.nn.Module()
    for k, v in node.items():
        if isinstance(v, list):
            mod.add_module(k, torch.nn.ModuleList(_holder(x) for x in v))
        elif isinstance(v, dict):  # stacked experts
            mod.add_module(k, _holder(v))
        else:
            mod.register_parameter(k, torch.nn.Parameter(torch.zeros(v.shape)))  # cpu: holder
    return mod
