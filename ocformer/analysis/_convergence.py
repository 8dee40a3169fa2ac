r"""Measured orders of convergence of the time discretisations.

For a scheme of order p, the error at $T$ against a reference solution behaves like
$C\,\delta t^p$; the slope of $\log(\text{error})$ against $\log\delta t$ (least squares
over the step sizes) is the measured order. The model is a small random float64
Transformer with smooth (``Basis``) controls, so that the continuous limit is a smooth
non-autonomous ODE and the asymptotic regime is reached at a few steps per layer.
"""

import io
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._counts import whole_number
from ..checkpointing import atomic_write_bytes
from ..controls._init import init_stacked_params
from ..controls._make import make_control
from ..integration import Discretisation
from ..models import ContinuousTransformer, IncompatibleError, reformulate
from ..operators import Activation
from ..splitting import SCHEMES, SOLVERS, AbstractSplittingSolver, Strang

STUDY_FORMULATIONS: tuple[str, ...] = ("pre", "projected", "relaxed")
REFERENCE_SOLVER = "tsit5"
# The reference's steps per layer over the finest studied (``reference_factor``).
REFERENCE_FACTOR = 8
# The finest reference grid a study builds (per layer): past it the arrays outgrow any
# machine (10^11 steps asked 17.5 TiB) before a word was said.
MAX_REFERENCE_STEPS_PER_LAYER = REFERENCE_FACTOR * 4096


def _log_points(dts: Sequence[float], errors: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """log(dt) and log(error), refusing what has no logarithm or no slope."""
    x, y = np.asarray(dts, float), np.asarray(errors, float)
    if x.ndim != 1 or x.shape != y.shape or len(x) < 2:
        raise ValueError(
            f"A slope needs two or more step sizes and as many errors; got {len(x)} step "
            f"sizes and {len(y)} errors."
        )
    for name, v in (("step size", x), ("error", y)):
        bad = [float(a) for a in v if not (np.isfinite(a) and a > 0)]
        if bad:
            exact = " (an error of 0 is exact there: leave that point out)" if 0 in bad else ""
            raise ValueError(
                f"A log-log slope needs positive, finite values; got {name}s {bad}{exact}."
            )
    return np.log(x), np.log(y)


def fitted_slope(dts: Sequence[float], errors: Sequence[float]) -> float:
    """Least-squares slope of log(error) against log(dt).

    Raises:
        ValueError: for fewer than two points, lengths that differ, or a step size or
            error that is not positive and finite.
    """
    x, y = _log_points(dts, errors)
    return float(np.polyfit(x, y, 1)[0])


def local_slopes(dts: Sequence[float], errors: Sequence[float]) -> list[float]:
    """The slopes of log(error) against log(dt) between consecutive points: where they
    settle is the asymptotic order, which a fit over all points may average away.

    Raises:
        ValueError: as ``fitted_slope``.
    """
    x, y = _log_points(dts, errors)
    return [float(s) for s in np.diff(y) / np.diff(x)]


def study_model(
    formulation: str = "pre",
    seed: int = 0,
    *,
    num_layers: int = 3,
    width: int = 8,
    hidden: int = 16,
    num_heads: int = 2,
    num_basis: int = 3,
    perturb: float = 0.2,
    init_scale: float = 0.5,
    activation: Activation = "gelu",
) -> ContinuousTransformer:
    r"""A small random float64 model with smooth controls for order measurements.

    Per-layer parameters from ``init_stacked_params``, every bias and layer-norm value
    perturbed by ``perturb`` times a standard normal (so that $\sigma_1, \sigma_2$ and
    the biases vary in t), fitted by a Legendre basis with ``num_basis`` terms.
    ``"pre"``: pre-LN with per-feature layer norms; ``"projected"``/``"relaxed"``:
    post-LN with the paper's scalar sets in the projected formulation (the limit the
    relaxation converges to), solved by Tsit5 until another discretisation is chosen
    with ``ocformer.models.rediscretise``.

    The hidden activation defaults to GELU: with ReLU the field has a kink wherever a
    hidden unit changes sign, so it is only Lipschitz in u and every method above
    second order degrades to about 2 (measured: Tsit5 and Bosh3 both give slope 2.0
    with ReLU); the splitting schemes' orders are unaffected.
    """
    if formulation not in STUDY_FORMULATIONS:
        raise ValueError(f"formulation must be one of {STUDY_FORMULATIONS}, got {formulation!r}.")
    if not jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]
        raise ValueError(
            "Order measurements need float64 (errors down to 1e-9): call "
            "jax.config.update('jax_enable_x64', True) first."
        )
    k_init, k_pert = jr.split(jr.PRNGKey(seed))
    post = formulation != "pre"
    values = init_stacked_params(
        k_init,
        num_layers,
        width,
        hidden,
        norm_affine="scalar" if post else "feature",
        init_scale=init_scale,
        dtype=jnp.float64,
    )
    # Perturb the vectors and scalars (biases, layer-norm sets), not the kernels: each
    # leaf gets its own key.
    leaves, treedef = jtu.tree_flatten(values)
    keys = jr.split(k_pert, len(leaves))
    leaves = [
        x + perturb * jr.normal(k, x.shape, x.dtype) if x.ndim <= 2 else x
        for k, x in zip(keys, leaves)
    ]
    values = jtu.tree_unflatten(treedef, leaves)
    control = make_control("basis", values, num_basis=num_basis)
    return ContinuousTransformer(
        control,
        norm="post" if post else "pre",
        num_heads=num_heads,
        activation=activation,
        formulation="projected" if post else "split",
        discretisation=Discretisation(SOLVERS[REFERENCE_SOLVER]()),
    )


