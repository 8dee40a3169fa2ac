"""The configuration reference of docs/training.md, written from the schema itself."""

import dataclasses

from ._schema import SECTIONS, Config
from ._validate import _type_name, field_types, section_class


def _allowed(meta) -> str:
    if meta.get("choices"):
        return " / ".join(repr(c) if c is not None else "None" for c in meta["choices"])
    bounds = [
        f"{op} {meta[key]}"
        for key, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        if meta.get(key) is not None
    ]
    return ", ".join(bounds)


def reference_table() -> str:
    """Every configuration field as a markdown table row: dotted name, type, default,
    allowed values and meaning, in schema order."""
    lines = [
        "| field | type | default | allowed | meaning |",
        "|---|---|---|---|---|",
    ]
    defaults = Config()
    for section in SECTIONS:
        cls = section_class(section)
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            path = f"{section}.{f.name}"
            default = getattr(getattr(defaults, section), f.name)
            type_name = _type_name(types[f.name]).replace("|", "\\|")
            doc = f.metadata.get("doc", "").replace("|", "\\|")
            lines.append(
                f"| `{path}` | {type_name} | `{default!r}` | {_allowed(f.metadata)} | {doc} |"
            )
    return "\n".join(lines) + "\n"
