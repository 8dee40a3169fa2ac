"""The package's shape: layers that read one way, private diffrax names in one module,
and a small public face."""

import ast
import importlib
import pathlib
import re
import shlex
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


def _modules_reading_argv() -> set[str]:
    """The modules of the package that read the command line, as ``python -m`` names."""
    reads = re.compile(r"\bsys\.argv\b|\bimport argparse\b")
    out = set()
    for path in (ROOT / "ocformer").rglob("*.py"):
        if reads.search(path.read_text()):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return out


def test_the_docs_name_every_module_that_reads_argv():
    """README's package table and docs/architecture.md name the modules that read argv
    (the command-line row and the two others); exactly those read it."""
    readers = _modules_reading_argv()
    assert "ocformer.train" in readers and "ocformer.tasks.prepare" in readers  # the scan works
    readme = (ROOT / "README.md").read_text()
    [row] = [line for line in readme.splitlines() if "the only modules that read argv" in line]
    first, rest = row.split(" | ", 1)
    named = {f"ocformer.{m}" for m in re.findall(r"`(\w+)`", first)}
    named |= set(re.findall(r"`python -m (ocformer[\w.]*)`", rest))
    assert named == readers
    doc = (ROOT / "docs" / "architecture.md").read_text()
    paragraph = re.search(r"\n(\w+) modules read argv.*?\n\n", doc, re.S)
    assert paragraph, "docs/architecture.md: no paragraph on the modules that read argv"
    listed = set(re.findall(r"`(?:python -m )?(ocformer[\w.]*)`", paragraph.group(0)))
    assert listed == readers
    numbers = [
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
    ]
    assert paragraph.group(1).lower() == numbers[len(readers) - 1]


def test_every_command_line_reports_a_refusal_through_one_function(capsys):
    """The modules that read argv import ``ocformer._cli.fail`` and write no error line
    of their own, and exit through ``exit_with``, having taken charge of Ctrl-C before
    any other import; ``fail`` writes argparse's form and returns the code it is given."""
    from ocformer._cli import fail

    for module in sorted(_modules_reading_argv()):
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.is_file():
            path = ROOT / module.replace(".", "/") / "__main__.py"
        text = path.read_text()
        imported = re.findall(r"^from \.+_cli import (\([^)]*\)|.*)$", text, re.M)
        assert {"exit_with", "fail"} <= set(re.findall(r"\w+", " ".join(imported))), module
        assert re.search(r'\nif __name__ == "__main__":\n    exit_with\(main(, .+)?\)\n\Z', text), (
            module
        )
        # Ctrl-C is the command's to report from before its first heavy import.
        first_import = re.search(r"^(import|from) .*$", text, re.M)
        assert first_import and first_import[0].endswith("_cli import record_interrupts"), module
        assert not re.search(r"error: \{", text), f"{module} writes its own error line"
    assert fail("ocformer.train", 2, "bad --set") == 2
    assert fail(None, 4, "no values") == 4
    assert capsys.readouterr().err == "ocformer.train: error: bad --set\nerror: no values\n"


def test_private_names_of_other_libraries_come_from_one_module():
    from diffrax import _root_finder, _term
    from jax._src import distributed
    from submitit.slurm import slurm

    from ocformer import _compat

    assert _compat.WrapTerm is _term.WrapTerm
    assert _compat.use_stepsize_tol is _root_finder.use_stepsize_tol
    assert _compat.jax_distributed_state is distributed.global_state
    renames = slurm.SlurmExecutor._equivalence_dict()
    assert renames is not None and renames["timeout_min"] == "time"
    script = _compat.sbatch_script("/tmp/x", {"timeout_min": 5}, array_size=2)
    assert script == slurm._make_sbatch_string(
        command=f"{shlex.quote(sys.executable)} -u -m submitit.core._submit /tmp/x",
        folder="/tmp/x",
        map_count=2,
        time=5,
    )
    # Imports of private modules or names, and private module names in text (such as
    # the module a job script runs with python -m).
    private = re.compile(
        r"from (diffrax|jax|equinox|optax|orbax|submitit)(\.\w+)*\._|"
        r"import (diffrax|jax|equinox|optax|orbax|submitit)(\.\w+)*\._|"
        r"from (diffrax|jax|equinox|optax|orbax|submitit)(\.\w+)* import _|"
        r"\b(diffrax|jax|equinox|optax|orbax|submitit)(\.\w+)*\._\w"
    )
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "ocformer").rglob("*.py")
        if path.name != "_compat.py" and private.search(path.read_text())
    ]
    assert offenders == []


