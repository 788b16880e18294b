"""Thin workers that glue envs, policies, algorithms and the runtime together."""

from tidal.data.routes import Topology
from tidal.workers.embodied_actor import EmbodiedActor
from tidal.workers.env_worker import EnvWorker
from tidal.workers.reward_worker import RewardWorker, build_reward_model, register_reward_model
from tidal.workers.rollout_worker import RolloutWorker

__all__ = [
    "EmbodiedActor",
    "EnvWorker",
    "RewardWorker",
    "RolloutWorker",
    "Topology",
    "build_reward_model",
    "register_reward_model",
]
