"""Bad input fails loudly, and the message names the array, the value and the fix.

Trace-time checks raise ``ValueError``. The one check on array values (a token of zero
variance meeting the eps = 0 projection) goes through ``eqx.error_if``: under
``eqx.filter_jit`` (and eagerly, where diffrax's own jit applies) it surfaces as
``eqx.EquinoxRuntimeError``; under a bare ``jax.jit`` as ``jax.errors.JaxRuntimeError``
carrying the same message. It is never a silent NaN.
"""

import json
import os
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layers import random_stack

from ocformer.controls import NormParams
from ocformer.convert import from_layers
from ocformer.operators import Attention, FeedForward, Grid, LayerNormProjection, activate
from ocformer.tasks import make_task, prepare_text
from ocformer.tasks._tokenizer import char_tokenizer
from ocformer.tasks.prepare import main as prepare_main
from ocformer.train import main as train_main

SMOKE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "smoke.py"
)

ZERO_VARIANCE = "zero variance"


def _layers(num_layers=2, d=6, d_ff=10, *, scalar_norm=False):
    return random_stack(0, num_layers, d, d_ff, scalar_norm=scalar_norm)


# ---------------------------------------------------------------------------------------
# The layout.


def test_wrong_shape_names_the_array_and_both_shapes():
    layers = _layers(3)
    layers[1]["w2"] = np.zeros((10, 7))
    with pytest.raises(
        ValueError, match=re.escape("layers[1]['w2'] has shape (10, 7), expected (10, 6)")
    ):
        from_layers(layers, num_heads=2)


@pytest.mark.parametrize(
    "key, shape, expected",
    [
        ("bq", (5,), "(6,)"),
        ("b1", (6,), "(10,)"),
        ("ln2_scale", (6, 1), "(6,) or ()"),
        ("wo", (6, 5), "(6, 6)"),
    ],
)
def test_wrong_shape_of_each_kind(key, shape, expected):
    layers = _layers(2)
    layers[0][key] = np.zeros(shape)
    message = f"layers[0]['{key}'] has shape {shape}, expected {expected}"
    with pytest.raises(ValueError, match=re.escape(message)):
        from_layers(layers, num_heads=2)


def test_width_disagreeing_between_layers_is_named():
    layers = _layers(2) + _layers(1, d=8)
    with pytest.raises(
        ValueError, match=re.escape("layers[2]['wq'] has shape (8, 8), expected (6, 6)")
    ):
        from_layers(layers, num_heads=2)


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match=r"num_heads=4 must be a positive integer dividing d=6"):
        from_layers(_layers(), num_heads=4)
    with pytest.raises(ValueError, match=r"num_heads=0"):
        from_layers(_layers(), num_heads=0)
    p = from_layers(_layers(), num_heads=1).layer(0).attention
    with pytest.raises(ValueError, match=r"d=6 is not divisible by num_heads=4"):
        Attention(num_heads=4)(p, jnp.zeros((3, 6)))


def test_missing_key_is_named():
    layers = _layers(2)
    del layers[1]["b1"]
    with pytest.raises(
        ValueError, match=re.escape("layers[1] has missing keys ['b1'] and unknown keys []")
    ):
        from_layers(layers, num_heads=2)


def test_unknown_key_is_named():
    layers = _layers(2)
    layers[0]["w3"] = np.zeros((6, 6))
    with pytest.raises(
        ValueError, match=re.escape("layers[0] has missing keys [] and unknown keys ['w3']")
    ):
        from_layers(layers, num_heads=2)


def test_required_array_cannot_be_absent():
    layers = _layers(2)
    layers[0]["wk"] = None
    with pytest.raises(ValueError, match=re.escape("layers[0]['wk'] is None, but wk is required")):
        from_layers(layers, num_heads=2)


def test_layers_must_share_one_structure():
    layers = _layers(2)
    layers[1]["bo"] = None
    with pytest.raises(ValueError, match=r"'bo' is None in some layers and an array in others"):
        from_layers(layers, num_heads=2)
    layers = _layers(2) + _layers(1, scalar_norm=True)
    with pytest.raises(ValueError, match=r"'ln1_scale' must be scalar in every layer or a vector"):
        from_layers(layers, num_heads=2)


@pytest.mark.parametrize("layers", [[], {"wq": np.eye(2)}, "layers"], ids=["empty", "dict", "str"])
def test_layers_must_be_a_list_of_dicts(layers):
    with pytest.raises(ValueError, match=r"`layers` must be a non-empty list"):
        from_layers(layers, num_heads=1)


def test_options_out_of_range():
    with pytest.raises(ValueError, match=r"ln_eps must be a number >= 0, got -0.1"):
        from_layers(_layers(), num_heads=2, ln_eps=-0.1)
    with pytest.raises(ValueError, match=r"norm must be one of \('pre', 'post'\), got 'sandwich'"):
        from_layers(_layers(), num_heads=2, norm="sandwich")
    with pytest.raises(ValueError, match=r"activation must be one of .*got 'swish'"):
        from_layers(_layers(), num_heads=2, activation="swish")
    with pytest.raises(ValueError, match=r"final_norm must be a dict with keys 'scale' and 'bias'"):
        from_layers(_layers(), num_heads=2, norm="pre", final_norm={"scale": np.ones(6)})
    with pytest.raises(
        ValueError, match=re.escape("final_norm['bias'] has shape (5,), expected (6,)")
    ):
        from_layers(
            _layers(), num_heads=2, norm="pre", final_norm={"scale": np.ones(6), "bias": np.ones(5)}
        )


