"""Evaluation of trained runs, under their own discretisation or another one."""

from ._evaluate import (
    DISCRETISATION_SECTIONS as DISCRETISATION_SECTIONS,
    check_evaluation_field as check_evaluation_field,
    count_evaluations as count_evaluations,
    discretisation_of as discretisation_of,
    evaluate as evaluate,
    evaluate_run as evaluate_run,
    evaluate_start as evaluate_start,
    evaluation_config as evaluation_config,
    evaluations_per_step as evaluations_per_step,
    solver_stats as solver_stats,
)
