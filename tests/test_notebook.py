"""The tutorial notebook examples/prototype_parallelism.ipynb runs end to end in a Jupyter kernel,
is stored clean, and covers its five steps (on ``vfsdp.shard_map``).

nbclient, nbformat and ipykernel are dev dependencies (``pip install -e ".[dev]"``): without them
this test fails rather than skips, so a missing tool cannot hide a broken notebook.
"""

import os
import re
import sys

import ipykernel  # noqa: F401  (the kernel the notebook runs in)
import nbclient
import nbformat
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NOTEBOOK = os.path.join(ROOT, "examples", "prototype_parallelism.ipynb")
CELL_TIMEOUT = 300  # seconds per cell; the whole notebook takes a few seconds on 2 CPU cores

# Run first, in memory only: which interpreter the kernel is and which vfsdp it imports.
_PROBE = "import sys, vfsdp\nprint(sys.executable)\nprint(vfsdp.__file__)"


def _read():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return nb


def _markdown(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def _code(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


def test_notebook_is_stored_without_outputs():
    nb = _read()
    assert nb.nbformat == 4
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"cell {i} has stored outputs: clear them before committing "
                f"(jupyter nbconvert --clear-output --inplace {os.path.relpath(NOTEBOOK, ROOT)})")
    assert nb.metadata.kernelspec.name == "python3"


def test_notebook_explains_its_five_steps():
    nb = _read()
    text = _markdown(nb)
    titles = {i: re.search(rf"^## Step {i}: (.+)$", text, re.MULTILINE) for i in range(1, 6)}
    assert all(titles.values()), f"markdown headings '## Step i: ...' missing: {titles}"
    for i, words in {1: ["mesh"], 2: ["TP", "FSDP", "MLP"], 3: ["visualize"],
                     4: ["train", "one process"], 5: ["expert", "MoE"]}.items():
        for word in words:
            assert word.lower() in titles[i].group(1).lower(), (i, word, titles[i].group(1))
    code = _code(nb)
    for call in ['vfsdp.mesh(("dp", 2), ("tp", 2))', "vfsdp.plan(", "tp=rule", "vfsdp.shard(",
                 'grad_reduce="sum"', "lax.column_parallel(", "lax.row_parallel(", "lax.psum(",
                 "lax.all_gather(", "lax.psum_scatter(", "lax.all_to_all(", "lax.axis_index(",
                 "lax.axis_size(", "vfsdp.visualize(", "figure=True", "vfsdp.optim.adamw(",
                 "vfsdp.zero_grads(", "opt.update(", "torch.optim.AdamW(", "moe.moe_ep(",
                 "moe.moe_reference(", 'tp_axis="ep"', "clip_grad_norm_of(", "simulate(4,",
                 "vfsdp.shard_map(", 'in_specs=P("dp")', 'P(("dp", "ep"))', "check_vma=",
                 'lax.psum(b.sum(), ("dp", "tp"))']:
        assert call in code, f"the notebook's code no longer shows {call}"


def test_notebook_executes(monkeypatch):
    nb = _read()
    n_cells = len(nb.cells)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    # The kernel starts in the repository root (resources' path) with the root first on its
    # PYTHONPATH, so it imports this checkout's vfsdp even where vfsdp is not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": ROOT}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"a notebook cell failed:\n{exc}")

    probe = "".join(o.get("text", "") for o in nb.cells[0].outputs).split()
    # jupyter_client runs the "python3" kernel spec's "python" as sys.executable: the kernel is
    # this interpreter (this venv), not whatever "python" is on PATH.
    assert probe[0] == sys.executable, (probe, sys.executable)
    assert os.path.samefile(probe[1], os.path.join(ROOT, "vfsdp", "__init__.py")), probe

    cells = nb.cells[1:]
    assert len(cells) == n_cells
    code = [c for c in cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    printed = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "TP x FSDP equals one process on all 4 ranks" in printed, printed
    assert "EP x FSDP equals one process on all 4 ranks" in printed, printed
    # the replication check inserts the forgotten pvary (strict: an error); unchecked, x.grad
    # is off
    assert "check_vma=True: x.grad off by 0.000" in printed, printed
    assert "check_vma='strict': vfsdp.shard_map (check_vma): TensorBase.matmul mixes" in printed
    off = re.search(r"check_vma=False: x.grad off by ([0-9.]+)", printed)
    assert off and float(off.group(1)) > 0.1, printed
    assert "the tp=1 piece of a 2-way split" in printed, printed  # visualize's text
    figures = [c for c in code if "figure=True" in c.source]
    assert figures and any("image/png" in o.get("data", {}) for c in figures
                           for o in c.outputs), "visualize(figure=True) showed no figure inline"
