# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Adjoint gradients and costates
#
# Training differentiates a scalar loss $J$ through the solve of
# $\dot u = f(t, u; \theta(t))$. The gradient methods of `ocformer.integration`:
#
# - **discretise-then-optimise** backpropagates through the steps: the *exact* gradient
#   of the discrete model that is evaluated; **direct** computes the same another way;
# - **optimise-then-discretise** solves the continuous costate equation
#   $\dot a = -(\partial_u f)^\top a$ backward: the gradient of the *continuous*
#   problem, off the exact one by the discretisation error.
#
# Float64 central finite differences are the referee. Then the costate
# $\lambda_n = dJ/du_n$ at every step and sub-step, the per-layer gradient density,
# post-LN against pre-LN, and random against trained controls. Everything is computed by
# `ocformer.analysis`; set `OCFORMER_RUN` to a work directory to analyse your own run
# (`ocformer.training.load_run`).

# %%
import os
import tempfile

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

jax.config.update("jax_enable_x64", True)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ocformer import analysis  # noqa: E402
from ocformer.config import (  # noqa: E402
    Config,
    DiscretisationConfig,
    ModelConfig,
    TaskConfig,
    TrainConfig,
)
from ocformer.models import rediscretise  # noqa: E402
from ocformer.objective import Objective, in_precision  # noqa: E402
from ocformer.splitting import Strang  # noqa: E402
from ocformer.sweeping import plain_log_xaxis  # noqa: E402
from ocformer.training import build, load_run, train  # noqa: E402

SMALL = os.environ.get("OCFORMER_NOTEBOOK_SMALL") == "1"
FIGURES = os.environ.get("OCFORMER_FIGURES")  # where `make notebooks` puts the PNGs
RUN = os.environ.get("OCFORMER_RUN")


def save(fig, name):
    if FIGURES:
        fig.savefig(os.path.join(FIGURES, name), dpi=110, bbox_inches="tight")


# %% [markdown]
# ## The model
#
# A small float64 pre-LN language model on the copy task, solved by Heun with 4 steps
# per layer, or the trained run in `OCFORMER_RUN`.


# %%
def toy_config(steps=0, **discretisation):
    return Config(
        model=ModelConfig(num_layers=3, width=8, hidden=16, num_heads=2, dtype="float64"),
        discretisation=DiscretisationConfig(
            **{"stepper": "heun", "steps_per_layer": 4, **discretisation}
        ),
        task=TaskConfig(name="copy", seq_len=6, vocab_size=5, batch_size=8),
        train=TrainConfig(steps=steps, eval_every=max(steps, 1), progress=False),
    )


if RUN:
    config, model = load_run(RUN)
    model = in_precision(model, jnp.float64)  # finite differences need float64
else:
    config = toy_config()
    model = build(config).model
task = build(config).task
batch = {k: jnp.asarray(v) for k, v in task.batch("train", 0, 4, 0).items()}
objective = Objective()


@eqx.filter_jit
def loss(m):
    return objective(m, batch)[0]


print(model.transformer.discretisation)

# %% [markdown]
# ## Every gradient method against finite differences

# %%
check = analysis.gradient_check(loss, model, directions=2 if SMALL else 4)
for name, entry in check["methods"].items():
    if entry["status"] == "ok":
        print(f"{name:>26}: |<g,v> - FD| / |FD| = {entry['fd_error']:.2e}")
    else:
        print(f"{name:>26}: refused ({entry['reason'][:80]}...)")

# %% [markdown]
# The exact methods agree with finite differences to the finite-difference error
# itself; optimise-then-discretise is off by its discretisation error at this grid.

# %% [markdown]
# ## The gap against the step count and the solver tolerance

# %%
steps = (1, 4) if SMALL else (1, 2, 4, 8, 16, 32)
comparison = analysis.gradient_comparison(
    steps_per_layer=steps,
    methods=("discretise_then_optimise", "optimise_then_discretise"),
    solver="heun",
    seed=0,
)
otd = comparison["methods"]["optimise_then_discretise"]

rtols = (1e-2, 1e-4) if SMALL else (1e-3, 1e-5, 1e-7)
tolerance_gaps = []
for rtol in rtols:
    adaptive = rediscretise(
        model, stepper=diffrax.Tsit5(), stepsize="pid", rtol=rtol, atol=1e-2 * rtol
    )
    r = analysis.gradient_check(
        loss,
        adaptive,
        methods=("discretise_then_optimise", "optimise_then_discretise"),
        directions=2,
    )
    tolerance_gaps.append(
        [
            r["methods"][n]["fd_error"]
            for n in ("discretise_then_optimise", "optimise_then_discretise")
        ]
    )
