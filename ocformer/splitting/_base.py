"""Operator-splitting schemes as diffrax solvers."""

import abc
import dataclasses
from typing import ClassVar

import diffrax
import equinox as eqx
import jax.numpy as jnp
from diffrax import RESULTS, AbstractTerm, LocalLinearInterpolation, MultiTerm
from jaxtyping import Array

from .._compat import WrapTerm
from ..dynamics import SUB_SOLVERS, AbstractSplitTerm, SubSolver, sum_fields


def check_sub_solver(who: str, sub_solver) -> None:
    if sub_solver not in SUB_SOLVERS:
        raise ValueError(
            f"{who}.sub_solver must be one of {', '.join(map(repr, SUB_SOLVERS))}, got "
            f"{sub_solver!r}. The sub-solver steps the smooth terms inside each split step."
        )


class AbstractSplittingSolver(diffrax.AbstractSolver):
    r"""A splitting scheme: one step composes the sub-flows of the split terms.

    The terms arrive as ``MultiTerm(term_1, ..., term_K)``; each ``term_k`` is an
    ``AbstractSplitTerm`` that knows its own sub-flow (explicit sub-solver, projection).
    The controls are evaluated once per step, at its midpoint, and frozen across the
    sub-steps: a second-order choice, and the one that makes step n of the layer grid
    use exactly layer n's parameters.

    The order of a scheme is the smaller of the splitting's order and its sub-flows'.
    A projection term (its sub-flow is the same map for every step size) is not the
    flow of a vector field, and where it sits in the composition can lower the
    splitting's order (``Strang``). The explicit sub-solver of the smooth terms
    (``sub_solver``: explicit Euler, midpoint or Heun) is part of the scheme: a
    numerical choice, not part of the equation.
    """

    interpolation_cls: ClassVar = LocalLinearInterpolation
    sub_solver: eqx.AbstractVar[SubSolver]
    num_terms: eqx.AbstractVar[int | None]

    @property
    def term_structure(self):
        if self.num_terms is None:
            raise ValueError(
                f"{type(self).__name__} does not know how many terms it splits; call "
                "`.for_terms(terms)` (ocformer.integration.solve does this for you)."
            )
        # A type built at runtime (diffrax checks the terms against it), not an annotation.
        return MultiTerm[tuple[(AbstractTerm,) * self.num_terms]]  # pyright: ignore[reportInvalidTypeArguments]

    def for_terms(self, terms: MultiTerm):
        """This scheme bound to the number of terms of ``terms``."""
        split = _split_terms(terms)
        return dataclasses.replace(self, num_terms=len(split))

    def check_terms(self, num_terms: int) -> None:
        """Raise ``ValueError`` if the scheme's own structure (a ``sequence``, ``groups``)
        does not fit ``num_terms`` terms: checked when a model takes the scheme, not at
        its first solve. Schemes without such structure fit any number."""
        del num_terms

    @abc.abstractmethod
    def splitting_order(self, num_terms: int, projections: tuple[int, ...] = ()) -> int:
        """The order of the splitting with exact sub-flows, for ``num_terms`` terms of
        which those at the indices ``projections`` are projections."""

    @abc.abstractmethod
    def feeds(self, source: int, target: int, terms) -> bool:
        """Whether every sub-flow of ``terms[target]`` starts from the state that a
        sub-flow of ``terms[source]`` has just produced (e.g. the post-LN closing
        projection right after the averaging step, where LayerNorm's eps becomes eps/4).
        """

    @abc.abstractmethod
    def compose(
        self,
        terms: tuple[AbstractSplitTerm, ...],
        theta,
        dt,
        y,
        args,
        record: list | None = None,
    ) -> Array:
        """One step of size dt from y with frozen controls theta.

        If ``record`` is a list, the state after every sub-flow is appended to it (for
        a parallel group: each branch, then their average), in the order computed.
        """

    def order(self, terms) -> int:
        flows = [t.flow_order(self.sub_solver) for t in _split_terms(terms)]
        finite = [o for o in flows if o is not None]
        projections = tuple(i for i, o in enumerate(flows) if o is None)
        return min([self.splitting_order(len(flows), projections), *finite])

    def init(self, terms, t0, t1, y0, args):
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        split = _split_terms(terms)
        theta = args.control(0.5 * (t0 + t1))
        y1 = self.compose(split, theta, t1 - t0, y0, args)
        dense_info = dict(y0=y0, y1=y1)
        return y1, None, dense_info, None, RESULTS.successful

    def func(self, terms, t0, y0, args):
        return sum_fields(_split_terms(terms), args.control(t0), y0, args)

    def substates(self, terms, t0, t1, y0, args) -> Array:
        """The states after each sub-flow of the step from (t0, y0) to t1, stacked on a
        new leading axis (the last one is the step's result).

        This recomputes the step outside ``diffeqsolve`` (whose ``SaveAt`` sees only
        whole steps); given the saved step states it is exact, and it vmaps over steps.
        """
        record: list = []
        theta = args.control(0.5 * (t0 + t1))
        self.compose(_split_terms(terms), theta, t1 - t0, y0, args, record=record)
        return jnp.stack(record)


def _split_terms(terms) -> tuple[AbstractSplitTerm, ...]:
    if not isinstance(terms, MultiTerm):
        raise ValueError(
            "A splitting solver takes its operators as diffrax.MultiTerm(term_1, ..., "
            f"term_K); got {type(terms).__name__}."
        )
    out = []
    for t in terms.terms:
        # diffeqsolve wraps each term to handle the direction of time. Splitting schemes
        # integrate forward only (ocformer.integration.solve always does), so unwrap.
        if isinstance(t, WrapTerm):
            t = t.term
        if not isinstance(t, AbstractSplitTerm):
            raise ValueError(
                "Every term of a splitting scheme must be an ocformer split term (it "
                f"carries its own sub-flow); got {type(t).__name__}."
            )
        out.append(t)
    return tuple(out)


class Lie(AbstractSplittingSolver):
    r"""Sequential (Lie-Trotter) splitting: each sub-problem over the whole step, in order.

    $$u^{n+1} = \Phi^{\delta t}_K \circ \cdots \circ \Phi^{\delta t}_1 (u^n).$$
    First order. With the post-LN terms, ``GridSteps`` on the layer grid and
    $\delta t = 1$, one step is exactly one post-LN encoder layer (Tai, Liu, Li, Chan,
    arXiv 2510.03989, section 3).

    Args:
        sub_solver: the explicit sub-solver of the smooth terms (``"euler"``, the
            Transformer's residual update; ``"midpoint"`` or ``"heun"``).
    """

    sub_solver: SubSolver = eqx.field(default="euler", static=True)
    num_terms: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        check_sub_solver("Lie", self.sub_solver)

    def splitting_order(self, num_terms, projections=()):
        return 1

    def feeds(self, source, target, terms):
        return target == source + 1

    def compose(self, terms, theta, dt, y, args, record=None):
        for term in terms:
            y = term.flow(theta, dt, y, args, self.sub_solver)
            if record is not None:
                record.append(y)
        return y


Lie.__init__.__doc__ = "**Arguments:** sub_solver (optional, default 'euler')"
