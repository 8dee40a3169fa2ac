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
# # The dynamics of tokens: clustering and Lyapunov exponents
#
# Each token is a particle $u_i(t) \in \mathbb{R}^d$ moved by attention (an interaction)
# and the feed-forward field. Geshkovski, Letrouit, Polyanskiy and Rigollet
# (*A mathematical perspective on Transformers*, 2023) show that self-attention
# dynamics make tokens cluster as t grows: the pairwise cosine similarities
# $\cos(u_i, u_j)$ approach 1. The finite-time Lyapunov exponents of the flow,
# $\lambda_k = \frac1T \log \sigma_k(\partial u(T)/\partial u(0))$, measure how it stretches
# perturbations of the input; they are computed as defined, from the singular values of
# the Jacobian of the discrete flow, built by Jacobian-vector products through the steps.
# Benettin's algorithm (random directions, QR re-orthonormalised) is compared at the end:
# it reaches the exponents only as $T \to \infty$. Both for a random model and a
# briefly trained one; set `OCFORMER_RUN` to analyse your own run.

# %%
import os
import tempfile

import jax
import jax.numpy as jnp

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
from ocformer.objective import in_precision  # noqa: E402
from ocformer.training import build, load_run, train  # noqa: E402

SMALL = os.environ.get("OCFORMER_NOTEBOOK_SMALL") == "1"
FIGURES = os.environ.get("OCFORMER_FIGURES")
RUN = os.environ.get("OCFORMER_RUN")


def save(fig, name):
    if FIGURES:
        fig.savefig(os.path.join(FIGURES, name), dpi=110, bbox_inches="tight")


# %% [markdown]
# ## A random and a trained model
#
# Pre-LN, 4 layers of width 16, Heun with 4 steps per layer, float64; the trained one
# after a short run on the sort task.


# %%
def config(steps):
    return Config(
        model=ModelConfig(num_layers=4, width=16, hidden=32, num_heads=2, dtype="float64"),
        discretisation=DiscretisationConfig(stepper="heun", steps_per_layer=4),
        task=TaskConfig(name="sort", seq_len=8, vocab_size=8, batch_size=16),
        train=TrainConfig(steps=steps, eval_every=max(steps, 1), progress=False),
    )


random_model, start = build(config(0)).model, "random"
if RUN:
    # The run and the model its configuration starts from (seeded, or its pretrained
    # start), in float64 and under Heun at the run's steps per layer: the Jacobians
    # below need a smooth step map.
    run_config, trained = load_run(RUN)
    start = "random" if run_config.model.init_from is None else "start"
    heun = random_model.transformer.discretisation.stepper
    trained, random_model = (
        in_precision(rediscretise(m, stepper=heun), jnp.float64)
        for m in (trained, build(run_config).model)
    )
else:
    run_config = config(3 if SMALL else 200)
    with tempfile.TemporaryDirectory() as workdir:
        print(train(run_config, workdir)["val_loss"], "validation loss after training")
        _, trained = load_run(workdir)
task = build(run_config).task
inputs = jnp.asarray(task.batch("validation", 0, 1, 0)["inputs"])
models = {start: random_model, "trained": trained}

# %% [markdown]
# ## Clustering: cosine similarities across depth

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
similarity = {}
for label, m in models.items():
    u0 = m.initial_state(inputs)[0].astype(jnp.float64)
    sim = analysis.token_similarity(m.transformer, u0)
    similarity[label] = sim
    axes[0].plot(sim.ts, sim.mean, label=f"{label}: mean")
    axes[0].plot(sim.ts, sim.min, "--", label=f"{label}: min")
axes[0].set_xlabel("t (layers)")
axes[0].set_ylabel("cosine similarity of token pairs")
axes[0].legend(fontsize=8)
for ax, (label, sim) in zip(axes[1:], similarity.items()):
    im = ax.imshow(np.asarray(sim.cosine[-1]), vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_title(f"{label}: cos(u_i(T), u_j(T))")
fig.colorbar(im, ax=axes[1:].tolist(), shrink=0.8)
save(fig, "tokens_clustering.png")
plt.show()
for label, sim in similarity.items():
    print(
        f"{label}: mean pairwise cosine {float(sim.mean[0]):.3f} at t = 0, "
        f"{float(sim.mean[-1]):.3f} at t = T; smallest {float(sim.min[0]):.3f} -> "
        f"{float(sim.min[-1]):.3f}"
    )

# %% [markdown]
# The printed means show how much the tokens align over the depth of each model.

# %% [markdown]
# ## Finite-time Lyapunov exponents, and their convergence as the step shrinks

# %%
num = 4
steps = (1, 2, 4) if SMALL else (1, 2, 4, 8, 16)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
refinement = {}
for label, m in models.items():
    u0 = m.initial_state(inputs)[0].astype(jnp.float64)
    r = analysis.lyapunov_refinement(m.transformer, u0, steps, num=num)
    refinement[label] = r
    ax1.loglog(
        r["dt"][:-1], r["distance_to_finest"][:-1], "o-", label=f"{label} (slope {r['slope']:.2f})"
    )
    lyap = analysis.model_lyapunov(rediscretise(m.transformer, steps_per_layer=steps[-1]), u0, num)
    for k in range(num):
        ax2.plot(
            lyap.ts,
            lyap.running[:, k],
            color="C0" if label == start else "C1",
            label=label if k == 0 else None,
        )
ax1.set_xlabel("dt = 1/m (Heun)")
ax1.set_ylabel("max |exponent(dt) - exponent(finest)|")
ax1.grid(True, which="both", alpha=0.3)
ax1.legend()
ax2.set_xlabel("t (layers)")
ax2.set_ylabel(f"(1/t) log sigma_k(du(t)/du(0)), m = {steps[-1]}")
ax2.legend()
fig.tight_layout()
save(fig, "tokens_lyapunov.png")
plt.show()
for label, r in refinement.items():
    print(
        f"{label}: exponents at m = {r['steps_per_layer'][-1]}:",
        np.round(r["exponents"][-1], 4),
        f"| distance to them at m = 1: {r['distance_to_finest'][0]:.2e}, slope {r['slope']:.2f}",
    )

# %% [markdown]
# The exponents converge as the step shrinks at about Heun's order (the fitted slopes
# are printed above); a positive leading exponent means the flow separates nearby
# inputs, negative ones that it contracts them (as clustering does).
#
# ## Benettin's estimate is the long-time limit, not the finite-time exponents
#
# Benettin's algorithm follows `num` random directions, re-orthonormalised after each
# step; over a finite depth it measures how those directions grow, which depends on the
# draw and differs from $\frac1T\log\sigma_k$ by $O(1/T)$. Over the depth of a model
# ($T$ its number of layers, a few here) the difference is not small: compare the
# finite-time exponents printed below with Benettin's estimates.

# %%
for label, m in models.items():
    u0 = m.initial_state(inputs)[0].astype(jnp.float64)
    fine = rediscretise(m.transformer, steps_per_layer=steps[-1])
    exact = refinement[label]["exponents"][-1]
    print(f"{label}: finite-time exponents", np.round(exact, 4))
    for seed in range(2):
        estimate = analysis.model_benettin(fine, u0, num, seed=seed).exponents
        print(f"  Benettin, seed {seed}:         ", np.round(np.asarray(estimate), 4))
