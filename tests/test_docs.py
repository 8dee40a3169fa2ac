"""Every Python block of README.md and docs/*.md runs as written, so examples cannot
drift from the code. Each block runs in a fresh interpreter from the repository root.

A ``print(...)`` whose line ends in a comment states what it prints, and that claim is
checked: ``# -> TEXT`` (the printed line is TEXT) or ``# ~X`` (the printed number is at
most 10 X: the order of magnitude). Any other comment on a print line is refused, so
that no printed claim goes unchecked."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from ocformer.config import reference_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


# The longest blocks (15 to 27 s each on the 2-core machine) run in the slow tier.
SLOW_BLOCKS = {"README.md#1", "README.md#2", "docs/pretrained.md#0"}


def _blocks():
    for path in DOCS:
        for i, match in enumerate(BLOCK.finditer(path.read_text(encoding="utf-8"))):
            name = f"{path.relative_to(ROOT)}#{i}"
            marks = [pytest.mark.slow] if name in SLOW_BLOCKS else []
            yield pytest.param(match.group(1), id=name, marks=marks)


def test_docs_have_python_blocks():
    assert len(list(_blocks())) >= 3


# A print statement on one line with a trailing comment: indent, arguments, claim.
CLAIMED_PRINT = re.compile(r"^(\s*)print\((.*)\)\s*#\s*(.*?)\s*$", re.M)
CLAIM_CHECK = """
import io as _io


def _claimed_print(claim, *args, **kwargs):
    buffer = _io.StringIO()
    print(*args, **kwargs, file=buffer)
    line = buffer.getvalue().strip()
    print(line)
    if claim.startswith("->"):
        expected = claim[2:].strip()
        assert line == expected, f"printed {line!r}, the text claims {expected!r}"
    else:
        bound = float(claim[1:])
        value = float(line.split()[-1])
        assert 0 <= value <= 10 * bound, f"printed {value:g}, the text claims ~{bound:g}"
"""


def with_checked_claims(code: str) -> str:
    """``code`` with each claimed print replaced by a call that checks its claim."""

    def replace(match):
        indent, args, claim = match.groups()
        if not (claim.startswith("->") or re.fullmatch(r"~[-+.eE0-9]+", claim)):
            raise ValueError(
                f"print line ends in the comment {claim!r}: state what it prints as "
                "'# -> TEXT' or '# ~NUMBER', or move the comment to the line above."
            )
        return f"{indent}_claimed_print({claim!r}, {args})"

    return CLAIM_CHECK + CLAIMED_PRINT.sub(replace, code)


def test_claim_checker_fails_on_a_false_claim():
    """The checker is not vacuous: a wrong text or magnitude fails the block."""
    for code in ("print(1 + 1)  # -> 3\n", "print(2e-12)  # ~1e-15\n"):
        out = subprocess.run(
            [sys.executable, "-c", with_checked_claims(code)], capture_output=True, text=True
        )
        assert out.returncode != 0 and "the text claims" in out.stderr
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            with_checked_claims("print(1, 2)  # -> 1 2\nprint(3e-16)  # ~1e-15\n"),
        ],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    with pytest.raises(ValueError, match="state what it prints"):
        with_checked_claims("print(1)  # one\n")


def test_docs_state_printed_claims():
    """The docs do claim printed values (the checks below are not empty)."""
    claims = [m.group(3) for c in _blocks() for m in CLAIMED_PRINT.finditer(c.values[0])]
    assert len(claims) >= 3, claims


@pytest.mark.parametrize("code", list(_blocks()))
def test_python_block_runs(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(with_checked_claims(code), encoding="utf-8")
    env = dict(os.environ)
    if "import flax" in code:
        # flax's LayerNorm picks its statistics' dtype by jnp.promote_types(dtype,
        # float32), which strict promotion refuses for the float64 reference layer such
        # a block builds; it runs under the standard rule, as a user's script does.
        env["JAX_NUMPY_DTYPE_PROMOTION"] = "standard"
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-3000:]}"


def test_configuration_reference_is_the_schema():
    """docs/training.md's field table is exactly what the schema says (regenerate it with
    ``ocformer.config.reference_table()`` after changing a field)."""
    text = (ROOT / "docs" / "training.md").read_text()
    assert reference_table() in text