def test_final_norm_is_checked_where_the_model_takes_it():
    """``from_layers`` takes a dict or a ``NormParams`` (a model's own ``final_norm``);
    ``ContinuousTransformer`` refused neither a dict (AttributeError at the first call)
    nor a wrong-shaped ``NormParams`` (a shape error at the first call)."""
    from ocformer.controls import NormParams
    from ocformer.models import ContinuousTransformer

    final = {"scale": np.full(6, 1.5), "bias": np.linspace(-1, 1, 6)}
    model = from_layers(_layers(), num_heads=2, norm="pre", final_norm=final)
    again = from_layers(_layers(), num_heads=2, norm="pre", final_norm=model.final_norm)
    np.testing.assert_array_equal(again.final_norm.scale, model.final_norm.scale)
    with pytest.raises(
        ValueError, match=r"final_norm must be None or an ocformer.controls.NormParams"
    ):
        ContinuousTransformer(model.control, norm="pre", num_heads=2, final_norm=final)
    short = NormParams(scale=np.ones(5), bias=np.zeros(6))
    with pytest.raises(ValueError, match=r"shape \(6,\) or \(\) .*got shapes \(5,\) and \(6,\)"):
        ContinuousTransformer(model.control, norm="pre", num_heads=2, final_norm=short)


def test_numbers_are_taken_as_numpy_gives_them_and_booleans_are_not():
    """NumPy scalars (a config read with NumPy, a shape's entry) were refused in some
    places and ``True`` taken as 1 in others."""
    import diffrax

    from ocformer.integration import Discretisation
    from ocformer.models import ContinuousTransformer

    model = from_layers(_layers(), num_heads=np.int64(2), ln_eps=np.float32(1e-5))
    assert model.attention.num_heads == 2 and type(model.attention.num_heads) is int
    ContinuousTransformer(model.control, num_heads=np.int64(2), relaxation_eps=np.float64(0.1))
    d = Discretisation(
        diffrax.Tsit5(), stepsize="pid", rtol=np.float32(1e-3), atol=np.float64(1e-6)
    )
    assert type(d.rtol) is float and type(d.atol) is float
    for bad in [dict(num_heads=True), dict(ln_eps=True), dict(ln_eps=float("nan"))]:
        with pytest.raises(ValueError, match=rf"{next(iter(bad))}"):
            from_layers(_layers(), **{"num_heads": 2, **bad})
    with pytest.raises(ValueError, match="num_heads=True"):
        ContinuousTransformer(model.control, num_heads=True)
    with pytest.raises(ValueError, match="relaxation_eps must be a number > 0, got True"):
        ContinuousTransformer(model.control, num_heads=2, relaxation_eps=True)
    for value in (True, float("inf"), 0.0):
        with pytest.raises(ValueError, match=r"rtol must be a finite number > 0"):
            Discretisation(diffrax.Tsit5(), stepsize="pid", rtol=value)


def test_a_bool_is_no_count_anywhere_and_a_numpy_integer_is_one():
    """Counts and sizes of the tasks, the operators, the embeddings, the controls and a
    checkpoint's config.json: ``True`` is refused by name (Python would take it as 1),
    and the tasks take NumPy integers (a sweep's ``np.arange``) as the numbers they are."""
    from ocformer.convert._family import read_int
    from ocformer.integration import DiscretiseThenOptimise
    from ocformer.models import TokenEmbedding
    from ocformer.operators import ConvAttention
    from ocformer.tasks import CopyTask, Digits

    key = jax.random.key(0)
    refusals = [
        (lambda: CopyTask(seq_len=True, vocab_size=5), "seq_len must be an even integer"),
        (lambda: CopyTask(seq_len=4, vocab_size=True), "vocab_size must be an integer >= 3"),
        (lambda: Digits(patch_size=True), "patch_size must be a positive integer"),
        (lambda: CopyTask(4, 5).batch("train", 0, True, 0), "batch_size must be an integer"),
        (lambda: CopyTask(4, 5).eval_batches(2, True), "num_batches must be an integer"),
        (lambda: Attention(num_heads=True), "num_heads must be a positive integer"),
        (lambda: ConvAttention(num_heads=1, token_grid=(True, 2)), "token_grid must be"),
        (lambda: TokenEmbedding(5, True, 4, key=key), "seq_len must be a positive integer"),
        (lambda: DiscretiseThenOptimise(checkpoints=True), "checkpoints"),
        (lambda: read_int({"n_layer": True}, "n_layer"), "n_layer must be a positive integer"),
    ]
    for make, words in refusals:
        with pytest.raises(ValueError, match=words):
            make()
    assert type(Attention(num_heads=np.int64(2)).num_heads) is int  # a module's count too
    assert ConvAttention(num_heads=1, token_grid=(np.int64(2), 3)).token_grid == (2, 3)
    assert DiscretiseThenOptimise(checkpoints=np.int64(2)).checkpoints == 2
    task = CopyTask(np.int64(4), np.int64(5))
    assert type(task.seq_len) is int and type(task.vocab_size) is int
    assert Digits(np.int32(2)).seq_len == 17
    first = CopyTask(4, 5).batch("train", np.int64(1), np.int64(3), np.int64(0))
    assert all(np.array_equal(first[k], CopyTask(4, 5).batch("train", 1, 3, 0)[k]) for k in first)


def test_a_layer_is_read_by_its_index_only():
    """``layer(np.int64(5))`` of a 2-layer model and ``layer(1.5)`` returned parameters
    (the control at a time past the end, or inside a piece) without a word."""
    model = from_layers(_layers(), num_heads=2)
    np.testing.assert_array_equal(
        model.layer(np.int64(1)).attention.wq, model.layer(1).attention.wq
    )
    for n in (np.int64(5), 5, -1):
        with pytest.raises(IndexError, match=rf"^layer {n} of a model of 2 layers"):
            model.layer(n)
    for n in (1.5, True, np.float32(1.0), np.bool_(True)):
        with pytest.raises(ValueError, match=r"layer takes a layer index 0..L-1"):
            model.layer(n)


