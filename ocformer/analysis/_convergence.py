r"""Measured orders of convergence of the time discretisations.

For a scheme of order p, the error at $T$ against a reference solution behaves like
$C\,\delta t^p$; the slope of $\log(\text{error})$ against $\log\delta t$ (least squares
over the step sizes) is the measured order. The model is a small random float64
Transformer with smooth (``Basis``) controls, so that the continuous limit is a smooth
non-autonomous ODE and the asymptotic regime is reached at a few steps per layer.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ..controls._init import init_stacked_params
from ..controls._make import make_control
from ..dynamics._solvers import SOLVERS
from ..models._transformer import ContinuousTransformer, with_scheme
from ..operators import Activation
from ..splitting import SCHEMES

STUDY_FORMULATIONS: tuple[str, ...] = ("pre", "projected", "relaxed")
REFERENCE_SOLVER = "tsit5"


def fitted_slope(dts: Sequence[float], errors: Sequence[float]) -> float:
    """Least-squares slope of log(error) against log(dt)."""
    x, y = np.log(np.asarray(dts, float)), np.log(np.asarray(errors, float))
    return float(np.polyfit(x, y, 1)[0])


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
    relaxation converges to), solved by Tsit5 until a scheme is chosen with
    ``with_scheme``.

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
    if post:
        return ContinuousTransformer(
            control,
            norm="post",
            num_heads=num_heads,
            activation=activation,
            formulation="projected",
            solver="tsit5",
        )
    return ContinuousTransformer(
        control, norm="pre", num_heads=num_heads, activation=activation, solver="tsit5"
    )


def study_input(model: ContinuousTransformer, seed: int = 0, tokens: int = 6) -> jax.Array:
    """A random embedded input u(0) of shape (tokens, d)."""
    return jr.normal(jr.PRNGKey(seed + 1), (tokens, model.width), jnp.float64)


def scheme_options(name: str) -> dict:
    """Solver options for a scheme name (a splitting scheme or a diffrax solver).

    Splitting schemes whose splitting is of order >= 2 get second-order (explicit
    midpoint) sub-flows, since Euler sub-steps would cap them at order 1.
    """
    if name in SCHEMES:
        scheme = SCHEMES[name]()
        sub = "midpoint" if scheme.splitting_order(2) >= 2 else "euler"
        return dict(solver=scheme, sub_solver=sub)
    if name in SOLVERS:
        return dict(solver=name, sub_solver="euler")
    raise ValueError(
        f"Unknown scheme {name!r}; splitting schemes: {', '.join(SCHEMES)}; diffrax "
        f"solvers: {', '.join(SOLVERS)}."
    )


def _error(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)))


def convergence_study(
    schemes: Sequence[str] = ("lie", "strang"),
    steps: Sequence[int] = (4, 8, 16, 32, 64),
    *,
    formulation: str = "pre",
    seed: int = 0,
    reference_factor: int = 8,
    epsilons: Sequence[float] = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3),
    relaxed_solver: str = "kencarp5",
    relaxed_steps: int = 32,
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
    slope in epsilon (expected 1); ``schemes`` and ``steps`` are then unused.

    Args:
        schemes: names from ``ocformer.splitting.SCHEMES`` or ``ocformer.dynamics.SOLVERS``.
        steps: steps per layer.
        formulation: ``"pre"`` (smooth pre-LN), ``"projected"`` or ``"relaxed"``
            (post-LN).
        seed: seeds the model and the input.
        reference_factor: the reference's step count relative to the finest.
        epsilons, relaxed_solver, relaxed_steps: the relaxation study.
        model: a model to study instead of ``study_model(formulation, seed)``.

    Returns:
        A JSON-ready dict: the set-up, and per scheme the step counts, step sizes,
        errors, fitted slope, the scheme's ``order()``, and the sub-solver used (with
        a note when it was chosen for the scheme); for ``"relaxed"``, per epsilon.
        A cell (scheme, step count) that the model refuses or whose solve fails has
        error ``None`` and its reason in ``failures`` (keyed by the step count); a
        scheme refused at every step count says so once, in ``refused``. The other
        cells are computed, and the slope is fitted over those that have an error.

    Raises:
        ValueError: an unknown scheme name, or fewer than two step counts (before
            anything is computed).
    """
    options_of = {name: scheme_options(name) for name in schemes}  # unknown names first
    if model is None:
        model = study_model(formulation, seed)
    u0 = study_input(model, seed)
    steps = sorted(int(m) for m in steps)
    if formulation != "relaxed" and len(steps) < 2:
        raise ValueError(f"A slope needs at least two step counts, got {steps}.")
    t0, t1 = model.control.interval
    length = (t1 - t0) / model.num_layers
    ref_steps = reference_factor * (steps[-1] if formulation != "relaxed" else relaxed_steps)
    ref_form = "projected" if formulation == "relaxed" else model.formulation
    reference = with_scheme(
        model, solver=REFERENCE_SOLVER, formulation=ref_form, steps_per_layer=ref_steps
    )
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
    if formulation == "relaxed":
        errors = []
        for eps in epsilons:
            relaxed = with_scheme(
                model,
                solver=relaxed_solver,
                formulation="relaxed",
                relaxation_eps=float(eps),
                steps_per_layer=relaxed_steps,
                rtol=1e-10,
                atol=1e-12,
            )
            errors.append(_error(relaxed(u0), u_ref))
        out["relaxation"] = dict(
            solver=relaxed_solver,
            steps_per_layer=relaxed_steps,
            epsilons=[float(e) for e in epsilons],
            errors=errors,
            slope=fitted_slope(epsilons, errors),
            expected_order=1,
        )
        return out
    results = {}
    for name in schemes:
        options = options_of[name]
        cells: list[float | None] = []
        failures: dict[str, str] = {}
        dts = [length / m for m in steps]
        expected = None
        for m in steps:
            try:
                discrete = with_scheme(
                    model,
                    steps_per_layer=m,
                    formulation=model.formulation,
                    rtol=1e-10,
                    atol=1e-12,
                    **options,
                )
                expected = discrete.order()
                cells.append(_error(discrete(u0), u_ref))
            except (ValueError, eqx.EquinoxRuntimeError) as e:
                # A refused combination or a failed solve is this cell's result.
                cells.append(None)
                failures[str(m)] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        done = [(h, e) for h, e in zip(dts, cells) if e is not None]
        entry: dict[str, Any] = dict(
            steps_per_layer=list(steps),
            dt=dts,
            errors=cells,
            slope=fitted_slope(*zip(*done)) if len(done) >= 2 else None,
            expected_order=expected,
            sub_solver=options["sub_solver"],
        )
        if failures:
            entry["failures"] = failures
            if not done and len(set(failures.values())) == 1:
                entry["refused"] = next(iter(failures.values()))
        if options["sub_solver"] != "euler":
            entry["note"] = (
                f"{name} is a second-order splitting: its explicit sub-flows use the "
                f"{options['sub_solver']} rule (Euler sub-steps would make it first order)."
            )
        results[name] = entry
    out["schemes"] = results
    return out


