"""Structured configs: dataclasses per component, YAML files, ``key.sub=value`` overrides.

``load_config(schema, path, overrides)`` merges a YAML file and command-line overrides onto
the dataclass defaults (OmegaConf). Unknown keys, moved keys, wrong types and broken rules
between keys raise ``ConfigError`` naming the key and the rule. This package is the schema
only: it imports nothing of tidal but its own modules, and the checks that need the world
(registered names, files, models, envs, the placement) are tidal.runners.preflight's, which
the runners run before any worker starts. Both halves share ``cluster``, ``runner``, ``actor``
and ``algorithm`` (tidal.config.common).
"""

from tidal.config.common import ActorConfig, AlgorithmConfig, ClusterConfig, RunnerConfig
from tidal.config.embodied import (
    EmbodiedActorConfig,
    EmbodiedAlgorithmConfig,
    EmbodiedConfig,
    EmbodiedRunnerConfig,
    EmbodiedSFTConfig,
    EnvConfig,
    ModelConfig,
    RewardModelConfig,
    RolloutConfig,
    validate_embodied,
)
from tidal.config.llm import LLMConfig
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
    "LLMConfig",
    "ModelConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "EmbodiedSFTConfig",
    "RunnerConfig",
    "describe",
    "field_help",
    "load_config",
    "read_yaml",
    "to_yaml",
    "validate_embodied",
]
