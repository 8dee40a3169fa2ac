"""The package's shape: layers that read one way, private diffrax names in one module,
and a small public face."""

import importlib
import pathlib
import re
import subprocess
import sys
import tomllib
import types

import diffrax
import pytest

import ocformer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_layers_contract_holds():
    """The import-linter layers contract of pyproject.toml (every import, including
    those inside functions, follows the layers of docs/architecture.md)."""
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    out = subprocess.run(
        [str(lint), "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


def _contract_layers() -> list[set[str]]:
    """The layers of the import-linter contract, top first, each as its set of modules."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [contract] = config["tool"]["importlinter"]["contracts"]
    return [{name.strip() for name in row.split("|")} for row in contract["layers"]]


def test_contract_layers_are_required_modules_that_exist():
    # An optional layer, "(name)", would let the contract pass with the module gone.
    for layer in _contract_layers():
        for name in layer:
            assert re.fullmatch(r"\w+", name), f"layer {name!r} is optional or malformed"
            package, module = ROOT / "ocformer" / name, ROOT / "ocformer" / f"{name}.py"
            assert package.is_dir() or module.is_file(), f"no module ocformer.{name}"


def test_architecture_doc_lists_the_contract_layers():
    """The diagram of docs/architecture.md draws the contract's layers, one row each, in
    its order: a row's first column is its modules, separated by " | "."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("\n## Layers\n", 1)[1].split("```\n", 2)[1]
    drawn = []
    for line in block.splitlines():
        row = re.match(r" (\w+(?: \| \w+)*)(?:  |$)", line)
        assert row, f"docs/architecture.md: not a layer row: {line!r}"
        drawn.append(set(row.group(1).split(" | ")))
    assert drawn == _contract_layers()


def test_readme_package_table_lists_the_contract_layers():
    """The package table of README.md: one row per layer, in the contract's order."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("| layer | holds |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    drawn = []
    for line in table.splitlines():
        row = re.match(r"\| (`\w+`(?: \\\| `\w+`)*) \| ", line)
        assert row, f"README.md: not a layer row: {line!r}"
        drawn.append(set(re.findall(r"`(\w+)`", row.group(1))))
    assert drawn == _contract_layers()


def test_private_names_of_other_libraries_come_from_one_module():
    from diffrax import _root_finder, _term
    from jax._src import distributed
    from submitit.slurm import slurm

    from ocformer import _compat

    assert _compat.WrapTerm is _term.WrapTerm
    assert _compat.use_stepsize_tol is _root_finder.use_stepsize_tol
    assert _compat.jax_distributed_state is distributed.global_state
    kwargs = dict(command="true", folder="/tmp/x", map_count=2)
    assert _compat.make_sbatch_string(**kwargs) == slurm._make_sbatch_string(**kwargs)
    private = re.compile(
        r"from (diffrax|jax|equinox|optax|orbax|submitit)(\.\w+)*\._|"
        r"import (diffrax|jax|equinox|optax|orbax|submitit)(\.\w+)*\._|"
        r"from (diffrax|jax|equinox|optax|orbax|submitit)(\.\w+)* import _"
    )
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "ocformer").rglob("*.py")
        if path.name != "_compat.py" and private.search(path.read_text())
    ]
    assert offenders == []


def test_a_moved_diffrax_name_fails_with_a_clear_message(monkeypatch):
    stub = types.ModuleType("diffrax._term")  # a diffrax whose _term lost WrapTerm
    monkeypatch.setitem(sys.modules, "diffrax._term", stub)
    monkeypatch.delitem(sys.modules, "ocformer._compat")
    with pytest.raises(ImportError, match=r"needs diffrax\._term\.WrapTerm"):
        importlib.import_module("ocformer._compat")
    monkeypatch.undo()
    importlib.import_module("ocformer._compat")


def test_public_face():
    for name in (
        "ContinuousTransformer",
        "Discretisation",
        "Lie",
        "Strang",
        "Parallel",
        "Hybrid",
        "DiscretiseThenOptimise",
        "OptimiseThenDiscretise",
        "Direct",
        "rediscretise",
        "refine",
        "from_layers",
        "to_layers",
        "Config",
        "train",
    ):
        assert hasattr(ocformer, name), name
    assert isinstance(ocformer.Strang(), diffrax.AbstractSolver)
    assert ocformer.__version__ != "0+unknown"
    from ocformer import train

    assert callable(train)


def test_package_inits_export_public_names_only():
    for init in (ROOT / "ocformer").rglob("__init__.py"):
        text = init.read_text()
        for line in text.splitlines():
            if line.startswith(("from .", "    ")) and " as _" in line:
                pytest.fail(f"{init.relative_to(ROOT)} re-exports a private name: {line}")
