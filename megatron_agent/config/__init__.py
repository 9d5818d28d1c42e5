"""A run's configuration: the schema, loading, one validation pass, and the plan derived from it.

- `schema.py`: the typed dataclass tree (`Config`), a docstring under every field.
- `load.py`: `load_config(path, overrides)`: defaults, YAML, dotted `key=value` overrides.
- `validate.py`: `validate_config(cfg)`: every check that needs no worker, run at load time.
- `plan.py`: `make_plan(cfg)`: the frozen `RunPlan` of what the run derives from the config.
Nothing changes the config after it is loaded.
"""

from megatron_agent.config.load import apply_override, config_from_dict, config_to_dict, load_config
from megatron_agent.config.plan import RunPlan, make_plan
from megatron_agent.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    AsyncConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    DebugConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    PythonToolConfig,
    RayConfig,
    RolloutConfig,
    SFTConfig,
    SyncConfig,
    ToolsConfig,
    TrainerConfig,
)
from megatron_agent.config.validate import validate_config

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DebugConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PythonToolConfig",
    "RayConfig",
    "RolloutConfig",
    "RunPlan",
    "SFTConfig",
    "SyncConfig",
    "ToolsConfig",
    "TrainerConfig",
    "apply_override",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "make_plan",
    "validate_config",
]