def test_operator_options_out_of_range():
    with pytest.raises(ValueError, match=r"Grid.h_x must be a positive number .* got 0.0"):
        Grid(h_x=0.0)
    with pytest.raises(ValueError, match=r"Grid.h_y must be a positive number .* got -1.0"):
        Grid(h_y=-1.0)
    with pytest.raises(ValueError, match=r"LayerNormProjection.eps must be a number >= 0, got -1"):
        LayerNormProjection(eps=-1e-5)
    with pytest.raises(ValueError, match=r"activation must be one of .*got 'tanh'"):
        FeedForward(activation="tanh")
    with pytest.raises(ValueError, match=r"Unknown activation 'tanh'"):
        activate(jnp.zeros(3), "tanh")
    with pytest.raises(ValueError, match=r"Attention.num_heads must be a positive integer, got 0"):
        Attention(num_heads=0)
    # A string is not a flag: "False" would otherwise be taken as true.
    with pytest.raises(ValueError, match=r"Attention.causal must be True or False, got 'False'"):
        Attention(num_heads=2, causal="False")
    import diffrax

    from ocformer.integration import Discretisation

    with pytest.raises(ValueError, match=r"jump_ts must be True or False, got 'False'"):
        Discretisation(diffrax.Tsit5(), stepsize="pid", jump_ts="False")
    with pytest.raises(ValueError, match=r"SemiImplicitEuler solves a partitioned system"):
        Discretisation(diffrax.SemiImplicitEuler())
    # A stochastic solver would fail only at the solve, inside diffrax's term checks.
    for sde in (diffrax.EulerHeun(), diffrax.SEA(), diffrax.ItoMilstein(), diffrax.ALIGN(0.1)):
        with pytest.raises(ValueError, match=r"is a stochastic \(SDE\) solver"):
            Discretisation(sde)
    for ode in (diffrax.ReversibleHeun(), diffrax.KenCarp3(), diffrax.Sil3()):
        assert Discretisation(ode).stepper is ode


@pytest.mark.parametrize("steps", [0, -2, 2.0, True, "4"])
def test_steps_per_layer_is_refused_alike_by_the_discretisation_and_the_grid(steps):
    """One check of steps per layer: a ``Discretisation`` and the time grid refuse the
    same values with the same message (True is no step count, though an int)."""
    from ocformer.controls import PiecewiseConstant, init_stacked_params
    from ocformer.integration import Discretisation, time_grid

    expected = f"steps_per_layer must be a positive integer, got {steps!r}."
    with pytest.raises(ValueError) as made:
        Discretisation(steps_per_layer=steps)
    control = PiecewiseConstant(init_stacked_params(jax.random.key(0), 2, 4, 8))
    with pytest.raises(ValueError) as gridded:
        time_grid(control, steps, jnp.float32)
    assert str(made.value) == str(gridded.value) == expected
    assert time_grid(control, 3, jnp.float32)[1] == 2 * 3
    # A numpy integer (from np.arange, a sweep's grid) is a step count.
    assert Discretisation(steps_per_layer=np.int64(3)).steps_per_layer == 3
    assert time_grid(control, np.int64(3), jnp.float32)[1] == 2 * 3
    # Past 2^20 per layer the grid was built whole first (10^9: 15 GiB, a traceback).
    with pytest.raises(ValueError, match=r"at most 1048576 \(2\^20; each step is a layer's"):
        Discretisation(steps_per_layer=10**9)
    with pytest.raises(ValueError, match=r"at most 1048576"):
        time_grid(control, 2**20 + 1, jnp.float32)
    # And over all layers at most 2^24 steps (the grid, and 512 times that for PID).
    deep = PiecewiseConstant(init_stacked_params(jax.random.key(0), 32, 4, 8))
    with pytest.raises(ValueError, match=r"^32 layers x steps_per_layer=1048576 is 33554432"):
        time_grid(deep, 2**20, jnp.float32)


# ---------------------------------------------------------------------------------------
# The state and the mask.


@pytest.fixture(scope="module")
def model():
    return from_layers(_layers(), num_heads=2)


