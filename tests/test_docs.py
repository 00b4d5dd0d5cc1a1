"""The documentation: the README's tutorial prints what it shows, and the site builds in strict
mode (every executed example and notebook runs, every cross-reference resolves) with an API
reference entry for every public name.

The strict build is what ``python -m mkdocs build --strict`` does; it needs the ``docs`` extra,
which the README's test command (``bash scripts/setup.sh dev``) installs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
# The modules whose public names the API reference renders (docs/api/*.md).
API_MODULES = {
    "vfsdp": "api/vfsdp", "vfsdp.spmd.lax": "api/spmd_lax",
    "vfsdp.interop.init": "api/interop_init", "vfsdp.optim": "api/optim",
    "vfsdp.checkpoint": "api/checkpoint", "vfsdp.testing": "api/testing",
    "vfsdp.testing.strategies": "api/testing_strategies", "vfsdp.functional": "api/functional",
    "vfsdp.functional.lowp": "api/functional_lowp", "vfsdp.collectives": "api/collectives",
    "vfsdp.planner": "api/planner", "vfsdp.placements": "api/placements",
}


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def tutorial_blocks(text: str) -> list[tuple[str, str]]:
    """(code, the output the README shows after it) for each executed tutorial block."""
    pattern = re.compile(r'```python exec="on"[^\n]*session="tutorial"[^\n]*\n(.*?)```'
                         r'.*?```text\n(.*?)```', re.S)
    return pattern.findall(text)


def same_output(shown: str, printed: str) -> bool:
    """Equal text, and numbers within float32 noise (1e-3 relative, or both below 1e-6)."""
    if NUMBER.split(shown) != NUMBER.split(printed):
        return False
    for a, b in zip(NUMBER.findall(shown), NUMBER.findall(printed)):
        x, y = float(a), float(b)
        if not (abs(x - y) <= 1e-3 * max(abs(x), abs(y)) or max(abs(x), abs(y)) < 1e-6):
            return False
    return True


def test_same_output_tells_numbers_from_text():
    assert same_output("loss 2.859942 diff 6.0e-08", "loss 2.859943 diff 5.1e-08")
    assert not same_output("loss 2.859942", "loss 2.95")
    assert not same_output("rank 3: holds (0, 8)", "rank 3: holds (0, 9)")
    assert not same_output("gathered: True", "gathered: False")


def test_readme_tutorial_prints_what_it_shows():
    blocks = tutorial_blocks(_readme())
    assert len(blocks) == 5, "plan, look, shard, step, compare"
    namespace: dict = {"__name__": "tutorial"}
    for code, shown in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), namespace)
        assert same_output(shown.strip(), out.getvalue().strip()), (
            f"the README shows\n{shown}\nbut the code prints\n{out.getvalue()}")


def test_every_page_is_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = f.read()
    pages = []
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        for name in files:
            if name.endswith((".md", ".ipynb")):
                pages.append(os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "docs")))
    missing = [p for p in pages if f": {p}" not in nav]
    assert pages and not missing, missing


def test_every_example_notebook_is_a_docs_page():
    """The site executes the notebooks in docs/notebooks: each example notebook is linked there."""
    examples = sorted(n for n in os.listdir(os.path.join(ROOT, "examples")) if n.endswith(".ipynb"))
    linked = os.path.join(ROOT, "docs", "notebooks")
    for name in examples:
        path = os.path.join(linked, name)
        assert os.path.realpath(path) == os.path.join(ROOT, "examples", name), name
    assert examples


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once in strict mode (executes the tutorial, pages and notebooks)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("the docs build needs the docs extra: pip install -e '.[docs]' "
                    "(bash scripts/setup.sh dev installs it)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", VFSDP_DOCS_NOTEBOOKS="true")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, "\n".join(
        line for line in log.splitlines() if "WARNING" in line or "ERROR" in line) or log[-4000:]
    return out


def _html(site, page: str) -> str:
    with open(os.path.join(site, page, "index.html"), encoding="utf-8") as f:
        return f.read()


@pytest.mark.slow
def test_docs_build_in_strict_mode_and_run_their_examples(site):
    tutorial = _html(site, "tutorial")
    # Executed: the outputs are in the page, not only the code that prints them.
    assert "rank 3: holds (0, 8) of layers[0].w" in tutorial
    assert "every rank&#39;s parameters within 1e-5 of one process&#39;s after 5 steps: True" \
        in tutorial or "every rank's parameters within 1e-5 of one process's after 5 steps: True" \
        in tutorial
    notebook = _html(site, "notebooks/prototype_parallelism")
    assert "jp-OutputArea-output" in notebook  # the notebook was executed as the site built


@pytest.mark.slow
def test_api_reference_documents_every_public_name(site):
    missing = []
    for module, page in API_MODULES.items():
        mod = importlib.import_module(module)
        html = _html(site, page)
        for name in mod.__all__:
            if isinstance(getattr(mod, name), type(os)):
                continue  # a namespace: it has its own page
            if f'id="{module}.{name}"' not in html:
                missing.append(f"{module}.{name}")
    assert not missing, f"not in the API reference (a docstring missing?): {missing}"
