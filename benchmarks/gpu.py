"""GPU benchmark: a GPT of >= 100M parameters at context 1024 on one NVIDIA GPU.

bfloat16 compute with float32 master parameters and optimiser state. ocformer's model
is the default experiment's kind (pre-LN, causal, GELU, final LayerNorm, AdamW with
clipping) at GPT-2-small size, built through ``ocformer.config`` and
``ocformer.training.build`` with ``model.precision=bfloat16``. Its step is the training
command's, as in the CPU benchmark (``_common.loop_step``: ``make_train_step`` with the
precision policy, ``ocformer.objective.MixedPrecision``: the float32 parameters cast to
bfloat16 inside the differentiated function, layer-norm statistics, softmax and loss in
float32, so gradients and updates stay float32; the constraint projection, the
finiteness flags with non-finite updates skipped, the gradient norm), donated.
The flax reference (``_flax_gpt``, plain and ``nn.remat``) computes in bfloat16 from
float32 parameters in the usual flax way (``dtype=bfloat16``). Reported: tokens/s,
model FLOP/s and MFU against the GPU's dense bfloat16 peak (the FLOP convention of
``_train_step``), peak device memory, and the ratios to flax.

Usage::

    python -m benchmarks.gpu --json FILE            # needs an NVIDIA GPU
    python -m benchmarks.gpu --dry-run --json FILE  # the same code path, tiny, any backend

On a machine without a GPU the first form exits with status 2 and says so.
"""

import argparse
import sys
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from ocformer.integration import GRADIENT_METHODS
from ocformer.training import build

from . import _flax_gpt
from ._args import output_file, positive_float, positive_int
from ._common import (
    Candidate,
    RandomTokens,
    aot_compile,
    donated,
    entry_copies,
    experiment_config,
    jax_compiled,
    loop_step,
    matmul_peak,
    provenance,
    time_interleaved,
    write_json,
)
from ._gpt import gpt_shape, model_flops_per_token

GPT2_SMALL = dict(layers=12, width=768, heads=12, hidden=3072, vocab=50304, seq_len=1024, batch=16)
DRY_RUN = dict(layers=2, width=64, heads=2, hidden=128, vocab=97, seq_len=32, batch=2)

# Dense bfloat16 peak FLOP/s by device kind (vendor data sheets, SXM parts, no sparsity).
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def _peak_for(device_kind: str) -> float | None:
    for name, peak in BF16_PEAK.items():
        if name in device_kind:
            return peak
    return None


def _overrides(size: dict, attention: str, gradient: str | None = None) -> list[str]:
    return [
        *([] if gradient is None else [f"discretisation.gradient={gradient}"]),
        "model.precision=bfloat16",
        f"model.attention_kernel={attention}",
        f"model.num_layers={size['layers']}",
        f"model.width={size['width']}",
        f"model.num_heads={size['heads']}",
        f"model.hidden={size['hidden']}",
        f"task.seq_len={size['seq_len']}",
        f"task.batch_size={size['batch']}",
    ]


def _ocformer_step(exp):
    """``(params, opt_state, batch) -> (params, opt_state, metrics, finite)``: the
    training command's step (``_common.loop_step``: the precision policy of
    ``model.precision``, clipping and AdamW, the constraint projection, the finiteness
    flags with non-finite updates skipped, the gradient norm), with the parameters and
    optimiser state donated, as the CPU benchmark times it."""
    return donated(loop_step(exp), exp.model)


# The custom call of cuDNN's fused attention (jax's cudnn fused_attention_stablehlo).
_CUDNN_ATTENTION = "__cudnn$fmha"


def _attention_ran(compiled) -> str:
    """``"cudnn"`` if the compiled step calls cuDNN's fused attention, else ``"xla"``:
    what ran, whatever was asked for (``kernel="cudnn"`` falls back off NVIDIA GPUs)."""
    return "cudnn" if _CUDNN_ATTENTION in (jax_compiled(compiled).as_text() or "") else "xla"


class _Stepper:
    """Holds a training state and advances it by one call of a compiled step whose
    outputs begin with the new parameters and optimiser state; ``loss`` is the last
    step's (the loop's ``metrics["loss"]``, or the reference's third output)."""

    def __init__(self, compiled, params, opt_state, batch):
        self.compiled, self.state, self.batch = compiled, (params, opt_state), batch
        self.loss = None

    def __call__(self):
        params, opt_state, out, *_ = self.compiled(*self.state, self.batch)
        loss = out["loss"] if isinstance(out, dict) else out
        jax.block_until_ready(loss)
        self.state, self.loss = (params, opt_state), loss


