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
# # A tour of ocformer
#
# A Transformer is the solution operator $u(0) \mapsto u(T)$ of a controlled
# integro-differential equation on tokens $x$ and features $y$:
#
# $$u_t = \mathcal{A}(P_{S_1}(u); \theta(t)) + \Phi(P_{S_1}(u); \theta(t)), \qquad t \in [0, L]$$
#
# (pre-LN): $\mathcal{A}$ is attention, an integral operator in $x$; $\Phi$ the
# feed-forward map; $P_{S_1}$ the layer norm, a projection; $\theta(t)$ the parameters,
# a control. One Lie step per layer of the split equation is exactly the standard layer
# stack; more steps, other schemes and solvers discretise the same equation.

# %%
import math
import os
import tempfile

import jax
import jax.numpy as jnp
import jax.random as jr

jax.config.update("jax_enable_x64", True)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ocformer import analysis  # noqa: E402
from ocformer.config import Config, ModelConfig, TaskConfig, TrainConfig  # noqa: E402
from ocformer.controls import init_stacked_params  # noqa: E402
from ocformer.convert import from_layers  # noqa: E402
from ocformer.models import rediscretise  # noqa: E402
from ocformer.operators import Attention, FeedForward, Grid  # noqa: E402
from ocformer.training import train  # noqa: E402

SMALL = os.environ.get("OCFORMER_NOTEBOOK_SMALL") == "1"
FIGURES = os.environ.get("OCFORMER_FIGURES")


def save(fig, name):
    if FIGURES:
        fig.savefig(os.path.join(FIGURES, name), dpi=110, bbox_inches="tight")


# %% [markdown]
# ## The operators on a grid
#
# Integrals over tokens and features are quadratures with spacings $h_x, h_y$
# (`Grid`). Softmax attention normalises its kernel by the same $x$-integral, so
# $h_x$ cancels: the operator is the same on any token spacing.

# %%
d, hidden, n = 8, 16, 5
theta = init_stacked_params(jr.key(0), 1, d, hidden, dtype=jnp.float64)
layer = jax.tree.map(lambda x: x[0], theta)
u = jr.normal(jr.key(1), (n, d), jnp.float64)
a_unit = Attention(num_heads=2)(layer.attention, u)
a_fine = Attention(num_heads=2, grid=Grid(h_x=0.1))(layer.attention, u)
phi = FeedForward(activation="gelu")(layer.feedforward, u)
print(
    "attention output", a_unit.shape, "| h_x = 1 vs 0.1:", float(jnp.max(jnp.abs(a_unit - a_fine)))
)
print(
    "feed-forward output",
    phi.shape,
    "| norm per token:",
    np.round(np.asarray(jnp.linalg.norm(phi, axis=-1)), 3),
)

# %% [markdown]
# ## Exact recovery of a standard layer stack
#
# A pre-LN stack of 3 layers (2 heads, GELU, LayerNorm eps 1e-5) from plain arrays,
# through `ocformer.convert.from_layers`, against an independent numpy implementation
# of the same stack written out below.

# %%
rng = np.random.default_rng(0)
L = 3


def kernel(a, b):
    return rng.standard_normal((a, b)) / np.sqrt(a)


layers = [
    dict(
        wq=kernel(d, d),
        wk=kernel(d, d),
        wv=kernel(d, d),
        wo=kernel(d, d),
        bq=0.1 * rng.standard_normal(d),
        bk=0.1 * rng.standard_normal(d),
        bv=0.1 * rng.standard_normal(d),
        bo=0.1 * rng.standard_normal(d),
        w1=kernel(d, hidden),
        b1=0.1 * rng.standard_normal(hidden),
        w2=kernel(hidden, d),
        b2=0.1 * rng.standard_normal(d),
        ln1_scale=1 + 0.1 * rng.standard_normal(d),
        ln1_bias=0.1 * rng.standard_normal(d),
        ln2_scale=1 + 0.1 * rng.standard_normal(d),
        ln2_bias=0.1 * rng.standard_normal(d),
    )
    for _ in range(L)
]