def _study_formulation(formulation: str | None, model: ContinuousTransformer | None) -> str:
    """The study's formulation: the one asked for, which ``model`` must be of, or the
    model's own (``"pre"`` without a model)."""
    if model is None:
        return "pre" if formulation is None else formulation
    own = model.formulation
    if own == "split":
        own = "pre" if model.norm == "pre" else None
    what = f"norm={model.norm!r}, formulation={model.formulation!r}"
    if own is None:
        raise ValueError(
            f"the model given ({what}) is of no study formulation: the split one is "
            "studied pre-LN; reformulate a post-LN model to 'projected' "
            "(ocformer.models.reformulate), or give study_model(formulation)."
        )
    if formulation is None:
        return own
    if not (formulation == own or (formulation == "relaxed" and own == "projected")):
        raise ValueError(
            f"formulation={formulation!r} does not describe the model given ({what}): the "
            "study would measure the model's own dynamics under another name. Leave "
            "formulation out to study the model as it is, or give a model of that "
            "formulation (ocformer.models.reformulate, or study_model(formulation))."
        )
    return formulation


def study_input(model: ContinuousTransformer, seed: int = 0, tokens: int = 6) -> jax.Array:
    """A random embedded input u(0) of shape (tokens, d)."""
    return jr.normal(jr.PRNGKey(seed + 1), (tokens, model.width), jnp.float64)


def study_stepper(name: str):
    """The time stepper of a study column (a splitting scheme or a diffrax solver).

    Splitting schemes whose splitting is of order >= 2 get second-order (explicit
    midpoint) sub-flows, since Euler sub-steps would cap them at order 1.
    ``"strang(1,0,2)"`` is Strang with that ``sequence`` (midpoint sub-flows too).
    """
    match = re.fullmatch(r"strang\(([\d,\s]*)\)", name)
    if match:
        sequence = tuple(int(i) for i in match.group(1).split(",") if i.strip())
        return Strang(sub_solver="midpoint", sequence=sequence)
    if name in SCHEMES:
        scheme = SCHEMES[name]()
        if scheme.splitting_order(2) >= 2:
            scheme = SCHEMES[name](sub_solver="midpoint")  # pyright: ignore[reportCallIssue]
        return scheme
    if name in SOLVERS:
        return SOLVERS[name]()
    raise ValueError(
        f"Unknown scheme {name!r}; splitting schemes: {', '.join(SCHEMES)} (Strang with "
        f"a sequence as e.g. strang(1,0,2)); diffrax solvers: {', '.join(SOLVERS)}."
    )