def _private_names() -> list[tuple[str, str]]:
    """Every ``(module, name)`` that ocformer/_compat.py resolves with ``_private``."""
    from ocformer import _compat

    tree = ast.parse((ROOT / "ocformer" / "_compat.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_private":
            module, name = (
                getattr(_compat, a.id) if isinstance(a, ast.Name) else ast.literal_eval(a)
                for a in node.args[:2]
            )
            found.append((module, name))
    return found


# Each private name, and how ocformer meets it: on import of ocformer._compat, or when
# a job script is written.
_MOVED = {
    ("diffrax._term", "WrapTerm"): "import",
    ("diffrax._root_finder", "use_stepsize_tol"): "import",
    ("diffrax._integrate", "loop"): "import",
    ("jax._src.distributed", "global_state"): "import",
    ("submitit.slurm.slurm", "_make_sbatch_string"): "job script",
    ("submitit.slurm.slurm", "SlurmExecutor._equivalence_dict"): "job script",
    ("submitit.core._submit", "submitit_main"): "job script",
}


def test_every_private_name_has_a_moved_name_test():
    assert sorted(_private_names()) == sorted(_MOVED)


@pytest.mark.parametrize("module, name", sorted(_MOVED), ids="{0[0]}.{0[1]}".format)
def test_a_moved_private_name_fails_with_a_clear_message(monkeypatch, module, name):
    """A release of the library without the name: ocformer stops with an ImportError
    that names it, instead of an AttributeError deep inside a run."""
    real = importlib.import_module(module)
    stub = types.ModuleType(module)  # the module of a release that lost the name
    head, _, rest = name.partition(".")
    if rest:  # an attribute of a class: the class stays, without it
        stub.__dict__.update(vars(real))
        setattr(stub, head, type(head, (), {}))
    monkeypatch.setitem(sys.modules, module, stub)
    monkeypatch.delitem(sys.modules, "ocformer._compat")
    message = rf"needs {re.escape(module)}\.{re.escape(name)} \("
    with pytest.raises(ImportError, match=message):
        compat = importlib.import_module("ocformer._compat")
        assert _MOVED[module, name] == "job script"
        compat.sbatch_script("/tmp/x", {"timeout_min": 5})
    monkeypatch.undo()
    importlib.import_module("ocformer._compat")


def test_sbatch_script_is_the_script_submitit_submits(monkeypatch, tmp_path):
    """The script a dry run prints is the one submitit's SLURM executor writes when it
    submits the same job: one task, and a job array as ``map_array`` makes it."""
    from submitit.slurm import slurm

    from ocformer.distributed import slurm_job

    # An executor as on a SLURM login node (SlurmExecutor looks for srun).
    monkeypatch.setattr(slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    job = slurm_job(
        str(tmp_path / "logs"),
        name="run",
        time_min=30,
        cpus_per_task=8,
        nodes=2,
        tasks_per_node=4,
        gpus_per_node=4,
        partition="gpu",
        array_parallelism=3,
    )
    executor = job.executor()._executor
    command = executor._submitit_command_str
    assert job.script() == executor._make_submission_file_text(command, "uid")
    array = slurm.SlurmExecutor(executor.folder)  # as map_array copies it
    array.update_parameters(**executor.parameters)
    array.parameters["map_count"] = 5
    script = job.script(array_size=5)
    assert script == array._make_submission_file_text(command, "uid")
    for line in ("--array=0-4%3", "--nodes=2", "--ntasks-per-node=4", "--time=30"):
        assert f"#SBATCH {line}\n" in script


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
    # The names load on first use (import ocformer imports no JAX), yet read as before:
    # a star import, and the subpackages as attributes.
    star: dict = {}
    exec("from ocformer import *", star)
    assert {"Discretisation", "from_layers", "Config", "train"} <= set(star)
    assert ocformer.models.refine is ocformer.refine
    code = "import sys, ocformer, ocformer.analysis as a; print('jax' in sys.modules)\n"
    code += "print(a._convergence.fitted_slope.__name__)  # its submodules load on first use"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "fitted_slope"], done.stderr
    # So is ocformer.analysis (`python -m ocformer.analysis` imports it first).
    exec("from ocformer.analysis import *", star)
    assert set(ocformer.analysis.__all__) == set(ocformer.analysis._EXPORTS) <= set(star)
    from ocformer import train

    assert callable(train)


def test_package_inits_export_public_names_only():
    for init in (ROOT / "ocformer").rglob("__init__.py"):
        text = init.read_text()
        for line in text.splitlines():
            if line.startswith(("from .", "    ")) and " as _" in line:
                pytest.fail(f"{init.relative_to(ROOT)} re-exports a private name: {line}")


def test_the_library_works_without_tokenizers_or_submitit():
    """``tokenizers`` (own corpora) and ``submitit`` (SLURM) are imported where they
    are used: the package, its command lines and a built-in task's experiment import
    and build on a machine that has neither."""
    code = (
        "import sys\n"
        "sys.modules['tokenizers'] = sys.modules['submitit'] = None  # import fails\n"
        "import ocformer, ocformer.train, ocformer.evaluate, ocformer.launch, ocformer.sweep\n"
        "import ocformer.analysis, ocformer.export\n"
        "from ocformer.config import resolve\n"
        "from ocformer.training import build\n"
        "build(resolve('experiments/smoke.py', []))\n"
        "print('OK')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-3000:]
