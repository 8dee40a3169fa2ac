"""Which fields of a configuration section were set explicitly.

A field set to its default value and a field left unset hold the same value, so the
value cannot tell them apart; where it matters (the architecture fields that a
pretrained start, ``model.init_from``, fixes), the configuration edge records it:

- an experiment file: while ``load_experiment`` runs its ``get_config``, each section
  built by a recording class (``records_set_fields``) notes the fields passed to its
  constructor, by keyword or position;
- ``--set section.field=value`` (``apply_overrides``): the field is noted as set.

A section built outside an experiment file (in library code, or read back from a
stored ``config.json``), or by a call that passes every field (``dataclasses.replace``
does), has no such record: for it a field counts as set when it differs from its
default, the only evidence left. The record is not a field: it does not change the
section's value, its equality, ``to_dict`` or ``config.json``.
"""

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")

_RECORD = "_ocformer_set_fields"
_recording: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ocformer_recording_set_fields", default=False
)


class SetFields(NamedTuple):
    """A section's record: ``names`` were set explicitly; ``complete`` says whether the
    other fields are known to be unset (else they count as set when they differ from
    their defaults)."""

    names: frozenset[str]
    complete: bool


_UNKNOWN = SetFields(frozenset(), False)


def records_set_fields(cls: type[T]) -> type[T]:
    """Make the frozen dataclass ``cls`` record, while ``recording()`` is active, which
    fields each construction was given."""
    init = cls.__init__
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)  # type: ignore[arg-type]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        given = frozenset(names[: len(args)]) | frozenset(kwargs)
        if _recording.get() and len(given) < len(names):
            # Every field given is a copy (dataclasses.replace): it says nothing.
            object.__setattr__(self, _RECORD, SetFields(given, True))

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Sections built inside the block record the fields they were given."""
    token = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(token)


def set_fields(section: Any) -> SetFields:
    """The record of ``section`` (unknown when it has none)."""
    return vars(section).get(_RECORD, _UNKNOWN)


def is_set(section: Any, name: str) -> bool:
    """Whether field ``name`` of ``section`` was set explicitly (see the module
    docstring; without a complete record, whether it differs from its default)."""
    record = set_fields(section)
    if name in record.names:
        return True
    if record.complete:
        return False
    f = {f.name: f for f in dataclasses.fields(section)}[name]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return getattr(section, name) != default


def without_field(section: T, name: str) -> T:
    """``section`` with field ``name`` back at its default, recorded as unset."""
    f = {f.name: f for f in dataclasses.fields(section)}[name]  # type: ignore[arg-type]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    record = set_fields(section)
    updated = dataclasses.replace(section, **{name: default})  # type: ignore[type-var]
    object.__setattr__(updated, _RECORD, SetFields(record.names - {name}, record.complete))
    return updated


def with_field(section: T, name: str, value: Any) -> T:
    """``section`` with field ``name`` set to ``value``, recorded as set explicitly."""
    record = set_fields(section)
    updated = dataclasses.replace(section, **{name: value})  # type: ignore[type-var]
    object.__setattr__(updated, _RECORD, SetFields(record.names | {name}, record.complete))
    return updated
