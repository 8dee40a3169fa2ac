"""From a ``Sweep`` to its points: resolved, validated configurations with readable
names and a hash of what they run.

Every point is resolved exactly as ``python -m ocformer.train`` resolves its command
line: the base experiment file, then ``--set`` overrides parsed by each field's type,
then validation. A point's work directory is ``<slug>-<hash>``: the slug says which
axis values it has, the hash (of the resolved configuration) says what it runs, so a
changed sweep never reuses a directory that ran something else.
"""

import dataclasses
import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..config import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_experiment,
    parse_override,
    to_dict,
    validate as validate_config,
)
from ..evaluation import check_evaluation_field, evaluation_config
from ..training import build
from ._spec import SEED_FIELD, Axis, Sweep, SweepError, experiment_path, format_value

# Sweep points never draw a progress bar: their output goes to log files.
QUIET = "train.progress=false"


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A trained point evaluated under other discretisation fields.

    Attributes:
        labels: axis name -> label of each evaluation axis.
        settings: field -> value it changes.
        sets: the ``--set`` texts of ``python -m ocformer.evaluate``.
        name: a file name, ``<slug>-<hash>``.
    """

    labels: dict[str, str]
    settings: dict[str, Any]
    sets: tuple[str, ...]
    name: str


@dataclasses.dataclass(frozen=True)
class Point:
    """One training run of a sweep.

    Attributes:
        labels: axis name -> label, and ``"seed"``.
        settings: every swept field -> its value (the seed included).
        sets: the ``--set`` texts that make the base experiment this point.
        config: the resolved configuration as plain data.
        name: its work directory's name, ``<slug>-<hash>``.
        evaluations: its evaluation-time discretisations.
    """

    labels: dict[str, str]
    settings: dict[str, Any]
    sets: tuple[str, ...]
    config: dict
    name: str
    evaluations: tuple[Evaluation, ...]

    @property
    def seed(self) -> int:
        return int(self.settings[SEED_FIELD])


def config_hash(config_dict: dict) -> str:
    """A short hash of a resolved configuration (its JSON, keys sorted)."""
    text = json.dumps(config_dict, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "x"


def _slug_of(labels: dict[str, str]) -> str:
    """``{"L": "2", "seed": "0"}`` -> ``"L=2_seed=0"`` (file-name safe)."""
    return "_".join(f"{_clean(k)}={_clean(v)}" for k, v in labels.items())


def _same(parsed: Any, value: Any) -> bool:
    """``value`` (from a sweep file) is the value ``parsed`` (its ``--set`` text read
    back by the field's type); an int is a fine float, a NumPy scalar its Python value,
    and NaN is NaN."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(parsed, float) and isinstance(value, float) and parsed != parsed:
        return value != value  # NaN
    if isinstance(parsed, bool) or isinstance(value, bool):
        return type(parsed) is type(value) and parsed == value
    if isinstance(parsed, float) and isinstance(value, int | float):
        return parsed == float(value)
    if isinstance(parsed, tuple) and isinstance(value, tuple | list):
        return len(parsed) == len(value) and all(map(_same, parsed, value))
    return type(parsed) is type(value) and parsed == value


def _check_axis(sweep_path: str, ax: Axis, kind: str) -> None:
    for field in ax.fields:
        if field == SEED_FIELD:
            raise SweepError(
                f"{sweep_path}: {kind} axis {ax.name!r}",
                f"{SEED_FIELD} is set by the sweep's seeds (Sweep(seeds=...) or --seeds K), "
                "not by an axis",
            )
        for label, values in zip(ax.labels, ax.values):
            value = dict(zip(ax.fields, values))[field]
            where = f"{sweep_path}: {kind} axis {ax.name!r}, value {label!r}"
            if kind == "evaluation":
                try:
                    check_evaluation_field(field)
                except ConfigError as e:
                    raise SweepError(where, str(e)) from None
            _check_value(where, field, value)


def _check_value(where: str, field: str, value: Any) -> str:
    """``value``, set on ``field`` by a sweep file, as its ``--set`` text; refused naming
    ``where`` when the field's type reads it as something else."""
    text = f"{field}={format_value(value)}"
    try:
        parsed = parse_override(text)[1]
    except ConfigError as e:
        raise SweepError(where, str(e)) from None
    if not _same(parsed, value):
        # The text would parse (e.g. the string "2" for an int field), but the sweep
        # file holds a value of another type: a mistake worth naming.
        raise SweepError(
            where,
            f"{field}: expected {type(parsed).__name__}, got {value!r} ({type(value).__name__})",
        )
    return text


def _combinations(axes: Sequence[Axis]):
    for idx in itertools.product(*(range(len(a.values)) for a in axes)):
        labels, settings = {}, {}
        for a, i in zip(axes, idx):
            labels[a.name] = a.labels[i]
            settings.update(a.settings(i))
        yield labels, settings


def _shared_field_hint(base, fixed: Sequence[str], axes: Sequence[Axis], field: str) -> str:
    """What to do about a refused ``field`` that no axis sets (every point takes the
    experiment's or the overrides' value) while another point takes it: such a field
    depends on the axes (``discretisation.chunks`` is refused at the point
    ``depth_parallel=none`` and taken at ``depth_parallel=parareal``), so it is varied
    with them. Empty when an axis sets it or no point takes it."""
    swept = [f for a in axes for f in a.fields]
    if not swept or field in swept:
        return ""
    for labels, settings in _combinations(axes):
        sets = [*fixed, *(f"{f}={format_value(v)}" for f, v in settings.items())]
        try:
            validate_config(apply_overrides(base, sets))
        except ConfigError:
            continue
        return (
            f" ({field} is not an axis of the sweep, so every point takes the value of "
            f"the experiment or the sweep's overrides; point {_slug_of(labels)} takes it "
            f"and this one does not: vary it together with {', '.join(dict.fromkeys(swept))} "
            "in one zipped axis)"
        )
    return ""


def _matches(only: Sequence[tuple[str, str]], labels: dict, settings: dict) -> bool:
    for key, text in only:
        if key in settings:
            if format_value(settings[key]) != text and labels.get(key) != text:
                try:
                    if parse_override(f"{key}={text}")[1] != settings[key]:
                        return False
                except ConfigError:
                    return False
        elif labels.get(key) != text:
            return False
    return True


def parse_only(sweep: Sweep, only: Sequence[str]) -> list[tuple[str, str]]:
    """``["field=value" or "axis=label", ...]`` -> pairs, each key checked against the
    sweep's axes."""
    known_fields = {f for a in sweep.axes for f in a.fields} | {SEED_FIELD}
    known_names = {a.name for a in sweep.axes} | {"seed"}
    out = []
    for text in only:
        if "=" not in text:
            raise SweepError("--only", f"expected field=value or axis=label, got {text!r}")
        key, value = (s.strip() for s in text.split("=", 1))
        if key not in known_fields | known_names:
            raise SweepError(
                "--only",
                f"{key!r} is not an axis of this sweep; axes: "
                + ", ".join(sorted(known_names | known_fields)),
            )
        out.append((key, value))
    return out


def resolve_points(
    sweep: Sweep,
    sweep_path: str,
    *,
    seeds: int | None = None,
    only: Sequence[str] = (),
) -> tuple[str, list[Point]]:
    """The experiment spec every point starts from, and the validated points.

    Args:
        sweep: the sweep.
        sweep_path: its file (named in messages; relative experiment paths start there).
        seeds: ``K`` runs seeds ``0..K-1`` instead of the sweep's own.
        only: ``field=value`` or ``axis=label`` filters; a point is kept if it matches
            every one.

    Raises:
        SweepError: naming the file, axis, point and field at fault.
    """
    exp = experiment_path(sweep, sweep_path)
    spec = exp if sweep.arg is None else f"{exp}:{sweep.arg}"
    try:
        base = load_experiment(spec)
    except ConfigError as e:
        raise SweepError(f"{sweep_path}: experiment", str(e)) from None
    for ax in sweep.axes:
        _check_axis(sweep_path, ax, "training")
    for ax in sweep.evaluate:
        _check_axis(sweep_path, ax, "evaluation")
    fixed = [QUIET]
    for field, value in sweep.overrides.items():
        fixed.append(_check_value(f"{sweep_path}: overrides", field, value))
    seed_values = list(range(seeds)) if seeds is not None else [int(s) for s in sweep.seeds]
    if not seed_values:
        raise SweepError("--seeds", "needs at least one seed")
    filters = parse_only(sweep, only)
    evaluations = list(_combinations(sweep.evaluate)) if sweep.evaluate else []

    points = []
    for labels, settings in _combinations(sweep.axes):
        for seed in seed_values:
            labels_s = {**labels, "seed": str(seed)}
            settings_s = {**settings, SEED_FIELD: seed}
            if not _matches(filters, labels_s, settings_s):
                continue
            slug = _slug_of(labels_s)
            sets = (*fixed, *(f"{f}={format_value(v)}" for f, v in settings_s.items()))
            try:
                config = validate_config(apply_overrides(base, list(sets)))
            except ConfigError as e:
                hint = _shared_field_hint(base, fixed, sweep.axes, e.field)
                raise SweepError(f"{sweep_path}: point {slug}", f"{e}{hint}") from None
            config_dict = to_dict(config)
            evals = []
            for e_labels, e_settings in evaluations:
                e_sets = tuple(f"{f}={format_value(v)}" for f, v in e_settings.items())
                e_slug = _slug_of(e_labels)
                try:
                    e_config = evaluation_config(config, e_sets)
                except ConfigError as e:
                    raise SweepError(
                        f"{sweep_path}: point {slug}, evaluation {e_slug}", str(e)
                    ) from None
                # Only the discretisation differs: the training fields evaluation_config
                # idles are the point's own, so the trained discretisation is recognised
                # and an evaluation's name does not depend on how the run was trained.
                e_dict = to_dict(dataclasses.replace(e_config, train=config.train))
                if e_dict == config_dict:
                    continue  # the trained discretisation itself: the point's own row
                evals.append(
                    Evaluation(e_labels, e_settings, e_sets, f"{e_slug}-{config_hash(e_dict)}")
                )
            points.append(
                Point(
                    labels=labels_s,
                    settings=settings_s,
                    sets=sets,
                    config=config_dict,
                    name=f"{slug}-{config_hash(config_dict)}",
                    evaluations=tuple(evals),
                )
            )
    if not points:
        raise SweepError("--only", f"no point of {sweep_path} matches {' '.join(only)}")
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SweepError(sweep_path, f"two points resolve to the same run: {', '.join(dup)}")
    return spec, points


def check_buildable(sweep_path: str, points: Sequence[Point]) -> None:
    """Build every distinct point (seeds aside) as ``ocformer.train`` would, so that a
    combination the library refuses at build time is reported before anything runs.

    Raises:
        SweepError: naming the point and the field.
    """
    seen = set()
    for p in points:
        key = config_hash({**p.config, "train": {**p.config["train"], "seed": 0}})
        if key in seen:
            continue
        seen.add(key)
        config = from_dict(p.config)
        if config.model.dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        try:
            build(config)
        except ConfigError as e:
            raise SweepError(f"{sweep_path}: point {p.name}", str(e)) from None
        except FileNotFoundError as e:
            raise SweepError(f"{sweep_path}: point {p.name}", str(e)) from None
