"""Structured configs: dataclasses per component, YAML files, ``key.sub=value`` overrides.

``load_config(path, overrides)`` merges a YAML file and command-line overrides onto the
dataclass defaults (OmegaConf), then validates. Unknown keys, wrong types and impossible
sizes raise ``ConfigError`` naming the key and the rule, before any worker starts.
"""

from tidal.config.embodied import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    EmbodiedConfig,
    EnvConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunnerConfig,
    validate_embodied,
)
from tidal.config.loader import ConfigError, load_config, to_yaml

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "EmbodiedConfig",
    "EnvConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunnerConfig",
    "load_config",
    "to_yaml",
    "validate_embodied",
]
