"""Execute notebooks from their jupytext text files and write each .ipynb with its outputs.

Usage (what `make notebooks` runs, from the repository root):
    python notebooks/execute.py 01_tour 02_adjoint_gradients ...
    python notebooks/execute.py --out DIR 01_tour ...      (write the .ipynb files to DIR)

Each ``notebooks/<name>.py`` runs in a fresh ``python3`` kernel with the notebooks folder
as its working directory; a cell error stops with a non-zero exit status and leaves the
committed .ipynb untouched. Only full-size runs rewrite the committed notebooks: at the
small size (``OCFORMER_NOTEBOOK_SMALL=1``) the .ipynb files go to ``--out`` (default: a
new temporary folder, printed), so that a quick check never replaces the committed
outputs with small ones.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbclient
from nbclient.exceptions import CellExecutionError

from ocformer.checkpointing import atomic_write_text

HERE = Path(__file__).resolve().parent


def _small() -> bool:
    return os.environ.get("OCFORMER_NOTEBOOK_SMALL") == "1"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python notebooks/execute.py")
    parser.add_argument("names", nargs="+", metavar="NAME", help="e.g. 01_tour")
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the executed .ipynb files go (default: next to their .py at full "
        "size; a new temporary folder at the small size)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    missing = [n for n in args.names if not (HERE / f"{n}.py").is_file()]
    if missing:
        print(f"error: no notebook {', '.join(missing)} in {HERE}", file=sys.stderr)
        return 2
    if args.out is not None:
        out = Path(args.out)
        if not out.is_dir():
            print(f"error: --out {out} is not a folder; create it first", file=sys.stderr)
            return 2
    elif _small():
        out = Path(tempfile.mkdtemp(prefix="ocformer-notebooks-"))
        print(f"small size (OCFORMER_NOTEBOOK_SMALL=1): writing the notebooks to {out}")
    else:
        out = HERE
    for name in args.names:
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
        except CellExecutionError as e:
            print(f"{name}: a cell failed\n{e}", file=sys.stderr)
            return 1
        # Written whole or not at all (a kill never leaves a torn .ipynb), ending in a
        # newline as jupytext.write does.
        text = jupytext.writes(notebook, fmt="ipynb").rstrip("\n") + "\n"
        atomic_write_text(str(out / f"{name}.ipynb"), text)
        print(f"{name}: executed in {time.perf_counter() - started:.0f} s -> {out / name}.ipynb")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
