"""Parareal and two-level MGRIT over the layer grid against the serial solve, in float64.

After K = N iterations (N chunks) parareal is the serial solve to rounding, u(T) and
gradients; the error against the serial states at the chunk boundaries falls at every
iteration for a coarse propagator close to the fine one, and the boundaries n <= k are
exact after k iterations. MGRIT with F-relaxation is parareal to rounding; with
FCF-relaxation the boundaries n <= 2k are exact after k iterations, so K = N / 2 gives
the serial u(T), and its error falls faster per iteration than F's. With the costate
solved by the same iteration (costate="parallel"), the gradient is the serial one after
as many iterations as make the forward solve exact, and differs before. 1, 2 and 4
forced CPU devices on the mesh's depth axis give the same numbers (one subprocess); bad
settings exit 2 naming the field.
"""

import functools
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
from ocformer.integration import MGRIT, Discretisation, Parareal
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


@pytest.mark.slow
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


@pytest.mark.parametrize("stepper", [diffrax.Tsit5(), diffrax.Heun()], ids=["tsit5", "heun"])
def test_projected_chunks_start_on_their_layer_s_set(stepper, inputs):
    """Under the projected formulation with a diffrax solver each chunk's solve starts
    past a jump of the controls that it is not told of: the state stayed on the old
    layer's set and K = N was 0.30 (Tsit5) and 0.27 (Heun) off the serial solve,
    relative, instead of rounding."""
    control = make_control(
        "piecewise_constant", jax.random.PRNGKey(0), num_layers=LAYERS, width=WIDTH,
        hidden=16, dtype=jnp.float64, norm_affine="scalar",
    )  # fmt: skip
    # A set S1(sigma1, sigma2) of its own for each layer.
    scale, bias = jax.random.normal(jax.random.PRNGKey(2), (2, LAYERS), jnp.float64)
    control = eqx.tree_at(
        lambda c: (c.values.norm2.scale, c.values.norm2.bias),
        control,
        (1.0 + 0.3 * scale, 0.3 * bias),
    )
    serial = ContinuousTransformer(
        control, norm="post", formulation="projected", num_heads=2, activation="gelu",
        discretisation=Discretisation(stepper, steps_per_layer=2),
    )  # fmt: skip
    u0, key_mask = inputs
    want = serial(u0, key_mask)
    for depth in (
        Parareal(iterations=2, chunks=2),
        MGRIT(relaxation="FCF", iterations=2, chunks=4),
    ):
        got = eqx.filter_jit(rediscretise(serial, depth_parallel=depth))(u0, key_mask)
        assert float(jnp.max(jnp.abs(got - want))) < 1e-12 * float(jnp.max(jnp.abs(want)))


@pytest.mark.slow
def test_under_pid_steps_the_last_iteration_differs_by_about_the_tolerance(inputs):
    """With adaptive steps each chunk restarts its step-size controller: at K = N the
    result is not the serial solve's to rounding, but within a small multiple of the
    tolerance, and closer at a tighter one (Tsit5, pre-LN, 4 chunks; printed with -s:
    the numbers of docs/depth_parallel.md)."""
    u0, key_mask = inputs
    base = ContinuousTransformer(_control(1.0), norm="pre", num_heads=2, ln_eps=1e-5)
    gaps = []
    for rtol in (1e-4, 1e-6, 1e-8):
        serial = rediscretise(base, stepsize="pid", stepper=diffrax.Tsit5(), rtol=rtol,
                              atol=rtol * 1e-2)  # fmt: skip
        par = rediscretise(serial, depth_parallel=Parareal(diffrax.Euler(), iterations=LAYERS))
        want_u, got_u = serial(u0, key_mask), eqx.filter_jit(par)(u0, key_mask)
        forward = float(jnp.max(jnp.abs(got_u - want_u)) / jnp.max(jnp.abs(want_u)))
        want_g = _value_and_grad(serial, u0, key_mask)[1].control
        got_g = _value_and_grad(par, u0, key_mask)[1].control
        diff = jax.tree.map(lambda a, b: a - b, got_g, want_g)
        gaps.append((forward, _max_abs(diff) / _max_abs(want_g)))
        print(f"rtol {rtol:.0e}: u(T) {forward:.1e}, gradient {gaps[-1][1]:.1e} (relative)")
    assert all(1e-12 < f < 100 * r for (f, _), r in zip(gaps, (1e-4, 1e-6, 1e-8), strict=True))
    assert gaps[0][0] > gaps[1][0] > gaps[2][0] and gaps[0][1] > gaps[2][1] > 1e-12


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
    [pytest.param(0.3, 10.0, marks=pytest.mark.slow), (1.0, 1.5)],
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


