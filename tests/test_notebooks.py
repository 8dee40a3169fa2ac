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


@pytest.mark.slow
def test_token_dynamics_analyses_a_run_of_its_own_shape(monkeypatch, tmp_path):
    """``OCFORMER_RUN`` names a float32 run of 16 tokens: the notebook's random model
    is that run's configuration (its own toy model of 8 tokens was given the run's
    inputs: a shape error in the first cell that used them)."""
    from ocformer import train as train_cli

    smoke = NOTEBOOKS_DIR.parent / "experiments" / "smoke.py"
    run = tmp_path / "run"
    sets = ["train.steps=1", "train.progress=false", "task.seq_len=16"]
    assert train_cli.main(["--config", str(smoke), "--workdir", str(run),
                           *(a for s in sets for a in ("--set", s))]) == 0  # fmt: skip
    monkeypatch.setenv("OCFORMER_NOTEBOOK_SMALL", "1")
    monkeypatch.delenv("OCFORMER_FIGURES", raising=False)
    monkeypatch.setenv("OCFORMER_RUN", str(run))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    notebook = jupytext.read(NOTEBOOKS_DIR / "05_token_dynamics.py")
    nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    ).execute()  # fmt: skip
    printed = "".join(
        "".join(o.get("text", "")) for c in notebook.cells for o in c.get("outputs", [])
    )
    assert "trained: mean pairwise cosine" in printed


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