@pytest.mark.parametrize(
    "shape", [(6,), (2, 3, 4, 6), (4, 5), (2, 4, 7)], ids=["rank1", "rank4", "width5", "width7"]
)
def test_state_of_wrong_rank_or_width(model, shape):
    message = (
        f"u0 must have shape (N, 6) or (B, N, 6) (tokens by the model's 6 features), got {shape}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        model(jnp.zeros(shape))


def test_state_must_be_floating(model):
    with pytest.raises(ValueError, match=r"u0 must be a floating-point array, got dtype int"):
        model(jnp.zeros((4, 6), jnp.int32))


@pytest.mark.parametrize(
    "u_shape, mask_shape", [((2, 4, 6), (2, 5)), ((2, 4, 6), (4,)), ((4, 6), (1, 4))]
)
def test_key_mask_of_wrong_shape(model, u_shape, mask_shape):
    message = (
        f"key_mask must have shape {u_shape[:-1]} (the state without its feature axis), "
        f"got {mask_shape}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        model(jnp.ones(u_shape), jnp.ones(mask_shape, bool))


@pytest.mark.parametrize(
    "mask, what", [(jnp.ones(4, jnp.int32), "int32"), (jnp.ones(4), "float"), ([True] * 4, "list")]
)
def test_key_mask_must_be_boolean(model, mask, what):
    """A 0/1 attention mask (as Hugging Face's) or a list is named, with the fix."""
    with pytest.raises(ValueError, match=rf"key_mask must be a boolean array .*got {what}"):
        model(jnp.ones((4, 6)), mask)
    assert model(jnp.ones((4, 6)), jnp.asarray(np.ones(4), bool)).shape == (4, 6)


def test_state_of_no_tokens_and_a_control_that_is_not_one(model):
    with pytest.raises(ValueError, match=re.escape("u0 holds no tokens (shape (0, 6))")):
        model(jnp.ones((0, 6)))
    from ocformer.controls import init_stacked_params
    from ocformer.models import ContinuousTransformer

    params = init_stacked_params(jax.random.key(0), 2, 6, 8)
    with pytest.raises(ValueError, match=r"e\.g\. PiecewiseConstant\(params\)\), got LayerParams"):
        ContinuousTransformer(params, num_heads=2)


def test_attention_operator_checks_the_key_mask():
    p = from_layers(_layers(), num_heads=2).layer(0).attention
    with pytest.raises(ValueError, match=re.escape("key_mask has shape (3,), expected (2, 4)")):
        Attention(num_heads=2)(p, jnp.ones((2, 4, 6)), jnp.ones(3, bool))


# ---------------------------------------------------------------------------------------
# A token with zero variance and eps = 0: no nearest point in S1.


def _constant_token_input(d=6):
    u = np.random.default_rng(1).standard_normal((2, 4, d))
    u[1, 2] = 0.75  # every feature equal
    return jnp.asarray(u)


def test_zero_variance_projection_raises():
    project = LayerNormProjection(eps=0.0)
    target = NormParams(scale=jnp.asarray(1.0), bias=jnp.asarray(0.0))
    u = _constant_token_input()
    with pytest.raises(eqx.EquinoxRuntimeError, match=ZERO_VARIANCE):
        eqx.filter_jit(project)(target, u)
    # The same input with eps > 0 is the regularised projection: finite, not an error.
    assert np.all(np.isfinite(LayerNormProjection(eps=1e-5)(target, u)))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_zero_variance_in_the_model_raises_under_jit(norm):
    layers = _layers(2, scalar_norm=True)
    if norm == "post":
        # With W^V = 0 and no value/output biases, attention adds nothing, so the first
        # projection sees the constant token itself.
        for layer in layers:
            layer.update(wv=np.zeros((6, 6)), bv=None, bo=None)
    model = from_layers(layers, norm=norm, num_heads=2, ln_eps=0.0)
    u = _constant_token_input()
    with pytest.raises(eqx.EquinoxRuntimeError, match=ZERO_VARIANCE):
        model(u)
    with pytest.raises(eqx.EquinoxRuntimeError, match=ZERO_VARIANCE):
        eqx.filter_jit(lambda m, x: m(x))(model, u)
    # A bare jax.jit cannot attach equinox's error type; the message still arrives.
    with pytest.raises(jax.errors.JaxRuntimeError, match=ZERO_VARIANCE):
        jax.block_until_ready(jax.jit(lambda x: model(x))(u))
    # The same model with eps > 0 is finite on this input.
    regularised = from_layers(layers, norm=norm, num_heads=2, ln_eps=1e-5)
    assert np.all(np.isfinite(regularised(u)))


# ---------------------------------------------------------------------------------------
# Prepared corpora: `python -m ocformer.tasks.prepare text|verify` and task.name=tokens.
# Each refusal exits with 2, names the file or field, and writes nothing.


def _file(directory, name, data: bytes) -> str:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _char_tokenizer_file(directory) -> str:
    path = directory / "tok" / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    char_tokenizer("abcdef ").save(str(path))
    return str(path)


_GOOD = b"abc def " * 200
PREPARE_REFUSALS = [
    # (id, arguments before --out given the temporary directory, message)
    ("glob-matching-nothing", lambda t: ["--input", f"{t}/none/*.txt", "--tokenizer", "char"],
     r"--input '.*none/\*\.txt' matches no file"),
    ("missing-file", lambda t: ["--input", f"{t}/missing.txt", "--tokenizer", "char"],
     r"--input .*missing\.txt: no such file"),
    ("empty-file", lambda t: ["--input", _file(t, "a.txt", _GOOD), _file(t, "e.txt", b""),
                              "--tokenizer", "char"],
     r"--input .*e\.txt: the file is empty"),
    ("not-utf8-char", lambda t: ["--input", _file(t, "l1.txt", "café".encode("latin-1")),
                                 "--tokenizer", "char"],
     r"l1\.txt: not UTF-8 at byte offset 3 "),
    ("not-utf8-second-file-given-tokenizer", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), _file(t, "b.txt", _GOOD + b"\xff" + _GOOD),
        "--tokenizer", _char_tokenizer_file(t), "--chunk-bytes", "100"],
     r"b\.txt: not UTF-8 at byte offset 1600 "),
    ("bpe-too-small", lambda t: ["--input", _file(t, "a.txt", _GOOD), "--tokenizer", "bpe:100"],
     r"--tokenizer 'bpe:100': N must be an integer between 256"),
    ("bpe-not-a-number", lambda t: ["--input", _file(t, "a.txt", _GOOD), "--tokenizer", "bpe:"],
     r"--tokenizer 'bpe:': N must be an integer between 256"),
    ("tokenizer-not-a-tokenizer", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", _file(t, "t.json", b'{"a": 1}')],
     r"--tokenizer .*t\.json is not a tokenizer\.json"),
    ("tokenizer-directory-without-one", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", str(t)],
     r"directory .* holds no tokenizer\.json"),
    ("tokenizer-path-missing", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", f"{t}/nothing.json"],
     r"nothing\.json does not exist"),
    ("out-not-ours", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", "char",
        "--out", os.path.dirname(_file(t, "out/notes.txt", b"mine"))],
     r"--out .*out is a non-empty directory not written by ocformer \(it holds notes\.txt"),
    ("out-a-dataset-holding-other-files", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", "char",
        "--out", _dataset_with(t / "ds", "NOTES.md")],
     r"--out .*ds is a dataset but also holds NOTES\.md, which replacing the dataset would "
     r"delete"),
    ("out-a-symbolic-link", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", "char", "--out", _link(t)],
     r"--out .*link is a symbolic link; give the directory itself"),
    ("out-below-a-file", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", "char",
        "--out", _file(t, "f.txt", b"x") + "/sub/ds"],
     r"--out .*f\.txt/sub/ds: .*f\.txt is not a directory"),
    ("tokenizer-missing-a-character", lambda t: [
        "--input", _file(t, "a.txt", _GOOD + b"xyz"), "--tokenizer", _char_tokenizer_file(t)],
     r"--input .*a\.txt: the tokenizer .*tokenizer\.json cannot encode its character 'x' "
     r"\(U\+0078\)"),
    ("chunk-bytes-zero", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", "char", "--chunk-bytes", "0"],
     r"^prepare text: error: --chunk-bytes must be >= 1, got 0$"),
    ("file-given-twice", lambda t: [
        "--input", _file(t, "in/a.txt", _GOOD), _file(t, "in/b.txt", _GOOD), f"{t}/in/*.txt",
        "--tokenizer", "char"],
     r"--input .*in/a\.txt is given twice \(by '.*in/a\.txt' and by '.*in/\*\.txt'\)"),
    ("out-the-current-directory", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", "char", "--out", "."],
     r"--out \. is the current directory or holds it; preparing replaces the directory whole"),
    ("a-hard-link-of-a-file-given", lambda t: [
        "--input", _file(t, "in/a.txt", _GOOD), _hard_link(t / "in/a.txt", t / "in/b.txt"),
        "--tokenizer", "char"],
     r"--input .*in/b\.txt is given twice \(as .*in/a\.txt\)"),
    ("two-files-of-the-same-contents", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), _file(t, "b.txt", b"xyz " * 300),
        _file(t, "copy.txt", _GOOD), "--tokenizer", "char"],
     r"--input files of the same contents fall in both the training and the validation split "
     r"\(.*a\.txt and .*copy\.txt\)"),
    ("input-inside-out", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), _dataset_file(t / "ds", "tokenizer.json"),
        "--tokenizer", "char", "--out", str(t / "ds")],
     r"--input .*ds/tokenizer\.json is inside --out .*ds, which preparing replaces whole"),
    ("binary-file", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), _file(t, "b.bin", b"ab \x00\x01" * 300),
        "--tokenizer", "char"],
     r"b\.bin: a NUL byte at byte offset 3: a binary file .*UTF-16 text \(convert it: iconv"),
    ("a-directory", lambda t: [
        "--input", os.path.dirname(_file(t, "dir/a.txt", _GOOD)), "--tokenizer", "char"],
     r"--input .*dir is a directory; give its files, e\.g\. --input '.*dir/\*\*/\*\.txt'"),
    ("glob-matching-directories-only", lambda t: [
        "--input", os.path.dirname(os.path.dirname(_file(t, "g/sub/a.txt", _GOOD))) + "/*",
        "--tokenizer", "char"],
     r"--input '.*g/\*' matches no file \(only the directories .*g/sub\)"),
    ("bpe-digits-of-another-script", lambda t: [
        "--input", _file(t, "a.txt", _GOOD), "--tokenizer", "bpe:\u0663\u0660\u0660"],
     r"--tokenizer 'bpe:.*': N must be an integer between 256"),
    ("file-given-twice-by-two-flags", lambda t: [
        "--input", _file(t, "in/a.txt", _GOOD), "--input", f"{t}/in/*.txt",
        "--tokenizer", "char"],
     r"--input .*in/a\.txt is given twice \(by '.*in/a\.txt' and by '.*in/\*\.txt'\)"),
]  # fmt: skip