def _error(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)))


def convergence_study(
    schemes: Sequence[str] = ("lie", "strang"),
    steps: Sequence[int] = (4, 8, 16, 32, 64),
    *,
    formulation: str | None = None,
    seed: int = 0,
    reference_factor: int = REFERENCE_FACTOR,
    epsilons: Sequence[float] = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3),
    relaxed_solver: str = "kencarp5",
    relaxed_steps: int = 32,
    relaxation_eps: float | None = None,
    model: ContinuousTransformer | None = None,
) -> dict:
    r"""Errors at T against a reference and the fitted orders, for each scheme.

    The reference is Tsit5 (fifth order) on the smooth formulation at
    ``reference_factor`` times the finest step count: its error, about
    $(\delta t_{\min}/8)^5$, is far below every measured error, and since it integrates
    the ODE (for ``"projected"``: with the $\dot\sigma$ terms in the field) rather than
    the split terms (where the moving set enters as a projection), agreement also checks
    that each scheme is consistent with that ODE.

    For ``"relaxed"`` the study instead reports the error of the relaxed model (solved
    by ``relaxed_solver`` at ``relaxed_steps`` steps per layer, with the relaxation
    implicit) against the projected-dynamics reference for each epsilon, and the fitted
    slope in epsilon (expected 1); ``schemes`` and ``steps`` are then unused. With
    ``relaxation_eps`` given, ``"relaxed"`` is instead studied like the other
    formulations: each scheme over ``steps`` on the relaxed equation with that epsilon,
    against Tsit5 on the same equation (at ``reference_factor`` times the finest step
    count, and at least $1/\epsilon$ steps per layer so that the explicit reference is
    stable and resolves the relaxation); each scheme's entry also holds ``dt_over_eps``.

    Args:
        schemes: names from ``ocformer.splitting.SCHEMES`` or ``ocformer.splitting.SOLVERS``.
        steps: steps per layer.
        formulation: ``"pre"`` (smooth pre-LN), ``"projected"`` or ``"relaxed"``
            (post-LN); default: that of ``model``, else ``"pre"``. A ``model`` must
            be of it (``"relaxed"``: a projected or relaxed model).
        seed: seeds the model and the input.
        reference_factor: the reference's step count relative to the finest.
        epsilons, relaxed_solver, relaxed_steps: the relaxation study.
        relaxation_eps: study the schemes on the relaxed formulation at this epsilon
            (only with ``formulation="relaxed"``).
        model: a model to study instead of ``study_model(formulation, seed)``.

    Returns:
        A JSON-ready dict: the set-up, and per scheme the step counts, step sizes,
        errors, fitted slope, local slopes, the scheme's ``order()``, and the sub-solver
        used (with a note when it was chosen for the scheme), and the study's
        ``steps_per_layer``; for ``"relaxed"``, per epsilon. A step count the rules
        refuse for a scheme, whose solve fails or is not finite, or whose error is 0
        (no logarithm), is left out of its column and listed under its ``skipped``
        (step count, status ``refused``, ``failed`` or ``exact``, reason); a scheme
        left with fewer than two counts is recorded as ``{"status": ..., "reason":
        ...}``. The other schemes are computed either way.
    """
    if isinstance(schemes, str):  # iterated, it would be one scheme per character
        raise ValueError(
            f"schemes must be a list of names, got the string {schemes!r}: give [{schemes!r}]."
        )
    if not schemes:
        raise ValueError("No scheme given; give e.g. ['lie', 'strang'].")
    if len(set(schemes)) < len(schemes):  # one column per name
        raise ValueError(f"A scheme is given twice: {list(schemes)}.")
    formulation = _study_formulation(formulation, model)
    steppers = {name: study_stepper(name) for name in schemes}  # unknown names first
    if relaxation_eps is not None:
        if formulation != "relaxed":
            raise ValueError(
                f"relaxation_eps={relaxation_eps!r} is the epsilon of the relaxed "
                f"formulation; got formulation={formulation!r}. Use formulation='relaxed'."
            )
        if not relaxation_eps > 0:
            raise ValueError(f"relaxation_eps must be > 0, got {relaxation_eps!r}.")
    eps_study = formulation == "relaxed" and relaxation_eps is None
    # The arguments before any model is built.
    given = list(np.asarray(steps).tolist() if hasattr(steps, "shape") else steps)
    if any(whole_number(m) is None for m in given):
        raise ValueError(f"Step counts must be whole numbers >= 1, got {given}.")  # not truncated
    if (whole_number(reference_factor) or 0) < 1:
        raise ValueError(f"reference_factor must be a whole number >= 1, got {reference_factor!r}.")
    if reference_factor == 1 and not eps_study and REFERENCE_SOLVER in schemes:
        raise ValueError(
            f"reference_factor=1 makes the {REFERENCE_SOLVER} column's finest solve the "
            "reference itself (an error of 0); give reference_factor >= 2"
        )
    steps = sorted(int(m) for m in given)
    if steps and steps[0] < 1:
        raise ValueError(f"Step counts must be >= 1, got {steps}.")
    if not eps_study and len(set(steps)) < 2:
        raise ValueError(f"A slope needs at least two distinct step counts, got {steps}.")
    if eps_study and len(set(epsilons)) < 2:
        raise ValueError(
            f"A slope in epsilon needs at least two distinct epsilons, got {list(epsilons)}."
        )
    if eps_study and not all(math.isfinite(e) and e > 0 for e in epsilons):
        raise ValueError(f"Epsilons must be finite and > 0, got {list(epsilons)}.")
    if len(set(steps)) < len(steps) or len(set(epsilons)) < len(epsilons):
        raise ValueError(f"A step count or epsilon is given twice: {steps}, {list(epsilons)}.")
    if model is None:
        model = study_model(formulation, seed)
    if not eps_study:
        for name, stepper in steppers.items():
            _check_fits(name, stepper, model, steps[0], formulation)  # before any solve
    u0 = study_input(model, seed)
    t0, t1 = model.control.interval
    length = (t1 - t0) / model.num_layers
    ref_steps = reference_factor * (relaxed_steps if eps_study else steps[-1])
    if relaxation_eps is not None:
        ref_steps = max(ref_steps, math.ceil(length / relaxation_eps))
    if ref_steps > MAX_REFERENCE_STEPS_PER_LAYER:
        raise ValueError(
            f"the reference would take {ref_steps} steps per layer ({reference_factor} times "
            "the finest step count, and at least 1/relaxation_eps for the explicit "
            "reference), more "
            f"than {MAX_REFERENCE_STEPS_PER_LAYER}; study fewer steps or a larger "
            "relaxation_eps"
        )
    ref_discretisation = Discretisation(SOLVERS[REFERENCE_SOLVER](), steps_per_layer=ref_steps)
    if relaxation_eps is not None:
        model = reformulate(
            model,
            formulation="relaxed",
            relaxation_eps=float(relaxation_eps),
            discretisation=ref_discretisation,
        )
    ref_form = "projected" if eps_study else model.formulation
    reference = reformulate(model, formulation=ref_form, discretisation=ref_discretisation)
    u_ref = reference(u0)
    out: dict = dict(
        formulation=formulation,
        seed=seed,
        model=dict(
            norm=model.norm,
            num_layers=model.num_layers,
            width=model.width,
            tokens=int(u0.shape[0]),
            control=type(model.control).__name__,
        ),
        reference=dict(solver=REFERENCE_SOLVER, steps_per_layer=ref_steps, formulation=ref_form),
        error="max |u_h(T) - u_ref(T)|",
    )
    if not eps_study:
        out["steps_per_layer"] = steps
    if relaxation_eps is not None:
        out["relaxation_eps"] = float(relaxation_eps)
    if eps_study:
        out["relaxation"] = _relaxation_study(
            model, u0, u_ref, epsilons, relaxed_solver, relaxed_steps
        )
        return out
    out["schemes"] = {
        name: _scheme_study(name, steppers[name], model, u0, u_ref, steps, length, relaxation_eps)
        for name in schemes
    }
    return out


