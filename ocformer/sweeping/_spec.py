"""What a sweep is: a base experiment, axes over config fields, seeds, and optional
evaluation-time axes; and how a sweep file is loaded.

A sweep file ``experiments/sweeps/<name>.py`` defines ``get_sweep(arg=None) -> Sweep``.
Axes name config fields by their dotted path (``"model.num_layers"``), the same names
``--set`` takes, so a sweep never depends on how the config is laid out beyond them.
"""

import dataclasses
import importlib.util
import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from .._counts import whole_number


class SweepError(ValueError):
    """A sweep that cannot run. ``where`` names the file, point or field at fault.

    The command line reports it and exits with code 2.
    """

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


def format_value(value: Any) -> str:
    """A Python value as ``--set`` text that parses back to the same value."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "(" + ",".join(format_value(v) for v in value) + ")"
    return str(value)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return format_value(value)


@dataclasses.dataclass(frozen=True)
class Axis:
    """One axis of a sweep: a list of values, each setting one or more fields.

    Build it with ``axis`` (one field) or ``zipped`` (several fields varied together).

    Attributes:
        name: the axis' short name, used in labels, tables and plots.
        fields: the dotted config fields the axis sets.
        values: one tuple per value, holding a value for each of ``fields``.
        labels: one readable label per value.
    """

    name: str
    fields: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]
    labels: tuple[str, ...]

    def __post_init__(self):
        if not self.values:
            raise SweepError(
                f"axis {self.name!r}",
                f"has no values; give at least one value for {', '.join(self.fields)}",
            )
        if len(self.labels) != len(self.values):
            raise SweepError(
                f"axis {self.name!r}",
                f"{len(self.labels)} labels for {len(self.values)} values; give one label "
                "per value",
            )
        if len(set(self.labels)) != len(self.labels):
            raise SweepError(f"axis {self.name!r}", f"labels must differ, got {self.labels}")
        for f in self.fields:
            if not isinstance(f, str) or "." not in f:
                raise SweepError(
                    f"axis {self.name!r}",
                    f"a field is a dotted config name such as 'model.num_layers', got {f!r}",
                )
        for v in self.values:
            if len(v) != len(self.fields):
                raise SweepError(
                    f"axis {self.name!r}", f"value {v!r} does not set each of {self.fields}"
                )

    def settings(self, i: int) -> dict[str, Any]:
        """Field -> value of the i-th value."""
        return dict(zip(self.fields, self.values[i]))


def axis(
    field: str,
    values: Sequence[Any],
    *,
    name: str | None = None,
    labels: Sequence[str] | None = None,
) -> Axis:
    """An axis over one config field.

    Args:
        field: the dotted config field, e.g. ``"model.num_layers"``.
        values: its values (Python values of the field's type).
        name: a short name for tables and labels (default: the field's last part).
        labels: a label per value (default: the value).
    """
    values = tuple(values)
    return Axis(
        name=name or (field.rsplit(".", 1)[-1] if isinstance(field, str) else repr(field)),
        fields=(field,),
        values=tuple((v,) for v in values),
        labels=tuple(labels) if labels is not None else tuple(_short(v) for v in values),
    )


def zipped(
    name: str, settings: Mapping[str, Sequence[Any]], *, labels: Sequence[str] | None = None
) -> Axis:
    """An axis over several fields varied together: value i sets every field to its i-th
    entry, e.g. ``zipped("scheme", {"x.stepper": ["lie", "strang"], "x.sub_solver":
    ["euler", "midpoint"]}, labels=["lie", "strang-midpoint"])``.
    """
    fields = tuple(settings)
    if not fields:
        raise SweepError(
            f"axis {name!r}",
            "sets no field; give each field its values, e.g. zipped(name, "
            '{"model.num_layers": [1, 2], "model.width": [16, 32]})',
        )
    columns = [tuple(settings[f]) for f in fields]
    lengths = {len(c) for c in columns}
    if len(lengths) > 1:
        raise SweepError(
            f"axis {name!r}",
            "zipped fields need the same number of values, got "
            + ", ".join(f"{f}: {len(c)}" for f, c in zip(fields, columns)),
        )
    values = tuple(zip(*columns)) if columns else ()
    if labels is None:
        labels = tuple("-".join(_short(x) for x in v) for v in values)
    return Axis(name=name, fields=fields, values=values, labels=tuple(labels))


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A study: every combination of ``axes`` (their product), trained once per seed.

    Attributes:
        experiment: the base experiment file; a relative path is relative to the sweep
            file's folder.
        arg: the experiment's argument (``get_config(arg)``).
        overrides: fields set for every point, ``{"train.steps": 100}``.
        axes: the training axes; the points are their product.
        seeds: the values of ``train.seed``, one run per point and seed.
        evaluate: evaluation-time axes: each trained point is also evaluated with every
            combination of these (discretisation fields only), without training again.
        slurm: default SLURM options (``partition``, ``time_min``, ``cpus``, ``gpus``,
            ``nodes``, ``array_parallelism``); flags override them.
    """

    experiment: str
    arg: str | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    axes: Sequence[Axis] = ()
    seeds: Sequence[int] = (0,)
    evaluate: Sequence[Axis] = ()
    slurm: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not list(self.seeds):
            raise SweepError("seeds", "no seeds; give at least one, e.g. seeds=(0,)")
        for seed in self.seeds:
            if (n := whole_number(seed)) is None or n < 0:
                raise SweepError("seeds", f"a seed is a whole number >= 0, got {seed!r}")
        seeds = [int(s) for s in self.seeds]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1})
        if repeated:
            raise SweepError("seeds", f"seeds must differ (each is one run); repeated: {repeated}")
        names = [a.name for a in [*self.axes, *self.evaluate]]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SweepError("axes", f"axis names must differ; repeated: {', '.join(dup)}")
        for a in [*self.axes, *self.evaluate]:
            if not isinstance(a, Axis):
                raise SweepError(
                    "axes", f"expected Axis values (use axis() or zipped()), got {a!r}"
                )


