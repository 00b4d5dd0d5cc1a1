"""A module as a parameter tree and a function: ``params, apply = vfsdp.functionalize(module)``.

vfsdp plans, shards and gathers pytrees of tensors; an ``nn.Module`` (a Hugging Face model, a
torchvision network) holds its tensors as attributes. :func:`functionalize` reads them out into
a tree that follows the module's own naming and returns the function that calls the module with
any tree of that shape: no wrapping, no copies.

* The tree nests by the dotted names (``model.layers.0.mlp.up_proj.weight`` is
  ``params["model"]["layers"][0]["mlp"]["up_proj"]["weight"]``). A module list becomes a list,
  so the planner's default units make each of its blocks a unit.
* A tie (one ``Parameter`` registered under several names, such as GPT-2's ``lm_head.weight``
  and ``transformer.wte.weight``) is one leaf under the name registered first; the others are
  in ``apply.ties`` and the call ties them again (``functional_call``'s ``tie_weights``). An
  export therefore writes it once, under the name Hugging Face keeps.
* Buffers stay apart, in ``apply.buffers`` (a plain dict the call passes along).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

import optree
import torch
from torch.func import functional_call

from vfsdp.functional.gather import gather
from vfsdp.functional.options import Policy
from vfsdp.functional.schedule import run_layers
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec, TensorSpec

__all__ = ["functionalize", "ModuleApply"]

_SEQUENCES = (torch.nn.ModuleList, torch.nn.Sequential)


def functionalize(module: torch.nn.Module) -> tuple[dict, ModuleApply]:
    """``(params, apply)``: the module's parameters as a tree, and ``apply(params, *args,
    **kwargs)``, the module's forward with those tensors.

    The tree's leaves are the module's own ``Parameter`` s (nothing is copied), so a module
    built on the ``meta`` device plans with no memory (``vfsdp.plan(params, ...)``) and
    ``vfsdp.shard(params, spec, init_fn=...)`` or
    :func:`vfsdp.checkpoint.load_safetensors` fills the shards.

    Args:
        module: Any ``nn.Module``.

    Returns:
        ``params``: nested dicts by dotted name, module lists as lists, one leaf per tensor
        (a tie under its first registered name). ``apply``: a :class:`ModuleApply`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example:
        >>> import torch, vfsdp
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        >>> params, apply = vfsdp.functionalize(net)
        >>> {k: sorted(v) for k, v in params.items()}
        {'0': ['bias', 'weight'], '2': ['bias', 'weight']}
        >>> x = torch.ones(4, 2)
        >>> torch.equal(apply(params, x), net(x))
        True
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"vfsdp.functionalize takes an nn.Module, got {type(module).__name__}")
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    tree: dict = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties[name] = first[id(p)]
            continue
        first[id(p)] = name
        node = tree
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = p
    params = _lists(module, tree, "")
    return params, ModuleApply(module, params, ties)


def _lists(module: torch.nn.Module, tree: dict, prefix: str) -> Any:
    """``tree`` with the nodes of module lists whose every block holds parameters as lists."""
    for key, sub in list(tree.items()):
        if isinstance(sub, dict):
            tree[key] = _lists(module, sub, f"{prefix}{key}.")
    owner = module.get_submodule(prefix[:-1]) if prefix else module
    if isinstance(owner, _SEQUENCES) and set(tree) == {str(i) for i in range(len(tree))}:
        return [tree[str(i)] for i in range(len(tree))]
    return tree


def _names(paths: list) -> list[str]:
    return [format_path(tuple(p)) for p in paths]


