"""notebooks/execute.py compares the numbers a full-size run prints with the committed
.ipynb's: every number that moved beyond the tolerance is reported, durations, paths,
stderr, figures and cells tagged ``no-drift-check`` are not compared, and ``--check``
writes nothing and exits 1 when anything moved (``make notebooks-check``)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "notebooks_execute", ROOT / "notebooks" / "execute.py"
)
assert _spec is not None and _spec.loader is not None
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)


def _stdout(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def _cell(*outputs, tags=()):
    metadata = {"tags": list(tags)} if tags else {}
    return {
        "cell_type": "code",
        "execution_count": 1,
        "metadata": metadata,
        "outputs": list(outputs),
        "source": "print(...)",
    }


def _notebook(*cells):
    markdown = {"cell_type": "markdown", "metadata": {}, "source": "The slope is printed."}
    return {"cells": [markdown, *cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def _figure(size):
    return {
        "output_type": "display_data",
        "metadata": {},
        "data": {"image/png": f"iVBOR{size}", "text/plain": f"<Figure size {size} with 1 Axes>"},
    }


def _compare(old, new, **tolerance):
    return execute.compare(_notebook(*old), _notebook(*new), **({"rtol": 1e-6} | tolerance))


def test_numbers_are_whole_tokens_with_sign_and_exponent():
    text = (
        "python3.11 step_1 tmp7q19 -0.433 -> -0.022, 1e-06 8.96e-05 [0.588  2] is 1.326. v0.6.2 nan"
    )
    assert execute.NUMBER.findall(text) == [
        "-0.433",
        "-0.022",
        "1e-06",
        "8.96e-05",
        "0.588",
        "2",
        "1.326",
        "nan",
    ]


def test_the_same_outputs_do_not_drift_whatever_their_form():
    lines = "  lie: fitted slope 1.11 (expected 1)\n strang: fitted slope 1.99 (expected 2)\n"
    as_list = [line + "\n" for line in lines.splitlines()]
    assert _compare([_cell(_stdout(lines))], [_cell(_stdout(as_list))]) == []
    # Split into several stream outputs (as a kernel flushes them) or not: the same text.
    halves = [_stdout(as_list[0]), _stdout(as_list[1])]
    assert _compare([_cell(_stdout(lines))], [_cell(*halves)]) == []


def test_a_moved_number_is_reported_with_both_values_and_its_line():
    old = [_cell(_stdout("lie: fitted slope 1.11 (expected 1); local slopes 1.12, 1.08\n"))]
    new = [_cell(_stdout("lie: fitted slope 1.13 (expected 1); local slopes 1.12, 1.08\n"))]
    [drift] = _compare(old, new)
    assert drift == execute.Drift(
        1, "number", "1.11", "1.13", "lie: fitted slope 1.13 (expected 1); local slopes 1.12, 1.08"
    )
    assert str(drift) == (
        "code cell 1: 1.11 -> 1.13 (relative 1.8e-02) in "
        "'lie: fitted slope 1.13 (expected 1); local slopes 1.12, 1.08'"
    )


def test_the_relative_tolerance_decides():
    old = [_cell(_stdout("loss 1.0000001\n")), _cell(_stdout("gap 2.2e-16\n"))]
    new = [_cell(_stdout("loss 1.0000002\n")), _cell(_stdout("gap 4.4e-16\n"))]
    # 1e-7 relative: within 1e-6, beyond 1e-8; the rounding-level gap moved by half.
    assert [(d.cell, d.now) for d in _compare(old, new)] == [(2, "4.4e-16")]
    assert [(d.cell, d.now) for d in _compare(old, new, rtol=1e-8)] == [
        (1, "1.0000002"),
        (2, "4.4e-16"),
    ]
    assert _compare(old, new, rtol=1e-6, atol=1e-15) == []
    assert _compare(old, new, rtol=0.6) == []


def test_timing_paths_stderr_and_figures_are_not_compared():
    def run(seconds, folder, warning_line, size):
        summary = (
            f"\nocformer: finished step 100 in {seconds}s\n"
            f"  train loss 1.3682   val loss 1.3257   waiting for data {seconds}% of the loop\n"
            f"  outputs in /tmp/{folder}/3\n"
            f"    checkpoint   /tmp/{folder}/checkpoints/step_100\n"
            f"{seconds} steps/s, 6 min {seconds} s\n"
        )
        warning = {"output_type": "stream", "name": "stderr", "text": f"auto.py:{warning_line}: W"}
        return [
            _cell(_stdout(summary), warning),
            _cell(_figure(size), _stdout("After 100 training steps the loss is 1.326.\n")),
        ]

    assert (
        _compare(run(68.8, "tmp7q19tlbh", 21, "550x450"), run(101.6, "tmp_q3s-2", 22, "600x400"))
        == []
    )
    moved = run(68.8, "tmpa", 21, "550x450")
    moved[1]["outputs"][1] = _stdout("After 100 training steps the loss is 1.327.\n")
    [drift] = _compare(run(68.8, "tmpa", 21, "550x450"), moved)
    assert (drift.cell, drift.committed, drift.now) == (2, "1.326", "1.327")


def test_a_cell_tagged_no_drift_check_is_not_compared():
    old = [_cell(_stdout("wall time 12.5 per step\n"), tags=["no-drift-check"])]
    new = [_cell(_stdout("wall time 19.0 per step\n"), tags=["no-drift-check"])]
    assert _compare(old, new) == []
    assert len(_compare([_cell(_stdout("wall time 12.5 per step\n"))], new)) == 1


def test_lines_that_came_went_or_changed_words_are_reported():
    old = [_cell(_stdout("a 1\nb 2\nc 3\n")), _cell(_stdout("gone 5\n"))]
    new = [_cell(_stdout("a 1\nb 2 extra 7\nc 3\nnew 4\n")), _cell(_stdout("no numbers now\n"))]
    drifts = _compare(old, new)
    assert [(d.cell, d.kind, d.committed, d.now) for d in drifts] == [
        (1, "line", "b 2", "b 2 extra 7"),
        (1, "line", "", "new 4"),
        (2, "line", "gone 5", ""),
    ]
    assert str(drifts[1]) == "code cell 1: newly printed: 'new 4'"
    assert str(drifts[2]) == "code cell 2: no longer printed: 'gone 5'"


def test_results_nan_and_a_code_cell_that_went_are_compared():
    def result(text):
        return {"output_type": "execute_result", "execution_count": 1, "metadata": {},
                "data": {"text/plain": text}}  # fmt: skip

    old = [_cell(result("(0.5, nan)")), _cell(_stdout("tail 9\n"))]
    assert _compare(old, old) == []
    drifts = _compare(old, [_cell(result("(nan, nan)"))])
    assert [(d.cell, d.kind, d.committed, d.now) for d in drifts] == [
        (1, "number", "0.5", "nan"),
        (2, "line", "tail 9", ""),
    ]
    assert "not finite" in str(drifts[0])


def test_the_committed_notebooks_printed_numbers_are_read():
    """On a committed notebook: its own outputs do not drift, one edited number is the
    one drift, and the training summary's timing and paths are left out."""
    committed = json.loads((ROOT / "notebooks" / "03_convergence.ipynb").read_text())
    assert execute.compare(committed, committed, rtol=0.0) == []
    edited = json.loads(json.dumps(committed))
    cell = next(c for c in edited["cells"] if "strang: fitted slope" in json.dumps(c))
    [output] = [o for o in cell["outputs"] if o.get("name") == "stdout"]
    text = execute._text(output["text"])
    found = re.search(r"strang: fitted slope (\S+) ", text)
    assert found
    number = found.group(1)
    output["text"] = text.replace(f"strang: fitted slope {number}", "strang: fitted slope 0.5")
    [drift] = execute.compare(committed, edited, rtol=1e-6)
    assert (drift.kind, drift.committed, drift.now) == ("number", number, "0.5")
    tour = json.loads((ROOT / "notebooks" / "01_tour.ipynb").read_text())
    [training] = [c for c in tour["cells"] if "finished step" in json.dumps(c)]
    lines = execute.printed_lines(training)
    assert "ocformer: finished step 1 in <time>" in lines
    assert not [line for line in lines if "/tmp" in line or "tmp" in line]


