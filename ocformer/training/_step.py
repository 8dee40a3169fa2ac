r"""The compiled training and evaluation steps.

One update is $\theta \leftarrow P_C(\theta - \mathrm{opt}(\nabla_\theta J))$: the gradient
of the objective $J$ by whatever adjoint the gradient method put on the model, an optax
update, then the projection $P_C$ onto the constraints. The step never looks at which
scheme or gradient method it got: both live inside the model.

A program is compiled once per shape. The learning rate is an entry of the optimiser
state (``ocformer.training._optimiser``), so the schedule is not part of the program;
the compiled steps are kept for the life of the process, keyed on what the program is
made of (objective, constraints, update rule, skip mode); and JAX's persistent
compilation cache (``enable_compile_cache``) keeps compiled programs across processes.
"""

import os
from collections.abc import Callable, Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax

from ..models import rediscretise
from ..objective import MSA, msa_iteration

# What every step checks, in this order. The optimiser state is checked apart from the
# parameters: a gradient that is finite but large enough for Adam's running second
# moment to overflow leaves the parameters finite (the update m / sqrt(inf) is zero) and
# the state not, and with it every later update.
FINITE_SOURCES: tuple[str, ...] = ("loss", "gradients", "parameters", "optimiser state")

# Environment variable: a directory for JAX's persistent compilation cache, or one of
# _OFF to leave it off.
COMPILE_CACHE_ENV = "OCFORMER_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no", "none")
# The shortest compilation whose program is written to the persistent cache: none, so
# every program is. JAX's default, one second, would leave out most of the steps of
# small models and the many small programs of a run's start (parameter initialisation,
# key splits), which load from the cache faster than they compile (benchmarks/README.md,
# end to end).
MIN_CACHED_COMPILE_S = 0.0


