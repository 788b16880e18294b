"""Proximal log-probabilities for decoupled PPO without an extra forward pass."""

from __future__ import annotations

import torch

from tidal.algorithms._tensors import check_same_shape, compute_dtype


def loglinear_prox_logp(
    behave_logp: torch.Tensor,
    logp: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
) -> torch.Tensor:
    """Log-linear interpolation between the behaviour and the current policy.

    A token generated at version ``v_b`` while the trainer makes version ``v`` (the policy
    trained, ``logp``): the proximal policy is the one of version ``v - 1`` (the weights the
    step starts from), approximated in log space as
    ``prox = behave + alpha * (logp.detach() - behave)`` with
    ``alpha = clamp(((v - 1) - v_b) / (v - v_b), 0, 1)`` where ``v - v_b > 0`` and ``v_b >= 0``,
    else ``alpha = 0`` (prompt tokens carry ``v_b = -1``). No gradient flows through it.
    """
    check_same_shape(behave_logp=behave_logp, logp=logp, versions=versions)
    dtype = compute_dtype(logp)
    behave = behave_logp.detach().to(dtype)
    v_b = versions.to(dtype)
    gap = current_version - v_b
    valid = (gap > 0) & (v_b >= 0)
    alpha = torch.where(valid, ((current_version - 1) - v_b) / torch.where(valid, gap, 1.0), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    return behave + alpha * (logp.detach().to(dtype) - behave)


def within_staleness(
    versions: torch.Tensor, current_version: int, max_staleness: int
) -> torch.Tensor:
    """Which samples a trainer at ``current_version`` may train on: those generated at most
    ``max_staleness`` versions earlier (``current_version - v_b <= max_staleness``)."""
    return (current_version - versions) <= max_staleness
