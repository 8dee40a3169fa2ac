"""Execute notebooks from their jupytext text files and write each .ipynb with its outputs.

Usage (what `make notebooks` runs, from the repository root):
    python notebooks/execute.py 01_tour 02_adjoint_gradients ...
    python notebooks/execute.py --out DIR 01_tour ...      (write the .ipynb files to DIR)
    python notebooks/execute.py --check 01_tour ...        (`make notebooks-check`)

Each ``notebooks/<name>.py`` runs in a fresh ``python3`` kernel with the notebooks folder
as its working directory; a cell error stops with a non-zero exit status and leaves the
committed .ipynb untouched. Only full-size runs rewrite the committed notebooks: at the
small size (``OCFORMER_NOTEBOOK_SMALL=1``) the .ipynb files go to ``--out`` (default: a
new temporary folder, printed; never the notebooks folder itself), so that a quick
check never replaces the committed outputs with small ones.

At full size the numbers each code cell prints (its stdout and the text of its results;
not stderr, not figures) are compared with the committed .ipynb's before it is replaced,
line by line, and every number that moved by more than ``--rtol`` (relative, default
1e-6) plus ``--atol`` (default 0) is reported, as is every printed line with numbers
that appeared, went or changed its words. Timing (a number followed by ``ms``, ``s``
or ``min``, a rate ``N unit/s``, the training summary's ``N% of the loop``), paths, and
the outputs of a cell tagged ``no-drift-check`` (``# %% tags=["no-drift-check"]`` in
the .py) are not compared.
With ``--check`` nothing is written (neither the .ipynb nor, since ``OCFORMER_FIGURES``
is unset for the kernels, a figure) and the exit status is 1 when anything moved: the
committed outputs are what the code computes exactly when it is 0.
"""

import argparse
import difflib
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import jupytext
import nbclient
from nbclient.exceptions import CellExecutionError, DeadKernelError

from ocformer.checkpointing import atomic_write_text

HERE = Path(__file__).resolve().parent


def _small() -> bool:
    return os.environ.get("OCFORMER_NOTEBOOK_SMALL") == "1"


# A printed number: not part of a word or of a longer dotted token (the 7 of tmp7q19, the
# 1 of step_1 and the 3.11 of python3.11 are not numbers), with its sign and exponent.
NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?!\w|\.\d)"
    r"|(?<![\w.])-?(?:nan|inf)(?!\w)"
)
# What is not compared: timing, which varies from run to run (a duration, a rate, the
# share of the training loop spent waiting for data), and a path (temporary folders are
# named at random).
TIMING = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:ms|s|min|[a-z]+/s)(?!\w)|% of the loop\b)")
PATH = re.compile(r"(?<!\S)[~.]{0,2}/\S*")
SKIP_TAG = "no-drift-check"


class Drift(NamedTuple):
    """A printed number that moved (``kind`` "number": ``committed`` and ``now`` are its
    two printed values), or a printed line with numbers that changed its words, came or
    went (``kind`` "line": the two lines, ``""`` for the one that is missing). ``cell``
    counts the code cells from 1; ``line`` is the line as printed now (or as committed,
    where it is gone)."""

    cell: int
    kind: str
    committed: str
    now: str
    line: str

    def __str__(self) -> str:
        where = f"code cell {self.cell}"
        if self.kind == "number":
            a, b = float(self.committed), float(self.now)
            finite = math.isfinite(a) and math.isfinite(b)
            change = f"relative {abs(a - b) / max(abs(a), abs(b)):.1e}" if finite else "not finite"
            return f"{where}: {self.committed} -> {self.now} ({change}) in {self.line.strip()!r}"
        if not self.now:
            return f"{where}: no longer printed: {self.committed.strip()!r}"
        if not self.committed:
            return f"{where}: newly printed: {self.now.strip()!r}"
        return f"{where}: line changed: {self.committed.strip()!r} -> {self.now.strip()!r}"


def _text(value: Any) -> str:
    # nbformat JSON stores a text as a string or as a list of lines.
    return "".join(value) if isinstance(value, list) else str(value)