def default_compile_cache_dir() -> str:
    """``$XDG_CACHE_HOME/ocformer/jax``, or ``~/.cache/ocformer/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ocformer", "jax")


def enable_compile_cache(off: bool = False) -> str | None:
    """Turn on JAX's persistent compilation cache; return its directory (None: off).

    ``off=True`` (a command's ``--no-compile-cache``) turns it off as
    ``OCFORMER_COMPILE_CACHE=off`` does, for this process and the library calls in it.

    The directory is ``$OCFORMER_COMPILE_CACHE`` if set to a path (``~`` expanded),
    else ``default_compile_cache_dir()``; ``OCFORMER_COMPILE_CACHE=off`` (or ``0``)
    turns the cache off, one the user gave JAX itself too. A cache directory the user
    gave JAX (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept. JAX reads the setting
    at its first compilation, so call this before anything is compiled (the command
    line does); later calls in a process that has compiled already change nothing.
    Programs that call back to the host (equinox's run-time checks) are never stored
    by JAX.
    """
    if off:
        os.environ[COMPILE_CACHE_ENV] = "off"  # also for train(), which enables it
    choice = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if choice.lower() in _OFF and choice:
        # Off, even where JAX was given a directory of its own (JAX_COMPILATION_CACHE_DIR).
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if not jax.config.jax_enable_compilation_cache:  # pyright: ignore[reportAttributeAccessIssue]
        return None  # off for JAX itself (JAX_ENABLE_COMPILATION_CACHE, or turned off here)
    existing = getattr(jax.config, "jax_compilation_cache_dir", None)
    if existing:
        return existing
    path = os.path.expanduser(choice) if choice else default_compile_cache_dir()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)
    return path


def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jtu.tree_leaves(tree) if eqx.is_inexact_array(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def _select(ok, new, old):
    return jtu.tree_map(lambda a, b: jnp.where(ok, a, b) if eqx.is_array(a) else a, new, old)


# The compiled steps of this process, by what their program is made of.
_TRAIN_STEPS: dict = {}


def _kept(cache: dict, key, step: Callable) -> Callable:
    """The step ``cache`` holds under ``key``, else ``step``, kept there from now on. A
    key with an unhashable part keeps nothing: ``step`` serves this call only."""
    try:
        kept = cache.get(key)
    except TypeError:
        return step
    if kept is None:
        kept = cache[key] = step
    return kept


def make_train_step(
    objective, constraints, optimiser: optax.GradientTransformation, *, skip_nonfinite: bool
) -> Callable:
    """``step(model, opt_state, batch) -> (model, opt_state, metrics, finite)``.

    ``finite`` holds one flag per entry of ``FINITE_SOURCES``. With ``skip_nonfinite``
    an update whose loss, gradients, new parameters or new optimiser state are not
    finite is discarded
    inside the compiled step (model and optimiser state are returned unchanged);
    otherwise it is returned as computed and the caller aborts before using it.

    Two calls with equal objectives and constraints, the same update function and
    the same ``skip_nonfinite`` return the same compiled step, so that a second run
    in the process traces and compiles nothing for shapes it has seen.
    """

    @eqx.filter_jit
    def step(model, opt_state, batch):
        (loss, metrics), grads = eqx.filter_value_and_grad(objective, has_aux=True)(model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, new_opt_state = optimiser.update(grads, opt_state, params)
        new_model = constraints.project(eqx.apply_updates(model, updates))
        finite = jnp.stack(
            [
                jnp.isfinite(loss),
                _all_finite(grads),
                _all_finite(new_model),
                _all_finite(new_opt_state),
            ]
        )
        if skip_nonfinite:
            ok = finite.all()
            new_model = _select(ok, new_model, model)
            new_opt_state = _select(ok, new_opt_state, opt_state)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return new_model, new_opt_state, metrics, finite

    key = (objective, constraints, optimiser.update, skip_nonfinite)
    return _kept(_TRAIN_STEPS, key, step)


def make_msa_step(objective, constraints, method: MSA, *, skip_nonfinite: bool) -> Callable:
    """``step(model, state, batch) -> (model, state, metrics, finite)`` for
    ``train.method=msa``: one ``ocformer.objective.msa_iteration`` in place of the
    gradient update, with ``make_train_step``'s contract (``finite`` over the loss, the
    backward sweep's gradient, the new parameters and the new method state; a
    non-finite iteration discarded with ``skip_nonfinite``) and its cache of compiled
    steps."""

    @eqx.filter_jit
    def step(model, state, batch):
        new_model, new_state, metrics = msa_iteration(
            method, objective, constraints, model, state, batch
        )
        finite = jnp.stack(
            [
                jnp.isfinite(metrics["loss"]),
                jnp.isfinite(metrics["grad_norm"]),
                _all_finite(new_model),
                _all_finite(new_state),
            ]
        )
        if skip_nonfinite:
            ok = finite.all()
            new_model = _select(ok, new_model, model)
            new_state = _select(ok, new_state, state)
        return new_model, new_state, metrics, finite

    return _kept(_TRAIN_STEPS, ("msa", objective, constraints, method, skip_nonfinite), step)


def validation_metrics(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The evaluation step's metrics (one record per validation batch) averaged over
    the batches and named as the metrics log and ``evaluate`` report them:
    ``val_objective`` (the step's ``loss``: the whole objective), ``val_loss`` (the
    task loss) and ``val_<name>`` for the task's other metrics (``val_accuracy``)."""
    mean = {k: float(np.mean([r[k] for r in records])) for k in records[0]}
    out = {"val_objective": mean.pop("loss")}
    out.update({f"val_{k}": v for k, v in mean.items()})
    if "val_task_loss" in out:
        out["val_loss"] = out.pop("val_task_loss")
    return out


_EVAL_STEPS: dict = {}


def make_eval_step(objective) -> Callable:
    """``evaluate(model, batch) -> metrics`` (with ``loss``), compiled (one per equal
    objective in a process, as ``make_train_step``)."""

    @eqx.filter_jit
    def evaluate(model, batch):
        loss, metrics = objective(model, batch)
        return dict(metrics, loss=loss)

    return _kept(_EVAL_STEPS, objective, evaluate)


def gradient_bias(grads, reference) -> dict[str, jax.Array]:
    r"""How far ``grads`` is from ``reference`` (two pytrees of the same structure):
    ``grad_cosine`` $\langle g, g_\mathrm{ref} \rangle / (|g| |g_\mathrm{ref}|)$ and
    ``grad_rel_norm`` $|g - g_\mathrm{ref}| / |g_\mathrm{ref}|$, over all the inexact
    leaves taken as one vector."""
    g = [x for x in jtu.tree_leaves(grads) if eqx.is_inexact_array(x)]
    r = [x for x in jtu.tree_leaves(reference) if eqx.is_inexact_array(x)]
    dot = sum(jnp.vdot(a, b) for a, b in zip(g, r, strict=True))
    norm_g, norm_r = optax.tree.norm(g), optax.tree.norm(r)
    diff = optax.tree.norm([a - b for a, b in zip(g, r, strict=True)])
    return {"grad_cosine": dot / (norm_g * norm_r), "grad_rel_norm": diff / norm_r}


_BIAS_STEPS: dict = {}


def make_bias_step(objective) -> Callable:
    """``bias(model, batch) -> metrics``: the gradient of ``objective`` at ``model``,
    whose transformer solves in depth in parallel, against the serial gradient at the
    same parameters and batch (the same model with ``depth_parallel=None``), as
    ``gradient_bias``'s ``grad_cosine`` and ``grad_rel_norm``. Both gradients are one
    compiled program, kept as ``make_eval_step``'s are."""

    def gradient(model, batch):
        (_, _), grads = eqx.filter_value_and_grad(objective, has_aux=True)(model, batch)
        return grads

    @eqx.filter_jit
    def bias(model, batch):
        serial = rediscretise(model, depth_parallel=None)
        return gradient_bias(gradient(model, batch), gradient(serial, batch))

    return _kept(_BIAS_STEPS, objective, bias)
