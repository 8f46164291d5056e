"""Execute every notebook in notebooks/ end to end (a Jupyter kernel, RO_NOTEBOOK_SMALL=1: a few steps each).

Needs nbclient, nbformat and ipykernel (the ``dev`` extra); skipped with the reason when they are missing.
The notebooks are committed without outputs; this test also keeps it that way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def _require_jupyter():
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[dev]')")
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[dev]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[dev]')")
    return nbclient, nbformat


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_ragged_plan.ipynb", "02_swap_optimizers.ipynb", "03_test_your_optimizer.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_committed_without_outputs(path):
    import json

    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, (
                f"{path.name} cell {i} has outputs: clear them before committing "
                f"(jupyter nbconvert --clear-output --inplace {path.name})"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbclient, nbformat = _require_jupyter()
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("RO_NOTEBOOK_SMALL", "1")
    # ipykernel's "python3" kernel is started with this interpreter (jupyter_client swaps its "python" for
    # sys.executable), so the notebooks import the ragged_optim installed in this environment.
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # cwd: anything a notebook writes lands in tmp
    )
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}")
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors, f"{path.name}: error outputs {errors}"
    # a cell's last expression left as a value prints its repr (load_corpus() printed "Corpus(...)" in 02)
    stray = [
        (i, out["data"].get("text/plain", "")[:120])
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "execute_result"
    ]
    assert not stray, f"{path.name}: stray value outputs (cell, repr) {stray}: assign them (`_ = ...`) or print"