def format_table(result: dict) -> str:
    """The study as a plain-text table."""
    lines = [
        f"formulation={result['formulation']} seed={result['seed']} "
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
    names = list(result["schemes"])
    steps = result["schemes"][names[0]]["steps_per_layer"]
    lines.append(f"{'steps/layer':>12}" + "".join(f"{n:>14}" for n in names))

    def cell(name: str, i: int) -> str:
        r = result["schemes"][name]
        if r["errors"][i] is not None:
            return f"{r['errors'][i]:>14.3e}"
        return f"{'refused' if 'refused' in r else 'failed':>14}"

    for i, m in enumerate(steps):
        lines.append(f"{m:>12d}" + "".join(cell(n, i) for n in names))
    slopes = [result["schemes"][n]["slope"] for n in names]
    lines.append(
        f"{'slope':>12}"
        + "".join("{:>14}".format("n/a" if s is None else f"{s:.3f}") for s in slopes)
    )
    lines.append(
        f"{'order()':>12}"
        + "".join(f"{str(result['schemes'][n]['expected_order']):>14}" for n in names)
    )
    for n in names:
        r = result["schemes"][n]
        if "note" in r:
            lines.append(f"note: {r['note']}")
        if "refused" in r:
            lines.append(f"refused: {n}: {r['refused']}")
        else:
            for m, why in r.get("failures", {}).items():
                lines.append(f"failed: {n} at {m} steps/layer: {why}")
    return "\n".join(lines)


def plot_study(result: dict, path: str) -> None:
    """A log-log plot of error against step size (or epsilon), saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    if "relaxation" in result:
        r = result["relaxation"]
        ax.loglog(r["epsilons"], r["errors"], "o-", label=f"slope {r['slope']:.2f}")
        ax.set_xlabel("epsilon")
    else:
        for name, r in result["schemes"].items():
            done = [(h, e) for h, e in zip(r["dt"], r["errors"]) if e is not None]
            if not done:
                continue  # refused: listed in the table and the JSON
            dts, errors = zip(*done)
            slope = "n/a" if r["slope"] is None else f"{r['slope']:.2f}"
            ax.loglog(dts, errors, "o-", label=f"{name} (slope {slope})")
        ax.set_xlabel("dt")
    ax.set_ylabel("error at T")
    ax.set_title(f"formulation={result['formulation']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