SEED_FIELD = "train.seed"


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"path.py:arg"`` -> ``("path.py", "arg")``."""
    if ":" in spec:
        head, tail = spec.rsplit(":", 1)
        if head.endswith(".py"):
            return head, tail
    return spec, None


def load_sweep(spec: str) -> tuple[Sweep, str, str | None]:
    """The ``Sweep`` of ``path/to/sweep.py[:arg]``, its absolute path and argument.

    Raises:
        SweepError: the file is missing, fails to import, has no ``get_sweep`` or
            returns something else than a ``Sweep``; the message names the file.
    """
    path, arg = split_spec(spec)
    if not path.endswith(".py") or not os.path.isfile(path):
        raise SweepError(
            path,
            f"sweep file not found (cwd {os.getcwd()}); expected path/to/sweep.py[:arg], "
            "see experiments/sweeps/",
        )
    path = os.path.abspath(path)
    name = "ocformer_sweep_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise SweepError(path, "cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    what = "failed to import:"
    try:
        module_spec.loader.exec_module(module)
        get_sweep = getattr(module, "get_sweep", None)
        if not callable(get_sweep):
            raise SweepError(path, "defines no get_sweep(arg: str | None = None) -> Sweep")
        what = f"get_sweep({arg!r}) raised"
        sweep = get_sweep(arg)
    except SweepError as e:
        if e.where == path:
            raise
        raise SweepError(path, str(e)) from None
    except Exception as e:
        raise SweepError(path, f"{what} {type(e).__name__}: {e} (at {_where(e, path)})") from None
    if not isinstance(sweep, Sweep):
        raise SweepError(
            path,
            f"get_sweep returned {type(sweep).__name__}, expected ocformer.sweeping.Sweep",
        )
    return sweep, path, arg


def _where(e: Exception, path: str) -> str:
    """``file:line`` of an error raised by a sweep file: a syntax error's own place; else
    the sweep file's last frame, so that the place is not importlib's frozen machinery;
    else the innermost frame."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if os.path.abspath(f.filename) == path]
    last = (own or frames)[-1]
    return f"{last.filename}:{last.lineno}"


def experiment_path(sweep: Sweep, sweep_path: str) -> str:
    """The base experiment's absolute path."""
    if os.path.isabs(sweep.experiment):
        return sweep.experiment
    return os.path.normpath(os.path.join(os.path.dirname(sweep_path), sweep.experiment))
