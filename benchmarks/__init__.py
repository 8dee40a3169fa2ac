"""Benchmarks of ocformer against hand-written JAX references.

``python -m benchmarks.run --quick --json FILE``: the cost of posing a Transformer as a
``diffeqsolve`` of the split equation, against a ``jax.lax.scan`` over the same layers.
"""
