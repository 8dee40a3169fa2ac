"""The continuous model through ``diffeqsolve`` against ``lax.scan`` over the same layers.

For each configuration the same random float32 layer stack is run two ways:

- ocformer: ``from_layers(...)``, the Lie scheme on the layer grid through one
  ``diffrax.diffeqsolve`` (default adjoint: ``RecursiveCheckpointAdjoint`` with one
  checkpoint per layer), compiled with ``eqx.filter_jit``;
- scan: a plain encoder layer (post-LN) or GPT-2 block (pre-LN) written directly in
  ``jax.numpy``, parameters stacked on a layer axis, iterated with ``jax.lax.scan``; and
  the same scan with ``jax.checkpoint`` on its body ("scan-remat"), the like-for-like
  comparison for a checkpointed solve.

Timed: forward + backward (``value_and_grad`` of a mean-squared loss with respect to
every parameter) and forward alone. Every function is lowered and compiled ahead of time
(compile time reported on its own), warmed up, then called in interleaved rounds so that
drift of the machine hits every candidate alike; medians and quartiles are reported,
with the ratios ``ratio_vs_scan = ocformer / scan``, ``ratio_vs_scan_remat`` and
``compile_ratio_vs_scan`` (forward + backward). Outputs and gradients of the two
implementations are compared as a guard that both compute the same thing.
"""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ocformer.convert import from_layers

from ._common import Candidate, aot_compile_phases, time_interleaved

