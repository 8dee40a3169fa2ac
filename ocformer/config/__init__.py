"""Configuration: one typed, frozen schema, validated before anything is traced."""

from ._explicit import is_set as is_set
from ._load import (
    apply_overrides as apply_overrides,
    load_experiment as load_experiment,
    parse_override as parse_override,
    resolve as resolve,
)
from ._reference import reference_table as reference_table
from ._schema import (
    DEPTH_FALLBACKS as DEPTH_FALLBACKS,
    SECTIONS as SECTIONS,
    Config as Config,
    ControlsConfig as ControlsConfig,
    DiscretisationConfig as DiscretisationConfig,
    MeshConfig as MeshConfig,
    ModelConfig as ModelConfig,
    ObjectiveConfig as ObjectiveConfig,
    OptimiserConfig as OptimiserConfig,
    TaskConfig as TaskConfig,
    TrainConfig as TrainConfig,
    field_value as field_value,
    to_dict as to_dict,
)
from ._validate import (
    ConfigError as ConfigError,
    as_recorded as as_recorded,
    check_keys as check_keys,
    choices as choices,
    from_dict as from_dict,
    stepper_object as stepper_object,
    unread_fields as unread_fields,
    unread_task_options as unread_task_options,
    validate as validate,
)