def test_check_writes_nothing_and_fails_when_a_number_moved(tmp_path, monkeypatch, capsys):
    """A full-size --check run (one kernel): the committed .ipynb printed 41, the code
    now prints 42; the run reports it, exits 1 and leaves the notebook and the figures
    folder as they were."""
    import jupytext
    import nbformat

    folder, figures = tmp_path / "notebooks", tmp_path / "figures"
    folder.mkdir()
    figures.mkdir()
    source = (
        "# %%\nimport os\n"
        "if os.environ.get('OCFORMER_FIGURES'):\n"
        "    open(os.path.join(os.environ['OCFORMER_FIGURES'], 'f.png'), 'w').close()\n"
        "print(6 * 7, 'at', 1.5)\n"
    )
    (folder / "tiny.py").write_text(source)
    notebook = jupytext.reads(source, fmt="py:percent")
    notebook.cells[0].outputs = [nbformat.from_dict(_stdout("41 at 1.5\n"))]
    committed = jupytext.writes(notebook, fmt="ipynb")
    (folder / "tiny.ipynb").write_text(committed)
    monkeypatch.setattr(execute, "HERE", folder)
    monkeypatch.delenv("OCFORMER_NOTEBOOK_SMALL", raising=False)
    monkeypatch.setenv("OCFORMER_FIGURES", str(figures))
    assert execute.main(["--check", "tiny"]) == 1
    out = capsys.readouterr().out
    assert "tiny: 1 printed numbers or lines moved" in out
    assert "code cell 1: 41 -> 42 (relative 2.4e-02) in '42 at 1.5'" in out
    assert (folder / "tiny.ipynb").read_text() == committed
    assert sorted(p.name for p in folder.iterdir()) == ["tiny.ipynb", "tiny.py"]
    assert list(figures.iterdir()) == []


