"""Symmetric, additive and hybrid splitting schemes."""

import equinox as eqx

from ..dynamics._terms import AbstractExplicitTerm
from ._base import AbstractSplittingSolver, Lie


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
    first order; give the explicit terms ``sub_solver="midpoint"`` or ``"heun"`` to see
    order 2.

    Macaron ("FFN/2, attention, FFN/2", Lu et al. 2019) is one instance: on the pre-LN
    terms (attention, feed-forward), ``Strang(sequence=(1, 0))`` puts the feed-forward
    term outside and attention in the middle; ``Strang()`` gives "attention/2, FFN,
    attention/2".

    Args:
        sequence: the order in which the terms are applied on the way out (a
            permutation of the term indices; the last one is the middle operator).
    """

    sequence: tuple[int, ...] | None = eqx.field(default=None, static=True)
    num_terms: int | None = eqx.field(default=None, static=True)

    def splitting_order(self, num_terms: int) -> int:
        return 2

    def compose(self, terms, theta, dt, y, args, record=None):
        *outer, middle = _check_permutation(self.sequence, len(terms), "Strang")
        half = 0.5 * dt
        for k in (*outer, middle, *reversed(outer)):
            y = terms[k].flow(theta, dt if k == middle else half, y, args)
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
    """

    num_terms: int | None = eqx.field(default=None, static=True)

    def splitting_order(self, num_terms: int) -> int:
        return 1

    def compose(self, terms, theta, dt, y, args, record=None):
        return _parallel(terms, tuple(range(len(terms))), theta, dt, y, args, record)


def _parallel(terms, group, theta, dt, y, args, record):
    k = len(group)
    if k == 1:
        out = terms[group[0]].flow(theta, dt, y, args)
    else:
        branches = [terms[i].flow(theta, k * dt, y, args) for i in group]
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
        groups: tuples of term indices, each index exactly once. Default: maximal runs
            of consecutive explicit (smooth) terms are parallel groups and every other
            term is its own group; for pre-LN terms that is one group (attention and
            feed-forward in parallel), for the post-LN split terms it is Lie.
    """

    groups: tuple[tuple[int, ...], ...] | None = eqx.field(default=None, static=True)
    num_terms: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.groups is not None and not (
            isinstance(self.groups, tuple)
            and self.groups
            and all(isinstance(g, tuple) and g for g in self.groups)
        ):
            raise ValueError(
                f"Hybrid.groups must be a non-empty tuple of non-empty tuples of term "
                f"indices, e.g. ((0, 1), (2,)); got {self.groups!r}."
            )

    def resolved_groups(self, terms) -> tuple[tuple[int, ...], ...]:
        if self.groups is None:
            return default_groups(terms)
        flat = sorted(i for g in self.groups for i in g)
        if flat != list(range(len(terms))):
            raise ValueError(
                f"Hybrid.groups={self.groups!r} must use each of the {len(terms)} term "
                f"indices {tuple(range(len(terms)))} exactly once."
            )
        return self.groups

    def splitting_order(self, num_terms: int) -> int:
        return 1

    def compose(self, terms, theta, dt, y, args, record=None):
        for group in self.resolved_groups(terms):
            y = _parallel(terms, group, theta, dt, y, args, record)
        return y


SCHEMES: dict[str, type[Lie | Strang | Parallel | Hybrid]] = {
    "lie": Lie,
    "strang": Strang,
    "parallel": Parallel,
    "hybrid": Hybrid,
}
"""Splitting schemes by name; each class is constructible with no arguments."""

Strang.__init__.__doc__ = "**Arguments:** sequence (optional permutation of term indices)"
Hybrid.__init__.__doc__ = "**Arguments:** groups (optional tuple of tuples of term indices)"
Parallel.__init__.__doc__ = "**Arguments:** None"