tolerance_gaps = np.array(tolerance_gaps)

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.loglog(
    comparison["steps_per_layer"],
    otd["gaps"],
    "o-",
    label="OtD vs DtO (numbers: local slope in dt)",
)
# Each segment carries its local slope in dt: the coarse grids are pre-asymptotic, and
# the local slopes show where the order settles, which one fitted slope would blur.
for m0, m1, g0, g1, slope in zip(
    steps, steps[1:], otd["gaps"], otd["gaps"][1:], otd["local_slopes"]
):
    ax1.annotate(
        f"{slope:.2f}",
        (np.sqrt(m0 * m1), np.sqrt(g0 * g1)),
        xytext=(4, 4),
        textcoords="offset points",
        fontsize=8,
    )
plain_log_xaxis(ax1, ticks=steps)
ax1.set_xlabel("steps per layer m (Heun)")
ax1.set_ylabel("relative gradient gap")
ax1.grid(True, which="both", alpha=0.3)
ax1.legend()
ax2.loglog(rtols, tolerance_gaps[:, 1], "o-", label="optimise-then-discretise")
ax2.loglog(rtols, tolerance_gaps[:, 0], "s-", label="discretise-then-optimise")
ax2.set_xlabel("rtol (Tsit5, PID, atol = rtol/100)")
ax2.set_ylabel("|<g,v> - FD| / |FD|")
ax2.grid(True, which="both", alpha=0.3)
ax2.legend()
fig.tight_layout()
save(fig, "adjoint_gradient_gap.png")
plt.show()
print(
    "Optimise-then-discretise differs from the exact gradient by "
    + ", ".join(f"{g:.3g}" for g in otd["gaps"])
    + f" at m = {', '.join(map(str, steps))}; local slopes in dt "
    + ", ".join(f"{s:.2f}" for s in otd["local_slopes"])
    + f" (Heun is second order). Under adaptive Tsit5 its distance "
    f"to finite differences goes from {tolerance_gaps[0, 1]:.2g} at rtol = {rtols[0]:g} to "
    f"{tolerance_gaps[-1, 1]:.2g} at rtol = {rtols[-1]:g}, while discretise-then-optimise "
    f"stays at {tolerance_gaps[:, 0].max():.1g} or below."
)

# %% [markdown]
# Left: the continuous adjoint is not the gradient of the network on its own coarse
# grid; as the grid is refined it approaches it, at the local slopes printed under the
# plot (compare them with Heun's second order). Right: under adaptive steps both
# approach the finite differences as the tolerance shrinks, and neither is exact: the
# accepted step sizes depend on $\theta$, finite differences see that dependence, and
# backpropagation through the steps treats them as constants (the numbers are printed
# under the plot).

# %% [markdown]
# ## The costate across depth
#
# $\lambda_n = dJ/du_n$ at every step, for several step counts: as m grows the discrete
# costates approach the continuous costate $a(t)$. Strang adds the costate after each
# of its sub-flows.

# %%
u0, key_mask, terminal = analysis.terminal_loss(model, batch)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
costate_steps = (1, 4) if SMALL else (1, 4, 16)
start_norms = {}
for m in costate_steps:
    c = analysis.costates(
        rediscretise(model.transformer, steps_per_layer=m), u0, terminal, key_mask=key_mask
    )
    name = type(model.transformer.discretisation.stepper).__name__
    ax1.plot(c.ts, c.norms, "o-" if m < 4 else "-", ms=3, label=f"{name}, m = {m}")
    start_norms[m] = float(c.norms[0])
ax1.set_xlabel("t (layers)")
ax1.set_ylabel(r"$|\lambda(t)|$")
ax1.legend()
strang = rediscretise(model.transformer, stepper=Strang(sub_solver="midpoint"), steps_per_layer=2)
s = analysis.costates(strang, u0, terminal, key_mask=key_mask, substeps=True)
ax2.plot(s.sub_ts, s.sub_norms, ".", label="after each sub-flow")
ax2.plot(s.ts, s.norms, "o", mfc="none", label="step ends")
ax2.set_xlabel("t (sub-steps ordered within each step)")
ax2.set_ylabel(r"$|\lambda|$ (Strang, m = 2)")
ax2.legend()
fig.tight_layout()
save(fig, "adjoint_costates.png")
plt.show()
print(
    "|lambda(0)| by steps per layer: "
    + ", ".join(f"m = {m}: {v:.4f}" for m, v in start_norms.items())
    + f"; |lambda(T)| = {float(c.norms[-1]):.4f}. Strang: {s.sub_norms.shape[0]} sub-state "
    f"costates, the last of each step equal to the step-end costate."
)