@pytest.mark.parametrize(
    "argv, small, message",
    [
        (["--check", "tiny"], True, "drop OCFORMER_NOTEBOOK_SMALL=1"),
        (["--check", "--out", ".", "tiny"], False, "drop --out"),
        (["--rtol", "-1", "tiny"], False, "'-1' is not a finite number >= 0"),
        (["--atol", "abc", "tiny"], False, "'abc' is not a finite number >= 0"),
    ],
)
def test_bad_check_options_are_refused_before_anything_runs(
    argv, small, message, monkeypatch, capsys
):
    if small:
        monkeypatch.setenv("OCFORMER_NOTEBOOK_SMALL", "1")
    else:
        monkeypatch.delenv("OCFORMER_NOTEBOOK_SMALL", raising=False)
    assert execute.main(argv) == 2
    assert message in capsys.readouterr().err


NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*.py"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_text_after_each_plot_quotes_only_printed_numbers(name):
    """A markdown cell after a figure states no number of its own: each number in it
    (outside LaTeX and code spans) is one the notebook prints, so `make notebooks-check`
    compares every number a reader is told."""
    import jupytext

    committed = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    code = [c for c in committed["cells"] if c["cell_type"] == "code"]
    printed = {
        float(n)
        for c in code
        for line in execute.printed_lines(c)
        for n in execute.NUMBER.findall(line)
    }
    assert printed, f"{name}.ipynb prints no number"
    cells = jupytext.read(ROOT / "notebooks" / f"{name}.py").cells
    after_plots = [
        cell.source
        for before, cell in zip(committed["cells"], cells[1:])
        if cell.cell_type == "markdown"
        and any("image/png" in o.get("data", {}) for o in before.get("outputs", []))
    ]
    assert len(committed["cells"]) == len(cells)
    for text in after_plots:
        prose = re.sub(r"\$\$.*?\$\$|\$[^$]*\$|`[^`]*`", " ", text, flags=re.S)
        quoted = [n for n in execute.NUMBER.findall(prose) if float(n) not in printed]
        assert not quoted, f"{name}: {quoted} quoted after a plot and not printed: {text!r}"
