"""Print the package's architecture figures, to compare two checkouts before and after a change.

    python scripts/architecture.py [PACKAGE_DIR]

* **registry lookups**: call sites that find a DBuffer (or pending work) through global state
  instead of the data passed in: the helpers ``owner_of``, ``global_owner``,
  ``live_dbuffers``, ``_packing_dbuffer``, ``wait_reductions`` / ``_pending``, and reads of
  ``_OWNERS`` / ``_GLOBAL_OWNERS``; plus every use of ``._cdata``;
* **module-level mutable state**: every dict, list, set, weak mapping or ``threading.local``
  assigned at module level, with the number of functions reading it;
* **names in vfsdp.__all__**;
* **largest modules**, in code lines (no docstrings, comments or blank lines: the rule of
  ``../shared/tools/loc.py``; the 600-line cap of ``tests/test_architecture.py`` counts these);
* **import graph between packages** (module- and function-level imports alike), with the
  edges that go up the layer order marked.

Everything is read from the source with ``ast``; nothing is imported, so it runs on any
checkout (``git worktree add /tmp/old <commit>`` then point it there).
"""

from __future__ import annotations

import ast
import io
import os
import sys
import tokenize
from collections import Counter, defaultdict

LAYERS = ["_torch_private", "placements", "planner", "collectives", "functional", "spmd",
          "interop", "optim", "checkpoint", "estimation", "testing", "<top>"]
"""Bottom to top. A package may import only packages below it (``functional`` and ``spmd`` are
siblings, and so are ``optim`` and ``checkpoint``: neither of a pair imports the other;
``estimation`` imports no ``testing``). ``<top>`` is
``vfsdp/__init__``, ``cli`` and ``__main__``; ``vfsdp/__init__`` loads ``testing`` only when
``vfsdp.testing`` is first used."""

RANK = {"_torch_private": 0, "placements": 1, "planner": 2, "collectives": 3, "functional": 4,
        "spmd": 4, "interop": 5, "optim": 6, "checkpoint": 6, "estimation": 7, "testing": 8,
        "<top>": 9}

REGISTRY_CALLS = {"owner_of", "global_owner", "live_dbuffers", "_packing_dbuffer",
                  "wait_reductions", "_pending", "_finish_oldest"}
REGISTRY_NAMES = {"_OWNERS", "_GLOBAL_OWNERS", "_PACKING"}
MUTABLE_CALLS = {"dict", "list", "set", "WeakValueDictionary", "WeakKeyDictionary", "WeakSet",
                 "local", "defaultdict", "OrderedDict", "Counter"}


def package_of(rel: str) -> str:
    """``vfsdp/optim/adamw.py`` -> ``optim``; top-level modules map to themselves or <top>."""
    parts = rel.split(os.sep)
    if len(parts) > 2:
        return parts[1]
    name = parts[1][:-3]
    return name if name in RANK else "<top>"


def code_lines(src: str) -> int:
    """Lines holding code: no docstring, comment or blank line (``../shared/tools/loc.py``)."""
    doc = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and ast.get_docstring(node, clean=False) is not None:
            doc.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    return len({ln for tok in tokenize.generate_tokens(io.StringIO(src).readline)
                if tok.type not in skip for ln in range(tok.start[0], tok.end[0] + 1)} - doc)


def modules(root: str):
    for dirpath, _, files in os.walk(root):
        if "__pycache__" in dirpath:
            continue
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, os.path.dirname(root)), path


