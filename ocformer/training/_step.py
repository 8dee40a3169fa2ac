r"""The compiled training and evaluation steps.

One update is $\theta \leftarrow P_C(\theta - \mathrm{opt}(\nabla_\theta J))$: the gradient
of the objective $J$ by whatever adjoint the gradient method put on the model, an optax
update, then the projection $P_C$ onto the constraints. The step never looks at which
scheme or gradient method it got: both live inside the model.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax

FINITE_SOURCES: tuple[str, ...] = ("loss", "gradients", "parameters")


def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jtu.tree_leaves(tree) if eqx.is_inexact_array(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def _select(ok, new, old):
    return jtu.tree_map(lambda a, b: jnp.where(ok, a, b) if eqx.is_array(a) else a, new, old)


def make_train_step(
    objective, constraints, optimiser: optax.GradientTransformation, *, skip_nonfinite: bool
) -> Callable:
    """``step(model, opt_state, batch) -> (model, opt_state, metrics, finite)``.

    ``finite`` holds one flag per entry of ``FINITE_SOURCES``. With ``skip_nonfinite``
    an update whose loss, gradients or new parameters are not finite is discarded
    inside the compiled step (model and optimiser state are returned unchanged);
    otherwise it is returned as computed and the caller aborts before using it.
    """

    @eqx.filter_jit
    def step(model, opt_state, batch):
        (loss, metrics), grads = eqx.filter_value_and_grad(objective, has_aux=True)(model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, new_opt_state = optimiser.update(grads, opt_state, params)
        new_model = constraints.project(eqx.apply_updates(model, updates))
        finite = jnp.stack([jnp.isfinite(loss), _all_finite(grads), _all_finite(new_model)])
        if skip_nonfinite:
            ok = finite.all()
            new_model = _select(ok, new_model, model)
            new_opt_state = _select(ok, new_opt_state, opt_state)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return new_model, new_opt_state, metrics, finite

    return step


def make_eval_step(objective) -> Callable:
    """``evaluate(model, batch) -> metrics`` (with ``loss``), compiled."""

    @eqx.filter_jit
    def evaluate(model, batch):
        loss, metrics = objective(model, batch)
        return dict(metrics, loss=loss)

    return evaluate
