"""A whole training step of the default experiment against flax and PyTorch.

ocformer's step is the one the training loop compiles (``ocformer.training.
make_train_step`` on the objects of ``ocformer.training.build``, ``_common.loop_step``):
forward, backward,
global-norm clipping, AdamW, the constraint projection and the finiteness flags. The
benchmark wraps it in ``jax.jit`` with the parameters and optimiser state donated. The
references are written here with the same shapes, the same optax optimiser (flax) or
the same AdamW hyperparameters (PyTorch), and are loaded with ocformer's parameters, so
that the losses can be checked to agree before anything is timed.
"""

import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ocformer.training import build

from . import _flax_gpt, _torch_gpt
from ._common import (
    Candidate,
    CompileCounter,
    aot_compile,
    donated,
    entry_copies,
    experiment_config,
    experiment_task,
    loop_step,
    time_interleaved,
    usable_cores,
    xla_matmul,
)
from ._gpt import gpt_shape, model_flops_per_token


class _Stepper:
    """Holds a training state and advances it by one call of a compiled step."""

    def __init__(self, compiled, state: tuple, fixed: tuple, n_state: int):
        self.compiled, self.state, self.fixed, self.n_state = compiled, state, fixed, n_state
        self.last = None

    def __call__(self):
        out = self.compiled(*self.state, *self.fixed)
        jax.block_until_ready(out)
        self.state, self.last = tuple(out[: self.n_state]), out
        return out


def _rel(a, b) -> float:
    return float(abs(float(a) - float(b)) / max(abs(float(b)), 1e-30))


def _model_shape_matmuls(shape, batch: int, budget_s: float) -> dict:
    """float32 FLOP/s of the feed-forward layer's first product, (B N, d) @ (d, d_ff),
    through XLA and through PyTorch on the same threads: how fast each backend does the
    matrix products that dominate the step (benchmarks/README.md, where the time goes)."""
    rows, inner, cols = batch * shape.seq_len, shape.width, shape.hidden
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((rows, inner), np.float32)
    b_np = rng.standard_normal((inner, cols), np.float32)
    candidates = [Candidate("xla", xla_matmul(jnp.asarray(a_np), jnp.asarray(b_np)))]
    torch = _torch_gpt.torch
    if torch is not None:
        ta, tb = torch.from_numpy(a_np), torch.from_numpy(b_np)
        candidates.append(Candidate("torch", lambda: torch.matmul(ta, tb)))
    timing = time_interleaved(candidates, budget_s, 10, 2000)
    flops = 2.0 * rows * inner * cols
    rates = {name: flops / t["median_s"] for name, t in timing.items()}
    return {
        "shape": [rows, inner, cols],
        "flop_per_s": rates,
        "xla_over_torch_time": rates["torch"] / rates["xla"] if "torch" in rates else None,
    }


