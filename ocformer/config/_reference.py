"""The configuration reference of docs/training.md, written from the schema itself."""

import dataclasses

from ..dynamics import SUB_SOLVERS
from ..integration import GRADIENT_METHODS, STEPSIZES
from ..splitting import SCHEMES
from ._schema import SECTIONS, Config
from ._validate import _type_name, field_types, section_class

# Fields whose allowed values come from a registry, not from the schema.
_REGISTRY_ALLOWED = {
    "discretisation.stepper": " / ".join(repr(s) for s in SCHEMES)
    + ", or a diffrax solver name (below)",
    "discretisation.sub_solver": " / ".join(repr(s) for s in SUB_SOLVERS),
    "discretisation.stepsize": " / ".join(repr(s) for s in STEPSIZES),
    "discretisation.gradient": " / ".join(repr(g) for g in GRADIENT_METHODS),
}


def _allowed(path: str, meta) -> str:
    if path in _REGISTRY_ALLOWED:
        return _REGISTRY_ALLOWED[path]
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
                f"| `{path}` | {type_name} | `{default!r}` | {_allowed(path, f.metadata)} | {doc} |"
            )
    return "\n".join(lines) + "\n"
