"""Configuration: one typed, frozen schema, validated before anything is traced."""

from ._load import (
    apply_overrides as apply_overrides,
    load_experiment as load_experiment,
    parse_override as parse_override,
    resolve as resolve,
)
from ._schema import (
    SECTIONS as SECTIONS,
    Config as Config,
    ControlsConfig as ControlsConfig,
    GradientConfig as GradientConfig,
    ModelConfig as ModelConfig,
    ObjectiveConfig as ObjectiveConfig,
    OptimiserConfig as OptimiserConfig,
    SchemeConfig as SchemeConfig,
    SolverConfig as SolverConfig,
    TaskConfig as TaskConfig,
    TrainConfig as TrainConfig,
    from_dict as from_dict,
    to_dict as to_dict,
)
from ._validate import ConfigError as ConfigError, validate as validate
