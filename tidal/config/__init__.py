"""Structured configs: dataclasses per component, YAML files, ``key.sub=value`` overrides.

``load_config(schema, path, overrides)`` merges a YAML file and command-line overrides onto
the dataclass defaults (OmegaConf). Unknown keys, moved keys, wrong types and impossible
sizes raise ``ConfigError`` naming the key and the rule, before any worker starts. Both
halves share ``cluster``, ``runner``, ``actor`` and ``algorithm`` (tidal.config.common).
"""

from tidal.config.common import ActorConfig, AlgorithmConfig, ClusterConfig, RunnerConfig
from tidal.config.embodied import (
    EmbodiedActorConfig,
    EmbodiedAlgorithmConfig,
    EmbodiedConfig,
    EmbodiedRunnerConfig,
    EnvConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    validate_embodied,
)
from tidal.config.loader import ConfigError, load_config, read_yaml, to_yaml
from tidal.config.schema import describe, field_help

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "EmbodiedActorConfig",
    "EmbodiedAlgorithmConfig",
    "EmbodiedConfig",
    "EmbodiedRunnerConfig",
    "EnvConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunnerConfig",
    "describe",
    "field_help",
    "load_config",
    "read_yaml",
    "to_yaml",
    "validate_embodied",
]