@functools.cache
def _mgrit_states(init_scale: float, relaxation: str, iterations: int):
    """MGRIT's iterates on the pre-LN model, 4 chunks of one layer (compiled once)."""
    method = MGRIT(Lie(), iterations=iterations, chunks=4, relaxation=relaxation)
    par = rediscretise(_pre_ln(init_scale), depth_parallel=method)
    u0 = jax.random.normal(jax.random.PRNGKey(1), (2, 5, WIDTH), jnp.float64)
    key_mask = jnp.ones((2, 5), bool).at[0, 4].set(False)
    return eqx.filter_jit(par.depth_iterates)(u0, key_mask)


def test_mgrit_with_f_relaxation_is_parareal(inputs):
    serial = _pre_ln(1.0)
    parareal = Parareal(Lie(), iterations=4, chunks=4)
    want_states = eqx.filter_jit(rediscretise(serial, depth_parallel=parareal).depth_iterates)(
        *inputs
    )
    got_states = _mgrit_states(1.0, "F", 4)
    # Every iterate k = 0..4 at every boundary: the FAS residual form rounds differently
    # from parareal's update, but it is the same iteration.
    scale = float(jnp.max(jnp.abs(want_states)))
    assert float(jnp.max(jnp.abs(got_states - want_states))) < 1e-13 * scale
    assert float(jnp.max(jnp.abs(want_states[1] - want_states[-1]))) > 1e-2  # k matters


