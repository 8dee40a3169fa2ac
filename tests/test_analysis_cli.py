"""The analysis command keeps partial results and checks its outputs before computing."""

import json
import re

import pytest

from ocformer.analysis import __main__ as cli


@pytest.mark.parametrize(
    "option, path, words",
    [
        ("--json", "missing/orders.json", "missing does not exist"),
        ("--plot", "missing/orders.png", "missing does not exist"),
        ("--json", ".", "is a directory"),
        ("--json", " ", "empty path"),
    ],
)
def test_outputs_are_checked_before_computing(option, path, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def must_not_run(*args, **kwargs):
        raise AssertionError("computed before checking the output path")

    monkeypatch.setattr("ocformer.analysis._convergence.convergence_study", must_not_run)
    assert cli.main(["convergence", "--steps", "2,4", option, path]) == 2
    err = capsys.readouterr().err
    assert words in err and "nothing was computed" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_refused_scheme_is_a_cell_and_the_others_are_computed(tmp_path, capsys):
    """Parallel splitting refuses the projected formulation: its cells say so, in the
    table and the JSON, and Lie's errors are still measured and written."""
    path = tmp_path / "orders.json"
    argv = ["convergence", "--schemes", "lie,parallel", "--steps", "2,4",
            "--formulation", "projected", "--json", str(path)]  # fmt: skip
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(path.read_text())
    lie, parallel = result["schemes"]["lie"], result["schemes"]["parallel"]
    assert parallel["status"] == "refused" and "errors" not in parallel
    assert "formulation='projected'" in parallel["reason"]
    assert "discretisation.stepper" in parallel["reason"]
    # Lie is first order: the error halves with the step (measured 0.181, 0.092).
    assert lie["status"] == "ok" and 0.8 < lie["slope"] < 1.2 and lie["errors"][1] > 0
    rows = [line.split() for line in table.splitlines()]
    assert ["2", f"{lie['errors'][0]:.3e}", "refused"] in rows
    assert any(line.startswith("parallel refused:") for line in table.splitlines())


def test_the_json_is_strict_with_a_non_finite_number_as_null():
    """A local slope of an exact scheme is log(0/0): written as null, not as NaN (which
    strict JSON readers refuse)."""
    result = {"slope": 1.0, "local_slopes": [float("nan"), 2.0], "x": (float("inf"), "a")}
    assert json.loads(json.dumps(cli._finite(result), allow_nan=False)) == {
        "slope": 1.0, "local_slopes": [None, 2.0], "x": [None, "a"],
    }  # fmt: skip


def test_the_library_studies_refuse_what_the_command_line_refuses(capsys):
    """No scheme, a step count of 0 or one given twice: refused before any solve, in
    the library as on the command line."""
    from ocformer.analysis import convergence_study, gradient_comparison

    for schemes, steps, words in [
        ([], [4, 8], "No scheme given"),
        (["lie"], [0, 4], "Step counts must be >= 1"),
        (["lie"], [4, 4], "at least two distinct step counts"),
        (["lie", "heun", "lie"], [4, 8], r"A scheme is given twice: \['lie', 'heun', 'lie'\]"),
    ]:
        with pytest.raises(ValueError, match=words):
            convergence_study(schemes, steps)
    with pytest.raises(ValueError, match="at least two distinct positive step counts"):
        gradient_comparison(steps_per_layer=(2, 2), solver="euler")
    assert cli.main(["convergence", "--schemes", "lie,lie", "--steps", "2,4"]) == 2
    assert "lie given twice in 'lie,lie'" in capsys.readouterr().err
    # A string is not a list of names (it was read a character at a time: scheme 'l').
    with pytest.raises(ValueError, match=r"schemes must be a list of names, got the string 'lie'"):
        convergence_study("lie", [4, 8])
    # A fractional step count was truncated without a word; a bad reference factor was
    # named as the reference's steps_per_layer.
    with pytest.raises(ValueError, match=r"Step counts must be whole numbers >= 1, got \[2.5, 4\]"):
        convergence_study(["lie"], [2.5, 4])
    for factor in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"reference_factor must be a whole number >= 1"):
            convergence_study(["lie"], [2, 4], reference_factor=factor)
    # A factor of 1 made the finest tsit5 column the reference itself: an error of 0.
    with pytest.raises(ValueError, match=r"reference_factor=1 makes the tsit5 column's finest"):
        convergence_study(["lie", "tsit5"], [2, 4], reference_factor=1)
    # One epsilon gave a "slope" fitted to one point (0.293, exit 0).
    with pytest.raises(ValueError, match=r"at least two distinct epsilons, got \[0.1\]"):
        convergence_study(formulation="relaxed", epsilons=(0.1,))
    assert cli.main(["convergence", "--formulation", "relaxed", "--epsilons", "0.1"]) == 2
    assert "A slope in epsilon needs at least two distinct epsilons" in capsys.readouterr().err


