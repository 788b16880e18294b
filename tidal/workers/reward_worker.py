"""The reward worker: a group that receives env outputs and returns rewards, e.g. a learned
reward model replacing or shaping the env reward. Reward models register by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.data import EnvOutput
from tidal.data.routes import Topology, reward_tags
from tidal.registry import Registry
from tidal.runtime import Channel, ConfigSections, Outbox, Worker, async_recv_batch

RewardModel = Callable[[EnvOutput], torch.Tensor]  # -> rewards [B, C]
REWARD_MODELS: Registry[Callable[..., RewardModel]] = Registry("reward model", "reward.name")
register_reward_model = REWARD_MODELS.register


def build_reward_model(name: str, **kwargs) -> RewardModel:
    return REWARD_MODELS.get(name)(**kwargs)


@register_reward_model("scale")
def _scale(scale: float = 1.0) -> RewardModel:
    """``scale * r``: the env reward rescaled."""
    return lambda out: out.rewards * scale


@register_reward_model("termination_penalty")
def _termination_penalty(penalty: float = 1.0) -> RewardModel:
    """Shaping: ``-penalty`` where an episode terminated (not where it was truncated)."""
    return lambda out: -penalty * out.terminations.float()


class RewardWorker(Worker):
    config_sections = ("rollout", "reward")

    def __init__(self, cfg: ConfigSections, topology: Topology):
        self.cfg, self.topo = cfg, topology
        self.model = build_reward_model(cfg.reward.name, **dict(cfg.reward.kwargs))
        self.mode = cfg.reward.mode

    async def compute_rewards(
        self, reward_ch: Channel, env_ch: Channel, timeout: float = 600.0
    ) -> int:
        """Serve every env step of one rollout epoch, stage by stage."""
        batch = self.topo.stage_batch("train")
        served = 0
        outbox = Outbox()
        for _ in range(self.cfg.rollout.num_steps):
            for s in range(self.topo.stages):
                tag_in, tag_out = reward_tags(s)
                out: EnvOutput = await async_recv_batch(
                    reward_ch,
                    self.rank,
                    self.topo.env,
                    self.world_size,
                    batch,
                    tag=tag_in,
                    timeout=timeout,
                )
                with torch.no_grad():
                    rewards = self.model(out).float()
                if self.mode == "add":
                    rewards = out.rewards + rewards
                await outbox.send(
                    env_ch,
                    {"rewards": rewards},
                    self.rank,
                    self.world_size,
                    self.topo.env,
                    tag=tag_out,
                )
                served += 1
        await outbox.flush()
        return served