# %% [markdown]
# As m grows the discrete costates settle onto the continuous costate $a(t)$ (the
# printed $|\lambda(0)|$ converge).

# %% [markdown]
# ## Gradient density per layer

# %%
density = analysis.gradient_density(model.transformer, u0, terminal, key_mask=key_mask)
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.step(density.ts, density.density, where="mid")
ax.set_xlabel("t (layers)")
ax.set_ylabel(r"$|dJ/d\theta(t)|$")
fig.tight_layout()
plt.show()
print(
    "Per-layer gradient norms |dJ/dtheta_k| (the density integrated over each layer): "
    + ", ".join(f"{x:.4f}" for x in np.asarray(density.per_layer_norms))
)

# %% [markdown]
# ## Post-LN (projected, non-smooth at the set) against pre-LN (smooth)
#
# The post-LN equation in its projected formulation (on $S_1$, each step followed by the
# projection) against the smooth pre-LN ODE, on the study models of the convergence
# notebook, Tsit5 at several step counts: the gap of the continuous adjoint to the exact
# gradient, measured against finite differences.

# %%
u_study = None
rows = []
study_steps = (2, 4) if SMALL else (2, 4, 8)
for formulation in ("pre", "projected"):
    study = analysis.study_model(formulation)
    u_study = analysis.study_input(study)
    weights = jr.normal(jr.key(7), u_study.shape, jnp.float64)
    for m in study_steps:
        discrete = rediscretise(study, steps_per_layer=m)
        r = analysis.gradient_check(
            lambda t, w=weights, u=u_study: jnp.sum(w * t(u)),
            discrete,
            methods=("optimise_then_discretise",),
            directions=2,
        )
        rows.append((formulation, m, r["methods"]["optimise_then_discretise"]["fd_error"]))
fig, ax = plt.subplots(figsize=(6, 4))
for formulation in ("pre", "projected"):
    ms = [m for f, m, _ in rows if f == formulation]
    gaps = [g for f, _, g in rows if f == formulation]
    ax.loglog(
        ms, gaps, "o-", label=f"{formulation} (slope {-analysis.fitted_slope(ms, gaps):.2f} in dt)"
    )
ax.set_xlabel("steps per layer m (Tsit5)")
ax.set_ylabel("OtD: |<g,v> - FD| / |FD|")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
save(fig, "adjoint_post_vs_pre.png")
plt.show()
print(
    "Optimise-then-discretise against finite differences: "
    + "; ".join(f"{f} m = {m}: {g:.2e}" for f, m, g in rows)
)

# %% [markdown]
# Both continuous adjoints converge to the finite differences as m grows; the projected
# post-LN dynamics, whose discrete steps end with a projection onto $S_1$, start much
# further off at coarse grids than the smooth pre-LN ODE (the numbers are printed above).

# %% [markdown]
# ## Random against trained controls
#
# The same model after a short training run (copy task, float64) in a temporary
# directory: where along depth the gradient and the costate concentrate.

# %%
with tempfile.TemporaryDirectory() as workdir:
    trained_config = toy_config(steps=2 if SMALL else 100)
    summary = train(trained_config, workdir)
    _, trained = load_run(workdir)
initial = build(trained_config).model
# The copy task's batch (with OCFORMER_RUN, `batch` is the run's).
toy = build(trained_config).task
toy_batch = {k: jnp.asarray(v) for k, v in toy.batch("train", 0, 4, 0).items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for label, m in (("random", initial), ("trained", trained)):
    u0, key_mask, terminal = analysis.terminal_loss(m, toy_batch)
    c = analysis.costates(m.transformer, u0, terminal, key_mask=key_mask)
    d = analysis.gradient_density(m.transformer, u0, terminal, key_mask=key_mask)
    toy_loss = float(objective(m, toy_batch)[0])
    ax1.plot(c.ts, c.norms, label=f"{label} (J = {toy_loss:.3f})")
    ax2.plot(range(len(d.per_layer_norms)), d.per_layer_norms, "o-", label=label)
    print(
        label,
        "loss",
        round(toy_loss, 4),
        "per-layer |dJ/dtheta|",
        np.round(np.asarray(d.per_layer_norms), 4),
    )
ax1.set_xlabel("t (layers)")
ax1.set_ylabel(r"$|\lambda(t)|$")
ax1.legend()
ax2.set_xlabel("layer")
ax2.set_ylabel(r"$|dJ/d\theta_k|$")
ax2.legend()
fig.tight_layout()
save(fig, "adjoint_random_vs_trained.png")
plt.show()
print(f"After {summary['step']} training steps the validation loss is {summary['val_loss']:.3f}.")
