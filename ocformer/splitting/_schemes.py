"""Symmetric, additive and hybrid splitting schemes."""

from typing import Any

import equinox as eqx

from .._counts import whole_number
from ..dynamics import AbstractExplicitTerm, SubSolver
from ._base import AbstractSplittingSolver, Lie, check_sub_solver


def _as_sequence(sequence: Any) -> Any:
    """A ``sequence`` given as a list or array, as the tuple of ints a static field holds
    (hashed and compared: a list was unhashable under ``jax.jit``); anything else is
    left for the scheme's check to name."""
    try:
        items = [whole_number(i) for i in sequence]
    except TypeError:  # not iterable, or None
        return sequence
    return sequence if None in items else tuple(items)


def _check_permutation(sequence, num_terms: int, who: str) -> tuple[int, ...]:
    if sequence is None:
        return tuple(range(num_terms))
    if sorted(sequence) != list(range(num_terms)):
        raise ValueError(
            f"{who}.sequence={sequence!r} must be a permutation of the {num_terms} term "
            f"indices {tuple(range(num_terms))}."
        )
    return tuple(sequence)


class Strang(AbstractSplittingSolver):
    r"""Symmetric (Strang) splitting: half steps out and back around the middle operator.

    With the terms taken in the order $s_1, \dots, s_K$ (``sequence``, default
    $1, \dots, K$):
    $$u^{n+1} = \Phi^{\delta t/2}_{s_1} \circ \cdots \circ \Phi^{\delta t/2}_{s_{K-1}}
      \circ \Phi^{\delta t}_{s_K} \circ \Phi^{\delta t/2}_{s_{K-1}} \circ \cdots
      \circ \Phi^{\delta t/2}_{s_1}(u^n).$$
    Second order with exact (or second-order) sub-flows (Strang 1968). Its ``order`` is
    the smaller of 2 and the sub-flows' orders: with explicit Euler sub-steps it is
    first order; ``Strang(sub_solver="midpoint")`` or ``"heun"`` is second order.

    A projection term keeps the second order only as the first term of ``sequence``;
    anywhere else ``order`` is 1. On the projected formulation the projection onto
    $S_1(\theta(t_{n+1/2}))$ is what moves the state with the set: the first time it is
    applied it carries the state from $S_1(t_n)$ to $S_1(t_{n+1/2})$, wherever it sits,
    its second application is the identity up to the local error, and the projection
    that closes the step (``ProjectedSolver``) carries the state on to
    $S_1(t_{n+1})$. Applied first, these two halves of the motion of the set sit at
    the two ends of the step, around the symmetric composition of the tangent flows;
    applied later, they split the step asymmetrically, a local error of order
    $\delta t^2$. Measured on the projected study model (midpoint sub-flows, local
    slopes between 32 and 64 steps per layer): 2.00 for ``sequence=(0, 1, 2)`` and
    ``(0, 2, 1)``; 1.03, 1.00, 1.03, 1.06 for ``(1, 0, 2)``, ``(2, 0, 1)``,
    ``(1, 2, 0)``, ``(2, 1, 0)``. With time-independent $\sigma$ the set does not move
    and the position of the projection no longer matters (the three sequences tried,
    (0, 1, 2), (1, 0, 2), (2, 1, 0), measured 2.00); ``order`` states what holds for
    all controls.

    Macaron ("FFN/2, attention, FFN/2", Lu et al. 2019) is one instance: on the pre-LN
    terms (attention, feed-forward), ``Strang(sequence=(1, 0))`` puts the feed-forward
    term outside and attention in the middle; ``Strang()`` gives "attention/2, FFN,
    attention/2".

    Args:
        sub_solver: the explicit sub-solver of the smooth terms (``"euler"``,
            ``"midpoint"`` or ``"heun"``).
        sequence: the order in which the terms are applied on the way out (a
            permutation of the term indices; the last one is the middle operator).
    """

    sub_solver: SubSolver = eqx.field(default="euler", static=True)
    sequence: tuple[int, ...] | None = eqx.field(default=None, static=True, converter=_as_sequence)
    num_terms: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        check_sub_solver("Strang", self.sub_solver)

    def check_terms(self, num_terms):
        _check_permutation(self.sequence, num_terms, "Strang")

    def splitting_order(self, num_terms, projections=()):
        first = _check_permutation(self.sequence, num_terms, "Strang")[0]
        return 2 if all(i == first for i in projections) else 1

    def feeds(self, source, target, terms):
        # Only the middle operator is always entered from one operator (the last outer
        # one); the outer ones are entered from both sides.
        *outer, middle = _check_permutation(self.sequence, len(terms), "Strang")
        return bool(outer) and target == middle and outer[-1] == source

    def compose(self, terms, theta, dt, y, args, record=None):
        *outer, middle = _check_permutation(self.sequence, len(terms), "Strang")
        half = 0.5 * dt
        for k in (*outer, middle, *reversed(outer)):
            y = terms[k].flow(theta, dt if k == middle else half, y, args, self.sub_solver)
            if record is not None:
                record.append(y)
        return y