def _dataset_with(directory, name: str) -> str:
    prepare_text([_file(directory.parent, "c.txt", _GOOD)], "char", directory, progress=False)
    (directory / name).write_text("mine")
    return str(directory)


def _hard_link(target, link) -> str:
    os.link(target, link)
    return str(link)


def _dataset_file(directory, name: str) -> str:
    prepare_text([_file(directory.parent, "c.txt", b"ghi jkl " * 150)], "char", directory,
                 progress=False)  # fmt: skip
    return str(directory / name)


def _link(directory) -> str:
    (directory / "real").mkdir()
    os.symlink(directory / "real", directory / "link")
    return str(directory / "link")


@pytest.mark.parametrize(
    "make_args, message", [r[1:] for r in PREPARE_REFUSALS], ids=[r[0] for r in PREPARE_REFUSALS]
)
def test_prepare_text_refuses_bad_input(make_args, message, tmp_path, capsys):
    args = make_args(tmp_path)
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert prepare_main(["text", *args, "--no-progress"]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    prepare_text([_file(root, "c.txt", _GOOD)], "char", root / "ds", progress=False)
    return root / "ds"


def _corrupt(name: str, edit):
    def apply(directory):
        path = directory / name
        path.write_bytes(edit(path.read_bytes()))

    return apply


def _edit_manifest(edit):
    def apply(directory):
        path = directory / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))

    return apply


