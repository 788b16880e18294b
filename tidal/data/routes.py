"""The routes the embodied records take between the workers: the groups' sizes and the
channel tags.

env → rollout: per pipeline stage, the stage's envs redistributed from E env ranks to R
rollout ranks (tag ``obs:<mode>:<stage>``); rollout → env: the way back (``act:...``), and
once per training epoch the policy's half of the stage's record (``policy:<stage>``,
batch-first: routed like the answers); env → reward → env (``rew_in/rew_out``); env → actor:
every (env rank, stage) is one source of ``E * S``, redistributed to A actor ranks (``traj``;
off-policy: ``transitions``, each env's to one actor rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.runtime import CommMapper, Outbox, async_recv_batch


@dataclass(frozen=True)
class Topology:
    env: int
    rollout: int
    actor: int
    stages: int
    total_num_envs: int
    eval_num_envs: int
    reward: int = 0

    def stage_batch(self, mode: str) -> int:
        """Envs in one pipeline stage over all env ranks."""
        return self.total_num_envs // self.stages if mode == "train" else self.eval_num_envs


def obs_tag(mode: str, stage: int) -> str:
    return f"obs:{mode}:{stage}"


def action_tag(mode: str, stage: int) -> str:
    return f"act:{mode}:{stage}"


def policy_tag(stage: int) -> str:
    return f"policy:{stage}"


def reward_tags(stage: int) -> tuple[str, str]:
    return f"rew_in:{stage}", f"rew_out:{stage}"


TRAJECTORY_TAG = "traj"

TRANSITION_TAG = "transitions"  # env -> actor: off-policy transitions for the replay buffer


@dataclass(frozen=True)
class EnvRoutes:
    """Env rank ``rank`` of ``world_size``'s sends and receives, each over its tag: observations
    to the rollout ranks and their answers back, the rollout's half of an epoch's record, the
    reward model's round trip, and the records for the actor ranks."""

    rank: int
    world_size: int
    topo: Topology

    async def send_obs(self, outbox: Outbox, rollout_ch, out, mode: str, stage: int) -> None:
        await outbox.send(
            rollout_ch, out, self.rank, self.world_size, self.topo.rollout, obs_tag(mode, stage)
        )

    async def recv_actions(self, env_ch, mode: str, stage: int, timeout: float):
        """The rollout ranks' ``ChunkActions`` for this rank's envs of ``stage``."""
        return await self._recv(env_ch, self.topo.rollout, mode, action_tag(mode, stage), timeout)

    async def recv_policy_record(self, env_ch, stage: int, timeout: float):
        """The rollout's half of ``stage``'s epoch (``RolloutWorker.generate`` with
        ``policy_record``): this rank's envs, from every rollout rank that served them."""
        return await self._recv(env_ch, self.topo.rollout, "train", policy_tag(stage), timeout)

    async def model_rewards(
        self, outbox: Outbox, reward_ch, env_ch, out, stage: int, timeout: float
    ) -> torch.Tensor:
        """The reward workers' rewards of a chunk step's ``EnvOutput``."""
        tag_in, tag_out = reward_tags(stage)
        await outbox.send(reward_ch, out, self.rank, self.world_size, self.topo.reward, tag_in)
        rewards = await self._recv(env_ch, self.topo.reward, "train", tag_out, timeout)
        return rewards["rewards"]

    async def send_trajectory(self, outbox: Outbox, actor_ch, trajectory, stage: int) -> None:
        """A stage's epoch, from source ``(rank, stage)`` redistributed over the actor ranks."""
        sources = self.world_size * self.topo.stages
        src = self.rank * self.topo.stages + stage
        await outbox.send(actor_ch, trajectory, src, sources, self.topo.actor, tag=TRAJECTORY_TAG)

    async def send_transitions(self, outbox: Outbox, actor_ch, per_actor: list, stage: int):
        """A stage's segment of transitions, ``per_actor[a]`` to actor rank ``a``."""
        src = self.rank * self.topo.stages + stage
        for dst, part in enumerate(per_actor):
            key = CommMapper.build_channel_key(src, dst, TRANSITION_TAG)
            await outbox.put(actor_ch, part, key)

    async def _recv(self, env_ch, senders: int, mode: str, tag: str, timeout: float):
        return await async_recv_batch(
            env_ch,
            self.rank,
            senders,
            self.world_size,
            self.topo.stage_batch(mode),
            tag=tag,
            timeout=timeout,
        )