def imported_packages(tree: ast.AST, rel: str = "") -> list[tuple[str, int]]:
    """``(package, line)`` for each vfsdp package a module imports; ``rel`` (the module's
    path, ``vfsdp/planner/spec.py``) resolves relative imports (``from ..functional import``)."""
    here = rel[:-3].split(os.sep) if rel else []
    if here and here[-1] == "__init__":
        here = here[:-1]
    package = here[:-1] if rel and not rel.endswith("__init__.py") else here
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0 and package:
            base = package[:len(package) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found = []
        for name in names:
            parts = name.split(".")
            if parts[0] == "vfsdp" and len(parts) > 1 and parts[1] in RANK \
                    and parts[1] not in found:
                found.append(parts[1])
        out += [(pkg, node.lineno) for pkg in found]
    return out


def report(root: str) -> dict:
    lines, graph, upward = {}, defaultdict(Counter), []
    lookups, cdata, mutable = Counter(), Counter(), []
    all_names: list = []
    for rel, path in modules(root):
        with open(path, encoding="utf-8") as f:
            src = f.read()
        tree = ast.parse(src)
        lines[rel] = code_lines(src)
        pkg = package_of(rel)
        for target, lineno in imported_packages(tree, rel):
            if target != pkg:
                graph[pkg][target] += 1
                if RANK[target] >= RANK[pkg] and pkg != "<top>":
                    upward.append(f"{rel}:{lineno} {pkg} -> {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(
                    fn, ast.Attribute) else None
                if name in REGISTRY_CALLS:
                    lookups[rel] += 1
            if isinstance(node, ast.Name) and node.id in REGISTRY_NAMES and isinstance(
                    node.ctx, ast.Load):
                lookups[rel] += 1
            if isinstance(node, ast.Attribute) and node.attr == "_cdata":
                cdata[rel] += 1
        for node in tree.body:  # module-level mutable state
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                kind = None
                if isinstance(value, (ast.Dict, ast.List, ast.Set)):
                    kind = type(value).__name__.lower()
                elif isinstance(value, ast.Call):
                    fn = value.func
                    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                    if name in MUTABLE_CALLS:
                        kind = name
                for t in targets:
                    if isinstance(t, ast.Name) and kind and t.id != "__all__":
                        uses = sum(1 for n in ast.walk(tree) if isinstance(n, ast.Name)
                                   and n.id == t.id and isinstance(n.ctx, ast.Load))
                        mutable.append((rel, t.id, kind, uses))
        if rel == os.path.join("vfsdp", "__init__.py"):
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                    all_names = [ast.literal_eval(e) for e in node.value.elts]
    return {"lines": lines, "graph": graph, "upward": upward, "lookups": lookups,
            "cdata": cdata, "mutable": mutable, "all": all_names}


def main(argv: list[str]) -> None:
    root = os.path.abspath(argv[1] if len(argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", "vfsdp"))
    r = report(root)
    print(f"package: {root}")
    print(f"\nregistry lookups: {sum(r['lookups'].values())} in {len(r['lookups'])} files")
    for rel, n in sorted(r["lookups"].items()):
        print(f"  {rel}: {n}")
    print(f"._cdata uses: {sum(r['cdata'].values())} in {len(r['cdata'])} files "
          f"{sorted(r['cdata'])}")
    print(f"\nmodule-level mutable state: {len(r['mutable'])}")
    for rel, name, kind, uses in r["mutable"]:
        print(f"  {rel}: {name} ({kind}, read {uses}x)")
    print(f"\nvfsdp.__all__: {len(r['all'])} names: {', '.join(r['all'])}")
    largest = sorted(r["lines"].items(), key=lambda kv: -kv[1])[:10]
    print(f"\nlargest modules ({len(r['lines'])} modules, {sum(r['lines'].values())} code lines):")
    for rel, n in largest:
        print(f"  {n:5d}  {rel}")
    print("\nimport graph (package -> package: import statements):")
    for pkg in LAYERS:
        if r["graph"].get(pkg):
            edges = ", ".join(f"{t} {n}" for t, n in sorted(r["graph"][pkg].items(),
                                                             key=lambda kv: RANK[kv[0]]))
            print(f"  {pkg:<14} -> {edges}")
    print(f"\nimports against the layer order ({' < '.join(LAYERS)}; optim and checkpoint "
          f"are siblings): {len(r['upward'])}")
    for u in r["upward"]:
        print(f"  {u}")


if __name__ == "__main__":
    main(sys.argv)