def numpy_stack(u, layers, heads=2, eps=1e-5):
    erf = np.vectorize(math.erf)

    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * g + b

    dh = u.shape[-1] // heads
    for p in layers:
        h = ln(u, p["ln1_scale"], p["ln1_bias"])
        q, k, v = h @ p["wq"] + p["bq"], h @ p["wk"] + p["bk"], h @ p["wv"] + p["bv"]
        out = []
        for i in range(heads):
            s = slice(i * dh, (i + 1) * dh)
            scores = q[:, s] @ k[:, s].T / np.sqrt(dh)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out.append((w / w.sum(-1, keepdims=True)) @ v[:, s])
        u = u + np.concatenate(out, -1) @ p["wo"] + p["bo"]
        h = ln(u, p["ln2_scale"], p["ln2_bias"]) @ p["w1"] + p["b1"]
        u = u + (0.5 * h * (1 + erf(h / np.sqrt(2)))) @ p["w2"] + p["b2"]
    return u


model = from_layers(layers, norm="pre", num_heads=2, activation="gelu", ln_eps=1e-5)
u0 = rng.standard_normal((n, d))
ours = np.asarray(model(jnp.asarray(u0)))
reference = numpy_stack(u0, layers)
print("discretisation:", model.discretisation)
err = np.max(np.abs(ours - reference))
# The difference itself is rounding noise (about 2e-15, its digits vary with the
# machine): what is printed is its bound, a float64 exactness of 1e-12 relative.
print(
    f"max |ocformer - numpy| < 1e-12 x |u(T)| max: {err < 1e-12 * np.max(np.abs(reference))} "
    f"(|u(T)| max {np.max(np.abs(reference)):.2f})"
)

# %% [markdown]
# Lie splitting with one step per layer reproduces the stack to float64 rounding (the
# bound is checked above; the difference itself is rounding noise, whose digits vary
# with the machine).

# %% [markdown]
# ## The same equation, refined
#
# More steps per layer solve the same equation more accurately: the network above is
# its coarsest discretisation. Paths of the tokens (projected on the two leading
# principal directions of u(0)) at one step per layer and at 16.

# %%
_, _, vt = np.linalg.svd(u0 - u0.mean(0), full_matrices=False)
fig, ax = plt.subplots(figsize=(5.5, 4.5))
for m, style in ((1, "o--"), (16, "-")):
    ts, ys = analysis.trajectory(rediscretise(model, steps_per_layer=m), jnp.asarray(u0))
    paths = np.asarray(ys) @ vt[:2].T  # (steps, tokens, 2)
    for i in range(n):
        ax.plot(
            paths[:, i, 0],
            paths[:, i, 1],
            style,
            color=f"C{i}",
            ms=3,
            label=f"m = {m}" if i == 0 else None,
        )
fine_end = np.asarray(rediscretise(model, steps_per_layer=16)(jnp.asarray(u0)))
ax.set_xlabel("principal direction 1")
ax.set_ylabel("principal direction 2")
ax.legend()
fig.tight_layout()
save(fig, "tour_paths.png")
plt.show()
print(
    f"max |u_1(T) - u_16(T)| = {np.max(np.abs(ours - fine_end)):.3f}: the network is "
    "not its continuous limit at one step per layer"
)

# %% [markdown]
# ## One training step
#
# `ocformer.training.train(config, workdir)` runs the loop of `python -m ocformer.train`;
# here one step on the copy task in a temporary directory.

# %%
config = Config(
    model=ModelConfig(num_layers=2, width=8, hidden=16, num_heads=2),
    task=TaskConfig(name="copy", seq_len=6, vocab_size=5, batch_size=8),
    train=TrainConfig(steps=1, eval_every=1, progress=False),
)
with tempfile.TemporaryDirectory() as workdir:
    summary = train(config, workdir)
print({k: summary[k] for k in ("step", "loss", "val_loss", "val_accuracy")})
