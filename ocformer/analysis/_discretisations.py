r"""A trained model under other discretisations: how far u(T) and the loss move from a
fine reference when the step count, the splitting scheme or the solver changes.

Training fixes the controls $\theta(t)$; the discretisation is chosen at evaluation.
If the trained network is close to its continuous limit, refining or changing the
scheme changes little; a network that exploits its own grid (one step per layer of a
first-order scheme) moves by O(1).
"""

from collections.abc import Mapping

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..integration import Discretisation
from ..models import IncompatibleError, SequenceModel, rediscretise
from ..objective import Objective


@eqx.filter_jit
def _forward(model: SequenceModel, objective: Objective, batch: dict):
    u_t = model.transformer(model.initial_state(batch["inputs"]), batch.get("key_mask"))
    return u_t, objective(model, batch)[0]


def discretisation_study(
    model: SequenceModel,
    batch: dict,
    discretisations: Mapping[str, Discretisation | Mapping],
    reference: Discretisation | Mapping,
    *,
    objective: Objective | None = None,
) -> dict:
    r"""u(T) and the loss of ``model`` on ``batch`` under each discretisation, against
    the reference.

    Args:
        model: a ``SequenceModel`` (e.g. ``ocformer.training.load_run(workdir)[1]``).
        batch: ``inputs``, ``targets`` (and optionally ``key_mask``).
        discretisations: label -> a ``Discretisation`` or the fields to change
            (``{"steps_per_layer": 8}``, ``{"stepper": diffrax.Tsit5()}``; ``{}``: the
            model's own).
        reference: the fine discretisation (same forms).
        objective: the loss (default ``Objective()``: the task's cross-entropy).

    Returns:
        A JSON-ready dict: ``reference`` (its loss) and per label either
        ``{"status": "refused", "reason"}`` or ``status="ok"``, ``steps_per_layer``,
        ``loss``, ``loss_gap`` $|J_h - J_{ref}|$, ``u_distance``
        $\max|u_h(T) - u_{ref}(T)|$ and ``u_relative``
        $|u_h(T) - u_{ref}(T)|_2 / |u_{ref}(T)|_2$.
    """
    objective = Objective() if objective is None else objective
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    def at(spec):
        if isinstance(spec, Discretisation):
            return rediscretise(model, spec)
        return rediscretise(model, **dict(spec)) if spec else model  # {}: as it is

    ref_model = at(reference)
    u_ref, loss_ref = _forward(ref_model, objective, batch)
    out: dict = dict(
        reference=dict(steps_per_layer=ref_model.transformer.steps_per_layer, loss=float(loss_ref)),
        results={},
    )
    ref_norm = float(jnp.linalg.norm(u_ref))
    for label, spec in discretisations.items():
        try:
            discrete = at(spec)
        except IncompatibleError as e:
            out["results"][label] = dict(status="refused", reason=str(e))
            continue
        u_t, loss = _forward(discrete, objective, batch)
        out["results"][label] = dict(
            status="ok",
            steps_per_layer=discrete.transformer.steps_per_layer,
            loss=float(loss),
            loss_gap=abs(float(loss) - float(loss_ref)),
            u_distance=float(jnp.max(jnp.abs(u_t - u_ref))),
            u_relative=float(np.linalg.norm(np.asarray(u_t - u_ref)) / ref_norm),
        )
    return out