def _check_fits(name: str, stepper, model, steps_per_layer: int, formulation: str) -> None:
    """Refuse a splitting scheme whose sequence or groups do not fit the study's
    equation (``strang(0,0,1)`` on the two terms of pre-LN, say): bad input, not a
    cell that failed. A pair the rules refuse is the cell's own ``refused``.

    Raises:
        ValueError: naming the scheme and the equation's terms.
    """
    if not isinstance(stepper, AbstractSplittingSolver):
        return
    try:
        reformulate(model, discretisation=Discretisation(stepper, steps_per_layer=steps_per_layer))
    except IncompatibleError:
        return
    except ValueError as e:
        raise ValueError(
            f"scheme {name!r} does not fit the terms of the {formulation} formulation: {e}"
        ) from None


def _relaxation_study(model, u0, u_ref, epsilons, solver: str, steps_per_layer: int) -> dict:
    """The relaxed model's error against the projected-dynamics reference ``u_ref`` for
    each epsilon, and its fitted slope in epsilon."""
    errors = []
    for eps in epsilons:
        relaxed = reformulate(
            model,
            formulation="relaxed",
            relaxation_eps=float(eps),
            discretisation=Discretisation(
                SOLVERS[solver](), steps_per_layer=steps_per_layer, rtol=1e-10, atol=1e-12
            ),
        )
        errors.append(_error(relaxed(u0), u_ref))
    return dict(
        solver=solver,
        steps_per_layer=steps_per_layer,
        epsilons=[float(e) for e in epsilons],
        errors=errors,
        slope=fitted_slope(epsilons, errors),
        expected_order=1,
    )