class Parallel(AbstractSplittingSolver):
    r"""Additive (parallel) splitting: every sub-problem from $u^n$ with $K$ times its
    operator, then the average,

    $$u^{n+1} = \frac{1}{K}\sum_{k=1}^K \Phi^{K\delta t}_k(u^n).$$
    First order. With explicit Euler sub-steps it is exactly explicit Euler on the sum
    of the fields ($\frac1K \sum_k (u + K\delta t f_k) = u + \delta t \sum_k f_k$): for
    pre-LN terms that is the parallel attention/MLP block of GPT-J. A projection term
    in a parallel group is averaged with the others, so the result is generally off
    its set.

    Args:
        sub_solver: the explicit sub-solver of the smooth terms.
    """

    sub_solver: SubSolver = eqx.field(default="euler", static=True)
    num_terms: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        check_sub_solver("Parallel", self.sub_solver)

    def splitting_order(self, num_terms, projections=()):
        return 1

    def feeds(self, source, target, terms):
        return len(terms) == 1

    def compose(self, terms, theta, dt, y, args, record=None):
        group = tuple(range(len(terms)))
        return _parallel(terms, group, theta, dt, y, args, record, self.sub_solver)


def _parallel(terms, group, theta, dt, y, args, record, sub_solver):
    k = len(group)
    if k == 1:
        out = terms[group[0]].flow(theta, dt, y, args, sub_solver)
    else:
        branches = [terms[i].flow(theta, k * dt, y, args, sub_solver) for i in group]
        if record is not None:
            record.extend(branches)
        out = branches[0]
        for b in branches[1:]:
            out = out + b
        out = out * (1.0 / k)
    if record is not None:
        record.append(out)
    return out


def default_groups(terms) -> tuple[tuple[int, ...], ...]:
    """Maximal runs of consecutive explicit (smooth) terms form parallel groups; every
    other term (a projection, the averaged feed-forward step) is a group of its own."""
    groups: list[list[int]] = []
    run: list[int] = []
    for i, term in enumerate(terms):
        if isinstance(term, AbstractExplicitTerm):
            run.append(i)
            continue
        if run:
            groups.append(run)
            run = []
        groups.append([i])
    if run:
        groups.append(run)
    return tuple(tuple(g) for g in groups)


class Hybrid(AbstractSplittingSolver):
    r"""Sequential composition of parallel groups $G_1, \dots, G_M$:

    $$u^{n+1} = \Psi_{G_M} \circ \cdots \circ \Psi_{G_1}(u^n),\qquad
      \Psi_G(v) = \frac{1}{|G|}\sum_{k \in G} \Phi^{|G|\delta t}_k(v).$$
    First order. Singleton groups give ``Lie``, one group of all terms ``Parallel``.

    Args:
        sub_solver: the explicit sub-solver of the smooth terms.
        groups: tuples of term indices, each index exactly once. Default: maximal runs
            of consecutive explicit (smooth) terms are parallel groups and every other
            term is its own group. With the two pre-LN terms that is one group, i.e.
            ``Parallel``; with the post-LN split terms every group is a singleton, i.e.
            ``Lie``: give ``groups`` to get a scheme that differs from both.
    """

    sub_solver: SubSolver = eqx.field(default="euler", static=True)
    groups: tuple[tuple[int, ...], ...] | None = eqx.field(default=None, static=True)
    num_terms: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        check_sub_solver("Hybrid", self.sub_solver)
        if self.groups is not None and not (
            isinstance(self.groups, tuple)
            and self.groups
            and all(isinstance(g, tuple) and g for g in self.groups)
        ):
            raise ValueError(
                f"Hybrid.groups must be a non-empty tuple of non-empty tuples of term "
                f"indices, e.g. ((0, 1), (2,)); got {self.groups!r}."
            )

    def check_terms(self, num_terms):
        if self.groups is None:
            return
        if sorted(i for g in self.groups for i in g) != list(range(num_terms)):
            raise ValueError(
                f"Hybrid.groups={self.groups!r} must use each of the {num_terms} term "
                f"indices {tuple(range(num_terms))} exactly once."
            )

    def resolved_groups(self, terms) -> tuple[tuple[int, ...], ...]:
        if self.groups is None:
            return default_groups(terms)
        self.check_terms(len(terms))
        return self.groups

    def splitting_order(self, num_terms, projections=()):
        return 1

    def feeds(self, source, target, terms):
        groups = self.resolved_groups(terms)
        return any(a == (source,) and b == (target,) for a, b in zip(groups[:-1], groups[1:]))

    def compose(self, terms, theta, dt, y, args, record=None):
        for group in self.resolved_groups(terms):
            y = _parallel(terms, group, theta, dt, y, args, record, self.sub_solver)
        return y


SCHEMES: dict[str, type[Lie | Strang | Parallel | Hybrid]] = {
    "lie": Lie,
    "strang": Strang,
    "parallel": Parallel,
    "hybrid": Hybrid,
}
"""Splitting schemes by name; each class is constructible with no arguments."""

Strang.__init__.__doc__ = "**Arguments:** sub_solver, sequence (optional permutation)"
Hybrid.__init__.__doc__ = "**Arguments:** sub_solver, groups (optional tuple of tuples)"
Parallel.__init__.__doc__ = "**Arguments:** sub_solver (optional, default 'euler')"