DATASET_REFUSALS = [
    # (id, corruption of a copy of a good dataset, error type, message naming the file)
    ("truncated-train-bin", _corrupt("train.bin", lambda b: b[:-2]), ValueError,
     r"train\.bin has 2884 bytes, the manifest says 2886 bytes \(1443 uint16 ids\)"),
    ("changed-id-in-val-bin", _corrupt("val.bin", lambda b: b"\x01\x00" + b[2:]), ValueError,
     r"val\.bin has SHA-256 [0-9a-f]{64}, the manifest says [0-9a-f]{64}"),
    ("id-at-vocab-size", _corrupt("train.bin", lambda b: b[:10] + b"\x07\x00" + b[12:]),
     ValueError, r"train\.bin: token 5 is id 7, not below the vocabulary size 7"),
    ("tokenizer-edited", _corrupt("tokenizer.json", lambda b: b + b"\n"), ValueError,
     r"tokenizer\.json is missing or does not match the SHA-256"),
    ("manifest-not-json", _corrupt("manifest.json", lambda b: b[:-5]), ValueError,
     r"manifest\.json is not a valid dataset manifest"),
    ("manifest-dtype", _edit_manifest(lambda m: m.update(dtype="foo")), ValueError,
     r"manifest\.json is not a valid dataset manifest \(ValueError: dtype is 'foo', "
     r"expected 'uint16' or 'uint32'\)"),
    ("manifest-byte-order", _edit_manifest(lambda m: m.update(byte_order="big")), ValueError,
     r"manifest\.json is not a valid dataset manifest \(ValueError: byte_order is 'big', "
     r"expected 'little'\)"),
    ("manifest-vocab-size", _edit_manifest(lambda m: m.update(vocab_size="abc")), ValueError,
     r"manifest\.json is not a valid dataset manifest \(ValueError: vocab_size is 'abc'"),
    ("manifest-tokenizer-hash", _edit_manifest(lambda m: m["tokenizer"].pop("sha256")),
     ValueError, r"manifest\.json is not a valid dataset manifest \(ValueError: "
     r"tokenizer\.sha256 is None, expected a hex digest\)"),
    ("manifest-tokenizer-not-a-record", _edit_manifest(lambda m: m.update(tokenizer="x")),
     ValueError, r"manifest\.json is not a valid dataset manifest \(AttributeError"),
    ("manifest-split-hash", _edit_manifest(lambda m: m["splits"]["train"].pop("sha256")),
     ValueError, r"manifest\.json is not a valid dataset manifest \(ValueError: "
     r"splits\.train\.sha256 is None"),
    ("not-a-dataset-directory", lambda d: (d / "manifest.json").unlink(), ValueError,
     r"ds is not a dataset directory \(no manifest\.json\)"),
    ("path-missing", lambda d: shutil.rmtree(d), FileNotFoundError,
     r"ds does not exist\. Prepare a dataset there"),
]  # fmt: skip


