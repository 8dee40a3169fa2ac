"""Analysis used by notebooks and the ``python -m ocformer.analysis`` command: measured
orders of convergence, gradients and costates, a trained model under other
discretisations, and the dynamics of tokens."""

import importlib as _importlib
import pkgutil as _pkgutil
from typing import TYPE_CHECKING as _TYPE_CHECKING

# Each name is imported from its module on first use: `python -m ocformer.analysis`
# imports this package before its command can take charge of Ctrl-C, so the package
# alone imports no JAX (as the top-level package; see ocformer.train).
_EXPORTS = {
    "Costates": "._adjoint",
    "GradientDensity": "._adjoint",
    "costates": "._adjoint",
    "gradient_check": "._adjoint",
    "gradient_density": "._adjoint",
    "terminal_loss": "._adjoint",
    "STUDY_FORMULATIONS": "._convergence",
    "convergence_study": "._convergence",
    "fitted_slope": "._convergence",
    "format_table": "._convergence",
    "local_slopes": "._convergence",
    "plot_study": "._convergence",
    "study_input": "._convergence",
    "study_model": "._convergence",
    "study_stepper": "._convergence",
    "discretisation_study": "._discretisations",
    "gradient_comparison": "._gradients",
    "ShiftedControl": "._steps",
    "StepMap": "._steps",
    "chain": "._steps",
    "trajectory": "._steps",
    "Lyapunov": "._tokens",
    "TokenSimilarity": "._tokens",
    "benettin_exponents": "._tokens",
    "lyapunov_exponents": "._tokens",
    "lyapunov_refinement": "._tokens",
    "model_benettin": "._tokens",
    "model_lyapunov": "._tokens",
    "randomised_lyapunov_exponents": "._tokens",
    "token_similarity": "._tokens",
}

if _TYPE_CHECKING:
    from ._adjoint import (
        Costates as Costates,
        GradientDensity as GradientDensity,
        costates as costates,
        gradient_check as gradient_check,
        gradient_density as gradient_density,
        terminal_loss as terminal_loss,
    )
    from ._convergence import (
        STUDY_FORMULATIONS as STUDY_FORMULATIONS,
        convergence_study as convergence_study,
        fitted_slope as fitted_slope,
        format_table as format_table,
        local_slopes as local_slopes,
        plot_study as plot_study,
        study_input as study_input,
        study_model as study_model,
        study_stepper as study_stepper,
    )
    from ._discretisations import discretisation_study as discretisation_study
    from ._gradients import gradient_comparison as gradient_comparison
    from ._steps import (
        ShiftedControl as ShiftedControl,
        StepMap as StepMap,
        chain as chain,
        trajectory as trajectory,
    )
    from ._tokens import (
        Lyapunov as Lyapunov,
        TokenSimilarity as TokenSimilarity,
        benettin_exponents as benettin_exponents,
        lyapunov_exponents as lyapunov_exponents,
        lyapunov_refinement as lyapunov_refinement,
        model_benettin as model_benettin,
        model_lyapunov as model_lyapunov,
        randomised_lyapunov_exponents as randomised_lyapunov_exponents,
        token_similarity as token_similarity,
    )

__all__ = [
    "Costates",
    "GradientDensity",
    "costates",
    "gradient_check",
    "gradient_density",
    "terminal_loss",
    "STUDY_FORMULATIONS",
    "convergence_study",
    "fitted_slope",
    "format_table",
    "local_slopes",
    "plot_study",
    "study_input",
    "study_model",
    "study_stepper",
    "discretisation_study",
    "gradient_comparison",
    "ShiftedControl",
    "StepMap",
    "chain",
    "trajectory",
    "Lyapunov",
    "TokenSimilarity",
    "benettin_exponents",
    "lyapunov_exponents",
    "lyapunov_refinement",
    "model_benettin",
    "model_lyapunov",
    "randomised_lyapunov_exponents",
    "token_similarity",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # the next look-up finds it without this function
        return value
    if name in {m.name for m in _pkgutil.iter_modules(__path__)}:  # `analysis._steps`, ...
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
