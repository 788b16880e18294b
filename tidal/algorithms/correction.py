"""Train–inference mismatch: the engine that generated a sequence (vLLM, tidal's engine in
another dtype or kernel) and the trainer give its tokens different log-probs under the same
weights. A correction reweights (truncated importance sampling) or drops (masked importance
sampling) tokens or sequences by ``r = pi_trainer / pi_rollout``.

Layout: ``[B, L]`` per token, the sequence along the last dim.
"""

from __future__ import annotations

import torch

from tidal.algorithms._tensors import as_mask, check_same_shape, compute_dtype, masked_mean

ROLLOUT_CORRECTIONS = ("none", "token_tis", "seq_tis", "seq_mis", "icepop")
_LOG_LIMIT = 20.0


def mismatch_metrics(
    trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``mismatch_kl`` (k3 estimate of KL(rollout || trainer) from the rollout's samples) and
    ``mismatch_ratio_{mean,max}`` of the per-token ratio, over ``mask``."""
    check_same_shape(trainer_logp=trainer_logp, rollout_logp=rollout_logp, mask=mask)
    m = as_mask(mask, trainer_logp)
    dtype = compute_dtype(trainer_logp)
    log_r = torch.where(m, trainer_logp.to(dtype) - rollout_logp.to(dtype), 0.0)
    log_r = log_r.clamp(-_LOG_LIMIT, _LOG_LIMIT)
    ratio = torch.exp(log_r)
    return {
        "mismatch_kl": masked_mean(torch.expm1(log_r) - log_r, m),
        "mismatch_ratio_mean": masked_mean(ratio, m),
        "mismatch_ratio_max": ratio[m].max() if m.any() else torch.ones((), dtype=dtype),
    }


def rollout_correction(
    trainer_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    lower: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights for the policy loss and which valid tokens they drop.

    - ``none``: 1;
    - ``token_tis``: ``min(r_t, cap)``; ``seq_tis``: ``min(R, cap)`` with ``R = prod_t r_t``;
    - ``seq_mis``: ``R`` where ``lower <= R <= cap``, else the sequence is dropped (0);
    - ``icepop``: ``r_t`` where ``lower <= r_t <= cap``, else the token is dropped (0).
    No gradient flows through a weight.
    """
    check_same_shape(trainer_logp=trainer_logp, rollout_logp=rollout_logp, mask=mask)
    m = as_mask(mask, trainer_logp)
    dtype = compute_dtype(trainer_logp)
    log_r = torch.where(m, trainer_logp.detach().to(dtype) - rollout_logp.to(dtype), 0.0)
    token = torch.exp(log_r.clamp(-_LOG_LIMIT, _LOG_LIMIT))
    sequence = torch.exp(log_r.sum(-1, keepdim=True).clamp(-_LOG_LIMIT, _LOG_LIMIT))
    sequence = sequence.expand_as(token)
    if mode == "none":
        weight = torch.ones_like(token)
    elif mode == "token_tis":
        weight = token.clamp(max=cap)
    elif mode == "seq_tis":
        weight = sequence.clamp(max=cap)
    elif mode == "seq_mis":
        weight = torch.where((sequence >= lower) & (sequence <= cap), sequence, 0.0)
    elif mode == "icepop":
        weight = torch.where((token >= lower) & (token <= cap), token, 0.0)
    else:
        raise ValueError(
            f"rollout_correction: expected one of {', '.join(ROLLOUT_CORRECTIONS)}, got {mode!r}"
        )
    weight = torch.where(m, weight, 0.0)
    return weight, m & (weight == 0)