def _scheme_study(
    name: str, stepper, model, u0, u_ref, steps: Sequence[int], length: float,
    relaxation_eps: float | None,
) -> dict:  # fmt: skip
    """One scheme's column: its errors against ``u_ref`` over ``steps`` per layer and
    the fitted order. A step count the rules refuse, whose solve fails or is not
    finite, or whose error is 0 is left out and listed under ``skipped`` (with its
    status and reason), the slopes fitted on the others; with fewer than two left the
    column is ``{"status": "refused" | "failed" | "exact", "reason": ...}`` (the study
    goes on with the other schemes)."""
    splitting = isinstance(stepper, AbstractSplittingSolver)
    sub_solver = stepper.sub_solver if splitting else None  # a diffrax solver has none
    computed, errors, dts, skipped = [], [], [], []
    expected = None
    for m in steps:
        try:
            discrete = reformulate(
                model,
                discretisation=Discretisation(stepper, steps_per_layer=m, rtol=1e-10, atol=1e-12),
            )
            expected = discrete.order()
            error = _error(discrete(u0), u_ref)
        except IncompatibleError as e:
            skipped.append(dict(steps_per_layer=m, status="refused", reason=str(e)))
            continue
        except Exception as e:  # a failing cell is recorded; the study goes on
            skipped.append(
                dict(steps_per_layer=m, status="failed", reason=f"{type(e).__name__}: {e}")
            )
            continue
        if not (math.isfinite(error) and error > 0):  # no logarithm: no slope through it
            status, reason = (
                ("exact", "the error is 0 (equal to the reference)")
                if error == 0
                else ("failed", f"the error is {error} (the solution is not finite)")
            )
            skipped.append(dict(steps_per_layer=m, status=status, reason=reason))
            continue
        computed.append(m)
        errors.append(error)
        dts.append(length / m)
    if len(computed) < 2:  # no slope: the scheme's column is its first refusal
        first = skipped[0]
        counts = [c["steps_per_layer"] for c in skipped]
        at = "" if len(skipped) == len(steps) else f" (computed only at {computed})"
        return dict(
            status=first["status"],
            reason=f"at steps per layer {counts}{at}: {first['reason']}",
        )
    entry: dict[str, Any] = dict(
        status="ok",
        steps_per_layer=computed,
        dt=dts,
        errors=errors,
        slope=fitted_slope(dts, errors),
        local_slopes=local_slopes(dts, errors),
        expected_order=expected,
        sub_solver=sub_solver,
    )
    if skipped:
        entry["skipped"] = skipped
    if relaxation_eps is not None:
        entry["dt_over_eps"] = [dt / relaxation_eps for dt in dts]
    if sub_solver not in (None, "euler"):
        why = (
            "since Euler sub-steps would make a second-order splitting first order"
            if expected is not None and expected >= 2
            else "as the study's other splittings do (this one is first order with any sub-flows)"
        )
        entry["note"] = f"{name}: its explicit sub-flows use the {sub_solver} rule, {why}."
    return entry


