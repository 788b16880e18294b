"""Recording one pipeline stage's chunk steps of an epoch as the ``Trajectory`` the actor
trains on."""

from __future__ import annotations

import torch

from tidal.data import ChunkActions, EnvOutput, Trajectory


class StageRecorder:
    """Collects one stage's chunk steps of an epoch and stacks them batch-first."""

    def __init__(self, first_dones: torch.Tensor):
        self.inputs, self.actions, self.logprobs, self.values, self.versions = [], [], [], [], []
        self.raw_obs, self.rewards = [], []
        self.terms, self.truncs, self.dones = [first_dones], [first_dones], [first_dones]
        self.last_bad = torch.full((first_dones.shape[0],), -1)  # last step with a non-finite value
        self.bootstrap_inputs: dict[str, torch.Tensor] | None = None

    def add_policy(self, act: ChunkActions, raw_obs: torch.Tensor) -> None:
        self.inputs.append(act.forward_inputs)
        self.actions.append(act.actions)
        self.logprobs.append(act.logprobs)
        self.versions.append(act.version)
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

    def trajectory(self) -> Trajectory:
        stack = lambda xs: torch.stack(xs, 1)  # noqa: E731  [B, T, ...]
        keys = self.inputs[0].keys()
        valid = torch.arange(len(self.rewards))[None, :] > self.last_bad[:, None]
        return Trajectory(
            forward_inputs={k: stack([i[k] for i in self.inputs]) for k in keys},
            actions=stack(self.actions),
            prev_logprobs=stack(self.logprobs),
            prev_values=stack(self.values) if self.values and self.values[0] is not None else None,
            rewards=stack(self.rewards),
            terminations=stack(self.terms),
            truncations=stack(self.truncs),
            dones=stack(self.dones),
            raw_obs=stack(self.raw_obs),
            versions=stack(self.versions),
            valid=valid,
            bootstrap_inputs=self.bootstrap_inputs,
        )
