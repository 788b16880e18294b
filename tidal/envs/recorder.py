"""Recording one pipeline stage's chunk steps of an epoch as the ``Trajectory`` the actor
trains on: the env side records what it stepped (``StageRecorder``), the rollout side what the
policy chose (``PolicyRecorder``), and the env joins the two halves once per epoch. The policy's
half never rides on the per-step answers: they carry only what the env steps with."""

from __future__ import annotations

import torch

from tidal.data import ChunkActions, EnvOutput, PolicyRecord, Trajectory


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(xs, 1)  # [B, T, ...]


class StageRecorder:
    """Collects one stage's env side of an epoch and stacks it batch-first."""

    def __init__(self, first_dones: torch.Tensor):
        self.raw_obs, self.rewards = [], []
        self.terms, self.truncs, self.dones = [first_dones], [first_dones], [first_dones]
        self.last_bad = torch.full((first_dones.shape[0],), -1)  # last step with a non-finite value

    def add_obs(self, raw_obs: torch.Tensor) -> None:
        self.raw_obs.append(raw_obs)

    def add_env(self, out: EnvOutput) -> None:
        self.rewards.append(out.rewards.clone())
        self.terms.append(out.terminations)
        self.truncs.append(out.truncations)
        self.dones.append(out.dones)

    def add_bootstrap(self, needs: torch.Tensor, final_values: torch.Tensor, gamma: float) -> None:
        """A truncated episode's last reward gains ``gamma * V(final_obs)``; the done then stops
        the recursion, so the value of the reset observation never leaks across episodes."""
        rows = needs.nonzero().flatten()
        if len(rows):
            position = self.dones[-1][rows].float().argmax(-1)
            self.rewards[-1][rows, position] += gamma * final_values[rows]

    def mark_bad(self, bad: torch.Tensor, step: int) -> None:
        """Mask these envs' samples up to ``step``: their advantages depend on the bad value."""
        self.last_bad[bad] = step

    def trajectory(self, policy: PolicyRecord) -> Trajectory:
        """This half joined with the rollout's ``policy`` half of the same envs and steps."""
        valid = torch.arange(len(self.rewards))[None, :] > self.last_bad[:, None]
        return Trajectory(
            forward_inputs=policy.forward_inputs,
            actions=policy.actions,
            prev_logprobs=policy.logprobs,
            prev_values=policy.values,
            rewards=_stack(self.rewards),
            terminations=_stack(self.terms),
            truncations=_stack(self.truncs),
            dones=_stack(self.dones),
            raw_obs=_stack(self.raw_obs),
            versions=policy.versions,
            valid=valid,
            bootstrap_inputs=policy.bootstrap_inputs,
        )


class PolicyRecorder:
    """The rollout's side of one stage's epoch: every answer's actions, log-probs, values,
    forward inputs and version. The last answer of an epoch (the bootstrap step) contributes
    only its value and its forward inputs."""

    def __init__(self):
        self.answers: list[ChunkActions] = []

    def add(self, answer: ChunkActions) -> ChunkActions:
        """Keep ``answer``; returns what the env needs of it (env actions, final values)."""
        self.answers.append(answer)
        return ChunkActions(env_actions=answer.env_actions, final_values=answer.final_values)

    def record(self) -> PolicyRecord:
        *steps, last = self.answers
        keys = steps[0].forward_inputs.keys()
        values = [a.values for a in self.answers]
        return PolicyRecord(
            forward_inputs={k: _stack([a.forward_inputs[k] for a in steps]) for k in keys},
            actions=_stack([a.actions for a in steps]),
            logprobs=_stack([a.logprobs for a in steps]),
            values=_stack(values) if values[0] is not None else None,
            versions=_stack([a.version for a in steps]),
            bootstrap_inputs=last.forward_inputs,
        )


def chunk_transition(
    obs: torch.Tensor, actions: torch.Tensor, out: EnvOutput, gamma: float
) -> dict[str, torch.Tensor]:
    """One chunk step as one transition per env (off-policy): the chunk's rewards discounted
    within it, its end (termination wins over truncation), the observation it ended on
    (``final_obs`` where an episode ended, else the next one) and the actions it took
    (``steps``)."""
    dones = out.dones
    chunk = dones.shape[1]
    ended = dones.any(-1)
    steps = torch.where(
        ended, dones.float().argmax(-1) + 1, torch.full_like(ended, chunk, dtype=torch.long)
    )
    discounts = gamma ** torch.arange(chunk, dtype=torch.float32)
    final = out.final_obs if out.final_obs is not None else out.obs
    terminated = out.terminations.any(-1)
    return {
        "obs": obs.float(),
        "actions": actions.float(),
        "rewards": (out.rewards.float() * discounts).sum(-1),
        "terminations": terminated,
        "truncations": out.truncations.any(-1) & ~terminated,
        "next_obs": torch.where(ended[:, None], final, out.obs).float(),
        "steps": steps.long(),
    }


class SegmentRecorder:
    """One stage's transitions of an off-policy collection segment, each env's kept for one
    actor rank (contiguous blocks of the stage's envs, so every rank's buffer holds whole
    episodes of its own envs); rows with a non-finite value are left out."""

    def __init__(self, stage_envs: int, actor_ranks: int, gamma: float):
        self.actor_of_env = torch.arange(stage_envs) * actor_ranks // stage_envs
        self.actor_ranks, self.gamma = actor_ranks, gamma
        self.records: list[dict[str, torch.Tensor]] = []

    def add(self, obs: torch.Tensor, actions: torch.Tensor, out: EnvOutput, bad) -> None:
        record = chunk_transition(obs, actions, out, self.gamma)
        record["actor_rank"] = self.actor_of_env
        keep = ~torch.as_tensor(bad)
        self.records.append({k: v[keep] for k, v in record.items()})

    def transitions(self) -> int:
        return sum(r["rewards"].shape[0] for r in self.records)

    def per_actor(self) -> list[dict[str, torch.Tensor]]:
        """The segment's transitions split by actor rank."""
        segment = {k: torch.cat([r[k] for r in self.records]) for k in self.records[0]}
        owner = segment.pop("actor_rank")
        return [{k: v[owner == a] for k, v in segment.items()} for a in range(self.actor_ranks)]
