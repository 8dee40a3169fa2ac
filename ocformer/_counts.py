"""Whole numbers at the library's edge.

A count, a size or an index may come as a Python integer, a NumPy integer scalar (a
sweep's ``np.arange``, a value read from an array) or a concrete integer JAX array
(diffrax's statistics); never as a float, which would be truncated, nor as a bool,
which Python counts as an integer (``True`` would be a count of 1). Each caller keeps
its own message, which names the argument and what it must be.
"""

import operator

import numpy as np


def whole_number(value: object) -> int | None:
    """``value`` as a Python ``int`` when it is a whole number, else ``None``.

    >>> whole_number(np.int64(3)), whole_number(3.0), whole_number(True)
    (3, None, None)
    """
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def to_whole_number(value):
    """``whole_number(value)`` where that is one, else ``value`` itself: the converter of
    a module's count field (``eqx.field(converter=...)``), so that a NumPy integer is
    stored as the ``int`` it is and anything else reaches the module's own check, which
    names it."""
    whole = whole_number(value)
    return value if whole is None else whole