def format_table(result: dict) -> str:
    """The study as a plain-text table."""
    eps = f" eps={result['relaxation_eps']:g}" if "relaxation_eps" in result else ""
    lines = [
        f"formulation={result['formulation']}{eps} seed={result['seed']} "
        f"reference={result['reference']['solver']} at "
        f"{result['reference']['steps_per_layer']} steps/layer; error = {result['error']}"
    ]
    if "relaxation" in result:
        r = result["relaxation"]
        lines.append(f"relaxation ({r['solver']}, {r['steps_per_layer']} steps/layer)")
        lines.append(f"{'eps':>10}  {'error':>10}")
        for e, err in zip(r["epsilons"], r["errors"]):
            lines.append(f"{e:>10.1e}  {err:>10.3e}")
        lines.append(f"slope in eps: {r['slope']:.3f} (expected {r['expected_order']})")
        return "\n".join(lines)
    cells = result["schemes"]
    names = list(cells)
    ok = [n for n in names if cells[n]["status"] == "ok"]
    # A column is at least two spaces wider than its name ("strang(2,1,0)", "implicit_euler").
    w = max([14, *(len(n) + 2 for n in names)])
    lines.append(f"{'steps/layer':>12}" + "".join(f"{n:>{w}}" for n in names))

    def cell(n, key, fmt, m=None):
        """The value of scheme ``n`` (at step count ``m``, or over the pair ``m``), or
        the status of what stands in its place."""
        c = cells[n]
        if c["status"] != "ok":
            return f"{c['status']:>{w}}"
        if m is None:
            return f"{format(c[key], fmt):>{w}}"
        computed = c["steps_per_layer"]
        pairs = list(zip(computed, computed[1:]))
        index = pairs.index(m) if isinstance(m, tuple) and m in pairs else None
        if isinstance(m, int) and m in computed:
            index = computed.index(m)
        if index is not None:
            return f"{format(c[key][index], fmt):>{w}}"
        wanting = {s["steps_per_layer"]: s["status"] for s in c.get("skipped", [])}
        missing = [wanting[k] for k in (m if isinstance(m, tuple) else (m,)) if k in wanting]
        return f"{(missing or ['-'])[0]:>{w}}"

    steps = result.get("steps_per_layer") or (cells[ok[0]]["steps_per_layer"] if ok else [])
    for m in steps:
        lines.append(f"{m:>12d}" + "".join(cell(n, "errors", ".3e", m) for n in names))
    pairs = list(zip(steps, steps[1:]))
    for n in ok:  # a scheme's own pair across a count it skipped (2-8 without 4)
        computed = cells[n]["steps_per_layer"]
        pairs += [p for p in zip(computed, computed[1:]) if p not in pairs]
    for a, b in sorted(pairs):
        label = f"local {a}-{b}"
        lines.append(
            f"{label:>12}" + "".join(cell(n, "local_slopes", ".3f", (a, b)) for n in names)
        )
    lines.append(f"{'slope':>12}" + "".join(cell(n, "slope", ".3f") for n in names))
    lines.append(f"{'order()':>12}" + "".join(cell(n, "expected_order", "") for n in names))
    if "relaxation_eps" in result and steps:
        first = cells[ok[0]]  # dt / eps = (layer length / eps) / m, for every m
        per_layer = first["dt_over_eps"][0] * first["steps_per_layer"][0]
        dt_over_eps = ", ".join(f"{per_layer / m:g}" for m in steps)
        lines.append(f"dt/eps at these steps/layer: {dt_over_eps}")
    for n in names:
        if "note" in cells[n]:
            lines.append(f"note: {cells[n]['note']}")
        if cells[n]["status"] != "ok":
            lines.append(f"{n} {cells[n]['status']}: {cells[n]['reason']}")
        for skip in cells[n].get("skipped", []):
            m = skip["steps_per_layer"]
            lines.append(f"{n} {skip['status']} at {m} steps/layer: {skip['reason']}")
    return "\n".join(lines)


