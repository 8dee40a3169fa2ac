"""Parareal over the layer grid against the serial solve, in float64.

After K = N iterations (N chunks) parareal is the serial solve to rounding, u(T) and
gradients; the error against the serial states at the chunk boundaries falls at every
iteration for a coarse propagator close to the fine one, and the boundaries n <= k are
exact after k iterations; 1, 2 and 4 forced CPU devices on the mesh's depth axis give
the same numbers (one subprocess); bad settings exit 2 naming the field.
"""

import json
import os
import subprocess
import sys

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import xla_flags

from ocformer.config import ConfigError, resolve
from ocformer.controls import make_control
from ocformer.integration import Discretisation, Parareal
from ocformer.models import ContinuousTransformer, IncompatibleError, rediscretise
from ocformer.splitting import Lie, Strang
from ocformer.train import main as train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
LAYERS, WIDTH = 4, 8


def _control(init_scale: float):
    key = jax.random.PRNGKey(0)
    return make_control(
        "piecewise_constant", key, num_layers=LAYERS, width=WIDTH, hidden=16,
        dtype=jnp.float64, init_scale=init_scale,
    )  # fmt: skip


@pytest.fixture(scope="module")
def inputs():
    u0 = jax.random.normal(jax.random.PRNGKey(1), (2, 5, WIDTH), jnp.float64)
    key_mask = jnp.ones((2, 5), bool).at[0, 4].set(False)
    return u0, key_mask


def _pre_ln(init_scale: float = 0.3) -> ContinuousTransformer:
    """Pre-LN, fine: Strang with midpoint sub-steps, 2 steps per layer (second order)."""
    fine = Discretisation(Strang(sub_solver="midpoint"), steps_per_layer=2)
    return ContinuousTransformer(
        _control(init_scale), norm="pre", num_heads=2, activation="gelu", discretisation=fine
    )


def _post_ln() -> ContinuousTransformer:
    """The post-LN Transformer (Lie, one step per layer)."""
    return ContinuousTransformer(_control(1.0), norm="post", num_heads=2, ln_eps=1e-5)


# Pre-LN: 4 chunks of one layer, coarse Lie with Euler sub-steps, one step per layer.
# Post-LN: 2 chunks of two layers, one coarse Lie step over each (layer-mean controls).
CASES = {
    "pre": (_pre_ln, dict(coarse_stepper=Lie(), chunks=4, coarse_steps=1)),
    "post": (_post_ln, dict(coarse_stepper=Lie(), chunks=2, coarse_steps=1)),
}


def _loss(model, u0, key_mask):
    return jnp.sum(jnp.tanh(model(u0, key_mask)) ** 2)


@eqx.filter_jit
def _value_and_grad(model, u0, key_mask):
    return eqx.filter_value_and_grad(_loss)(model, u0, key_mask)


def _max_abs(tree) -> float:
    return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", sorted(CASES))
def test_as_many_iterations_as_chunks_is_the_serial_solve(case, inputs):
    make, kwargs = CASES[case]
    serial = make()
    u0, key_mask = inputs
    chunks = kwargs["chunks"]
    par = rediscretise(serial, depth_parallel=Parareal(iterations=chunks, **kwargs))
    want_u = serial(u0, key_mask)
    got_u = eqx.filter_jit(par)(u0, key_mask)
    assert float(jnp.max(jnp.abs(got_u - want_u))) < 1e-12 * float(jnp.max(jnp.abs(want_u)))
    want_j, want_g = _value_and_grad(serial, u0, key_mask)
    got_j, got_g = _value_and_grad(par, u0, key_mask)
    assert abs(float(got_j - want_j)) < 1e-12 * abs(float(want_j))
    diff = jax.tree.map(lambda a, b: a - b, got_g.control, want_g.control)
    assert _max_abs(diff) < 1e-12 * _max_abs(want_g.control)
    # One iteration fewer is not exact: the test can tell the two apart.
    short = rediscretise(serial, depth_parallel=Parareal(iterations=chunks - 1, **kwargs))
    assert float(jnp.max(jnp.abs(short(u0, key_mask) - want_u))) > 1e-10


def _boundary_errors(serial, iterates, chunks):
    """max_n |U^k_n - u(T_n)| for each k, and the same over the boundaries n <= k."""
    _, ys = serial.trajectory(*iterates["inputs"])
    per_chunk = (ys.shape[0] - 1) // chunks
    exact = ys[::per_chunk]  # the serial states at T_0, ..., T_N
    err = jnp.max(jnp.abs(iterates["states"] - exact[None]), axis=tuple(range(2, ys.ndim + 1)))
    total = [float(e) for e in jnp.max(err, axis=1)]
    settled = [float(jnp.max(err[k, : k + 1])) for k in range(err.shape[0])]
    return total, settled


