"""The embodied records: what the env sends the rollout, what comes back, what the actor trains on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class EnvOutput:
    """One chunk step of a batch of envs (``B`` envs, ``C`` actions per chunk).

    ``obs`` is what the policy sees next (after any reset). For envs whose episode ended in
    this chunk, ``final_obs`` holds the observation the episode ended on (else a copy of
    ``obs``) — the rollout bootstraps truncated episodes from it. ``rewards``,
    ``terminations``, ``truncations`` and ``dones`` are ``[B, C]``; ``dones`` is
    ``terminations | truncations``.
    """

    obs: torch.Tensor
    final_obs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    terminations: torch.Tensor | None = None
    truncations: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    # the value of final_obs is needed for these envs ([B] bool): set by the env worker
    needs_bootstrap: torch.Tensor | None = None


@dataclass(kw_only=True)
class ChunkActions:
    """The rollout's answer for a batch of envs: an action chunk per env and what the actor
    needs later. ``logprobs`` are per action dimension ``[B, C, A]``; ``values`` ``[B]``;
    ``final_values`` ``[B]`` the value of ``final_obs`` where the env asked for a bootstrap."""

    actions: torch.Tensor  # in the policy's own space (what the actor re-evaluates)
    env_actions: torch.Tensor  # as the env takes them, [B, C, ...]
    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    final_values: torch.Tensor | None = None
    forward_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    version: torch.Tensor | None = None  # [B] policy version that chose the actions


@dataclass(kw_only=True)
class Trajectory:
    """One rollout epoch of ``B`` envs over ``T`` chunk steps, batch-first.

    ``forward_inputs`` ``{name: [B, T, ...]}`` re-evaluate the policy; ``actions``
    ``[B, T, C, ...]``; ``prev_logprobs`` ``[B, T, C, A]``; ``prev_values`` ``[B, T + 1]``
    (the last column bootstraps); ``rewards`` ``[B, T, C]``; ``terminations``,
    ``truncations`` and ``dones`` ``[B, T + 1, C]`` where column ``t + 1`` ends step ``t`` and
    column 0 is the previous epoch's last; ``raw_obs`` ``[B, T, ...]`` for the observation
    normaliser; ``versions`` ``[B, T]``.
    """

    forward_inputs: dict[str, torch.Tensor]
    actions: torch.Tensor
    prev_logprobs: torch.Tensor
    prev_values: torch.Tensor | None
    rewards: torch.Tensor
    terminations: torch.Tensor
    truncations: torch.Tensor
    dones: torch.Tensor
    raw_obs: torch.Tensor | None = None
    versions: torch.Tensor | None = None
