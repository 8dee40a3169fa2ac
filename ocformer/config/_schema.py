"""The typed, frozen configuration of a training run.

One schema, eight sections: the equation (``model``, ``controls``), its
``discretisation``, the ``objective``, the ``optimiser``, the ``task``, the
``train`` loop and the device ``mesh`` it runs on. Every field carries its allowed
values (choices or a range) as dataclass metadata, so that validation, ``--set``
parsing and the documentation all read the same source. A name the library knows by
a registry (a task, a formulation, a time stepper, a gradient method, ...) takes its
choices from that registry, never from a list written here. Nothing here traces or
allocates: a bad configuration is rejected before anything is.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..controls import CONTROL_KINDS, NORM_AFFINES
from ..dynamics import SUB_SOLVERS
from ..integration import (
    COSTATES,
    DEPTH_PARALLEL,
    GRADIENT_METHODS,
    MAX_STEPS_PER_LAYER,
    RELAXATIONS,
    STEPSIZES,
)
from ..models import FORMULATIONS, NORM_POSITIONS, READOUTS, WEIGHT_DECAY_ON
from ..objective import KERNEL_NORMS, PRECISIONS, TRAINING_METHODS
from ..operators import ACTIVATIONS, ATTENTION_KERNELS
from ..splitting import SCHEMES, SOLVERS
from ..tasks import FALLBACKS, TASKS
from ._explicit import records_set_fields

# What train.depth_fallback does to a depth-parallel solve when its rule fires
# (ocformer.training.DepthFallback): nothing, the serial solve, or twice the iterations.
DEPTH_FALLBACKS = ("none", "serial", "raise_iterations")


def _field(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    return field(default=default, metadata=meta)


@records_set_fields  # the fields a checkpoint fixes: see model.init_from
@dataclass(frozen=True)
class ModelConfig:
    """The continuous Transformer: width, depth (the time horizon T) and its operators."""

    num_layers: int = _field(2, "layers L: the time horizon T = L with unit layer steps", ge=1)
    width: int = _field(32, "feature width d", ge=1)
    num_heads: int = _field(2, "attention heads; must divide width", ge=1)
    hidden: int = _field(64, "feed-forward hidden width d_ff", ge=1)
    norm: str = _field("pre", "layer-norm position", choices=NORM_POSITIONS)
    activation: str = _field("gelu", "hidden pointwise sub-step", choices=ACTIVATIONS)
    ln_eps: float = _field(1e-5, "layer-norm epsilon", ge=0.0)
    final_norm: bool = _field(True, "project onto S1 at t = T (the final LayerNorm)")
    readout: str = _field(
        "linear",
        "language tasks' logits: a linear head with a bias, or u(T) E^T tied to the token "
        "embedding E (GPT-2's head: such a run can be exported)",
        choices=READOUTS,
    )
    formulation: str = _field(
        "split",
        "split equation, projected dynamics on S1, or Moreau-Yosida relaxation",
        choices=FORMULATIONS,
    )
    relaxation_eps: float = _field(1e-2, "epsilon of the relaxed formulation", gt=0.0)
    dtype: str = _field(
        "float32",
        "floating dtype of the master parameters, optimiser state and checkpoints",
        choices=("float32", "float64"),
    )
    precision: str | None = _field(
        None,
        "compute dtype of the loss and its gradient (None: model.dtype); layer-norm "
        "statistics, softmax, loss and times stay in float32 or wider",
        choices=(None, *PRECISIONS),
    )
    attention: str = _field(
        "dot",
        "Q/K/V projections: pointwise (dot) or CvT's local kernels over the 2-D token grid "
        "(conv, image tasks)",
        choices=("dot", "conv"),
    )
    attention_kernel: str = _field(
        "xla",
        "scaled dot-product attention through XLA, or cuDNN's fused kernel (cudnn: NVIDIA "
        "GPUs, bfloat16/float16 states; elsewhere XLA)",
        choices=ATTENTION_KERNELS,
    )
    conv_kernel: int = _field(3, "side k of the convolutional projections' k x k kernels", ge=1)
    conv_init_scale: float = _field(
        0.5, "noise scale of the initial kernels (unit kernel plus noise)", ge=0.0
    )
    init_from: str | None = _field(
        None,
        "start from a Hugging Face checkpoint directory (GPT-2, BERT, ViT) or an ocformer "
        "work directory (PATH@STEP: its checkpoint of that step); the architecture comes "
        "from it",
    )


@dataclass(frozen=True)
class DiscretisationConfig:
    """How the equation is solved: field for field ``ocformer.integration.Discretisation``.

    ``stepper`` names a splitting scheme (``ocformer.splitting.SCHEMES``; its
    ``sub_solver`` steps the smooth terms) or a diffrax solver
    (``ocformer.splitting.SOLVERS``) for the smooth formulations. Allowed names come
    from those registries.
    """

    stepper: str = _field(
        "lie",
        "time stepper: a splitting scheme or a diffrax solver",
        choices=(*SCHEMES, *SOLVERS),
    )
    sub_solver: str = _field(
        "euler",
        "explicit sub-solver of a splitting scheme's smooth terms (order 1 or 2)",
        choices=SUB_SOLVERS,
    )
    steps_per_layer: int = _field(
        1, "steps per layer m (dt = 1/m); 1 is the Transformer", ge=1, le=MAX_STEPS_PER_LAYER
    )
    stepsize: str = _field(
        "constant", "step-size controller: constant steps or PID", choices=STEPSIZES
    )
    rtol: float = _field(1e-3, "relative tolerance of the PID controller and Newton", gt=0.0)
    atol: float = _field(1e-6, "absolute tolerance of the PID controller and Newton", gt=0.0)
    jump_ts: bool = _field(
        True, "tell an adaptive controller where piecewise-constant controls jump"
    )
    gradient: str = _field(
        "discretise_then_optimise",
        "gradient method (ocformer.integration.GRADIENT_METHODS)",
        choices=tuple(GRADIENT_METHODS),
    )
    depth_parallel: str | None = _field(
        None,
        "solve the layer grid in parallel chunks (parareal, mgrit; None: the serial solve)",
        choices=(None, *DEPTH_PARALLEL),
    )
    coarse_stepper: str = _field(
        "lie",
        "coarse time stepper of the depth-parallel solve (euler sub-solver)",
        choices=(*SCHEMES, *SOLVERS),
    )
    coarse_steps: int = _field(
        1, "coarse steps over each chunk (divides its layers or is a multiple)", ge=1
    )
    iterations: int = _field(1, "depth-parallel iterations K", ge=1)
    relaxation: str = _field("F", "relaxation of mgrit: F (parareal) or FCF", choices=RELAXATIONS)
    depth_costate: str = _field(
        "reverse",
        "gradient of the depth-parallel solve: reverse mode through its iterations, or "
        "the costate solved by the same iteration (parallel)",
        choices=COSTATES,
    )
    chunks: int | None = _field(
        None, "chunks of the layer grid, dividing the layers (None: one per layer)", ge=1
    )


@records_set_fields  # the fields a checkpoint fixes: see model.init_from
@dataclass(frozen=True)
class ControlsConfig:
    """theta(t): how the controls depend on time and how they are initialised."""

    kind: str = _field(
        "piecewise_constant",
        "time dependence of theta",
        choices=CONTROL_KINDS,
    )
    basis_size: int = _field(4, "coefficients K of a basis control", ge=1)
    init_scale: float = _field(1.0, "multiplies every initial kernel's standard deviation", gt=0.0)
    norm_affine: str = _field("feature", "layer-norm gain/bias shape", choices=NORM_AFFINES)


@dataclass(frozen=True)
class ObjectiveConfig:
    """Running-cost weights of the optimal-control objective and the control constraints."""

    control_smoothness: float = _field(0.0, "weight of int |theta'(t)|^2 dt", ge=0.0)
    control_size: float = _field(0.0, "weight of int |theta(t)|^2 dt", ge=0.0)
    kinetic_energy: float = _field(0.0, "weight of int |u_t|^2 dt", ge=0.0)
    sigma_floor: float | None = _field(
        1e-3, "lower bound on sigma2 (layer-norm scale); None: no floor", gt=0.0
    )
    kernel_norm: str | None = _field(
        None, "norm bounded on every kernel", choices=(None, *KERNEL_NORMS)
    )
    kernel_bound: float | None = _field(None, "bound on the kernel norm", gt=0.0)
    ternary: bool = _field(
        False,
        "feed-forward kernels in {-a, 0, a}, one scale a per layer and map (gradient "
        "training: straight-through estimator; msa: the discrete MSA; docs/msa.md)",
    )
    ternary_sparsity: float = _field(
        0.0, "weight lambda of |W|_0 in the ternary projection (objective.ternary)", ge=0.0
    )


@dataclass(frozen=True)
class OptimiserConfig:
    """optax optimiser, learning-rate schedule and gradient clipping."""

    name: str = _field("adamw", "optimiser", choices=("adamw", "adam", "sgd"))
    learning_rate: float = _field(1e-3, "peak learning rate", gt=0.0)
    schedule: str = _field(
        "cosine", "warmup then cosine decay, or constant", choices=("cosine", "constant")
    )
    warmup_steps: int = _field(0, "linear warmup steps", ge=0)
    end_lr_ratio: float = _field(
        0.1, "final / peak learning rate of the cosine decay", ge=0.0, le=1.0
    )
    weight_decay: float = _field(0.0, "decoupled weight decay (adamw)", ge=0.0)
    weight_decay_on: str = _field(
        "all",
        "parameters adamw's weight decay acts on: all, or the weight matrices only (the "
        "attention maps W^Q, W^K, W^V, W^O and CvT's Q/K/V kernels, the feed-forward "
        "controls W_j, the symbol, token-type and patch embeddings, the readout and "
        "pooler weights; not the biases, layer-norm gains and biases, position tables, "
        "class token)",
        choices=WEIGHT_DECAY_ON,
    )
    b1: float = _field(0.9, "Adam beta1", ge=0.0, lt=1.0)
    b2: float = _field(0.99, "Adam beta2", ge=0.0, lt=1.0)
    momentum: float = _field(0.0, "SGD momentum (0: none)", ge=0.0, lt=1.0)
    clip_norm: float | None = _field(1.0, "clip gradients to this global norm (None: off)", gt=0.0)


@dataclass(frozen=True)
class TaskConfig:
    """The data: which task, its sizes, and the batch sizes."""

    name: str = _field(
        "copy",
        "task (ocformer.tasks.TASKS)",
        choices=tuple(TASKS),
    )
    seq_len: int = _field(16, "tokens the transformer sees (language and sequence tasks)", ge=1)
    vocab_size: int = _field(8, "symbols of the synthetic tasks (copy, sort)", ge=2)
    patch_size: int = _field(4, "patch size of the image task", ge=1)
    data_dir: str | None = _field(None, "directory holding the prepared corpus (default .data)")
    fallback: str | None = _field(
        None, "corpus used if Shakespeare is missing", choices=(None, *FALLBACKS)
    )
    path: str | None = _field(
        None,
        "dataset directory of task tokens (python -m ocformer.tasks.prepare text); the "
        "vocabulary size is its manifest's",
    )
    batch_size: int = _field(16, "training batch size", ge=1)
    eval_batch_size: int = _field(32, "validation batch size", ge=1)
    eval_batches: int = _field(4, "validation batches (a fixed set)", ge=1)
    eval_seed: int | None = _field(
        None,
        "seed of the validation windows (None: train.seed); set it to evaluate runs of "
        "different train.seed on one validation set",
        ge=0,
        lt=2**32,
    )


@dataclass(frozen=True)
class TrainConfig:
    """The loop: length, seeds, evaluation, checkpoints, faults."""

    steps: int = _field(100, "optimiser updates", ge=0)
    seed: int = _field(
        0,
        "seed of initialisation, data order, sampling and, unless task.eval_seed is set, "
        "the validation windows (JAX's keys take 32 bits of it)",
        ge=0,
        lt=2**32,
    )
    eval_every: int = _field(50, "evaluate on the validation set every this many steps", ge=1)
    checkpoint_every: int = _field(50, "save a checkpoint every this many steps", ge=1)
    keep_checkpoints: int = _field(3, "checkpoints kept (older ones deleted)", ge=1)
    log_every: int = _field(1, "append a metrics line every this many steps", ge=1)
    sample_tokens: int = _field(
        0,
        "tokens sampled at each evaluation (language models; characters for a character task)",
        ge=0,
    )
    sample_prompt: str = _field("\n", "prompt of the samples")
    sample_temperature: float = _field(0.8, "sampling temperature", gt=0.0)
    on_nonfinite: str = _field(
        "abort",
        "what a NaN/Inf in loss, gradients, parameters or optimiser state does",
        choices=("abort", "skip"),
    )
    preempt_grace_s: float = _field(
        30.0, "after SIGTERM, seconds allowed to checkpoint before exiting anyway", gt=0.0
    )
    stop_check_every: int = _field(
        10,
        "a run of several processes agrees whether to stop (SIGTERM) every this many "
        "steps; a single process checks after every step",
        ge=1,
    )
    progress: bool = _field(True, "show a progress bar")
    profile_steps: str | None = _field(
        None, "A:B writes a jax.profiler trace of steps A+1..B to DIR/profile (A < B <= steps)"
    )
    method: str = _field(
        "gradient",
        "how each batch updates the controls: a gradient step of the optimiser, or an "
        "iteration of the method of successive approximations (E-MSA, docs/msa.md)",
        choices=TRAINING_METHODS,
    )
    msa_inner_steps: int = _field(
        10, "msa: inner optimiser steps per iteration on each layer's Hamiltonian", ge=1
    )
    msa_inner_optimiser: str = _field(
        "adam", "msa: the inner optimiser (Adam or plain gradient ascent)", choices=("adam", "sgd")
    )
    msa_inner_learning_rate: float = _field(3e-3, "msa: the inner learning rate", gt=0.0)
    msa_rho: float = _field(
        1.0, "msa: initial and smallest penalty weight rho of the augmented Hamiltonian", gt=0.0
    )
    msa_rho_growth: float = _field(
        2.0,
        "msa: rho is multiplied by this after an iteration that increased J on its batch and "
        "divided by it (down to msa_rho) after one that did not (1: rho fixed)",
        ge=1.0,
    )
    msa_ternary_step: float = _field(
        1.0,
        "msa with objective.ternary: weight eta of each Hamiltonian gradient in the real "
        "kernels M that the ternary kernels are the projection of",
        gt=0.0,
    )
    msa_ternary_memory: float = _field(
        1.0,
        "msa with objective.ternary: weight alpha of the past in M (1: no decay)",
        gt=0.0,
        le=1.0,
    )
    depth_bias_every: int = _field(
        0,
        "with a depth-parallel solve: every this many steps, log the cosine and relative "
        "norm of its gradient against the serial gradient on the step's batch (0: never)",
        ge=0,
    )
    depth_fallback: str = _field(
        "none",
        "with a depth-parallel solve: what the fallback rule does when it fires (serial: "
        "the serial solve; raise_iterations: twice the iterations, serial once exact)",
        choices=DEPTH_FALLBACKS,
    )
    depth_fallback_cosine: float | None = _field(
        None,
        "the fallback fires at a bias check whose grad_cosine is below this (None: never)",
        ge=-1.0,
        le=1.0,
    )
    depth_fallback_patience: int = _field(
        0,
        "the fallback fires when this many evaluations in a row did not lower the best "
        "validation loss (0: never)",
        ge=0,
    )


@dataclass(frozen=True)
class MeshConfig:
    """The device mesh: the batch is split over ``data`` devices, and the controls over
    ``model`` devices by attention heads and feed-forward hidden width. ``-1`` (for one
    of the two) takes every device the other leaves; the product must not exceed the
    devices of all processes. The layout changes where numbers live, not the run."""

    data: int = _field(-1, "devices the batch is split over (-1: those mesh.model leaves)", ge=-1)
    model: int = _field(
        1, "devices the controls are split over by heads and hidden width (-1: the rest)", ge=-1
    )
    depth: int = _field(
        1,
        "devices the chunks of a depth-parallel solve are split over; divides the layers",
        ge=1,
    )


@dataclass(frozen=True)
class Config:
    """A complete training run. Build it in an experiment file's ``get_config``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    controls: ControlsConfig = field(default_factory=ControlsConfig)
    discretisation: DiscretisationConfig = field(default_factory=DiscretisationConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimiser: OptimiserConfig = field(default_factory=OptimiserConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)

    @property
    def eval_seed(self) -> int:
        """The seed of the validation windows: ``task.eval_seed``, else ``train.seed``."""
        seed = self.task.eval_seed
        return self.train.seed if seed is None else seed


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))


def field_value(config: Config, dotted: str) -> Any:
    """The value of the field ``section.name`` of ``config``."""
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def to_dict(config: Config) -> dict:
    """The configuration as nested plain data (tuples become lists), for JSON."""
    return dataclasses.asdict(config)