LN_EPS = 1e-5
DTYPE = np.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark shape. ``norm="post"``: ReLU encoder (Vaswani et al.);
    ``norm="pre"``: causal GELU-tanh block with a final LayerNorm (GPT-2)."""

    name: str
    norm: str
    d: int
    heads: int
    d_ff: int
    n: int
    batch: int
    layers: int

    @property
    def causal(self) -> bool:
        return self.norm == "pre"

    @property
    def activation(self) -> str:
        return "relu" if self.norm == "post" else "gelu_tanh"

    def shapes(self) -> dict:
        return {
            "d": self.d,
            "heads": self.heads,
            "d_ff": self.d_ff,
            "N": self.n,
            "B": self.batch,
            "L": self.layers,
            "norm": self.norm,
            "causal": self.causal,
            "activation": self.activation,
            "dtype": np.dtype(DTYPE).name,
        }


NANOGPT = dict(d=128, heads=4, d_ff=512, n=64, batch=12)
QUICK = [Config("pre-L4", "pre", layers=4, **NANOGPT)]
FULL = [
    *QUICK,
    Config("pre-L12", "pre", layers=12, **NANOGPT),
    Config("post-L4", "post", layers=4, **NANOGPT),
    Config("post-L8", "post", layers=8, **NANOGPT),
    Config("post-L12", "post", layers=12, **NANOGPT),
    Config("post-L8-N256", "post", d=128, heads=4, d_ff=512, n=256, batch=4, layers=8),
]
TINY = [Config("tiny", "post", d=16, heads=2, d_ff=32, n=8, batch=2, layers=2)]


# ---------------------------------------------------------------------------------------
# The reference: a standard layer written directly in jax.numpy.


def _layer_norm(x, scale, bias):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LN_EPS) * scale + bias


def _self_attention(x, p, heads: int, causal: bool):
    b, n, d = x.shape
    dh = d // heads

    def split(z):
        return z.reshape(b, n, heads, dh).transpose(0, 2, 1, 3)

    q = split(x @ p["wq"] + p["bq"])
    k = split(x @ p["wk"] + p["bk"])
    v = split(x @ p["wv"] + p["bv"])
    s = jnp.einsum("bhqc,bhkc->bhqk", q, k) / np.sqrt(dh).astype(x.dtype)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, jnp.finfo(s.dtype).min)
    z = jnp.einsum("bhqk,bhkc->bhqc", jax.nn.softmax(s, axis=-1), v)
    return z.transpose(0, 2, 1, 3).reshape(b, n, d) @ p["wo"] + p["bo"]


def _mlp(x, p, activation: str):
    h = x @ p["w1"] + p["b1"]
    h = jax.nn.relu(h) if activation == "relu" else jax.nn.gelu(h, approximate=True)
    return h @ p["w2"] + p["b2"]


def scan_model(cfg: Config, remat: bool) -> Callable:
    """``(params, x) -> y``: the stack as a ``lax.scan`` over stacked layer parameters."""

    def layer(x, p):
        if cfg.norm == "post":
            x = _layer_norm(
                x + _self_attention(x, p, cfg.heads, False), p["ln1_scale"], p["ln1_bias"]
            )
            return _layer_norm(x + _mlp(x, p, cfg.activation), p["ln2_scale"], p["ln2_bias"])
        h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
        x = x + _self_attention(h, p, cfg.heads, cfg.causal)
        return x + _mlp(_layer_norm(x, p["ln2_scale"], p["ln2_bias"]), p, cfg.activation)

    def body(x, p):
        return layer(x, p), None

    if remat:
        body = jax.checkpoint(body)

    def forward(params, x):
        y, _ = jax.lax.scan(body, x, params["layers"])
        if cfg.norm == "pre":
            y = _layer_norm(y, params["final"]["scale"], params["final"]["bias"])
        return y

    return forward


# ---------------------------------------------------------------------------------------
# Inputs.


def random_problem(cfg: Config, seed: int = 0):
    """A layer stack in the plain layout, the final norm, an input and a target."""
    rng = np.random.default_rng(seed)

    def kernel(din, dout):
        return (rng.standard_normal((din, dout)) / np.sqrt(din)).astype(DTYPE)

    def vec(n, loc=0.0):
        return (loc + 0.1 * rng.standard_normal(n)).astype(DTYPE)

    d, d_ff = cfg.d, cfg.d_ff
    layers = [
        {
            "wq": kernel(d, d),
            "wk": kernel(d, d),
            "wv": kernel(d, d),
            "wo": kernel(d, d),
            "bq": vec(d),
            "bk": vec(d),
            "bv": vec(d),
            "bo": vec(d),
            "w1": kernel(d, d_ff),
            "b1": vec(d_ff),
            "w2": kernel(d_ff, d),
            "b2": vec(d),
            "ln1_scale": vec(d, 1.0),
            "ln1_bias": vec(d),
            "ln2_scale": vec(d, 1.0),
            "ln2_bias": vec(d),
        }  # fmt: skip
        for _ in range(cfg.layers)
    ]
    final = {"scale": vec(d, 1.0), "bias": vec(d)} if cfg.norm == "pre" else None
    x = rng.standard_normal((cfg.batch, cfg.n, d)).astype(DTYPE)
    target = rng.standard_normal((cfg.batch, cfg.n, d)).astype(DTYPE)
    return layers, final, x, target


def _mse(y, target):
    return jnp.mean(jnp.square(y - target))


# ---------------------------------------------------------------------------------------
# Timing.


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _call(compiled, *args):
    return lambda: jax.block_until_ready(compiled(*args))


def run_config(
    cfg: Config, budget_s: float, min_repeats: int, max_repeats: int, seed: int = 0
) -> dict:
    layers, final, x_np, target_np = random_problem(cfg, seed)
    x, target = jnp.asarray(x_np), jnp.asarray(target_np)
    model = from_layers(
        layers,
        norm=cfg.norm,
        num_heads=cfg.heads,
        activation=cfg.activation,
        causal=cfg.causal,
        ln_eps=LN_EPS,
        final_norm=final,
    )
    params = {
        "layers": {k: jnp.stack([jnp.asarray(layer[k]) for layer in layers]) for k in layers[0]},
        "final": None if final is None else {k: jnp.asarray(v) for k, v in final.items()},
    }

    def oc_loss(m, x, target):
        return _mse(m(x), target)

    def scan_grad(forward):
        return jax.jit(jax.value_and_grad(lambda p, x, t: _mse(forward(p, x), t)))

    scan, scan_remat = scan_model(cfg, remat=False), scan_model(cfg, remat=True)
    functions = {
        "ocformer_fwd_bwd": (
            eqx.filter_jit(eqx.filter_value_and_grad(oc_loss)),
            (model, x, target),
        ),
        "scan_fwd_bwd": (scan_grad(scan), (params, x, target)),
        "scan_remat_fwd_bwd": (scan_grad(scan_remat), (params, x, target)),
        "ocformer_fwd": (eqx.filter_jit(lambda m, x: m(x)), (model, x)),
        "scan_fwd": (jax.jit(scan), (params, x)),
    }
    compiled, phases = {}, {}
    for name, (fn, args) in functions.items():
        compiled[name], phases[name] = aot_compile_phases(fn, *args)
    compile_s = {name: p["total_s"] for name, p in phases.items()}
    candidates = [
        Candidate(name, _call(compiled[name], *args), compile_s[name])
        for name, (_, args) in functions.items()
    ]

    # Both implementations compute the same loss, output and gradients.
    (oc_value, oc_grads) = compiled["ocformer_fwd_bwd"](model, x, target)
    (sc_value, sc_grads) = compiled["scan_fwd_bwd"](params, x, target)
    y_oc = compiled["ocformer_fwd"](model, x)
    y_sc = compiled["scan_fwd"](params, x)
    g_oc = oc_grads.control.values
    grad_pairs = [
        (g_oc.attention.wq, sc_grads["layers"]["wq"]),
        (g_oc.attention.bo, sc_grads["layers"]["bo"]),
        (g_oc.feedforward.weights[0], sc_grads["layers"]["w1"]),  # d/dW_1 = d/dA_1
        (g_oc.norm2.scale, sc_grads["layers"]["ln2_scale"]),
    ]

    timing = time_interleaved(candidates, budget_s, min_repeats, max_repeats)
    med = {k: v["median_s"] for k, v in timing.items()}
    oc, sc, rm = med["ocformer_fwd_bwd"], med["scan_fwd_bwd"], med["scan_remat_fwd_bwd"]
    return {
        "name": cfg.name,
        "shapes": cfg.shapes(),
        "median_s": med,
        "timing": timing,
        "compile_s": compile_s,
        "compile_phases_s": phases,
        "repeats": timing["ocformer_fwd_bwd"]["repeats"],
        "ratio_vs_scan": oc / sc,
        "ratio_vs_scan_remat": oc / rm,
        "forward_ratio_vs_scan": med["ocformer_fwd"] / med["scan_fwd"],
        "compile_ratio_vs_scan": compile_s["ocformer_fwd_bwd"] / compile_s["scan_fwd_bwd"],
        "max_rel_diff_output": _rel(y_oc, y_sc),
        "max_rel_diff_loss": _rel(oc_value, sc_value),
        "max_rel_diff_grad": max(_rel(a, b) for a, b in grad_pairs),
    }


def format_table(results) -> str:
    header = (
        f"{'config':<14}{'L':>3}{'N':>5}{'B':>4} | {'ocformer':>9}{'scan':>9}{'remat':>9} ms"
        f" | {'ratio':>6}{'/remat':>7}{'fwd':>6} | {'compile s oc/scan':>18} | {'max rel diff':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        s, m, c = r["shapes"], r["median_s"], r["compile_s"]
        lines.append(
            f"{r['name']:<14}{s['L']:>3}{s['N']:>5}{s['B']:>4} | "
            f"{1e3 * m['ocformer_fwd_bwd']:>9.2f}{1e3 * m['scan_fwd_bwd']:>9.2f}"
            f"{1e3 * m['scan_remat_fwd_bwd']:>9.2f}    | "
            f"{r['ratio_vs_scan']:>6.3f}{r['ratio_vs_scan_remat']:>7.3f}"
            f"{r['forward_ratio_vs_scan']:>6.3f} | "
            f"{c['ocformer_fwd_bwd']:>8.2f} /{c['scan_fwd_bwd']:>7.2f}   | "
            f"{max(r['max_rel_diff_output'], r['max_rel_diff_grad']):>12.1e}"
        )
    return "\n".join(lines)
