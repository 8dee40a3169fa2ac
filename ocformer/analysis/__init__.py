"""Analysis used by notebooks and the ``python -m ocformer.analysis`` command: measured
orders of convergence, gradients and costates, a trained model under other
discretisations, and the dynamics of tokens."""

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
