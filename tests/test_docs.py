"""Every Python block of README.md and docs/*.md runs as written, so examples cannot
drift from the code. Each block runs in a fresh interpreter from the repository root."""

import pathlib
import re
import subprocess
import sys

import pytest

from ocformer.config import reference_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for path in DOCS:
        for i, match in enumerate(BLOCK.finditer(path.read_text(encoding="utf-8"))):
            yield pytest.param(match.group(1), id=f"{path.relative_to(ROOT)}#{i}")


def test_docs_have_python_blocks():
    assert len(list(_blocks())) >= 3


@pytest.mark.parametrize("code", list(_blocks()))
def test_python_block_runs(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-3000:]}"


def test_configuration_reference_is_the_schema():
    """docs/training.md's field table is exactly what the schema says (regenerate it with
    ``ocformer.config.reference_table()`` after changing a field)."""
    text = (ROOT / "docs" / "training.md").read_text()
    assert reference_table() in text