def printed_lines(cell: dict) -> list[str]:
    """The lines of a code cell's printed output that hold a number to compare: its
    stdout and the text of its results (not stderr, not the text of a figure), with
    timing and paths masked; none for a cell tagged ``no-drift-check``."""
    if SKIP_TAG in cell.get("metadata", {}).get("tags", []):
        return []
    text = ""
    for output in cell.get("outputs", []):
        kind = output.get("output_type")
        if kind == "stream" and output.get("name") == "stdout":
            text += _text(output.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = output.get("data", {})
            if "text/plain" in data and not any(k.startswith("image/") for k in data):
                text += _text(data["text/plain"]).rstrip("\n") + "\n"
    masked = (PATH.sub("<path>", TIMING.sub("<time>", line)) for line in text.splitlines())
    return [line for line in masked if NUMBER.search(line)]


def _close(a: str, b: str, rtol: float, atol: float) -> bool:
    x, y = float(a), float(b)
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return a == b or (math.isnan(x) and math.isnan(y))
    return abs(x - y) <= atol + rtol * max(abs(x), abs(y))


def compare(committed: dict, executed: dict, *, rtol: float, atol: float = 0.0) -> list[Drift]:
    """Every printed number of ``executed`` (a notebook as nbformat's JSON) that differs
    from ``committed``'s by more than ``atol + rtol * max(|a|, |b|)``, and every printed
    line with numbers whose words differ, came or went. Code cells are paired in order;
    within a cell, lines are paired by their words (the line with its numbers masked)."""
    cells = [
        [printed_lines(c) for c in notebook["cells"] if c["cell_type"] == "code"]
        for notebook in (committed, executed)
    ]
    old_cells, new_cells = cells
    old_cells += [[]] * (len(new_cells) - len(old_cells))
    new_cells += [[]] * (len(old_cells) - len(new_cells))
    drifts = []
    for index, (old, new) in enumerate(zip(old_cells, new_cells), start=1):
        words = [[NUMBER.sub("#", line) for line in lines] for lines in (old, new)]
        matcher = difflib.SequenceMatcher(None, *words, autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op == "equal":
                for a_line, b_line in zip(old[i1:i2], new[j1:j2]):
                    numbers = zip(NUMBER.findall(a_line), NUMBER.findall(b_line))
                    drifts += [
                        Drift(index, "number", a, b, b_line)
                        for a, b in numbers
                        if not _close(a, b, rtol, atol)
                    ]
                continue
            gone, came = old[i1:i2], new[j1:j2]
            for k in range(max(len(gone), len(came))):
                a_line = gone[k] if k < len(gone) else ""
                b_line = came[k] if k < len(came) else ""
                drifts.append(Drift(index, "line", a_line, b_line, b_line or a_line))
    return drifts


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def _dead_kernel(error: BaseException | None) -> str | None:
    """nbclient's ``DeadKernelError`` among ``error`` and the exceptions it arose from
    (a kernel killed by a signal sent to the process group, or by the OOM killer)."""
    while error is not None:
        if isinstance(error, DeadKernelError):
            return str(error) or type(error).__name__
        error = error.__cause__ or error.__context__
    return None


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
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a printed number moved from the committed .ipynb",
    )
    parser.add_argument(
        "--rtol",
        type=_tolerance,
        default=1e-6,
        help="relative change of a printed number that counts as moved (default 1e-6)",
    )
    parser.add_argument(
        "--atol", type=_tolerance, default=0.0, help="absolute change allowed (default 0)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.check and (_small() or args.out is not None):
        problem = "OCFORMER_NOTEBOOK_SMALL=1" if _small() else "--out"
        print(f"error: --check compares full-size runs with the committed notebooks and "
              f"writes nothing; drop {problem}", file=sys.stderr)  # fmt: skip
        return 2
    missing = [n for n in args.names if not (HERE / f"{n}.py").is_file()]
    if missing:
        print(f"error: no notebook {', '.join(missing)} in {HERE}", file=sys.stderr)
        return 2
    if args.out is not None:
        out = Path(args.out)
        if not out.is_dir():
            print(f"error: --out {out} is not a folder; create it first", file=sys.stderr)
            return 2
        if _small() and out.resolve() == HERE.resolve():
            print(f"error: --out {out} is the notebooks folder, whose committed outputs "
                  f"are full-size; small runs (OCFORMER_NOTEBOOK_SMALL=1) go to another "
                  f"folder: drop --out or name a different one", file=sys.stderr)  # fmt: skip
            return 2
    elif _small():
        out = Path(tempfile.mkdtemp(prefix="ocformer-notebooks-"))
        print(f"small size (OCFORMER_NOTEBOOK_SMALL=1): writing the notebooks to {out}")
    else:
        out = HERE
    if args.check:
        os.environ.pop("OCFORMER_FIGURES", None)  # the kernels inherit it: no figure written
    elif os.environ.get("OCFORMER_FIGURES"):
        # The kernels run in the notebooks folder: a relative folder is this command's.
        os.environ["OCFORMER_FIGURES"] = os.path.abspath(os.environ["OCFORMER_FIGURES"])
    # tqdm.auto warns in a kernel without ipywidgets (its bars fall back to text), with
    # the path of the installation: not part of what a notebook shows.
    quiet = "ignore:IProgress not found"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))
    moved = 0
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
        except BaseException as e:
            # A SIGINT or SIGTERM makes nbclient shut the kernel down, and its clean-up
            # can then fail on its own (its kernel manager already gone): the dead
            # kernel is what is reported, in one line.
            died = _dead_kernel(e)
            if died is None:
                raise
            kept = "" if args.check else "; nothing of it was written"
            print(f"{name}: stopped, the kernel is gone ({died}: a SIGINT or SIGTERM to this "
                  f"command, or the kernel was killed){kept}", file=sys.stderr)  # fmt: skip
            return 1
        text = jupytext.writes(notebook, fmt="ipynb").rstrip("\n") + "\n"
        seconds = time.perf_counter() - started
        committed = HERE / f"{name}.ipynb"
        if not _small() and committed.is_file():
            drifts = compare(
                json.loads(committed.read_text()), json.loads(text), rtol=args.rtol, atol=args.atol
            )
            moved += len(drifts)
            tolerance = f"rtol {args.rtol:g}, atol {args.atol:g}"
            print(f"{name}: {len(drifts)} printed numbers or lines moved from {committed} "
                  f"({tolerance})" + "".join(f"\n  {d}" for d in drifts))  # fmt: skip
        elif args.check:
            moved += 1
            print(f"{name}: no committed {committed} to compare with")
        if args.check:
            print(f"{name}: executed in {seconds:.0f} s (checked, nothing written)")
            continue
        # Written whole or not at all (a kill never leaves a torn .ipynb), ending in a
        # newline as jupytext.write does.
        atomic_write_text(str(out / f"{name}.ipynb"), text)
        print(f"{name}: executed in {seconds:.0f} s -> {out / name}.ipynb")
    return 1 if args.check and moved else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
