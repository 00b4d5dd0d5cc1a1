"""The package's shape: layers, private APIs, the one-screen API, module sizes.

The layer order lives in ``scripts/architecture.py`` (which also prints the figures) and is
drawn in docs/architecture.md; these tests enforce it statically (imports) and at run time (calls made
by a training step).
"""

import ast
import importlib
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import warnings

import optree
import pytest
import torch

import vfsdp
from vfsdp.testing import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "vfsdp")


def _architecture():
    spec = importlib.util.spec_from_file_location("architecture",
                                                  os.path.join(ROOT, "scripts", "architecture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARCH = _architecture()


def _modules():
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, ROOT), path


def test_imports_follow_the_layers():
    report = ARCH.report(PACKAGE)
    assert report["upward"] == [], "\n".join(report["upward"])
    assert "optim" not in report["graph"].get("checkpoint", {})
    assert "testing" not in report["graph"].get("estimation", {})
    assert ARCH.RANK["estimation"] < ARCH.RANK["testing"]


def test_import_vfsdp_loads_no_testing_until_it_is_used():
    code = ("import sys, vfsdp\n"
            "print(sorted(m for m in sys.modules if m.startswith('vfsdp.testing')))\n"
            "print(vfsdp.testing.simulate.__module__, 'testing' in dir(vfsdp))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)).stdout.split("\n")
    assert out[:2] == ["[]", "vfsdp.testing.simulate True"], out


def test_relative_imports_count_as_imports():
    """``from ..functional import gather`` in the planner is as upward as the absolute form."""
    for src in ("from ..functional import gather", "from vfsdp.functional import gather",
                "from ..functional.gather import gather", "from .. import functional"):
        found = ARCH.imported_packages(ast.parse(src), os.path.join("vfsdp", "planner", "spec.py"))
        assert [pkg for pkg, _ in found] == ["functional"], src
    inside = ARCH.imported_packages(ast.parse("from .spec import ShardSpec"),
                                    os.path.join("vfsdp", "planner", "__init__.py"))
    assert [pkg for pkg, _ in inside] == ["planner"]


def test_the_docs_draw_the_layers():
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        readme = f.read()
    for line in ("optim      checkpoint", "interop", "functional spmd", "collectives", "planner",
                 "placements"):
        assert line in readme, line
    assert "tests/test_architecture.py" in readme


def test_private_torch_apis_only_in_torch_private():
    bad = []
    for rel, path in _modules():
        if rel.endswith("_torch_private.py"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("_cdata", "_C"):
                bad.append(f"{rel}:{node.lineno} .{node.attr}")
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if any(p in name for p in ("_python_dispatch", "torch._C", "testing._internal",
                                           "torch._functorch", "torch._dynamo")):
                    bad.append(f"{rel}:{node.lineno} imports {name}")
    assert bad == [], bad


def test_no_buffer_registries():
    report = ARCH.report(PACKAGE)
    assert sum(report["lookups"].values()) == 0, report["lookups"]
    assert set(report["cdata"]) <= {os.path.join("vfsdp", "_torch_private.py")}


def test_modules_stay_small():
    """600 code lines a module: docstrings, comments and blank lines do not count."""
    big = {rel: n for rel, n in ARCH.report(PACKAGE)["lines"].items() if n > 600}
    assert big == {}, big
    src = 'def f():\n    """Doc.\n\n    More."""\n    # note\n\n    return (1,\n            2)  # end\n'
    assert ARCH.code_lines(src) == 3


def test_one_screen_api():
    assert vfsdp.__all__ == [
        "plan", "rows", "whole", "ShapeDtype", "check_spec", "plan_stats",
        "ShardSpec", "UnitLayout", "TensorSpec", "RaggedShard", "StridedRaggedShard",
        "shard", "scatter", "gather", "gather_async", "release",
        "reduce_scatter", "run_layers", "grads", "zero_grads", "clip_grad_norm", "Policy",
        "functionalize",
        "to_dtensor", "from_dtensor", "dtensor_placement",
        "mesh", "lax", "shard_map", "P", "visualize", "estimate",
        "init", "optim", "checkpoint", "testing",
    ]
    for name in vfsdp.__all__:
        obj = getattr(vfsdp, name)
        assert obj.__doc__ and obj.__doc__.strip(), name
        if isinstance(obj, type):
            assert "Example" in obj.__doc__, name


# Every public namespace: the ones the API reference renders (``docs/api/``).
NAMESPACES = {name: importlib.import_module(home) for name, home in (
    ("vfsdp", "vfsdp"), ("vfsdp.optim", "vfsdp.optim"), ("vfsdp.checkpoint", "vfsdp.checkpoint"),
    ("vfsdp.testing", "vfsdp.testing"), ("vfsdp.testing.strategies", "vfsdp.testing.strategies"),
    ("vfsdp.init", "vfsdp.interop.init"), ("vfsdp.lax", "vfsdp.spmd.lax"),
    ("vfsdp.functional", "vfsdp.functional"), ("vfsdp.functional.lowp", "vfsdp.functional.lowp"),
    ("vfsdp.collectives", "vfsdp.collectives"), ("vfsdp.planner", "vfsdp.planner"),
    ("vfsdp.placements", "vfsdp.placements"), ("vfsdp.estimation", "vfsdp.estimation"))}


def test_namespaces_are_the_public_ones():
    assert NAMESPACES["vfsdp.init"] is vfsdp.init and NAMESPACES["vfsdp.lax"] is vfsdp.lax


def _public(kind):
    for mname, mod in NAMESPACES.items():
        for name in mod.__all__:
            obj = getattr(mod, name)
            if kind(obj):
                yield f"{mname}.{name}", obj


def _public_functions():
    return _public(inspect.isfunction)


@pytest.mark.parametrize("name, fn", list(_public_functions()), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_public_functions_document_args_returns_raises_and_an_example(name, fn):
    doc = inspect.getdoc(fn) or ""
    sig = inspect.signature(fn)
    takes = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    want = ["Raises:", "Example"] + (["Args:"] if takes else [])
    if sig.return_annotation not in (None, "None", inspect.Signature.empty):
        want.append("Returns:")
    missing = [w for w in want if w not in doc]
    assert not missing, f"{name} lacks {missing}"


@pytest.mark.parametrize("name, cls", list(_public(inspect.isclass)), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_public_classes_have_an_example(name, cls):
    assert "Example" in (cls.__doc__ or ""), f"{name} has no Example"


def test_no_docstring_skips_its_example():
    skipped = []
    for rel, path in _modules():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                if "+SKIP" in doc:
                    skipped.append(f"{rel}:{getattr(node, 'lineno', 1)}")
    assert skipped == [], skipped


@pytest.mark.parametrize("module, name", [("vfsdp", "dbuffers"), ("vfsdp", "PASSTHROUGH"),
                                          ("vfsdp", "split_reference"), ("vfsdp", "Replicate"),
                                          ("vfsdp.collectives", "owner_of"),
                                          ("vfsdp.collectives", "live_dbuffers"),
                                          ("vfsdp.optim.adamw", "CHUNK")])
def test_removed_names_stay_gone(module, name):
    """Names removed after their deprecation are plain missing attributes."""
    with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
        getattr(importlib.import_module(module), name)


def _package(filename):
    rel = os.path.relpath(filename, ROOT)
    if not rel.startswith("vfsdp" + os.sep):
        return None
    return ARCH.package_of(rel)


def step_call_edges():
    """Every (caller package, callee package) pair of vfsdp frames during a training step."""
    params = {"layers": [{"w": torch.randn(6, 4), "b": torch.zeros(4)} for _ in range(2)],
              "head": torch.randn(4, 3)}
    spec = vfsdp.plan(params, 2)
    shards = vfsdp.shard(params, spec)
    opt = vfsdp.optim.chain(vfsdp.optim.clip_by_global_norm(1.0), vfsdp.optim.adamw())
    state = opt.init(shards, spec)
    edges = set()

    def tracer(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = _package(frame.f_code.co_filename), _package(frame.f_back.f_code.co_filename)
        if callee == "testing" and frame.f_code.co_name == "__torch_function__":
            return  # simulate's per-rank RNG mode sees every torch call: instrumentation
        if callee and caller and callee != caller:
            edges.add((caller, callee, frame.f_code.co_name))

    sys.setprofile(tracer)
    try:
        for async_reduce in (False, True):
            full = vfsdp.gather(shards["head"], spec["head"], grads="buffer",
                                async_reduce=async_reduce)
            h = vfsdp.run_layers(lambda p, x: torch.tanh(x @ p["w"][:4] + p["b"]),
                                 shards["layers"], spec["layers"], torch.ones(2, 4))
            (h @ full).sum().backward()
            nxt = vfsdp.gather_async(shards, spec)
            nxt.wait()
            vfsdp.release(shards, spec)
            state = opt.update(vfsdp.grads(shards, spec), state, shards, spec)
            vfsdp.zero_grads(shards, spec)
    finally:
        sys.setprofile(None)
    return sorted(edges)


def test_a_training_step_calls_straight_down_the_layers():
    rank = ARCH.RANK
    for edges in simulate(2, step_call_edges):
        up = [e for e in edges if rank[e[1]] > rank[e[0]]]
        assert up == [], up
        assert {("functional", "collectives"), ("optim", "functional")} <= {e[:2] for e in edges}


def test_spec_caches_belong_to_the_spec():
    spec = vfsdp.plan({"a": torch.empty(3), "b": [torch.empty(2)]}, 2)
    assert spec.unit_leaves() is spec.unit_leaves()
    again = vfsdp.plan({"a": torch.empty(3), "b": [torch.empty(2)]}, 2)
    assert again == spec and again.unit_leaves() is not spec.unit_leaves()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optree.tree_leaves(spec.tree)


@pytest.mark.parametrize("name, fn", list(_public_functions()), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_public_functions_are_typed(name, fn):
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    assert not missing, f"{name}: no annotation for {missing}"


def test_package_is_typed_and_ships_the_marker():
    assert os.path.exists(os.path.join(PACKAGE, "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert 'vfsdp = ["py.typed"]' in f.read()


def test_ruff_passes():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run([ruff, "check", ROOT], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
