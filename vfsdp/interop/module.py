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

import contextlib
import functools
import itertools
import operator
import threading
from typing import Any, Optional

import optree
import torch
from torch.func import functional_call

from vfsdp._torch_private import checkpoint_wrapped, compiling
from vfsdp.collectives.dbuffer import poison
from vfsdp.functional.gather import gather
from vfsdp.functional.options import Policy, merge
from vfsdp.functional.pieces import layer_pieces
from vfsdp.functional.schedule import LayerRun
from vfsdp.planner.granularity import format_path
from vfsdp.planner.spec import ShardSpec


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
    every = list(module.named_parameters(remove_duplicate=False))
    first = {id(p): name for name, p in reversed(every)}  # a tensor's first registered name
    params = _tree(module, "", set(first.values()))  # each tensor once, under its first name
    return params, ModuleApply(module, params, {n: first[id(p)] for n, p in every if first[id(p)] != n})


def _parent(tree: Any, name: str) -> tuple[Any, str]:
    """The node of ``tree`` that holds dotted ``name`` (dicts made on the way) and its key."""
    *parents, leaf = name.split(".")
    for part in parents:
        tree = tree[int(part)] if isinstance(tree, list) else tree.setdefault(part, {})
    return tree, leaf


def _tree(module: torch.nn.Module, prefix: str, names: set) -> Any:
    """The parameters of ``module`` (dotted ``prefix``) registered first under it (``names``),
    nested by name; a module list whose every block holds some as a list."""
    node = {k: p for k, p in module.named_parameters(recurse=False) if prefix + k in names}
    for k, sub in module.named_children():
        if child := _tree(sub, f"{prefix}{k}.", names):
            node[k] = child
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and \
            set(node) == {str(i) for i in range(len(node))}:
        return [node[str(i)] for i in range(len(node))]
    return node


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

    ``torch.utils.checkpoint`` in the module's forward recomputes, in the backward, with the
    call's tensors: they are swapped in again for each recompute (a reentrant one runs as a
    non-reentrant one: the same gradients).

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
        self._names = [format_path(p) for p in paths]
        self.blocks = _blocks(params)
        self._thread: Optional[int] = None
        self._run: Optional[_Blocks] = None  # the run_layers call in progress
        self._scopes: dict = {}  # (owner id, module id) -> (module, its prefix, names under it)
        self._own: list = []  # the blocks' parameters, and what _Blocks puts in their place
        self._block_ties: dict = {}  # block -> {tied name: its tensor's name}, under the block
        if self.blocks is not None:
            where = format_path(self.blocks) + "." if self.blocks else ""
            # each block at its first position
            first = {block: i for i, block in reversed(list(enumerate(module.get_submodule(where[:-1]))))}
            for block, i in first.items():
                at = f"{where}{i}."
                self._own += _stand_ins(block, at)
                self._block_ties[block] = {n[len(at):]: t[len(at):] for n, t in ties.items()
                                           if n.startswith(at) and t.startswith(at)}

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

    def saved_names(self) -> Any:
        """The names Hugging Face's ``save_pretrained`` writes the module's tensors under, as a
        ``rename`` for :func:`vfsdp.checkpoint.load_safetensors` (``dotted name -> name in the
        file``): transformers renames some on the way out (its checkpoint conversion mapping,
        e.g. GPT-NeoX's ``lm_head`` as ``embed_out``, ViT's attention under its older names).
        Names it keeps, and every name of a module that is not a transformers model, map to
        themselves.

        Returns:
            A callable ``str -> str``.

        Raises:
            Nothing.

        Example:
            >>> import torch, vfsdp
            >>> params, apply = vfsdp.functionalize(torch.nn.Linear(2, 2))
            >>> apply.saved_names()("weight")
            'weight'
        """
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError:  # not a transformers model's concern: names as they are
            return lambda name: name
        if not hasattr(self.module, "config"):
            return lambda name: name
        back = [t.reverse_transform() for t in reversed(get_model_conversion_mapping(
            self.module, add_legacy=False)) if isinstance(t, WeightRenaming)]  # as save_pretrained does
        return functools.lru_cache(maxsize=None)(
            lambda name: rename_source_key(name, back, [], reverse=True)[0])

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
        tree = optree.tree_map(lambda t: t, shards)  # new containers, the same tensors
        for name in self._persistent:
            node, leaf = _parent(tree, name)
            if leaf in node:
                raise ValueError(f"apply.state_tree: buffer {name} is already a leaf of the tree")
            node[leaf] = self.buffers[name]
        return tree

    def _call(self, tensors: dict, args: tuple, kwargs: dict) -> Any:
        self._claim()
        meta = next((n for n, b in self.buffers.items() if b.device.type == "meta"), None)
        if meta is not None:
            raise ValueError(f"apply: buffer {meta} is on the meta device (the module was built "
                             f"there); give it values: apply.buffers[{meta!r}] = tensor")
        full = {**tensors, **{n: tensors[s] for n, s in self.ties.items() if s in tensors},
                **self.buffers}
        with checkpoint_wrapped(functools.partial(self._again, self.module, lambda: full)):
            return functional_call(self.module, {**tensors, **self.buffers}, args, kwargs,
                                   tie_weights=True, strict=False)

    def _claim(self) -> None:
        me = threading.get_ident()
        if self._thread not in (None, me):
            raise RuntimeError(
                "apply: called from a second thread. A call swaps the module's tensors in and "
                "out of its attributes, so two threads sharing one module would read each "
                "other's; under vfsdp.testing.simulate (ranks are threads) build the module and "
                "functionalize it inside the rank's function")
        self._thread = me

    def run_layers(self, shards: Any, spec: ShardSpec, *args: Any,
                   policy: Optional[Policy] = None, **kwargs: Any) -> Any:
        """The module's forward from this rank's shards, each block's unit gathered around
        that block's own call, as :func:`vfsdp.run_layers` gathers its layers: the next
        block prefetched, each released after its call (the last block's position excepted)
        and gathered again for its backward.

        The module's own forward runs: every block gets the arguments its call gets and
        what it returns flows on as the code says (per-layer masks, position biases,
        auxiliary outputs, work between the blocks). A block held at several positions
        (``[a, b, a]``) runs at each, its unit gathered for each call. Blocks in an
        ``nn.Sequential``, a model that is a Sequential of blocks and
        ``nn.TransformerEncoder`` run the same way. The units outside the blocks are
        gathered first, with ``grads="buffer"`` and ``free_after_backward=True`` (where
        ``policy`` leaves them unset).

        Activation checkpointing: ``policy=vfsdp.Policy(recompute="full" | "selective" |
        SAC policy)`` checkpoints every block's call. Either recompute reads the regathered
        parameters, as does ``torch.utils.checkpoint`` in the module's own forward (Hugging
        Face's ``gradient_checkpointing_enable()`` included) inside a block's call; around one
        block or several (and the work between them) it keeps what it keeps in torch, and
        its recompute gathers each block again around its call, released at the next. With
        ``recompute``, a Hugging Face model's KV cache is off (``use_cache=False`` unless
        passed), as Hugging Face's own switch does.

        Args:
            shards: This rank's shards (``vfsdp.shard`` of the tree).
            spec: Their spec, planned with each block a unit (the default units).
            *args: The module's positional inputs.
            policy: A :class:`vfsdp.Policy` for every gather (``grad_sync``, ``param_dtype``,
                ``recompute``, ...).
            **kwargs: The module's keyword inputs.

        Returns:
            What the module's forward returns.

        Raises:
            ValueError: the tree has no module list of blocks, a unit holds tensors of a block
                and tensors outside it, or a tie joins a block to another tensor.
            ValueError: called while compiling (``torch.compile``).
            RuntimeError: a second thread calls this ``apply``.
        """
        self._claim()  # before any collective: the other ranks then stop instead of waiting
        if compiling():
            raise ValueError("apply.run_layers is not supported under torch.compile (it gathers "
                             "each block around the module's own call of it, eagerly); compile "
                             "apply(vfsdp.gather(shards, spec), ...) or vfsdp.run_layers")
        if self.blocks is None:
            raise ValueError("apply.run_layers: the module has no module list of blocks (an "
                             "nn.ModuleList or nn.Sequential whose every block holds "
                             "parameters); call apply(vfsdp.gather(shards, spec), ...) instead")
        path = self.blocks
        where = format_path(path)
        for name, target in self.ties.items():
            inside = [n.startswith(where + ".") or not path for n in (name, target)]
            if inside[0] != inside[1]:
                raise ValueError(f"apply.run_layers: {name} is tied to {target}, across the "
                                 f"blocks' boundary; call apply(vfsdp.gather(shards, spec), ...)")
        block_spec = functools.reduce(operator.getitem, path, spec)
        policy = merge(policy, {}, "apply.run_layers")
        if policy.recompute is not None and "use_cache" not in kwargs and \
                getattr(getattr(self.module, "config", None), "use_cache", False):
            kwargs["use_cache"] = False  # a cache written again by each recompute: off, as HF
        run = LayerRun(layer_pieces(functools.reduce(operator.getitem, path, shards), block_spec, None,
                                    "apply.run_layers"), policy, "apply.run_layers")
        unset = {k: v for k, v in (("grads", "buffer"), ("free_after_backward", True))
                 if getattr(policy, k) is None}
        # the tensors outside the blocks (none when the module is the list of blocks)
        rest = _flat_names(gather(_pruned(shards, path), _without(spec, path, block_spec), policy,
                                  recompute=None, **unset)) if path else {}
        self._run = state = _Blocks(self, run, list(self.module.get_submodule(where if path else "")))
        try:
            return self._call(rest, args, kwargs)
        finally:
            self._run = None
            state.close()
            run.finish()

    def _again(self, owner: torch.nn.Module, tensors: Any, fn: Any) -> Any:
        """``fn`` of a ``torch.utils.checkpoint`` inside a call of ``owner``, as its recompute
        (in the backward, after the call) runs it: with the call's tensors (``tensors()``,
        dotted names under ``owner``) swapped in again, those under ``fn``'s module where it is
        one (or a method of one), else all of ``owner``'s; a checkpoint inside it the same."""
        sub = fn
        while isinstance(sub, functools.partial):  # Hugging Face's: partial(layer.__call__)
            sub = sub.func
        sub = sub if isinstance(sub, torch.nn.Module) else getattr(sub, "__self__", None)
        sub = sub if isinstance(sub, torch.nn.Module) else None
        run = self._run if owner is self.module else None  # its blocks are not in tensors()
        key = (id(owner), id(sub))
        if key not in self._scopes:
            prefix = next((n + "." for n, m in owner.named_modules(remove_duplicate=False)
                           if m is sub and n), "")
            names = [n for n, _ in itertools.chain(owner.named_parameters(remove_duplicate=False),
                                                   owner.named_buffers()) if n.startswith(prefix)]
            self._scopes[key] = (sub if prefix else owner, len(prefix), names)
        target, cut, names = self._scopes[key]

        def again(*args: Any, **kwargs: Any) -> Any:
            full = tensors()
            with checkpoint_wrapped(functools.partial(self._again, owner, lambda: full)), \
                    contextlib.nullcontext() if run is None else run.replaying():
                return _swapped(target, {n[cut:]: full[n] for n in names if n in full}, fn,
                                args, kwargs)

        return again

    def _in_block(self, run: LayerRun, block: torch.nn.Module, tree: Any, forward: Any,
                  args: tuple, kwargs: dict) -> Any:
        """A block's call in :meth:`run_layers`: a checkpoint inside it recomputes with the
        tensors regathered for its backward."""
        refresh: list = []
        ties = self._block_ties[block]

        def tensors() -> dict:
            if refresh:
                refresh[0](None)
            flat = _flat_names(tree)
            return {**flat, **{n: flat[t] for n, t in ties.items()}}  # a tie inside the block

        def wrap(fn: Any) -> Any:
            refresh[:] = refresh or [run.refresher(tree)]
            return self._again(block, tensors, fn)

        with checkpoint_wrapped(wrap):
            return _swapped(block, tensors(), forward, args, kwargs)