def _torch_candidates(exp, shape, batch_np, oc_loss, modes, seed):
    """PyTorch candidates by mode, and per mode either its compile time or why not."""
    torch = _torch_gpt.torch
    if torch is None:
        return [], {"error": _torch_gpt.TORCH_MISSING}
    torch.manual_seed(seed)
    torch.set_num_threads(usable_cores())
    inputs = torch.from_numpy(np.asarray(batch_np["inputs"], np.int64))
    targets = torch.from_numpy(np.asarray(batch_np["targets"], np.int64))
    cfg = exp.config.optimiser
    info: dict = {"threads": torch.get_num_threads(), "modes": {}}
    candidates = []
    for mode in modes:
        gpt = _torch_gpt.GPT(shape)
        _torch_gpt.load_ocformer(gpt, exp.model)
        with torch.no_grad():
            logits = gpt(inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, shape.vocab), targets.reshape(-1)
            )
        forward = gpt if mode == "eager" else torch.compile(gpt)
        step = _torch_gpt.make_train_step(gpt, forward, cfg, cfg.clip_norm)
        start = time.perf_counter()
        try:
            step(inputs, targets)  # compiles (torch.compile) and warms up
            step(inputs, targets)
        except Exception as e:  # noqa: BLE001 (report any failure of torch.compile)
            info["modes"][mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        info["modes"][mode] = {
            "first_two_steps_s": time.perf_counter() - start,
            "loss_rel_diff_vs_ocformer": _rel(loss.item(), oc_loss),
        }
        candidates.append(Candidate(f"torch_{mode}", lambda s=step: s(inputs, targets)))
    return candidates, info


def run(
    overrides=(),
    *,
    budget_s: float,
    min_repeats: int,
    max_repeats: int,
    torch_modes=("eager", "compile"),
    random_tokens: bool = False,
    peak_flop_per_s: float | None = None,
    seed: int = 0,
    gradients=("stored", "stored_dots", "stored_projections"),
) -> dict:
    """Time one training step of ocformer, flax (plain and remat) and PyTorch.

    ``gradients``: further gradient methods (names of ``ocformer.integration.
    GRADIENT_METHODS``) whose training step of the same model is timed too, as
    ``ocformer_<name>`` (donated, like ``ocformer``)."""
    config = experiment_config(overrides)
    task, task_name = experiment_task(config, random_tokens)
    exp = build(config, task=task)
    shape = gpt_shape(config, task.vocab_size)
    b = config.task.batch_size
    batch_np = task.batch("train", 0, b, seed)
    batch = {k: jnp.asarray(v) for k, v in batch_np.items()}

    oc_step = loop_step(exp)
    oc_loss = float(exp.objective(exp.model, batch)[1]["task_loss"])
    opt_state = exp.optimiser.init(eqx.filter(exp.model, eqx.is_inexact_array))
    jitted, params = donated(oc_step, exp.model)
    oc_compiled, oc_compile_s = aot_compile(jitted, params, opt_state, batch)
    copies = {"ocformer": entry_copies(oc_compiled)}
    cost = oc_compiled.cost_analysis()
    xla_flops = float(cost.get("flops", float("nan"))) if isinstance(cost, dict) else math.nan

    # The loop's own call, as the training loop makes it (not donated); compiled on
    # its first call.
    start = time.perf_counter()
    loop_state = oc_step(exp.model, opt_state, batch)
    jax.block_until_ready(loop_state)
    loop_compile_s = time.perf_counter() - start

    def loop_run():
        nonlocal loop_state
        loop_state = oc_step(loop_state[0], loop_state[1], batch)
        jax.block_until_ready(loop_state)

    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 (fresh, donatable buffers)
    candidates = [
        Candidate(
            "ocformer",
            _Stepper(oc_compiled, (copy(params), copy(opt_state)), (batch,), 2),
            oc_compile_s,
        ),
        Candidate("ocformer_loop_call", loop_run, loop_compile_s),
    ]

    # The same model and optimiser with another gradient method: only the
    # discretisation's gradient field differs, so the parameters are the same arrays.
    gradient_info = {}
    for gradient in gradients:
        variant = build(
            experiment_config([*overrides, f"discretisation.gradient={gradient}"]), task=task
        )
        variant_step = loop_step(variant)
        v_opt_state = variant.optimiser.init(eqx.filter(variant.model, eqx.is_inexact_array))
        v_jitted, v_params = donated(variant_step, variant.model)
        v_compiled, v_compile_s = aot_compile(v_jitted, v_params, v_opt_state, batch)
        v_loss = float(variant.objective(variant.model, batch)[1]["task_loss"])
        name = f"ocformer_{gradient}"
        copies[name] = entry_copies(v_compiled)
        candidates.append(
            Candidate(
                name,
                _Stepper(v_compiled, (copy(v_params), copy(v_opt_state)), (batch,), 2),
                v_compile_s,
            )
        )
        gradient_info[gradient] = {"loss_rel_diff_vs_ocformer": _rel(v_loss, oc_loss)}

    flax_params = _flax_gpt.params_from_ocformer(exp.model)
    flax_info = {}
    for remat in (False, True):
        name = "flax_remat" if remat else "flax"
        gpt = _flax_gpt.GPT(shape, remat=remat)
        loss = _flax_gpt.cross_entropy(gpt.apply(flax_params, batch["inputs"]), batch["targets"])
        step = _flax_gpt.make_train_step(gpt, exp.optimiser)
        p0 = copy(flax_params)
        o0 = exp.optimiser.init(p0)
        compiled, compile_s = aot_compile(step, p0, o0, batch)
        copies[name] = entry_copies(compiled)
        candidates.append(Candidate(name, _Stepper(compiled, (p0, o0), (batch,), 2), compile_s))
        flax_info[name] = {"loss_rel_diff_vs_ocformer": _rel(loss, oc_loss)}

    torch_candidates, torch_info = _torch_candidates(
        exp, shape, batch_np, oc_loss, torch_modes, seed
    )
    candidates += torch_candidates

    with CompileCounter() as compiles:
        timings = time_interleaved(candidates, budget_s, min_repeats, max_repeats)
    matmuls = _model_shape_matmuls(shape, b, budget_s / 4)

    med = {k: v["median_s"] for k, v in timings.items()}
    torch_best = min((k for k in med if k.startswith("torch_")), key=med.get, default=None)
    flops_per_step = model_flops_per_token(shape) * b * shape.seq_len
    achieved = flops_per_step / med["ocformer"]
    report = {
        "config": DEFAULT_DESCRIPTION,
        "overrides": list(overrides),
        "task": task_name,
        "shape": {**shape.__dict__, "batch": b, "dtype": config.model.dtype},
        "params": {
            "ocformer": int(sum(x.size for x in jax.tree.leaves(params))),
            "reference": shape.num_params(),
        },
        "timing": timings,
        "compile_s": {c.name: c.compile_s for c in candidates if c.compile_s is not None},
        # The top-level copies of each compiled step (entry_copies), e.g. the zero
        # arrays copied into a differentiated scan's residual stacks.
        "entry_copies": copies,
        "ratio_vs_flax": med["ocformer"] / med["flax"],
        "ratio_vs_flax_remat": med["ocformer"] / med["flax_remat"],
        "ratio_vs_flax_by_gradient": {g: med[f"ocformer_{g}"] / med["flax"] for g in gradient_info},
        "gradients": gradient_info,
        "ratio_vs_torch": None if torch_best is None else med["ocformer"] / med[torch_best],
        "ratio_vs_torch_by_mode": {
            k.removeprefix("torch_"): med["ocformer"] / v
            for k, v in med.items()
            if k.startswith("torch_")
        },
        "torch_best_mode": None if torch_best is None else torch_best.removeprefix("torch_"),
        "torch": torch_info,
        "loop_call_over_donated": med["ocformer_loop_call"] / med["ocformer"],
        "flax": flax_info,
        "compilations_while_timing": compiles.count,
        "tokens_per_s": b * shape.seq_len / med["ocformer"],
        "model_flops_per_step": flops_per_step,
        "xla_flops_per_step": xla_flops,
        "achieved_flop_per_s": achieved,
        "flops_fraction": None if peak_flop_per_s is None else achieved / peak_flop_per_s,
        "matmul_at_model_shape": matmuls,
    }
    return report


DEFAULT_DESCRIPTION = "experiments/shakespeare_char.py (the default experiment)"