# The image formats matplotlib writes by itself (pgf needs LaTeX, avif a Pillow plugin).
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def plot_format(path: str) -> str:
    """The image format of a plot written to ``path``: its extension, one matplotlib
    writes (png, pdf, svg, ...).

    Raises:
        ValueError: no extension, or one matplotlib does not write.
    """
    formats = PLOT_FORMATS
    ext = os.path.splitext(path)[1][1:].lower()
    if ext not in formats:
        what = f"its extension .{ext}" if ext else "it has no extension, which"
        raise ValueError(
            f"{path}: {what} names no image format the plot is written in; end the "
            "name in .png, .pdf or .svg (or "
            f"{', '.join(f'.{f}' for f in sorted(set(formats) - {'png', 'pdf', 'svg'}))})"
        )
    return ext


def plot_study(result: dict, path: str | None = None, ax=None):
    """A log-log plot of error against step size (or epsilon), with the fitted slopes.

    Args:
        result: a ``convergence_study`` result.
        path: also save the figure here, whole or not at all, in the format of its
            extension (``plot_format``: .png, .pdf, .svg, ...).
        ax: draw on these matplotlib axes (default: a new figure).

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: ``path`` names no format matplotlib writes (nothing is drawn).
    """
    import matplotlib.pyplot as plt

    image = None if path is None else plot_format(path)

    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 4))
    else:
        fig = ax.figure
    from matplotlib.ticker import NullFormatter

    if "relaxation" in result:
        r = result["relaxation"]
        ax.loglog(r["epsilons"], r["errors"], "o-", label=f"slope {r['slope']:.2f}")
        ax.set_xlabel("epsilon")
        xs = set(r["epsilons"])
    else:
        xs = set()
        for name, r in result["schemes"].items():
            if r["status"] != "ok":
                continue
            ax.loglog(r["dt"], r["errors"], "o-", label=f"{name} (slope {r['slope']:.2f})")
            xs.update(r["dt"])
        ax.set_xlabel("dt")
    if xs:  # ticks at the points themselves: the minor labels of a short decade overlap
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sorted(xs), [f"{x:.3g}" for x in sorted(xs)])
    ax.set_ylabel("error at T")
    ax.set_title(f"formulation={result['formulation']}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if path is not None:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format=image, dpi=120)
        atomic_write_bytes(path, buffer.getvalue())
    return fig