def run(
    size: dict,
    *,
    budget_s: float,
    min_repeats: int,
    max_repeats: int,
    dry_run: bool,
    attention: str = "xla",
    gradients: Sequence[str] = (),
):
    """Time ocformer's step (the default gradient, and each of ``gradients`` as
    ``ocformer_<name>``: the same model, parameters and optimiser) against flax's."""
    compute_dtype = jnp.bfloat16
    config = experiment_config(_overrides(size, attention))
    task = RandomTokens(size["seq_len"], size["vocab"])
    exp = build(config, task=task)
    shape = gpt_shape(config, size["vocab"])
    batch = {k: jnp.asarray(v) for k, v in task.batch("train", 0, size["batch"], 0).items()}

    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    oc_jit, oc_params = _ocformer_step(exp)
    oc_opt = exp.optimiser.init(eqx.filter(exp.model, eqx.is_inexact_array))
    oc_compiled, oc_compile_s = aot_compile(oc_jit, oc_params, oc_opt, batch)
    candidates = [
        Candidate(
            "ocformer",
            _Stepper(oc_compiled, copy(oc_params), copy(oc_opt), batch),
            oc_compile_s,
        )
    ]
    attention_ran = _attention_ran(oc_compiled)
    memory = {"ocformer": jax_compiled(oc_compiled).memory_analysis()}
    copies = {"ocformer": entry_copies(oc_compiled)}
    for gradient in gradients:
        variant = build(experiment_config(_overrides(size, attention, gradient)), task=task)
        v_jit, v_params = _ocformer_step(variant)
        v_opt = variant.optimiser.init(eqx.filter(variant.model, eqx.is_inexact_array))
        v_compiled, v_compile_s = aot_compile(v_jit, v_params, v_opt, batch)
        name = f"ocformer_{gradient}"
        candidates.append(
            Candidate(name, _Stepper(v_compiled, v_params, v_opt, batch), v_compile_s)
        )
        memory[name] = jax_compiled(v_compiled).memory_analysis()
        copies[name] = entry_copies(v_compiled)
    flax_params = _flax_gpt.params_from_ocformer(exp.model)
    for remat in (False, True):
        name = "flax_remat" if remat else "flax"
        gpt = _flax_gpt.GPT(
            shape,
            remat=remat,
            dtype=compute_dtype,
            # As ocformer's kernel choice: cuDNN only where there is a GPU.
            attention="cudnn" if attention == "cudnn" and jax.default_backend() == "gpu" else None,
        )
        step = _flax_gpt.make_train_step(gpt, exp.optimiser)
        p0 = copy(flax_params)
        o0 = exp.optimiser.init(p0)
        compiled, compile_s = aot_compile(step, p0, o0, batch)
        memory[name] = compiled.memory_analysis()
        copies[name] = entry_copies(compiled)
        candidates.append(Candidate(name, _Stepper(compiled, p0, o0, batch), compile_s))
    del oc_params, oc_opt, flax_params

    timing = time_interleaved(candidates, budget_s, min_repeats, max_repeats)
    med = {k: v["median_s"] for k, v in timing.items()}
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak = _peak_for(device.device_kind)
    # 8192-square products, whose time outweighs the wait for each call's result more
    # than at 4096: there the median rate (327 TFLOP/s on the H200) was below what plain
    # flax's whole step reached (mfu_vs_measured_matmul 1.11, gpu/h200_cudnn_b32.json).
    measured_peak = matmul_peak(
        8192 if not dry_run else 256, 2.0 if not dry_run else 0.2, compute_dtype
    )
    tokens = size["batch"] * size["seq_len"]
    flops = model_flops_per_token(shape) * tokens

    def per(name):
        return {
            "tokens_per_s": tokens / med[name],
            "model_flop_per_s": flops / med[name],
            "mfu": None if peak is None else flops / med[name] / peak,
            "mfu_vs_measured_matmul": flops / med[name] / measured_peak["median_flop_per_s"],
            "compiled_peak_bytes": _peak_bytes(memory[name]),
            # Top-level copies of the compiled step (benchmarks._common.entry_copies):
            # whether the residual stacks' zero fill is copied on this backend too.
            "entry_copies": copies[name],
        }

    losses = {c.name: float(c.run.loss) for c in candidates}
    return {
        "size": size,
        "params": shape.num_params(),
        "attention_implementation": attention_ran,
        "compute_dtype": "bfloat16",
        "master_dtype": "float32",
        "timing": timing,
        "compile_s": {c.name: c.compile_s for c in candidates},
        "last_loss": losses,
        "ratio_vs_flax": med["ocformer"] / med["flax"],
        "ratio_vs_flax_remat": med["ocformer"] / med["flax_remat"],
        "ratio_vs_flax_by_gradient": {g: med[f"ocformer_{g}"] / med["flax"] for g in gradients},
        "mfu_by_gradient": {g: per(f"ocformer_{g}")["mfu"] for g in gradients},
        "by_model": {name: per(name) for name in med},
        "tokens_per_s": tokens / med["ocformer"],
        "mfu": per("ocformer")["mfu"],
        "peak_bf16_flop_per_s": peak,
        "measured_bf16_matmul": measured_peak,
        "device_peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "model_flops_per_step": flops,
    }