@pytest.mark.parametrize(
    "init_scale, factor",
    # The measured errors (printed with -s) fall by these factors at least per iteration.
    [(0.3, 10.0), (1.0, 1.5)],
)
def test_error_falls_every_iteration_and_is_rounding_at_the_last(init_scale, factor, inputs):
    serial = _pre_ln(init_scale)
    chunks = 4
    par = rediscretise(serial, depth_parallel=Parareal(Lie(), iterations=chunks, chunks=chunks))
    states = eqx.filter_jit(par.depth_iterates)(*inputs)
    assert states.shape == (chunks + 1, chunks + 1, *inputs[0].shape)
    total, settled = _boundary_errors(serial, {"states": states, "inputs": inputs}, chunks)
    print(f"init_scale={init_scale}: error at the chunk boundaries per iteration", total)
    scale = float(jnp.max(jnp.abs(states[-1, -1])))
    assert total[0] > 1e-4  # the coarse guess is not already the answer
    for k in range(chunks):
        assert total[k + 1] < total[k] / factor, (k, total)
    assert total[chunks] < 1e-12 * scale
    # Parareal's induction: after k iterations the boundaries 0..k are the serial ones.
    assert max(settled) < 1e-12 * scale, settled


_DEVICES = """
import json, re, sys
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, sys.argv[1])
from test_depth_parallel import _loss, _pre_ln
from ocformer.integration import Parareal
from ocformer.models import rediscretise

u0 = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8), jnp.float64)
key_mask = jnp.ones((2, 5), bool).at[0, 4].set(False)
out = {"devices": jax.device_count()}
for count in (1, 2, 4):
    mesh = Mesh(np.array(jax.devices()[:count]), ("depth",))
    par = rediscretise(_pre_ln(), depth_parallel=Parareal(iterations=2, chunks=4, mesh=mesh))
    compiled = jax.jit(lambda u: par.depth_iterates(u, key_mask)).lower(u0).compile()
    states, hlo = compiled(u0), compiled.as_text()
    grads = eqx.filter_jit(eqx.filter_grad(_loss))(par, u0, key_mask)
    out[count] = {
        "states": np.asarray(states).ravel().tolist(),
        "grads": np.concatenate(
            [np.asarray(g).ravel() for g in jax.tree.leaves(grads.control)]
        ).tolist(),
        # The chunk axis of the fine solves' saved states (chunks, 1 save, *u0.shape):
        # a device's share, 4 / count chunks.
        "local": sorted(
            {int(m) for m in re.findall(r"f64\\[(\\d+),1,2,5,8\\]", hlo)}
        ),
        "all_gather": "all-gather" in hlo,
    }
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_one_two_and_four_depth_devices_give_the_same_numbers():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4), PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _DEVICES, os.path.dirname(os.path.abspath(__file__))],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["devices"] == 4
    one = out["1"]
    assert one["local"] == [4] and not one["all_gather"]  # one device runs every chunk
    for count in ("2", "4"):
        got = out[count]
        np.testing.assert_allclose(got["states"], one["states"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(got["grads"], one["grads"], rtol=0, atol=1e-12)
        # Each device solves only its chunks, and the coarse sweep gathers them.
        assert got["local"] == [4 // int(count)], got["local"]
        assert got["all_gather"]


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (
            ["discretisation.depth_parallel=parareal", "mesh.depth=3", "model.num_layers=4"],
            "mesh.depth",
            "must divide model.num_layers=4",
        ),
        (
            ["discretisation.depth_parallel=parareal", "discretisation.coarse_stepper=tsit5",
             "model.norm=post"],
            "discretisation.coarse_stepper",
            "as the coarse stepper of depth_parallel='parareal': tsit5 steps a pointwise",
        ),
        (
            ["discretisation.depth_parallel=parareal", "discretisation.iterations=0"],
            "discretisation.iterations",
            "must be >= 1, got 0",
        ),
        (
            ["discretisation.depth_parallel=parareal", "discretisation.chunks=3",
             "model.num_layers=4"],
            "discretisation.chunks",
            "chunks=3 must divide model.num_layers=4",
        ),
    ],
)  # fmt: skip
def test_bad_depth_settings_exit_2_naming_the_field(overrides, field, words, tmp_path, capsys):
    with pytest.raises(ConfigError) as raised:
        resolve(SMOKE, overrides)
    assert raised.value.field == field
    assert words in str(raised.value)
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run")]
    for o in overrides:
        argv += ["--set", o]
    assert train_main(argv) == 2
    assert f"{field}: " in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_library_refuses_alike():
    with pytest.raises(IncompatibleError, match="discretisation.coarse_stepper: as the coarse"):
        rediscretise(_post_ln(), depth_parallel=Parareal(diffrax.Tsit5(), chunks=2))
    with pytest.raises(ValueError, match="Parareal.iterations must be an integer >= 1, got 0"):
        Parareal(iterations=0)
