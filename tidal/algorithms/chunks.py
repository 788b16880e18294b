"""Advantages of action-chunk trajectories: the embodied half's per-step rewards, dones and
validity turned into the estimator's inputs and back to the loss's layout.

Time-major throughout: rewards ``[T, B, C]`` (C actions per chunk), dones ``[T + 1, B, C]``,
values ``[T + 1, B]``, valid ``[T, B]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.algorithms.advantages import (
    advantage_spec,
    get_advantage,
    loss_mask_from_dones,
    masked_whiten,
    reduce_chunk_level,
)
from tidal.algorithms.losses import reshape_logprobs
from tidal.algorithms.objectives import PolicyInputs, ValueInputs


@dataclass
class ChunkAdvantages:
    """``[T, B]`` per chunk step, or ``[T, B, C]`` per action (``reward_type="action"``)."""

    advantages: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor
    mask_sum: torch.Tensor
    metrics: dict[str, float]


def chunk_advantages(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    values: torch.Tensor | None,
    valid: torch.Tensor | None,
    *,
    adv_type: str,
    reward_type: str,
    gamma: float,
    lam: float,
    group_size: int,
    auto_reset: bool,
    normalize: bool,
) -> ChunkAdvantages:
    """Advantages and returns of one collection from the ``adv_type`` estimator.

    With ``auto_reset`` every step trains; without it an env's steps after its first done are
    masked (and ``mask_sum`` counts each env's valid steps). Steps of envs that returned
    non-finite values (``valid`` false) are out of the mask.
    """
    steps, batch, chunk = rewards.shape
    r, d = reduce_chunk_level(rewards, dones, reward_type)
    if auto_reset:
        mask = torch.ones_like(r, dtype=torch.bool)
        mask_sum = torch.full(r.shape, float(r.shape[0]))
    else:
        mask, mask_sum = loss_mask_from_dones(d)
    per_action = reward_type == "action"
    if valid is not None:
        mask = mask & (valid.repeat_interleave(chunk, 0) if per_action else valid)
    adv, ret = get_advantage(adv_type)(
        rewards=r, values=values, dones=d, mask=mask, gamma=gamma, lam=lam, group_size=group_size
    )
    if normalize and advantage_spec(adv_type).whiten:
        adv = masked_whiten(adv, mask)
    any_valid = bool(mask.any())
    metrics = {
        "rollout/reward_per_step": float(r[mask].mean()) if any_valid else 0.0,
        "rollout/advantage_mean": float(adv[mask].mean()) if any_valid else 0.0,
        "rollout/return_target_mean": float(ret[mask].mean()) if any_valid else 0.0,
        "rollout/valid_fraction": float(mask.float().mean()),
    }
    if per_action:  # [T * C, B] → [T, B, C]: one advantage per action
        adv, ret, mask, mask_sum = (
            x.reshape(steps, chunk, batch).transpose(1, 2) for x in (adv, ret, mask, mask_sum)
        )
    return ChunkAdvantages(adv, ret, mask, mask_sum, metrics)


def spread_to(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-step (``[N]``) or per-action (``[N, C]``) values spread to the log-prob level."""
    while x.dim() < like.dim():
        x = x.unsqueeze(-1)
    if x.dim() > like.dim():  # per-action values at chunk level cannot happen (validated)
        raise ValueError(f"cannot spread {tuple(x.shape)} onto log-probs of {tuple(like.shape)}")
    return x.expand_as(like)


def chunk_loss_inputs(
    micro: dict[str, torch.Tensor], out: dict[str, torch.Tensor], level: str, version: int
) -> tuple[PolicyInputs, ValueInputs | None]:
    """What an objective takes for a micro-batch of flat samples (``micro``: the actor's batch
    keys) and the policy's outputs on it (``out``: ``logprobs``, ``entropy``, ``values``),
    log-probs at ``level`` (token | action | chunk) and per-step tensors spread to it."""
    logp = reshape_logprobs(out["logprobs"].float(), level)

    def at_level(key: str) -> torch.Tensor | None:
        return reshape_logprobs(micro[key], level) if key in micro else None

    policy_mask, value_mask = chunk_masks(micro, level)
    policy = PolicyInputs(
        logp=logp,
        behave=at_level("old_logprobs"),
        advantages=spread_to(micro["advantages"], logp),
        mask=policy_mask,
        version=version,
        prox=at_level("prox_logprobs"),
        versions=spread_to(micro["versions"], logp),
        ref=at_level("ref_logprobs"),
        entropy=reshape_logprobs(out["entropy"].float(), level),
    )
    if "values" not in out or "old_values" not in micro:
        return policy, None
    returns = micro["returns"]  # per step, or per action: its first's
    value = ValueInputs(
        out["values"].float(),
        micro["old_values"],
        returns if returns.dim() == 1 else returns[:, 0],
        value_mask,
    )
    return policy, value


def chunk_masks(micro: dict[str, torch.Tensor], level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's mask at the log-probs' level (the policy terms) and per step (the
    value loss), from its ``mask`` (per step ``[N]`` or per action ``[N, C]``)."""
    mask = micro["mask"]
    policy = spread_to(mask, reshape_logprobs(micro["old_logprobs"], level))
    return policy, mask if mask.dim() == 1 else mask.any(-1)
