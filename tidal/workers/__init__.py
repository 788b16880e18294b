"""Thin workers that glue envs, policies, algorithms and the runtime together."""

from tidal.workers.actor_worker import ActorWorker
from tidal.workers.env_worker import EnvWorker
from tidal.workers.reward_worker import RewardWorker, build_reward_model, register_reward_model
from tidal.workers.rollout_worker import RolloutWorker
from tidal.workers.routes import Topology

__all__ = [
    "ActorWorker",
    "EnvWorker",
    "RewardWorker",
    "RolloutWorker",
    "Topology",
    "build_reward_model",
    "register_reward_model",
]
