"""The decoder of :mod:`vfsdp.testing.models` as ``nn.Module`` s (one per block), for the
``fully_shard`` comparisons of ``vs_fsdp2.py`` and ``gpu_vs_fsdp2.py``."""

from __future__ import annotations

import optree
import torch

from vfsdp.testing.models import GPTConfig, block, embed, head_loss


class Block(torch.nn.Module):
    """One subtree of the parameters (a block, or ``io``) as a module: its leaves are the
    parameters, named by their path (``experts__0__w_up``)."""

    def __init__(self, tree: dict, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        paths, leaves, self.treespec = optree.tree_flatten_with_path(tree)
        self.names = ["__".join(map(str, path)) for path in paths]
        for name, value in zip(self.names, leaves):
            self.register_parameter(name, torch.nn.Parameter(value.clone()))

    def tree(self) -> dict:
        return optree.tree_unflatten(self.treespec, [getattr(self, n) for n in self.names])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block(self.tree(), x, self.cfg)


class GPTModule(torch.nn.Module):
    """The same model as modules (one per block), for ``fully_shard`` comparisons."""

    def __init__(self, params: dict, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.io = Block(params["io"], cfg)
        self.blocks = torch.nn.ModuleList(Block(p, cfg) for p in params["layers"])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        io = self.io.tree()
        x = embed(io, tokens)
        for blk in self.blocks:
            x = blk(x)
        return head_loss(io, x, targets)
