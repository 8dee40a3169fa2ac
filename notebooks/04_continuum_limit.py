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
# # The continuum limit of a trained model
#
# Training fixes the controls $\theta(t)$; the discretisation is chosen at evaluation.
# Is a trained network a good discretisation of its own continuous equation? We
# evaluate it at other step counts, schemes and solvers and measure the distance of
# $u(T)$ and of the loss to a fine reference (Tsit5, 32 steps per layer), with
# `ocformer.analysis.discretisation_study`.
#
# The models are two short runs trained here: piecewise-constant controls under Lie with
# one step per layer (the standard network), and smooth (Legendre basis) controls under
# Heun with two steps per layer. Set `OCFORMER_RUN` to a work directory to analyse that
# run instead (`OCFORMER_RUN=../runs/shakespeare_char` for the one `make train` writes).

# %%
import os
import tempfile

import diffrax
import matplotlib.pyplot as plt  # noqa: E402

from ocformer import analysis  # noqa: E402
from ocformer.config import (  # noqa: E402
    Config,
    ControlsConfig,
    DiscretisationConfig,
    ModelConfig,
    ObjectiveConfig,
    TaskConfig,
    TrainConfig,
)
from ocformer.integration import Discretisation  # noqa: E402
from ocformer.splitting import Lie, Strang  # noqa: E402
from ocformer.training import build, load_run, train  # noqa: E402

SMALL = os.environ.get("OCFORMER_NOTEBOOK_SMALL") == "1"
FIGURES = os.environ.get("OCFORMER_FIGURES")
RUN = os.environ.get("OCFORMER_RUN")


def save(fig, name):
    if FIGURES:
        fig.savefig(os.path.join(FIGURES, name), dpi=110, bbox_inches="tight")


# %% [markdown]
# ## The trained models


# %%
def short_run(kind, stepper, steps_per_layer):
    return Config(
        model=ModelConfig(num_layers=4, width=16, hidden=32, num_heads=2),
        controls=ControlsConfig(kind=kind, basis_size=4),
        # Constraints project stored values; a basis stores coefficients, so none here.
        objective=ObjectiveConfig(sigma_floor=None),
        discretisation=DiscretisationConfig(stepper=stepper, steps_per_layer=steps_per_layer),
        task=TaskConfig(name="sort", seq_len=8, vocab_size=8, batch_size=16),
        train=TrainConfig(
            steps=3 if SMALL else 300, eval_every=3 if SMALL else 300, progress=False
        ),
    )


runs = {}
if RUN:
    runs[os.path.basename(os.path.normpath(RUN))] = load_run(RUN)
else:
    workdir = tempfile.mkdtemp(prefix="ocformer_continuum_")
    for label, config in {
        "piecewise constant, Lie m=1": short_run("piecewise_constant", "lie", 1),
        "basis, Heun m=2": short_run("basis", "heun", 2),
    }.items():
        path = os.path.join(workdir, label.split(",")[0].replace(" ", "_"))
        summary = train(config, path)
        print(f"{label}: validation loss {summary['val_loss']:.3f} after {summary['step']} steps")
        runs[label] = load_run(path)

# %% [markdown]
# ## Other step counts, schemes and solvers

# %%
steps = (1, 2, 4) if SMALL else (1, 2, 4, 8)
candidates = {f"lie m={m}": Discretisation(Lie(), steps_per_layer=m) for m in steps}
candidates |= {
    f"strang m={m}": Discretisation(Strang(sub_solver="midpoint"), steps_per_layer=m) for m in steps
}
candidates |= {f"heun m={m}": Discretisation(diffrax.Heun(), steps_per_layer=m) for m in steps}
reference = Discretisation(diffrax.Tsit5(), steps_per_layer=8 if SMALL else 32)
studies = {}
for label, (config, model) in runs.items():
    batch = build(config).task.batch("validation", 0, 4 if SMALL else 16, 0)
    studies[label] = analysis.discretisation_study(model, batch, candidates, reference)

fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for i, (label, study) in enumerate(studies.items()):
    for family, marker in (("lie", "o"), ("strang", "s"), ("heun", "^")):
        rows = [study["results"][f"{family} m={m}"] for m in steps]
        ms = [m for m, r in zip(steps, rows) if r["status"] == "ok"]
        axes[0].loglog(
            ms,
            [r["u_distance"] for r in rows if r["status"] == "ok"],
            marker + ("-" if i == 0 else "--"),
            color=f"C{i}",
            label=f"{label}: {family}",
        )
        axes[1].loglog(
            ms,
            [max(r["loss_gap"], 1e-16) for r in rows if r["status"] == "ok"],
            marker + ("-" if i == 0 else "--"),
            color=f"C{i}",
        )
axes[0].set_ylabel(r"max $|u_h(T) - u_{ref}(T)|$")
axes[1].set_ylabel(r"$|J_h - J_{ref}|$")
for ax in axes:
    ax.set_xlabel("steps per layer m")
    ax.grid(True, which="both", alpha=0.3)
axes[0].legend(fontsize=7)
fig.tight_layout()
save(fig, "continuum_limit.png")
plt.show()
for label, study in studies.items():
    ref = study["reference"]["loss"]
    print(f"{label}: reference loss {ref:.4f}")
    for name in (
        "lie m=1",
        f"lie m={steps[-1]}",
        "heun m=1",
        f"heun m={steps[-1]}",
        f"strang m={steps[-1]}",
    ):
        r = study["results"][name]
        print(
            f"   {name:>12}: |u - u_ref| = {r['u_distance']:.3g}, loss {r['loss']:.4f} "
            f"(gap {r['loss_gap']:.3g})"
        )

# %% [markdown]
# Read the printed numbers: a network trained at one Lie step per layer can fit its own
# grid (its loss there can be far below the loss of the same controls at the fine
# reference), and at m = 1 refining moves u(T) far (the printed |u - u_ref|). Every
# scheme approaches the reference as m grows, at its order, once m is in the asymptotic
# regime; how soon that happens depends on how large the trained field is, for smooth
# controls as well.