# The boundary errors max_n |U^k_n - u(T_n)| of parareal (MGRIT-F), printed by the error
# test above; FCF's must be smaller at every k >= 1.
def _fcf_and_f_errors(init_scale, inputs):
    serial = _pre_ln(init_scale)
    chunks = 4
    errors = {}
    for relaxation, iterations in (("F", chunks), ("FCF", chunks // 2)):
        states = _mgrit_states(init_scale, relaxation, iterations)
        errors[relaxation] = (
            _boundary_errors(serial, {"states": states, "inputs": inputs}, chunks),
            float(jnp.max(jnp.abs(states[-1, -1]))),
        )
    return errors


@pytest.mark.parametrize(
    "init_scale",
    [pytest.param(0.3, marks=pytest.mark.slow), 1.0],  # 0.3: about 20 s
)
def test_fcf_is_exact_after_half_the_iterations_and_falls_faster_than_f(init_scale, inputs):
    errors = _fcf_and_f_errors(init_scale, inputs)
    (f_total, _), scale = errors["F"]
    (fcf_total, fcf_settled), _ = errors["FCF"]
    print(f"init_scale={init_scale}: boundary error per iteration, F {f_total}, FCF {fcf_total}")
    assert fcf_total[0] == f_total[0]  # the same coarse guess
    # FCF: after k iterations the boundaries n <= 2k are the serial ones, so K = N / 2 = 2
    # is exact and K = 1 is not.
    assert fcf_total[2] < 1e-12 * scale
    assert fcf_total[1] > 1e-8
    assert max(fcf_settled) < 1e-12 * scale  # n <= k, implied by n <= 2k
    assert fcf_total[1] < f_total[1] and f_total[2] > 1e-8


def test_fcf_on_two_chunks_is_exact_after_one_iteration(inputs):
    serial = _post_ln()
    method = MGRIT(Lie(), iterations=1, chunks=2, relaxation="FCF")
    states = eqx.filter_jit(rediscretise(serial, depth_parallel=method).depth_iterates)(*inputs)
    total, _ = _boundary_errors(serial, {"states": states, "inputs": inputs}, 2)
    assert total[0] > 1e-2 and total[1] < 1e-12 * float(jnp.max(jnp.abs(states[-1, -1])))


@eqx.filter_jit
def _grads(model, u0, key_mask):
    """The loss's gradient with respect to the controls and u0, flattened."""
    g_model, g_u0 = eqx.filter_grad(lambda mu: _loss(mu[0], mu[1], key_mask))((model, u0))
    return jnp.concatenate([x.ravel() for x in [*jax.tree.leaves(g_model.control), g_u0]])


def _relative(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


@pytest.mark.slow  # about 30 s on the idle 2-core machine
def test_parallel_costate_gives_the_serial_gradient_once_exact(inputs):
    serial = _post_ln()  # 2 chunks of two layers
    want = _grads(serial, *inputs)
    errors = {}
    for method, iterations in (("parareal", 1), ("parareal", 2), ("mgrit", 1)):
        solve = (Parareal if method == "parareal" else functools.partial(MGRIT, relaxation="FCF"))(
            Lie(), iterations=iterations, chunks=2, costate="parallel"
        )
        errors[method, iterations] = _relative(
            _grads(rediscretise(serial, depth_parallel=solve), *inputs), want
        )
    print("gradient's relative error, post-LN, 2 chunks:", errors)
    assert errors["parareal", 2] < 1e-12  # K = N
    assert errors["mgrit", 1] < 1e-12  # FCF: K = N / 2
    assert errors["parareal", 1] > 1e-6  # K < N: an approximation


@pytest.mark.slow
def test_parallel_costate_error_per_iteration_against_reverse_mode(inputs):
    serial = _pre_ln(0.3)  # 4 chunks of one layer
    want = _grads(serial, *inputs)
    table = {}
    for costate in ("parallel", "reverse"):
        for k in range(1, 5):
            solve = Parareal(Lie(), iterations=k, chunks=4, costate=costate)
            got = _grads(rediscretise(serial, depth_parallel=solve), *inputs)
            table[costate, k] = _relative(got, want)
    print("gradient's relative error per iteration K:", table)
    for costate in ("parallel", "reverse"):
        errors = [table[costate, k] for k in range(1, 5)]
        assert all(b < a / 10 for a, b in zip(errors, errors[1:])), (costate, errors)
        assert errors[-1] < 1e-12 and errors[-2] > 1e-12


_DEVICES = """
import collections, json, re, sys
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, sys.argv[1])
from test_depth_parallel import _loss, _pre_ln
from ocformer.integration import MGRIT, Parareal
from ocformer.models import rediscretise

u0 = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8), jnp.float64)
key_mask = jnp.ones((2, 5), bool).at[0, 4].set(False)
out = {"devices": jax.device_count()}
methods = {
    "parareal": lambda mesh: Parareal(iterations=2, chunks=4, mesh=mesh),
    "mgrit": lambda mesh: MGRIT(iterations=1, chunks=4, mesh=mesh, relaxation="FCF"),
    "costate": lambda mesh: Parareal(iterations=2, chunks=4, mesh=mesh, costate="parallel"),
}
for name, count in [(n, c) for n in methods for c in (1, 2, 4)]:
    mesh = Mesh(np.array(jax.devices()[:count]), ("depth",))
    par = rediscretise(_pre_ln(), depth_parallel=methods[name](mesh))
    grads = eqx.filter_jit(eqx.filter_grad(_loss))(par, u0, key_mask)
    grads = np.concatenate([np.asarray(g).ravel() for g in jax.tree.leaves(grads.control)])
    if name == "costate":  # its forward solve is parareal's
        out[f"{name}/{count}"] = {"grads": grads.tolist()}
        continue
    compiled = jax.jit(lambda u: par.depth_iterates(u, key_mask)).lower(u0).compile()
    states, hlo = compiled(u0), compiled.as_text()
    out[f"{name}/{count}"] = {
        "states": np.asarray(states).ravel().tolist(),
        "grads": grads.tolist(),
        # The chunk axis of the fine solves' states (chunks, [1 save,] *u0.shape), the
        # shape most of the program works on: a device's share, 4 / count chunks.
        "local": collections.Counter(
            int(m) for m in re.findall(r"f64\\[(\\d+),(?:1,)?2,5,8\\]", hlo)
        ).most_common(1)[0][0],
        "all_gather": "all-gather" in hlo,
    }
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_one_two_and_four_depth_devices_give_the_same_numbers():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4), PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _DEVICES, os.path.dirname(os.path.abspath(__file__))],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["devices"] == 4
    # The costate solved by parareal: the same gradients on 1, 2 and 4 devices.
    for count in ("2", "4"):
        np.testing.assert_allclose(
            out[f"costate/{count}"]["grads"], out["costate/1"]["grads"], rtol=0, atol=1e-12
        )
    assert out["costate/1"]["grads"] != out["parareal/1"]["grads"]  # another gradient (K < N)
    for name in ("parareal", "mgrit"):  # mgrit: FCF-relaxation
        one = out[f"{name}/1"]
        assert one["local"] == 4 and not one["all_gather"]  # one device runs every chunk
        for count in ("2", "4"):
            got = out[f"{name}/{count}"]
            np.testing.assert_allclose(got["states"], one["states"], rtol=0, atol=1e-12)
            np.testing.assert_allclose(got["grads"], one["grads"], rtol=0, atol=1e-12)
            # Each device solves only its chunks, and the coarse sweep gathers them.
            assert got["local"] == 4 // int(count), got["local"]
            assert got["all_gather"]


_TRAINING = """
import json, os, sys, tempfile
import equinox as eqx, jax

jax.config.update("jax_enable_x64", True)
from ocformer.config import resolve
from ocformer.distributed import Layout
from ocformer.evaluation import evaluate_run
from ocformer.training import build, make_train_step, train

spec, base = sys.argv[1], sys.argv[2:]
out = {"devices": jax.device_count()}
for data, depth in [(1, 1), (1, 4), (2, 2)]:
    config = resolve(spec, [*base, f"mesh.data={data}", f"mesh.depth={depth}"])
    with tempfile.TemporaryDirectory() as w:
        train(config, w)
        with open(os.path.join(w, "metrics.jsonl")) as f:
            losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
        serial = evaluate_run(w, ["discretisation.depth_parallel=none"])["val_loss"]
    layout = Layout(config)
    exp = build(config, mesh=layout.mesh)
    method = exp.model.transformer.discretisation.depth_parallel
    state = layout.put_state(
        exp.optimiser.init(eqx.filter(exp.model, eqx.is_inexact_array)), exp.model
    )
    model = layout.put_model(exp.model)
    step = layout.compile_train_step(
        make_train_step(exp.objective, exp.constraints, exp.optimiser, skip_nonfinite=False),
        model, state,
    )
    batch = layout.put_batch(exp.task.batch("train", 0, config.task.batch_size, 0))
    hlo = step.lower(model, state, batch).compile().as_text()
    out[f"{data}x{depth}"] = {
        "losses": losses,
        "mesh_depth": None if method.mesh is None else int(method.mesh.shape["depth"]),
        "all_gather": "all-gather" in hlo,
        "serial_val_loss": serial,
    }
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_training_with_mesh_depth_splits_the_chunks_and_keeps_the_losses():
    """A few float64 training steps of the smoke model (4 layers, parareal on 4 chunks)
    on 4 forced CPU devices: mesh.depth = 4 and data x depth = 2 x 2 give the losses
    of mesh.depth = 1, the built model's solve has the mesh, and the compiled step
    gathers over the depth devices. Each run is evaluated under the serial solve
    (``depth_parallel=none``, which resets the depth devices), with the same loss."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4), PYTHONPATH=ROOT)
    overrides = [
        "model.num_layers=4", "discretisation.depth_parallel=parareal",
        "discretisation.chunks=4", "discretisation.iterations=2", "train.steps=3",
        "train.eval_every=3", "train.checkpoint_every=3", "train.progress=false",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", _TRAINING, f"{SMOKE}:float64", *overrides],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["devices"] == 4
    one = out["1x1"]
    assert len(one["losses"]) == 3 and one["mesh_depth"] is None and not one["all_gather"]
    for mesh, depth in (("1x4", 4), ("2x2", 2)):
        got = out[mesh]
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-12, atol=0)
        assert got["serial_val_loss"] == pytest.approx(one["serial_val_loss"], rel=1e-10)
        assert got["mesh_depth"] == depth
    # On the 1 x 1 x 4 mesh only the depth axis can split anything: the step gathers the
    # chunks' end states over it for the serial coarse sweep.
    assert out["1x4"]["all_gather"]


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
        (
            ["discretisation.depth_parallel=mgrit", "discretisation.relaxation=CF"],
            "discretisation.relaxation",
            "got 'CF'; did you mean 'FCF'? allowed: 'F', 'FCF'",
        ),
        (
            ["discretisation.depth_parallel=mgrit", "discretisation.depth_costate=forward"],
            "discretisation.depth_costate",
            "got 'forward'; allowed: 'reverse', 'parallel'",
        ),
        (
            ["discretisation.depth_costate=parallel"],
            "discretisation.depth_costate",
            "depth_costate='parallel' solves the costate of a depth-parallel solve, but",
        ),
        (
            ["discretisation.depth_parallel=parareal", "discretisation.relaxation=FCF"],
            "discretisation.relaxation",
            "relaxation='FCF' is a relaxation of two-level MGRIT, but depth_parallel='parareal'",
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


# A field that only a depth-parallel solve reads, set without one: its value, and how
# the refusal names the value received.
DEPTH_ONLY = [
    ("discretisation.chunks", 2, "chunks=2"),
    ("discretisation.iterations", 3, "iterations=3"),
    ("discretisation.coarse_stepper", "euler", "coarse_stepper='euler'"),
    ("discretisation.coarse_steps", 2, "coarse_steps=2"),
]


@pytest.mark.parametrize("field, value, received", DEPTH_ONLY, ids=[d[2] for d in DEPTH_ONLY])
def test_a_depth_parallel_field_without_depth_parallel_exits_2_naming_it_and_the_fix(
    field, value, received, tmp_path, capsys
):
    """The serial solve would ignore it, and the run would silently be another
    experiment than the one asked for: refused, naming the field, the value and the fix;
    the same field with a depth-parallel solve is taken."""
    override = f"{field}={value}"
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run"), "--set", override]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert f"{field}: {received} " in err and "but depth_parallel is none" in err
    assert "set discretisation.depth_parallel=parareal or mgrit, or drop " in err
    assert not (tmp_path / "run").exists()
    taken = resolve(SMOKE, ["discretisation.depth_parallel=parareal", override])
    assert getattr(taken.discretisation, field.split(".")[1]) == value


def test_the_serial_solve_of_the_library_has_no_depth_fields_to_ignore():
    """In the library the chunks, iterations and coarse stepper live in the
    depth-parallel solve object, so ``depth_parallel=None`` (what the depth fallback
    rediscretises to) drops them: the rules see their defaults and take the model."""
    parallel = rediscretise(
        _post_ln(), depth_parallel=Parareal(Strang(), coarse_steps=2, iterations=3, chunks=2)
    )
    got = parallel.choices()
    assert (got.chunks, got.iterations, got.coarse_stepper, got.coarse_steps) == (2, 3, "strang", 2)
    serial = rediscretise(parallel, depth_parallel=None).choices()
    assert (serial.chunks, serial.iterations, serial.coarse_stepper, serial.coarse_steps) == (
        None, 1, "lie", 1,
    )  # fmt: skip


def test_the_library_refuses_alike():
    with pytest.raises(IncompatibleError, match="discretisation.coarse_stepper: as the coarse"):
        rediscretise(_post_ln(), depth_parallel=Parareal(diffrax.Tsit5(), chunks=2))
    with pytest.raises(ValueError, match="Parareal.iterations must be an integer >= 1, got 0"):
        Parareal(iterations=0)
    with pytest.raises(ValueError, match="Use MGRIT\\(relaxation='FCF'\\)"):
        Parareal(relaxation="FCF")
    with pytest.raises(ValueError, match="MGRIT.relaxation must be one of 'F', 'FCF', got 'C'"):
        MGRIT(relaxation="C")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MGRIT.costate must be one of 'reverse', 'parallel'"):
        MGRIT(costate="forward")  # type: ignore[arg-type]


def test_a_splitting_coarse_stepper_under_a_diffrax_fine_stepper(inputs):
    """Heun on the smooth pre-LN equation (one ODETerm) with the default coarse Lie
    scheme (split terms, posed for it): the model is built (its check read the fine
    stepper's single term as the coarse scheme's and raised AttributeError) and, at
    K = N, is the serial Heun solve to rounding."""
    serial = ContinuousTransformer(
        _control(0.3), norm="pre", num_heads=2, activation="gelu",
        discretisation=Discretisation(diffrax.Heun(), steps_per_layer=2),
    )  # fmt: skip
    par = rediscretise(serial, depth_parallel=Parareal(iterations=LAYERS))
    u0, key_mask = inputs
    want = serial(u0, key_mask)
    got = eqx.filter_jit(par)(u0, key_mask)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-12 * float(jnp.max(jnp.abs(want)))
    one_short = rediscretise(serial, depth_parallel=Parareal(iterations=LAYERS - 1))
    assert float(jnp.max(jnp.abs(one_short(u0, key_mask) - want))) > 1e-10
