"""Channel tags and routing shared by the embodied workers.

env → rollout: per pipeline stage, the stage's envs redistributed from E env ranks to R
rollout ranks (tag ``obs:<mode>:<stage>``); rollout → env: the way back (``act:...``), and once per training epoch the policy's half of the
stage's record (``policy:<stage>``, batch-first: routed like the answers);
env → reward → env (``rew_in/rew_out``); env → actor: every (env rank, stage) is one source of
``E * S``, redistributed to A actor ranks (``traj``).
"""

from __future__ import annotations

from dataclasses import dataclass


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