def test_a_scheme_that_does_not_fit_the_equation_is_bad_input(capsys, monkeypatch):
    """A Strang sequence that is no permutation of the equation's terms was a column
    of "failed" cells after the reference solve, with exit 0; an unbalanced name was
    reported as an unknown scheme '1'. Both are refused before any solve."""
    from ocformer.analysis import _convergence, convergence_study

    solved = []
    monkeypatch.setattr(_convergence, "study_input", lambda *a: solved.append(1))
    for sequence in ("strang(0,0,1)", "strang(5)", "strang()"):
        with pytest.raises(ValueError, match=rf"scheme '{re.escape(sequence)}' does not fit the"):
            convergence_study(["lie", sequence], [1, 2])
        assert cli.main(["convergence", "--schemes", f"lie,{sequence}", "--steps", "1,2"]) == 2
        err = capsys.readouterr().err
        assert "must be a permutation of the 2 term indices (0, 1)" in err
    assert not solved
    assert cli.main(["convergence", "--schemes", "lie,strang(1,0", "--steps", "1,2"]) == 2
    assert "unbalanced parentheses in 'lie,strang(1,0'" in capsys.readouterr().err


def test_a_plot_is_written_whole_in_the_format_of_its_extension(tmp_path, capsys, monkeypatch):
    """--plot x.xyz ended in a traceback after the whole study (exit 1), and a name
    without an extension wrote another file (name.png): both are refused before
    computing; a .pdf or .svg name gets that format, written whole."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("computed before checking the plot's format")

    with monkeypatch.context() as m:
        m.setattr("ocformer.analysis._convergence.convergence_study", must_not_run)
        for name, words in (("x.xyz", "its extension .xyz names no image format"),
                            ("noext", "it has no extension")):  # fmt: skip
            assert cli.main(["convergence", "--steps", "2,4", "--plot", str(tmp_path / name)]) == 2
            err = capsys.readouterr().err
            assert words in err and "nothing was computed" in err and "Traceback" not in err
    argv = ["convergence", "--schemes", "lie", "--steps", "1,2"]
    for name, magic in (("p.pdf", b"%PDF"), ("p.svg", b"<?xml"), ("p.png", b"\x89PNG")):
        assert cli.main([*argv, "--plot", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(magic)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pdf", "p.png", "p.svg"]
    # The command closes its figures (a caller's process keeps no figure of its own).
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []
    assert cli.main([*argv, "--plot", str(tmp_path / "p.pgf")]) == 2  # needs LaTeX


def test_a_refusal_names_the_command_and_its_options(capsys):
    """The library's refusal in the command line's words: the program, then
    ``--relaxation-eps 0.01`` and ``--formulation pre`` for its keyword arguments."""
    assert cli.main(["convergence", "--steps", "2,4", "--relaxation-eps", "0.01"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ocformer.analysis: error: --relaxation-eps 0.01 is the epsilon")
    assert "got --formulation pre. Use --formulation relaxed." in err


def test_options_a_study_does_not_read_are_refused(capsys):
    """The error in epsilon of the relaxed formulation solves the relaxed model alone:
    ``--schemes`` and ``--steps`` given to it were ignored without a word, as a
    ``--relaxation-eps`` of 0 reached the library under its keyword's name."""
    assert cli.main(["convergence", "--formulation", "relaxed", "--schemes", "lie"]) == 2
    err = capsys.readouterr().err
    assert "does not read --schemes: drop it, or add --relaxation-eps EPS" in err, err
    argv = ["convergence", "--formulation", "relaxed", "--schemes", "lie", "--steps", "4,8"]
    assert cli.main(argv) == 2
    assert "does not read --schemes or --steps: drop them" in capsys.readouterr().err
    for eps in ("0", "-1", "nan", "inf", "x"):
        assert cli.main(["convergence", "--relaxation-eps", eps]) == 2
        err = capsys.readouterr().err
        assert f"argument --relaxation-eps: expected a finite number > 0, got '{eps}'" in err
