"""Random layer stacks in the plain layout of ``ocformer.convert.from_layers``: the one
builder the tests share."""

import numpy as np


def random_layer(
    rng,
    d,
    d_ff,
    *,
    biases=True,
    output_map=True,
    scalar_norm=False,
    dtype=np.float64,
):
    """One layer with realistic scales: kernels N(0, 1/fan_in), biases and LN offsets
    of size 0.1, LN gains near 1."""

    def kernel(din, dout):
        return rng.standard_normal((din, dout)) / np.sqrt(din)

    def bias(n):
        return 0.1 * rng.standard_normal(n) if biases else None

    def gain():
        return 1.0 + 0.1 * rng.standard_normal(() if scalar_norm else d)

    def offset():
        return 0.1 * rng.standard_normal(() if scalar_norm else d)

    layer = {
        "wq": kernel(d, d),
        "wk": kernel(d, d),
        "wv": kernel(d, d),
        "wo": kernel(d, d) if output_map else None,
        "bq": bias(d),
        "bk": bias(d),
        "bv": bias(d),
        "bo": bias(d) if output_map else None,
        "w1": kernel(d, d_ff),
        "b1": bias(d_ff),
        "w2": kernel(d_ff, d),
        "b2": bias(d),
        "ln1_scale": gain(),
        "ln1_bias": offset(),
        "ln2_scale": gain(),
        "ln2_bias": offset(),
    }
    return {k: None if v is None else np.asarray(v, dtype) for k, v in layer.items()}


def random_stack(seed, num_layers, d, d_ff, **kwargs):
    rng = np.random.default_rng(seed)
    return [random_layer(rng, d, d_ff, **kwargs) for _ in range(num_layers)]


def random_input(seed, batch, n, d, dtype=np.float64):
    shape = (n, d) if batch is None else (batch, n, d)
    return np.random.default_rng(seed + 1000).standard_normal(shape).astype(dtype)
