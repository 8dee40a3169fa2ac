"""The optimal-control objective: terminal cost, running costs, constraints, and training
by the maximum principle (E-MSA)."""

from ._constraints import (
    KERNEL_NORMS as KERNEL_NORMS,
    Constraints as Constraints,
    project_frobenius as project_frobenius,
    project_spectral as project_spectral,
)
from ._msa import (
    MSA as MSA,
    TRAINING_METHODS as TRAINING_METHODS,
    MSAState as MSAState,
    Sweep as Sweep,
    augmented_hamiltonian as augmented_hamiltonian,
    check_msa as check_msa,
    maximise_hamiltonians as maximise_hamiltonians,
    msa_iteration as msa_iteration,
    msa_refusals as msa_refusals,
    sweep as sweep,
)
from ._objective import (
    PRECISIONS as PRECISIONS,
    MixedPrecision as MixedPrecision,
    Objective as Objective,
    cross_entropy as cross_entropy,
    in_precision as in_precision,
)
from ._running import (
    control_size as control_size,
    control_smoothness as control_smoothness,
    grid_saveat as grid_saveat,
    kinetic_energy as kinetic_energy,
    kinetic_energy_of_states as kinetic_energy_of_states,
)
from ._ternary import (
    Ternary as Ternary,
    check_ternary as check_ternary,
    feedforward_kernels as feedforward_kernels,
    ternary_projection as ternary_projection,
    ternary_refusals as ternary_refusals,
    with_feedforward_kernels as with_feedforward_kernels,
)
