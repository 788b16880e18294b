"""Environments: adapters registered by name, and action-chunk stepping.

An adapter is a vectorised env of ``num_envs`` copies with a small interface
(``VectorEnvAdapter``). ``gymnasium`` (classic control, MuJoCo, anything ``gymnasium.make_vec``
builds), ``metaworld`` and ``libero`` are built in; ManiSkill or a user's env plug in with
``register_env``.
"""

from tidal.envs import rendering  # noqa: F401, I001  (picks MUJOCO_GL before mujoco is imported)
from tidal.envs.base import (
    ChunkedEnv,
    EpisodeStats,
    MultiTaskAdapter,
    VectorEnvAdapter,
    adapter_arguments,
    env_make_kwargs,
    episode_metrics,
    get_env_adapter,
    list_env_adapters,
    make_env,
    register_env,
    success_metrics,
)
from tidal.envs.gym_adapter import GymnasiumVectorEnv
from tidal.envs.layout import LayoutBox, ObsLayout, layout_of, tokenize
from tidal.envs.libero import LiberoVectorEnv
from tidal.envs import libero_demos  # noqa: F401  (registers LIBERO's scripted demonstrations)
from tidal.envs.metaworld_adapter import MetaWorldVectorEnv

__all__ = [
    "ChunkedEnv",
    "EpisodeStats",
    "GymnasiumVectorEnv",
    "LayoutBox",
    "LiberoVectorEnv",
    "MetaWorldVectorEnv",
    "MultiTaskAdapter",
    "ObsLayout",
    "VectorEnvAdapter",
    "adapter_arguments",
    "env_make_kwargs",
    "get_env_adapter",
    "list_env_adapters",
    "make_env",
    "layout_of",
    "register_env",
    "success_metrics",
    "episode_metrics",
    "tokenize",
]
