"""Experiment files and ``--set`` overrides.

An experiment file is a Python file with ``get_config(arg: str | None) -> Config``;
``--config path.py:arg`` passes ``arg``, and ``get_config`` refuses an argument it does
not know (raising ``ValueError`` that names the allowed ones). A file that cannot be
imported, or a ``get_config`` that raises, is reported as a ``ConfigError`` naming the
file and line, never as a traceback. ``--set section.field=value`` parses ``value``
by the field's declared type, so ``--set train.steps=1e3`` is refused rather than
silently truncated. Both record which fields they set explicitly (``_explicit``), so
that a field set to its default value is told apart from one left unset.
"""

import dataclasses
import importlib.util
import os
import traceback
import types
import typing
from typing import Any

from ..tasks import TASKS
from ._explicit import recording, with_field, without_field
from ._schema import Config
from ._validate import (
    ConfigError,
    check_keys,
    field_types,
    section_class,
    unread_task_options,
    validate,
)

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


def _parse_scalar(path: str, text: str, tp) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if type(None) in args and text.strip().lower() in _NONE:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _parse_scalar(path, text, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(path, f"cannot parse {text!r} as {tp}".replace("typing.", ""))
    if origin is tuple:
        body = text.strip()
        if body.startswith("(") and body.endswith(")"):
            body = body[1:-1]
        items = [s.strip() for s in body.split(",") if s.strip()]
        (elem, *_) = typing.get_args(tp)
        return tuple(_parse_scalar(path, s, elem) for s in items)
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(
            path, f"expected a bool (true/false; also 1/0, yes/no, on/off), got {text!r}"
        )
    if tp is int:
        try:
            return int(text.strip())
        except ValueError:
            raise ConfigError(path, f"expected an int, got {text!r}") from None
    if tp is float:
        try:
            return float(text.strip())
        except ValueError:
            raise ConfigError(path, f"expected a float, got {text!r}") from None
    if tp is str:
        return text
    raise ConfigError(path, f"fields of type {tp} cannot be set from the command line")


def parse_override(text: str) -> tuple[str, Any]:
    """``"section.field=value"`` -> (dotted key, value parsed by the field's type)."""
    if "=" not in text:
        raise ConfigError(
            "--set",
            f"bad --set syntax {text!r}; expected section.field=value, e.g. --set train.steps=100",
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    f = check_keys(key)
    if f is None:
        raise ConfigError(
            key,
            f"--set needs a field, not a whole section; e.g. --set {key}."
            f"{dataclasses.fields(section_class(key))[0].name}=...",
        )
    section, name = key.split(".")
    tp = field_types(section_class(section))[name]
    return key, _parse_scalar(key, raw, tp)


def apply_overrides(config: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """``config`` with every ``section.field=value`` override applied, in order."""
    if isinstance(overrides, str):  # iterated, it would be one override per character
        raise ConfigError(
            "--set",
            f"overrides must be a list of 'section.field=value' strings, got the string "
            f"{overrides!r}: give [{overrides!r}]",
        )
    keys = set()
    for text in overrides:
        key, value = parse_override(text)
        section, name = key.split(".")
        updated = with_field(getattr(config, section), name, value)
        config = dataclasses.replace(config, **{section: updated})
        keys.add(key)
    if "task.name" in keys and config.task.name in TASKS:  # an unknown name is refused later
        # Another task than the experiment's: the options the experiment gave its own
        # task, and the new one does not read, are not the researcher's request here
        # (smoke.py's task.vocab_size under --set task.name=tokens). They go back to
        # their defaults; one given by --set stays, and validation refuses it.
        task = config.task
        for name in unread_task_options(task.name):
            if f"task.{name}" not in keys:
                task = without_field(task, name)
        config = dataclasses.replace(config, task=task)
    return config


def load_experiment(spec: str) -> Config:
    """The ``Config`` of ``path/to/experiment.py[:arg]`` (not yet validated)."""
    path, arg = spec, None
    if ":" in spec:
        head, tail = spec.rsplit(":", 1)
        if head.endswith(".py"):
            path, arg = head, tail
    if not path.endswith(".py"):
        raise ConfigError(
            "--config", f"expected a Python experiment file path/to/name.py[:arg], got {spec!r}"
        )
    if not os.path.isfile(path):
        raise ConfigError(
            "--config",
            f"experiment file {path!r} does not exist (cwd {os.getcwd()}); see experiments/ "
            "for the available ones",
        )
    name = "ocformer_experiment_" + os.path.splitext(os.path.basename(path))[0]
    spec_ = importlib.util.spec_from_file_location(name, path)
    if spec_ is None or spec_.loader is None:
        raise ConfigError("--config", f"cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec_)
    try:
        spec_.loader.exec_module(module)
    except SyntaxError as e:
        where = f"{e.filename or path}, line {e.lineno}"
        raise ConfigError(
            "--config", f"experiment file {where}: SyntaxError: {e.msg}; fix the file"
        ) from None
    except (Exception, SystemExit) as e:  # an experiment file runs arbitrary code
        raise ConfigError(
            "--config", f"experiment file {_where(e, path)}: importing it raised {_what(e)}"
        ) from None
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError("--config", f"{path} defines no get_config(arg: str | None) -> Config")
    try:
        with recording():  # the fields its sections are given count as set
            config = get_config(arg)
    except (Exception, SystemExit) as e:
        raise ConfigError(
            "--config", f"{spec}: get_config({arg!r}) raised {_what(e)} (at {_where(e, path)})"
        ) from None
    if not isinstance(config, Config):
        raise ConfigError(
            "--config",
            f"{path}: get_config returned {type(config).__name__}, expected ocformer.config.Config",
        )
    return config


def _what(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _where(error: BaseException, path: str) -> str:
    """``file, line n`` of the innermost frame of ``error`` in the experiment file (the
    innermost frame overall if none is in it)."""
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
    frame = (inside or frames or [None])[-1]
    if frame is None:
        return path
    return f"{frame.filename}, line {frame.lineno}"


def resolve(spec: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load an experiment file, apply ``--set`` overrides and validate."""
    return validate(apply_overrides(load_experiment(spec), overrides))
