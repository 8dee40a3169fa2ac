"""Every notebook runs at small size without a cell error, and each .ipynb is its
jupytext text pair with outputs (figures) committed."""

import json
from pathlib import Path

import jupytext
import nbclient
import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = [
    "01_tour",
    "02_adjoint_gradients",
    "03_convergence",
    "04_continuum_limit",
    "05_token_dynamics",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_small(name, monkeypatch, tmp_path):
    """Executes the text pair in a fresh kernel, as `make notebooks` does at full size;
    a cell error fails the test (nbclient raises CellExecutionError)."""
    monkeypatch.setenv("OCFORMER_NOTEBOOK_SMALL", "1")
    monkeypatch.delenv("OCFORMER_FIGURES", raising=False)
    monkeypatch.delenv("OCFORMER_RUN", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    notebook = jupytext.read(NOTEBOOKS_DIR / f"{name}.py")
    client = nbclient.NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()
    images = [
        o
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    assert images, f"{name} displayed no figure"


def _code(cells):
    return [
        ("".join(c["source"]) if isinstance(c["source"], list) else c["source"]).strip()
        for c in cells
        if c["cell_type"] == "code"
    ]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_ipynb_is_the_text_pair_with_outputs(name):
    """The committed .ipynb has the code cells of the .py (edit the .py, then `make
    notebooks`) and its figures, so they show on a repository page."""
    ipynb = json.loads((NOTEBOOKS_DIR / f"{name}.ipynb").read_text())
    text = jupytext.read(NOTEBOOKS_DIR / f"{name}.py")
    assert _code(ipynb["cells"]) == _code(text.cells)
    outputs = [o for c in ipynb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}.ipynb has no figure"
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
