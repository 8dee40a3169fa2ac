"""Validation of a ``Config``: types, ranges, choices, and combinations that cannot work.

Every error names the dotted field, the value received and what is allowed. Validation
reads only the configuration and the names registered by the library (schemes,
solvers); it traces and allocates nothing.
"""

import dataclasses
import difflib
import types
import typing
from typing import Any

from ._schema import SECTIONS, Config


class ConfigError(ValueError):
    """A configuration that cannot run. ``field`` is the dotted path of the culprit.

    The command line reports it and exits with code 2.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_class(name: str) -> type:
    return type(getattr(Config(), name))


def _allowed_fields(section: str) -> list[str]:
    return [f"{section}.{f.name}" for f in dataclasses.fields(section_class(section))]


def check_keys(dotted: str) -> dataclasses.Field | None:
    """Check that ``dotted`` names a section or a field; suggest the nearest if not."""
    parts = dotted.split(".")
    if not dotted or len(parts) > 2 or not all(parts):
        raise ConfigError(
            dotted,
            f"malformed key {dotted!r}; keys are 'section.field' with section one of "
            f"{', '.join(SECTIONS)}",
        )
    section = parts[0]
    if section not in SECTIONS:
        near = difflib.get_close_matches(section, SECTIONS, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise ConfigError(
            dotted,
            f"unknown section {section}{hint} allowed: {', '.join(SECTIONS)}",
        )
    if len(parts) == 1:
        return None
    fields = {f.name: f for f in dataclasses.fields(section_class(section))}
    if parts[1] not in fields:
        allowed = _allowed_fields(section)
        near = difflib.get_close_matches(dotted, allowed, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise ConfigError(dotted, f"unknown field {dotted}{hint} allowed: {', '.join(allowed)}")
    return fields[parts[1]]


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _is_instance(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_is_instance(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_instance(v, args[0]) for v in value)
        return len(args) == len(value) and all(map(_is_instance, value, args))
    if tp is float:
        # An integer is a fine float; a bool is not a number here.
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _check_field(path: str, f: dataclasses.Field, tp, value) -> None:
    if not _is_instance(value, tp):
        raise ConfigError(
            path,
            f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})",
        )
    meta = f.metadata
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(path, f"got {value!r}; allowed: {', '.join(repr(c) for c in choices)}")
    if value is None or isinstance(value, str | bool | tuple):
        return
    tests = {
        "ge": (">=", lambda lim: value >= lim),
        "gt": (">", lambda lim: value > lim),
        "le": ("<=", lambda lim: value <= lim),
        "lt": ("<", lambda lim: value < lim),
    }
    for key, (sign, holds) in tests.items():
        limit = meta.get(key)
        if limit is not None and not holds(limit):
            raise ConfigError(path, f"must be {sign} {limit}, got {value!r}")


def scheme_classes() -> dict[str, type]:
    """The splitting schemes by name (``ocformer.splitting.SCHEMES``)."""
    from .. import splitting

    return dict(splitting.SCHEMES)


def _registered_schemes() -> tuple[str, ...]:
    return tuple(scheme_classes())


def _registered_solvers() -> tuple[str, ...]:
    from .. import dynamics

    return tuple(dynamics.SOLVERS)


def validate(config: Config) -> Config:
    """Check every field of ``config`` and the combinations; return it unchanged.

    Raises:
        ConfigError: naming the dotted field, the value and what is allowed.
    """
    if not isinstance(config, Config):
        raise ConfigError("", f"expected an ocformer.config.Config, got {type(config).__name__}")
    for section in SECTIONS:
        value = getattr(config, section)
        cls = section_class(section)
        if type(value) is not cls:
            raise ConfigError(section, f"expected {cls.__name__}, got {type(value).__name__}")
        hints = field_types(cls)
        for f in dataclasses.fields(cls):
            _check_field(f"{section}.{f.name}", f, hints[f.name], getattr(value, f.name))
    _check_combinations(config)
    return config


def _check_combinations(c: Config) -> None:
    m = c.model
    if m.width % m.num_heads:
        raise ConfigError(
            "model.num_heads",
            f"num_heads={m.num_heads} must divide model.width={m.width}; choose a "
            f"divisor of {m.width}",
        )
    if m.formulation != "split" and m.norm != "post":
        raise ConfigError(
            "model.formulation",
            f"formulation={m.formulation!r} is a smooth limit of post-LN; with "
            "model.norm=pre the equation is already smooth: use model.formulation=split",
        )
    schemes = _registered_schemes()
    if c.scheme.name not in schemes:
        raise ConfigError(
            "scheme.name", f"unknown scheme {c.scheme.name!r}; allowed: {', '.join(schemes)}"
        )
    smooth = c.solver.name != "scheme"
    if smooth:
        solvers = _registered_solvers()
        if c.solver.name not in solvers:
            raise ConfigError(
                "solver.name",
                f"unknown solver {c.solver.name!r}; allowed: 'scheme', "
                f"{', '.join(repr(s) for s in solvers)}",
            )
        if m.norm == "post" and m.formulation == "split":
            raise ConfigError(
                "solver.name",
                f"a diffrax solver ({c.solver.name!r}) needs a smooth vector field, but a "
                "post-LN split equation has projection terms; use model.norm=pre, or "
                "model.formulation=projected|relaxed, or solver.name=scheme",
            )
    if c.solver.stepsize == "pid":
        if not smooth:
            raise ConfigError(
                "solver.stepsize",
                "an adaptive (pid) controller needs an error estimate, which splitting "
                "schemes do not provide; set solver.name to an embedded diffrax solver "
                "(e.g. tsit5) or use solver.stepsize=constant",
            )
        if c.controls.kind == "piecewise_constant" and not c.solver.jump_ts:
            raise ConfigError(
                "solver.jump_ts",
                "an adaptive (pid) controller with piecewise-constant controls must be "
                "told the jump times (solver.jump_ts=true), or it steps across the "
                "discontinuities and fails or loses accuracy",
            )
    if c.gradient.method == "optimise_then_discretise" and not smooth:
        raise ConfigError(
            "gradient.method",
            "optimise_then_discretise (BacksolveAdjoint) integrates the adjoint equation "
            "of a smooth vector field; the splitting scheme "
            f"{c.scheme.name!r} has projection sub-flows. Use "
            "gradient.method=discretise_then_optimise, or a smooth formulation with "
            "solver.name set to a diffrax solver",
        )
    o = c.objective
    if c.controls.kind == "basis":
        if c.controls.basis_size > m.num_layers:
            raise ConfigError(
                "controls.basis_size",
                f"basis_size={c.controls.basis_size} coefficient sets are fitted to the "
                f"model.num_layers={m.num_layers} initial layers by least squares, so it "
                f"must be <= {m.num_layers}; lower controls.basis_size or add layers",
            )
        if o.sigma_floor is not None or o.kernel_norm is not None:
            raise ConfigError(
                "objective.sigma_floor",
                "constraints are enforced by projecting the stored control values, and a "
                "basis control stores expansion coefficients (clipping them neither "
                "bounds theta(t) nor projects it); set objective.sigma_floor=none and no "
                "kernel bound, or use controls.kind=piecewise_constant|piecewise_linear",
            )
    if (o.kernel_norm is None) != (o.kernel_bound is None):
        raise ConfigError(
            "objective.kernel_bound",
            "objective.kernel_norm and objective.kernel_bound go together (got "
            f"kernel_norm={o.kernel_norm!r}, kernel_bound={o.kernel_bound!r})",
        )