class ModuleApply:
    """The module's forward as a function of a parameter tree (from :func:`functionalize`).

    Attributes:
        module: The module (its own tensors are never used by a call).
        ties: ``{tied name: the name its tensor is under in the tree}``.
        buffers: ``{dotted name: buffer}``, passed to every call; assign to replace one (e.g.
            a buffer that a ``meta`` module holds no values for).
        blocks: The key path of the module list of blocks (the one holding the most
            parameters, e.g. ``("model", "layers")``), or ``None``: what :meth:`run_layers`
            runs unit by unit.

    A call swaps the module's attributes while it runs, so one ``ModuleApply`` serves one
    thread: ranks that are threads (``vfsdp.testing.simulate``) each functionalize a module of
    their own.

    Example:
        >>> import torch, vfsdp
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = torch.nn.ModuleList(
        ...             torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(2))
        ...     def forward(self, x):
        ...         for layer in self.layers:
        ...             x = layer(x)
        ...         return x
        >>> def body():
        ...     torch.manual_seed(0)
        ...     net = Net()                          # each rank (a thread here) its own module
        ...     params, apply = vfsdp.functionalize(net)
        ...     spec = vfsdp.plan(params, 2)         # each block a unit
        ...     shards = vfsdp.shard(params, spec)
        ...     x = torch.ones(1, 4)
        ...     return torch.equal(apply.run_layers(shards, spec, x), net(x)), apply.blocks
        >>> vfsdp.testing.simulate(2, body)
        [(True, ('layers',)), (True, ('layers',))]
    """

    def __init__(self, module: torch.nn.Module, params: dict, ties: dict) -> None:
        self.module = module
        self.ties = ties
        self.buffers = dict(module.named_buffers())
        persistent = module.state_dict(keep_vars=True)  # references only: nothing is copied
        self._persistent = [n for n in self.buffers if n in persistent]
        paths, _, self._treespec = optree.tree_flatten_with_path(params)
        self._names = _names(paths)
        self.blocks = _blocks(params)
        self._thread: Optional[int] = None
        self._rest: dict = {}  # treespec -> dotted names, for trees without the blocks

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        """The module's forward with ``params`` (a tree shaped as :func:`functionalize`'s,
        e.g. ``vfsdp.gather``'s full tensors) and the buffers.

        Raises:
            ValueError: ``params`` is not shaped as the module's tree, or a buffer is on the
                ``meta`` device.
            RuntimeError: a second thread calls this ``apply``.
        """
        leaves, treespec = optree.tree_flatten(params)
        if treespec != self._treespec:
            raise ValueError(f"apply: the parameter tree is not shaped as the module's "
                             f"({treespec.num_leaves} leaves, the module's tree has "
                             f"{self._treespec.num_leaves}); pass the tree functionalize returned "
                             f"or one made from it (vfsdp.shard, vfsdp.gather)")
        return self._call(dict(zip(self._names, leaves)), args, kwargs)

    def state_tree(self, shards: Any) -> Any:
        """``shards`` with the module's persistent buffers (BatchNorm's running statistics)
        added at their dotted names: the tree whose export has the keys ``state_dict()`` has.

        :func:`vfsdp.checkpoint.save_safetensors` and ``to_state_dict`` write each buffer
        from ``dst``'s copy (a buffer is whole on every rank); ``load_safetensors`` and
        ``from_state_dict`` fill ``apply.buffers`` in place on every rank.

        Args:
            shards: This rank's shards (or any tree shaped as :func:`functionalize`'s).

        Returns:
            A new tree (the same tensors; new containers) with the buffers added.

        Raises:
            ValueError: a buffer's name is already a leaf of ``shards``.

        Example:
            >>> import torch, vfsdp
            >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
            >>> params, apply = vfsdp.functionalize(net)
            >>> sorted(apply.state_tree(params)[1])   # a Sequential of modules with tensors: a list
            ['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight']
        """
        def copy(node):
            if isinstance(node, dict):
                return {k: copy(v) for k, v in node.items()}
            return [copy(v) for v in node] if isinstance(node, list) else node

        tree = copy(shards)
        for name in self._persistent:
            node = tree
            *parents, leaf = name.split(".")
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
            if leaf in node:
                raise ValueError(f"apply.state_tree: buffer {name} is already a leaf of the tree")
            node[leaf] = self.buffers[name]
        return tree

    def _call(self, tensors: dict, args: tuple, kwargs: dict, module=None, buffers=None) -> Any:
        self._claim()
        buffers = self.buffers if buffers is None else buffers
        meta = next((n for n, b in buffers.items() if b.device.type == "meta"), None)
        if meta is not None:
            raise ValueError(f"apply: buffer {meta} is on the meta device (the module was built "
                             f"there); give it values: apply.buffers[{meta!r}] = tensor")
        return functional_call(self.module if module is None else module,
                               {**tensors, **buffers}, args, kwargs, tie_weights=True,
                               strict=False)

    def _claim(self) -> None:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif self._thread != me:
            raise RuntimeError(
                "apply: called from a second thread. A call swaps the module's tensors in and "
                "out of its attributes, so two threads sharing one module would read each "
                "other's; under vfsdp.testing.simulate (ranks are threads) build the module and "
                "functionalize it inside the rank's function")

    def run_layers(self, shards: Any, spec: ShardSpec, *args: Any,
                   policy: Optional[Policy] = None, **kwargs: Any) -> Any:
        """The module's forward from this rank's shards, its blocks run by
        :func:`vfsdp.run_layers`: each block's unit is gathered (the next one prefetched),
        released after its forward and gathered again in backward.

        The units outside the blocks are gathered first, with ``grads="buffer"`` and
        ``free_after_backward=True`` (where ``policy`` leaves them unset), as the blocks are.
        The module's forward runs with the module list of blocks replaced by stand-ins: the
        first runs every block, the others pass the result on (so the forward must call the
        blocks one after the other, each on the previous one's output, as decoders do).

        Args:
            shards: This rank's shards (``vfsdp.shard`` of the tree).
            spec: Their spec, planned with each block a unit (the default units).
            *args: The module's positional inputs.
            policy: A :class:`vfsdp.Policy` for every gather (``grad_sync``, ``param_dtype``,
                ...).
            **kwargs: The module's keyword inputs.

        Returns:
            What the module's forward returns.

        Raises:
            ValueError: the tree has no module list of blocks, a unit holds tensors of a block
                and tensors outside it, or a tie joins a block to another tensor.
            RuntimeError: a second thread calls this ``apply``, or the forward does not call
                the blocks back to back, in order.
        """
        self._claim()  # before any collective: the other ranks then stop instead of waiting
        if self.blocks is None:
            raise ValueError("apply.run_layers: the module has no module list of blocks; "
                             "call apply(vfsdp.gather(shards, spec), ...) instead")
        path = self.blocks
        for name, target in self.ties.items():
            prefix = format_path(path) + "."
            if name.startswith(prefix) != target.startswith(prefix):
                raise ValueError(f"apply.run_layers: {name} is tied to {target}, across the "
                                 f"blocks' boundary; call apply(vfsdp.gather(shards, spec), ...)")
        block_shards = _at(shards, path)
        block_spec = spec
        for k in path:
            block_spec = block_spec[k]
        rest_spec = _without(spec, path, block_spec)
        rest = gather(_pruned(shards, path), rest_spec, policy, **_defaults(policy))
        leaves, treespec = optree.tree_flatten(rest)
        names = self._rest.get(treespec)
        if names is None:
            paths = optree.tree_paths(_pruned(optree.tree_unflatten(
                self._treespec, [0] * self._treespec.num_leaves), path))
            names = self._rest[treespec] = _names(paths)
        parent = self.module.get_submodule(format_path(path[:-1]) if len(path) > 1 else "")
        original = parent._modules[path[-1]]
        runner = _Runner(self, original, block_shards, block_spec, policy)
        stand_ins = torch.nn.ModuleList(_StandIn(runner, i) for i in range(len(original)))
        parent._modules[path[-1]] = stand_ins
        try:
            return self._call(dict(zip(names, leaves)), args, kwargs,
                              buffers={n: b for n, b in self.buffers.items()
                                       if not n.startswith(format_path(path) + ".")})
        finally:
            parent._modules[path[-1]] = original


