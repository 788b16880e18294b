"""Demonstrations from MetaWorld's scripted expert policies.

The executed action is the expert's plus Gaussian noise, while the recorded label is the
expert's own action in the state reached (DART-style): the data covers states off the expert's
path, each labelled with how the expert recovers, so it is not one degenerate trajectory per
goal. Observations are recorded exactly as the adapter emits them (packed state / instruction /
pixels), so a policy trained on them acts in the same env unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tidal.envs.metaworld_adapter import MetaWorldVectorEnv, resolve_tasks
from tidal.extras import needs_extra
from tidal.registry import Registry

# env.adapter -> collect(env_id, demos_per_task, action_noise=, seed=, **adapter_kwargs):
# the scripted demonstrations tidal sft and RLPD's replay.sft_demos clone or replay
DEMO_SOURCES: Registry = Registry("demonstration source", "env.adapter")
register_demos = DEMO_SOURCES.register


def _tool_centre_to_goal(task_env, state: np.ndarray) -> np.ndarray:
    """The state with its goal moved by the hand-to-tool-centre offset, so an expert that
    steers the hand to the goal puts the tool centre (what success measures) there."""
    view = state.copy()
    view[-3:] += state[:3] - task_env.tcp_center
    return view


# What an expert is shown instead of the raw state, per task. MetaWorld's reach expert steers
# the hand to the goal, while success asks for the tool centre, 4.5 cm below the hand, within
# 5 cm: its episodes succeed by half a centimetre, and a policy imitating them closely misses.
EXPERT_VIEWS = {"reach-v3": _tool_centre_to_goal}


@dataclass
class Demonstrations:
    obs: np.ndarray  # [N, D] what the policy sees at each step
    actions: np.ndarray  # [N, A] the expert's action there, clipped to the action bounds
    episode: np.ndarray  # [N] the episode each step belongs to
    tasks: list[str]  # per episode
    instructions: list[str]  # per episode
    successes: np.ndarray  # [E] the episode succeeded
    # the transitions as executed (off-policy RL's demonstrations, RLPD): the noisy action sent,
    # the reward, whether the episode terminated there, and the observation it led to
    executed: np.ndarray | None = None  # [N, A]
    rewards: np.ndarray | None = None  # [N]
    terminations: np.ndarray | None = None  # [N]
    next_obs: np.ndarray | None = None  # [N, D]
    # the script's own success per task over every episode it tried (kept or not)
    script_success: dict[str, float] | None = None

    @property
    def num_episodes(self) -> int:
        return len(self.tasks)

    def action_chunks(self, chunk: int) -> np.ndarray:
        """``[N, chunk, A]``: the actions from each step on, the episode's last action repeated
        past its end (the expert holds still once done)."""
        n = len(self.actions)
        index = np.arange(n)[:, None] + np.arange(chunk)[None, :]
        last = np.zeros(n, dtype=np.int64)  # the index of each step's episode's last step
        ends = np.flatnonzero(np.diff(self.episode, append=-1) != 0)
        starts = np.concatenate([[0], ends[:-1] + 1])
        for s, e in zip(starts, ends):
            last[s : e + 1] = e
        return self.actions[np.minimum(index, last[:, None])]

    def transitions(self) -> dict[str, torch.Tensor]:
        """The episodes as a replay buffer's demonstration transitions (one action per step:
        ``actions`` ``[N, 1, A]``); an episode cut at success or at the collector's horizon
        ends unterminated, so its last transition bootstraps."""
        n = len(self.obs)
        return {
            "obs": torch.from_numpy(self.obs),
            "actions": torch.from_numpy(self.executed).float()[:, None],
            "rewards": torch.from_numpy(self.rewards).float(),
            "terminations": torch.from_numpy(self.terminations),
            "truncations": torch.zeros(n, dtype=torch.bool),
            "next_obs": torch.from_numpy(self.next_obs),
            "steps": torch.ones(n, dtype=torch.int64),
        }


@register_demos("metaworld")
def collect_metaworld_demos(
    env_id: str,
    demos_per_task: int,
    action_noise: float = 0.1,
    seed: int = 0,
    max_episode_steps: int = 200,
    stop_at_success: bool = True,
    only_successful: bool = True,
    max_attempts_factor: int = 4,
    **adapter_kwargs,
) -> Demonstrations:
    """``demos_per_task`` episodes of each task of ``env_id`` (``reach-v3``, ``MT10``, ...).
    ``adapter_kwargs`` (``obs_mode``, ``image_size``, ...) shape the observations as in training."""
    with needs_extra("embodied", "MetaWorld's scripted experts"):
        from metaworld.policies import ENV_POLICY_MAP

    if demos_per_task < 1:
        raise ValueError(f"sft.demos: must be >= 1, got {demos_per_task}")
    rng = np.random.default_rng(seed)
    obs, actions, episode, tasks, instructions, successes = [], [], [], [], [], []
    steps = {"executed": [], "rewards": [], "terminations": [], "next_obs": []}
    for t, task in enumerate(resolve_tasks(env_id)):
        env = MetaWorldVectorEnv(1, task, max_episode_steps=max_episode_steps, **adapter_kwargs)
        expert, kept = ENV_POLICY_MAP[task](), 0
        view = EXPERT_VIEWS.get(task, lambda _, state: state)
        for attempt in range(demos_per_task * max_attempts_factor):
            o = env.reset(seeds=[seed * 100_003 + t * 1009 + attempt])
            steps_obs, steps_act = [], []
            episode_steps = {k: [] for k in steps}
            while True:
                label = np.clip(expert.get_action(view(env.envs[0], env.states[0])), -1.0, 1.0)
                steps_obs.append(o[0])
                steps_act.append(label)
                sent = np.clip(label + rng.normal(0.0, action_noise, label.shape), -1.0, 1.0)
                o, reward, term, trunc = env.step(sent[None])
                for key, value in zip(steps, (sent, reward[0], term[0], o[0]), strict=True):
                    episode_steps[key].append(value)
                if term[0] or trunc[0] or (stop_at_success and env.successes[0]):
                    break
            succeeded = bool(env.successes[0])
            if only_successful and not succeeded:
                continue
            obs += steps_obs
            actions += steps_act
            for key, values in episode_steps.items():
                steps[key] += values
            episode += [len(tasks)] * len(steps_obs)
            tasks.append(task)
            instructions.append(env.instructions[0])
            successes.append(succeeded)
            kept += 1
            if kept == demos_per_task:
                break
        env.close()
        if kept < demos_per_task:
            raise RuntimeError(
                f"the scripted expert for {task} succeeded in only {kept} of "
                f"{demos_per_task * max_attempts_factor} episodes (action noise {action_noise})"
            )
    return Demonstrations(
        obs=np.stack(obs).astype(np.float32),
        actions=np.stack(actions).astype(np.float32),
        episode=np.array(episode),
        tasks=tasks,
        instructions=instructions,
        successes=np.array(successes),
        executed=np.stack(steps["executed"]).astype(np.float32),
        rewards=np.array(steps["rewards"], dtype=np.float32),
        terminations=np.array(steps["terminations"], dtype=bool),
        next_obs=np.stack(steps["next_obs"]).astype(np.float32),
    )
