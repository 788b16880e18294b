"""Environments: adapters registered by name, and action-chunk stepping.

An adapter is a vectorised env of ``num_envs`` copies with a small interface
(``VectorEnvAdapter``). ``gymnasium`` (classic control, MuJoCo, anything ``gymnasium.make_vec``
builds) is built in; ManiSkill, LIBERO or a user's env plug in with ``register_env``.
"""

from tidal.envs.base import (
    ChunkedEnv,
    EpisodeStats,
    VectorEnvAdapter,
    get_env_adapter,
    list_env_adapters,
    make_env,
    register_env,
)
from tidal.envs.gym_adapter import GymnasiumVectorEnv

__all__ = [
    "ChunkedEnv",
    "EpisodeStats",
    "GymnasiumVectorEnv",
    "VectorEnvAdapter",
    "get_env_adapter",
    "list_env_adapters",
    "make_env",
    "register_env",
]