def _defaults(policy: Optional[Policy]) -> dict:
    wanted = {"grads": "buffer", "free_after_backward": True}
    return {k: v for k, v in wanted.items() if policy is None or getattr(policy, k) is None}


def _blocks(params: dict) -> Optional[tuple]:
    """The key path of the outermost list of blocks holding the most elements."""
    found: list = []

    def walk(node, path):
        if isinstance(node, list):
            size = sum(t.numel() for t in optree.tree_leaves(node))
            found.append((size, path))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))

    walk(params, ())
    return max(found, key=lambda f: f[0])[1] if found else None


def _at(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _pruned(tree: Any, path: tuple) -> Any:
    """``tree`` with the subtree at ``path`` replaced by ``None`` (copies along the path)."""
    if not path:
        return None
    out = dict(tree) if isinstance(tree, dict) else list(tree)
    out[path[0]] = _pruned(tree[path[0]], path[1:])
    return out


def _without(spec: ShardSpec, path: tuple, block_spec: ShardSpec) -> ShardSpec:
    """The spec of the tree without the blocks.

    Raises:
        ValueError: a unit holds tensors of the blocks and tensors outside them.
    """
    sub = _pruned(spec.tree, path)
    leaves, treespec = optree.tree_flatten(sub)
    keys = {x.unit for x in leaves if isinstance(x, TensorSpec)}
    shared = keys & set(block_spec.units)
    if shared:
        raise ValueError(f"apply.run_layers: unit {sorted(map(str, shared))[0]} holds tensors "
                         f"of the blocks at {format_path(path)} and tensors outside them; plan "
                         f"with each block a unit of its own (the default units=)")
    units = {k: v for k, v in spec.units.items() if k in keys}
    return ShardSpec(treespec, leaves, units, spec.mesh_shape, spec.mesh_dim_names,
                     {x.path for x in leaves if isinstance(x, TensorSpec)} & spec.frozen)


class _Runner:
    """Runs every block through :func:`vfsdp.run_layers` when the first stand-in is called."""

    def __init__(self, apply: ModuleApply, blocks: torch.nn.Module, shards: Any, spec: ShardSpec,
                 policy: Optional[Policy]) -> None:
        self.apply, self.blocks, self.shards, self.spec = apply, blocks, shards, spec
        self.policy = policy
        self.out: Any = None
        self.hidden: Any = None
        self.called = 0

    def __call__(self, index: int, args: tuple, kwargs: dict) -> Any:
        if index != self.called:
            raise RuntimeError(f"apply.run_layers: the forward called block {index} after "
                               f"{self.called} blocks; run_layers needs the blocks called in "
                               f"order, each once")
        self.called += 1
        hidden_key = None if args else "hidden_states"
        h = args[0] if args else kwargs.get(hidden_key)
        if index:
            if h is not self.hidden:
                raise RuntimeError(
                    f"apply.run_layers: the forward passed block {index} something other than "
                    f"block {index - 1}'s output; run_layers runs the blocks back to back, so the "
                    f"forward may do nothing between them: move that work into the blocks, or "
                    f"call apply(vfsdp.gather(shards, spec), ...)")
            return self.out
        rest = args[1:]
        others = {k: v for k, v in kwargs.items() if k != hidden_key}
        apply = self.apply
        path = format_path(apply.blocks)
        blocks = self.blocks
        order = itertools.count()
        extra: list = []

        def layer_fn(full, x):
            i = next(order)
            prefix = f"{path}.{i}."
            leaves, paths = optree.tree_leaves(full), optree.tree_paths(full)
            names = _names(paths)
            buffers = {n[len(prefix):]: b for n, b in apply.buffers.items()
                       if n.startswith(prefix)}
            if hidden_key is None:
                out = apply._call(dict(zip(names, leaves)), (x, *rest), others,
                                  module=blocks[i], buffers=buffers)
            else:
                out = apply._call(dict(zip(names, leaves)), (), {**others, hidden_key: x},
                                  module=blocks[i], buffers=buffers)
            if isinstance(out, tuple):
                extra[:] = [out[1:]]
                return out[0]
            extra[:] = []
            return out

        h = self.hidden = run_layers(layer_fn, self.shards, self.spec, h, self.policy)
        self.out = (h, *extra[0]) if extra else h
        return self.out


class _StandIn(torch.nn.Module):
    """Block ``index`` while :meth:`ModuleApply.run_layers` runs."""

    def __init__(self, runner: _Runner, index: int) -> None:
        super().__init__()
        self.runner, self.index = runner, index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner(self.index, args, kwargs)
