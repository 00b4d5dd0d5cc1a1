"""A griffe extension: vfsdp's docstrings use Sphinx roles (``:func:`gather```) and ``::``
literal blocks, which Markdown does not know. This rewrites them, as the API reference is
generated, into cross-references to the names the reference renders, or into plain code
where the target is not rendered (a private helper, a torch name), so that a strict build
fails only on real mistakes.

Loaded by mkdocstrings (``mkdocs.yml``: ``extensions: [docs/griffe_rst.py]``).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import griffe

# The modules the API reference renders: their public names are the link targets. Where a
# name is rendered on several pages, links go to the first listed here (the top level first).
RENDERED = (
    "vfsdp", "vfsdp.optim", "vfsdp.checkpoint", "vfsdp.testing", "vfsdp.testing.strategies",
    "vfsdp.functional", "vfsdp.spmd.lax", "vfsdp.interop.init",
    "vfsdp.functional.lowp", "vfsdp.collectives", "vfsdp.planner", "vfsdp.placements",
)
ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def _targets() -> tuple[set[str], dict[str, str]]:
    """Public paths the reference renders, and canonical path -> public path."""
    public: set[str] = set()
    canonical: dict[str, str] = {}
    for name in RENDERED:
        mod = importlib.import_module(name)
        public.add(name)
        for attr in getattr(mod, "__all__", ()):
            path = f"{name}.{attr}"
            public.add(path)
            obj = getattr(mod, attr, None)
            qual = getattr(obj, "__qualname__", None)
            owner = getattr(obj, "__module__", None)
            if isinstance(obj, type(importlib)):
                if path not in RENDERED:  # a module re-exported as a name: not rendered there
                    public.discard(path)
            elif qual and owner:
                canonical.setdefault(f"{owner}.{qual}", path)
            if isinstance(obj, type):
                for member, value in vars(obj).items():
                    # Rendered members: those with a docstring of their own (not an enum's
                    # values, not plain attributes).
                    documented = callable(value) or isinstance(value, (property, staticmethod,
                                                                      classmethod))
                    if not member.startswith("_") and documented:
                        public.add(f"{path}.{member}")
                        if qual and owner:
                            canonical.setdefault(f"{owner}.{qual}.{member}", f"{path}.{member}")
    return public, canonical


class ReSTRoles(griffe.Extension):
    """Rewrite Sphinx roles and ``::`` blocks in every docstring of the package."""

    def __init__(self) -> None:
        self.public, self.canonical = _targets()

    def _resolve(self, text: str, obj: griffe.Object) -> str | None:
        scopes = []
        cur: Any = obj
        while cur is not None:
            scopes.append(cur.path)
            cur = cur.parent
        candidates = [text, f"vfsdp.{text}"] + [f"{s}.{text}" for s in scopes]
        for cand in candidates:
            if cand in self.canonical:
                return self.canonical[cand]
            if cand in self.public:
                return cand
        return None

    def _rewrite(self, value: str, obj: griffe.Object) -> str:
        def role(m: re.Match) -> str:
            text = m.group(1).strip()
            shown = text.split(".")[-1] if "`~" in m.group(0) else text
            target = self._resolve(text.rstrip("()"), obj)
            return f"[`{shown}`][{target}]" if target else f"`{shown}`"

        value = ROLE.sub(role, value)
        # Google style's section for doctests is "Examples:"; "Example:" would be read as
        # prose, and a doctest's output ("[[1.0]]") as a Markdown link.
        value = re.sub(r"^(\s*)Example:[ \t]*$", r"\1Examples:", value, flags=re.M)
        # "text::" before an indented block is reST's literal block; Markdown wants ":".
        return re.sub(r"(\S)::\n", r"\1:\n", value)

    def _unshadow(self, pkg: griffe.Module) -> None:
        """``vfsdp.functional.gather`` is a function at run time but also a submodule's name,
        which static analysis takes for the module: point such names at the function."""
        for name in RENDERED:
            mod: Any = pkg
            for part in name.split(".")[1:]:
                mod = mod.members[part]
            runtime = importlib.import_module(name)
            for attr in getattr(runtime, "__all__", ()):
                obj = getattr(runtime, attr, None)
                member = mod.members.get(attr)
                if member is None or isinstance(obj, type(importlib)):
                    continue
                while member.is_alias and member.resolved:
                    member = member.final_target
                if member.is_module:
                    real = member.members.get(getattr(obj, "__qualname__", attr))
                    if real is not None:
                        mod.set_member(attr, griffe.Alias(attr, real, parent=mod))

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "vfsdp":
            return
        seen: set[int] = set()

        def walk(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite(obj.docstring.value, obj)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)

        walk(pkg)
        self._unshadow(pkg)  # after the walk: it hides the shadowed modules from it
