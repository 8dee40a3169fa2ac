"""Execute notebooks from their jupytext text files and write each .ipynb with its outputs.

Usage (what `make notebooks` runs, from the repository root):
    python notebooks/execute.py 01_tour 02_adjoint_gradients ...

Each ``notebooks/<name>.py`` runs in a fresh ``python3`` kernel with the notebooks folder
as its working directory; a cell error stops with a non-zero exit status and leaves the
committed .ipynb untouched.
"""

import sys
import time
from pathlib import Path

import jupytext
import nbclient

HERE = Path(__file__).resolve().parent


def main(names: list[str]) -> int:
    for name in names:
        started = time.perf_counter()
        notebook = jupytext.read(HERE / f"{name}.py")
        client = nbclient.NotebookClient(
            notebook,
            timeout=None,
            kernel_name="python3",
            resources={"metadata": {"path": str(HERE)}},
        )
        try:
            client.execute()
        except nbclient.exceptions.CellExecutionError as e:
            print(f"{name}: a cell failed\n{e}", file=sys.stderr)
            return 1
        jupytext.write(notebook, HERE / f"{name}.ipynb")
        print(f"{name}: executed in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