def _peak_bytes(m) -> int | None:
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--json", metavar="FILE", type=output_file, help="write the results as JSON to FILE"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="a tiny model on whatever backend is present: checks the code path",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help=f"sequences per step (default {GPT2_SMALL['batch']}; a dry run's {DRY_RUN['batch']})",
    )
    parser.add_argument(
        "--budget", type=positive_float, default=60.0,
        help="seconds of timing of each step (a dry run times 0.2 s, whatever is given)",
    )  # fmt: skip
    parser.add_argument(
        "--attention",
        choices=("xla", "cudnn"),
        default="xla",
        help="attention kernel of both models: ocformer's model.attention_kernel and the "
        "flax reference's jax.nn.dot_product_attention implementation (cudnn: fused)",
    )
    parser.add_argument(
        "--gradients",
        default="stored,stored_dots,stored_projections",
        help="further gradient methods of ocformer's step, timed in the same rounds as "
        "ocformer_<name> (comma-separated; empty for none)",
    )
    args = parser.parse_args(argv)
    gradients = tuple(g for g in args.gradients.split(",") if g)
    unknown = [g for g in gradients if g not in GRADIENT_METHODS]
    if unknown:
        print(
            f"--gradients: unknown method(s) {unknown}; choose from {sorted(GRADIENT_METHODS)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    backend = jax.default_backend()
    if not args.dry_run and backend != "gpu":
        print(
            f"benchmarks.gpu needs an NVIDIA GPU, but JAX's backend here is {backend!r} "
            f"(devices: {jax.devices()}). Run it on a GPU machine with a CUDA build of "
            "jax (`pip install 'jax[cuda12]'`), or pass --dry-run to check the code path "
            "at a tiny size on this machine.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    size = dict(DRY_RUN if args.dry_run else GPT2_SMALL)
    if args.batch is not None:
        size["batch"] = args.batch
    budget, repeats = (0.2, (3, 10)) if args.dry_run else (args.budget, (10, 1000))
    result = run(
        size,
        budget_s=budget,
        min_repeats=repeats[0],
        max_repeats=repeats[1],
        dry_run=args.dry_run,
        attention=args.attention,
        gradients=gradients,
    )
    report = {
        "benchmark": "ocformer GPT training step on one GPU, bfloat16 compute, float32 master",
        "dry_run": args.dry_run,
        # --attention; attention_implementation (in result) is what the compiled step
        # runs: cuDNN's kernel only on an NVIDIA GPU.
        "attention_requested": args.attention,
        **result,
        **provenance(),
    }
    print(
        f"{result['params'] / 1e6:.1f}M parameters, context {size['seq_len']}, batch "
        f"{size['batch']}: {result['tokens_per_s']:,.0f} tokens/s, MFU "
        f"{'n/a' if result['mfu'] is None else format(result['mfu'], '.3f')}, "
        f"ratio vs flax {result['ratio_vs_flax']:.3f} (remat {result['ratio_vs_flax_remat']:.3f})"
    )
    for g, ratio in result["ratio_vs_flax_by_gradient"].items():
        mfu = result["mfu_by_gradient"][g]
        copied = result["by_model"][f"ocformer_{g}"]["entry_copies"]["bytes"]
        print(
            f"  gradient={g}: ratio vs flax {ratio:.3f}, MFU "
            f"{'n/a' if mfu is None else format(mfu, '.3f')}, "
            f"top-level copies {copied / 1e6:.1f} MB (flax: "
            f"{result['by_model']['flax']['entry_copies']['bytes'] / 1e6:.1f} MB)"
        )
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