@pytest.mark.parametrize(
    "corrupt, error, message",
    [r[1:] for r in DATASET_REFUSALS],
    ids=[r[0] for r in DATASET_REFUSALS],
)
def test_tokens_task_refuses_a_corrupted_dataset(
    corrupt, error, message, dataset, tmp_path, capsys
):
    directory = tmp_path / "ds"
    shutil.copytree(dataset, directory)
    corrupt(directory)
    with pytest.raises(error, match=message):
        make_task("tokens", path=str(directory), seq_len=4)
    assert prepare_main(["verify", str(directory)]) == 2
    assert re.search(message, capsys.readouterr().err)
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run"),
            "--set", "task.name=tokens", "--set", f"task.path={directory}"]  # fmt: skip
    assert train_main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_tokens_task_needs_a_path_and_checks_ids_of_a_large_dataset(dataset, tmp_path, capsys):
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run"), "--set", "task.name=tokens"]
    assert train_main(argv) == 2
    assert re.search(
        r"task\.path: task\.name=tokens reads a dataset directory", capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()
    # Past FULL_CHECK_BYTES, opening checks sizes only; a bad id is caught when read.
    directory = tmp_path / "ds"
    shutil.copytree(dataset, directory)
    ids = np.full(1443, 7, dtype="<u2")
    (directory / "train.bin").write_bytes(ids.tobytes())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ocformer.tasks._dataset.FULL_CHECK_BYTES", 0)
        task = make_task("tokens", path=str(directory), seq_len=4)
    with pytest.raises(
        ValueError, match=r"train\.bin: token \d+ is id 7, not below the vocabulary size 7"
    ):
        task.batch("train", 0, 2, seed=0)


# ---------------------------------------------------------------------------------------
# Command lines: each bad invocation exits with its code and a message naming the option,
# and the folder it runs in comes out byte-for-byte unchanged.


def _snapshot(directory) -> dict[str, bytes]:
    """Every file under ``directory``: relative path -> its bytes."""
    import os

    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return out


def _in_a_process(module: str):
    """The command line of ``module`` as a process (its output passed on)."""

    def main(argv):
        import subprocess
        import sys

        proc = subprocess.run(
            [sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120
        )
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        return proc.returncode

    return main


def _launch_help(tmp_path, stack):
    return _in_a_process("ocformer.launch"), ["--help"]


def _launch_port_taken(tmp_path, stack):
    import socket

    holder = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    train = ["--config", "experiments/smoke.py", "--workdir", str(tmp_path / "run")]
    argv = ["local", "--nproc", "2", "--port", str(port), "--", *train]
    return _in_a_process("ocformer.launch"), argv


def _convergence(*options):
    def prepare(tmp_path, stack):
        from ocformer.analysis import __main__ as analysis

        return analysis.main, ["convergence", *options]

    return prepare


def _sweep_with(*flags):
    def case(tmp_path, stack):
        sweep = [str(SWEEPS / "smoke.py"), "--workdir", str(tmp_path / "sweep"), *flags]
        return _in_a_process("ocformer.sweep"), sweep

    return case


def _sweep_here(*argv):
    def case(tmp_path, stack):
        from ocformer import sweep

        return sweep.main, [*argv]

    return case


def _sweep_parallel_zero(tmp_path, stack):
    smoke = SWEEPS / "smoke.py"
    return _in_a_process("ocformer.sweep"), [
        str(smoke),
        "--workdir",
        str(tmp_path / "sweep"),
        "--parallel",
        "0",
    ]


def _evaluate_json(where):
    def prepare(tmp_path, stack):
        from ocformer import evaluate

        return evaluate.main, [str(tmp_path / "run"), "--json", where(tmp_path)]

    return prepare


def _evaluate_truncated_config(tmp_path, stack):
    import pathlib
    import tempfile

    from ocformer import evaluate
    from ocformer.training._rundir import RUN_MARKER

    run = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
    (run / RUN_MARKER).write_text("{}")
    (run / "config.json").write_text('{"model": {"num_lay')
    return evaluate.main, [str(run)]


SWEEPS = __import__("pathlib").Path(__file__).resolve().parent.parent / "experiments" / "sweeps"

BAD_COMMAND_LINES = [
    ("launch --help", _launch_help, 0, ["usage: python -m ocformer.launch", "local", "slurm"]),
    ("launch --port taken", _launch_port_taken, 2,
     ["is taken on this machine", "choose another --port"]),
    ("convergence --steps 0,4", _convergence("--steps", "0,4"), 2,
     ["argument --steps: '0' is not a whole number of steps from 1 to 4096"]),
    # A first value with a minus sign is the list's, not an option's ("expected one
    # argument" from argparse otherwise).
    ("convergence --steps -4,8", _convergence("--steps", "-4,8"), 2,
     ["argument --steps: '-4' is not a whole number of steps from 1 to 4096"]),
    # A grid of 10^11 steps per layer was allocated (17.5 TiB) before anything was said.
    ("convergence --steps 4,99999999999", _convergence("--steps", "4,99999999999"), 2,
     ["argument --steps: '99999999999' is not a whole number of steps from 1 to 4096"]),
    ("convergence --relaxation-eps 1e-9", _convergence(
        "--formulation", "relaxed", "--relaxation-eps", "1e-9", "--schemes", "kvaerno3",
        "--steps", "4,8"), 2,
     ["the reference would take 1000000000 steps per layer", "more than 32768"]),
    ("convergence --epsilons -0.1,0.2", _convergence("--epsilons", "-0.1,0.2"), 2,
     ["argument --epsilons: '-0.1' is not a finite number > 0"]),
    ("convergence --steps 4,abc", _convergence("--steps", "4,abc"), 2,
     ["argument --steps: 'abc' is not a whole number"]),
    ("convergence --schemes ''", _convergence("--schemes", ""), 2,
     ["argument --schemes: no scheme given"]),
    ("convergence --epsilons abc", _convergence("--epsilons", "abc"), 2,
     ["argument --epsilons: 'abc' is not a finite number > 0"]),
    ("convergence --steps 4,8,4", _convergence("--steps", "4,8,4"), 2,
     ["argument --steps: 4 given twice; the points of a fit must differ"]),
    ("convergence --epsilons of a study without them", _convergence("--epsilons", "0.1,0.01"),
     2, ["--epsilons are the epsilons of the error in epsilon", "drop --epsilons"]),
    ("sweep --parallel 0", _sweep_parallel_zero, 2, ["--parallel: must be >= 1", "got 0"]),
    # Options the chosen launcher would ignore.
    ("sweep local --partition", _sweep_with("--partition", "gpu", "--wait"), 2,
     ["--partition, --wait are SLURM options, which the local launcher does not read: add "
      "--launcher slurm, or drop them"]),
    ("sweep local --gpus 0", _sweep_with("--gpus", "0"), 2,
     ["--gpus is a SLURM option, which the local launcher does not read"]),
    ("sweep --onl", _sweep_with("--onl", "layers=1"), 2, ["unrecognized arguments: --onl"]),
    # An empty path is not the current directory (a sweep would start there).
    ("sweep --workdir ''", _sweep_here(str(SWEEPS / "smoke.py"), "--workdir", "", "--dry-run"),
     2, ["--workdir: is an empty path"]),
    ("sweep report ''", _sweep_here("report", ""), 2, ["the sweep directory: is an empty path"]),
    ("sweep slurm --parallel", _sweep_with("--launcher", "slurm", "--parallel", "2"), 2,
     ["--parallel is the number of local worker processes, which --launcher slurm does not "
      "read"]),
    ("evaluate --json into a missing folder", _evaluate_json(lambda t: str(t / "no" / "r.json")),
     2, ["--json", "does not exist; create it first"]),
    ("evaluate --json a directory", _evaluate_json(lambda t: str(t)), 2,
     ["is a directory; give the path of a file"]),
    ("evaluate on a truncated config.json", _evaluate_truncated_config, 2,
     ["config.json cannot be read", "writes it again from the configuration its newest"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "case, code, words", [b[1:] for b in BAD_COMMAND_LINES], ids=[b[0] for b in BAD_COMMAND_LINES]
)
def test_bad_command_line(case, code, words, tmp_path, monkeypatch, capsys):
    import contextlib
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)  # the experiments' relative paths
    with contextlib.ExitStack() as stack:
        main, argv = case(tmp_path, stack)
        before = _snapshot(tmp_path)
        capsys.readouterr()
        assert main(argv) == code
    out, err = capsys.readouterr()
    for word in words:
        assert word in out + err, (word, out, err)
    assert "Traceback" not in err, err
    assert _snapshot(tmp_path) == before and os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_small_notebook_runs_never_rewrite_the_committed_notebooks(tmp_path, monkeypatch):
    """notebooks/execute.py at the small size writes its .ipynb to a temporary folder;
    only a full-size run (``make notebooks``) writes next to the .py."""
    import importlib.util
    import json
    import tempfile
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "notebooks" / "execute.py"
    spec = importlib.util.spec_from_file_location("notebooks_execute", path)
    assert spec is not None and spec.loader is not None
    execute = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(execute)
    folder = tmp_path / "notebooks"
    folder.mkdir()
    (folder / "tiny.py").write_text("# %%\nprint(6 * 7)\n")
    monkeypatch.setattr(execute, "HERE", folder)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def printed(ipynb: Path) -> str:
        cells = json.loads(ipynb.read_text())["cells"]
        texts = [o["text"] for c in cells for o in c["outputs"] if "text" in o]
        return "".join("".join(t) if isinstance(t, list) else t for t in texts)

    monkeypatch.setenv("OCFORMER_NOTEBOOK_SMALL", "1")
    assert execute.main(["tiny"]) == 0
    assert not (folder / "tiny.ipynb").exists()
    assert execute.main(["--out", str(folder), "tiny"]) == 2  # nor when named as --out
    assert not (folder / "tiny.ipynb").exists()
    [small] = tmp_path.glob("ocformer-notebooks-*/tiny.ipynb")
    assert printed(small) == "42\n"
    monkeypatch.delenv("OCFORMER_NOTEBOOK_SMALL")
    assert execute.main(["tiny"]) == 0
    assert printed(folder / "tiny.ipynb") == "42\n"
    assert execute.main(["nope"]) == 2  # no such notebook: nothing runs


def test_a_run_s_step_is_a_whole_number():
    """``load_run(wd, "10")`` answered ``no committed checkpoint of step 10; committed
    steps: [10]``."""
    from ocformer.training import load_run

    for step in ("10", 10.0, True):
        with pytest.raises(ValueError, match=r"step must be a whole number or None"):
            load_run("unread", step)  # type: ignore[arg-type]


def test_jax_integers_and_list_sequences_are_stored_as_the_static_values_they_are():
    """``steps_per_layer=jnp.asarray(2)`` was stored as a JAX array (unhashable; the
    model's call failed deep in diffeqsolve) and ``Strang(sequence=[1, 0])`` as a list
    (unhashable under ``jax.jit``'s static arguments, unequal to the tuple): both are
    stored as Python ints now; a float array is still refused by name."""
    import jax.numpy as jnp

    from ocformer.integration import Discretisation
    from ocformer.splitting import Strang

    d = Discretisation(steps_per_layer=jnp.asarray(2))
    assert type(d.steps_per_layer) is int and hash(d) == hash(Discretisation(steps_per_layer=2))
    with pytest.raises(ValueError, match=r"steps_per_layer must be a positive integer, got Arr"):
        Discretisation(steps_per_layer=jnp.asarray(2.0))
    for given in ([1, 0, 2], np.array([1, 0, 2]), (np.int64(1), 0, 2)):
        s = Strang(sequence=given)
        assert s.sequence == (1, 0, 2) and all(type(i) is int for i in s.sequence)
        assert s == Strang(sequence=(1, 0, 2)) and hash(s) == hash(Strang(sequence=(1, 0, 2)))
    model = from_layers(_layers(), num_heads=2, norm="pre")  # two terms
    x = np.random.default_rng(0).normal(size=(3, model.control.values.attention.wq.shape[-1]))
    from ocformer.models import rediscretise

    y = rediscretise(model, stepper=Strang(sequence=[1, 0]))(x)
    assert np.array_equal(y, rediscretise(model, stepper=Strang(sequence=(1, 0)))(x))


def test_from_layers_refuses_weights_that_are_not_real_numbers_and_runs_under_grad():
    """A complex array lost its imaginary part (a NumPy warning only), an object array
    of None became NaN, strings were parsed, and each cast the whole model to float32;
    refused by key now. And ``from_layers`` is traced by ``jax.grad`` (it read its
    arrays' dtype with NumPy, which a tracer refuses): its gradient is the finite
    difference's."""
    import jax

    for bad in (lambda w: w + 1j, lambda w: np.array([["0.1"] * w.shape[1]] * w.shape[0]),
                lambda w: np.full(w.shape, None)):  # fmt: skip
        layers = _layers()
        layers[0]["wq"] = bad(np.asarray(layers[0]["wq"]))
        with pytest.raises(ValueError, match=r"layers\[0\]\['wq'\] has dtype .*give real numbers"):
            from_layers(layers, num_heads=2)
    layers = [{k: None if v is None else np.asarray(v, np.float64) for k, v in layer.items()}
              for layer in _layers()]  # fmt: skip
    width = layers[0]["wq"].shape[0]
    x = np.random.default_rng(1).normal(size=(3, width))

    def loss(wq):
        stack = [dict(layers[0], wq=wq), *layers[1:]]
        return (from_layers(stack, num_heads=2, norm="pre")(x) ** 2).sum()

    grad = np.asarray(jax.grad(loss)(layers[0]["wq"]))  # float64: the suite enables x64
    e = np.zeros_like(layers[0]["wq"])
    e[0, 1] = 1e-6
    fd = (loss(layers[0]["wq"] + e) - loss(layers[0]["wq"] - e)) / 2e-6
    assert grad.dtype == np.float64 and abs(grad[0, 1]) > 1e-3
    assert abs(grad[0, 1] - float(fd)) < 1e-7 * abs(float(fd))
