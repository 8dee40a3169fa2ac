"""Analysis used by notebooks and the ``python -m ocformer.analysis`` command:
measured orders of convergence under refinement."""

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
from ._gradients import gradient_comparison as gradient_comparison