def _blocks(params: dict) -> Optional[tuple]:
    """The key path of the outermost list of blocks holding the most elements."""

    def walk(node, path):
        if isinstance(node, list):
            yield sum(t.numel() for t in optree.tree_leaves(node)), path
        elif isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, (*path, k))

    return max(walk(params, ()), key=lambda f: f[0], default=(0, None))[1]


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
    found = spec.of_subtree(_pruned(spec.tree, path))
    shared = set(found.units) & set(block_spec.units)
    if shared:
        raise ValueError(f"apply.run_layers: unit {sorted(map(str, shared))[0]} holds tensors "
                         f"of the blocks at {format_path(path)} and tensors outside them; plan "
                         f"with each block a unit of its own (the default units=)")
    return found


class _Blocks:
    """The blocks of one :meth:`ModuleApply.run_layers` call: each distinct block's
    ``forward`` is replaced while it runs by one that gathers its unit around the call, and
    again while a checkpoint of the module's forward recomputes blocks' calls in the backward
    (:meth:`replaying`)."""

    def __init__(self, apply: ModuleApply, run: LayerRun, blocks: list) -> None:
        self.apply, self.run, self.blocks = apply, run, blocks
        self.units: dict = {}  # block module -> its unit's index (its first position)
        self.first = [self.units.setdefault(block, pos) for pos, block in enumerate(blocks)]
        self.calls = self.replays = 0  # the position the next call is expected at; recomputes in progress
        self.saved = {block: block.__dict__.get("forward") for block in self.units}
        self.forwards = {block: block.forward for block in self.units}
        self.trees: dict = {}  # unit index -> its tree of the forward's (latest) call
        self.install()

    def install(self) -> None:
        """Each block's forward replaced, and its parameters, outside its calls, by stand-ins
        that raise when read (the run gathers a block only around its call)."""
        for block, forward in self.forwards.items():
            block.forward = functools.partial(self.call, block, forward)
        for (where, leaf, _), stand_in in self.apply._own:
            where[leaf] = stand_in

    @contextlib.contextmanager
    def replaying(self) -> Any:
        """While a checkpoint of the module's forward recomputes, after the run: each block's
        call regathers its unit (released at the next block's; the last one is what the
        backward reads next)."""
        if not self.replays:
            self.install()
        self.replays += 1
        try:
            yield
        finally:
            self.replays -= 1
            if not self.replays:
                self.close()
                self.run.held = []  # the last block's: its backward comes next

    def close(self) -> None:
        for block, forward in self.saved.items():
            del block.forward
            if forward is not None:
                block.forward = forward
        for (where, leaf, own), _ in self.apply._own:
            where[leaf] = own

    def call(self, block: torch.nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.replays and self.apply._run is not self:  # outside the run's forward
            return forward(*args, **kwargs)
        i, n, dbs = self.units[block], len(self.blocks), None
        if self.replays:  # a recompute: the unit regathered, released at the next block
            full = self.run.regathered(self.trees[i])
        else:
            pos = self.calls if self.calls < n and self.blocks[self.calls] is block else i
            self.calls = pos + 1
            full, dbs = self.run.enter(i, self.first[pos + 1] if pos + 1 < n else None)
            self.trees[i], last = full, pos + 1 == n
        out = self.run.call(lambda tree, *a, **k: self.apply._in_block(self.run, block, tree,
                                                                       forward, a, k),
                            full, args, kwargs)
        if dbs is not None:
            self.run.exit(dbs, last=last)
        return out


def _stand_ins(block: torch.nn.Module, at: str) -> Any:
    """``((its module's parameter dict, key, the parameter), stand-in)`` for each of the
    block's parameter names (``at``: the block's dotted prefix). A stand-in is what the
    parameter is outside the block's calls: an alias (no memory) that raises when an operation
    reads it, naming the fix."""
    for name, p in block.named_parameters(remove_duplicate=False):
        prefix, _, leaf = name.rpartition(".")
        stand_in = p.detach()
        poison([stand_in], f"apply.run_layers: {at}{name} is a block's parameter, read outside "
                           f"that block's call, where the run has not gathered it; read it inside "
                           f"the block's forward, or call apply(vfsdp.gather(shards, spec), ...)")
        yield (block.get_submodule(prefix)._parameters, leaf, p), stand_in


def _flat_names(tree: Any) -> dict:
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return {format_path(p): t for p, t in zip(paths, leaves)}


def _swapped(module: torch.nn.Module, tensors: dict, fn: Any, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with ``tensors`` (dotted names under ``module``) in place of
    the module's parameters; what was there is put back after."""
    owners = []
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix)
        where = owner._parameters if leaf in owner._parameters else owner._buffers
        owners.append((where, leaf, where[leaf]))
        where[leaf] = t
    try:
        return fn(*args, **kwargs)
    finally:
        for where, leaf, old in owners:
            where[leaf] = old
