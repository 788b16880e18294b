"""Policy and value losses, loss aggregation and log-prob reshaping.

Every loss takes per-element tensors of one shape plus a ``mask`` of valid elements and
returns ``(loss, metrics)``: a scalar with gradient and a dict of detached scalar tensors.
Masked-out elements never reach the loss, so padding may hold anything (even inf or NaN).
Log-ratios are clamped to ±``LOG_RATIO_LIMIT`` before ``exp`` so no inf leaks in.
"""

from __future__ import annotations

import torch

from tidal.algorithms._tensors import as_mask, check_same_shape, compute_dtype, masked_mean

LOG_RATIO_LIMIT = 20.0
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "embodied-ratio")


def aggregate_loss(
    losses: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    loss_mask_sum: torch.Tensor | None = None,
    max_episode_steps: int | None = None,
    count_mask: torch.Tensor | None = None,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce per-element losses to a scalar: a sum over the ``mask``ed elements divided by a
    count over ``count_mask`` (default the mask; elements a behaviour cap rejected stay in it).

    - ``token-mean``: over all counted elements.
    - ``seq-mean-token-mean``: per sequence (the last dim) the sum over its counted elements,
      then the mean over sequences that have any.
    - ``seq-mean-token-sum``: per sequence the sum, then the mean over sequences that have any.
    - ``embodied-ratio``: ``mean(L / (loss_mask_sum / max_episode_steps) * mask)`` over all
      elements: each env's steps weighted by how short its episode was.

    ``denominator``: the count of the whole minibatch when these are one micro-batch of it
    (``loss_denominator`` summed over its micro-batches): the micro-batches' losses then sum
    to the minibatch's, however it is split. An all-masked batch gives 0 (still attached).
    """
    m = mask.bool()
    counted = m if count_mask is None else count_mask.bool()
    zeroed = torch.where(m, losses, 0.0)
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        if losses.dim() < 2:
            raise ValueError(
                f"agg {agg!r}: expected [..., seq_len] losses, got shape {tuple(losses.shape)}"
            )
        per_seq = zeroed.sum(-1)
        if agg == "seq-mean-token-mean":
            per_seq = per_seq / counted.sum(-1).clamp(min=1)
        total = per_seq.sum()
    elif agg == "token-mean":
        total = zeroed.sum()
    elif agg == "embodied-ratio":
        if loss_mask_sum is None or max_episode_steps is None:
            raise ValueError("agg 'embodied-ratio': needs loss_mask_sum and max_episode_steps")
        check_same_shape(losses=losses, loss_mask_sum=loss_mask_sum)
        scale = (loss_mask_sum.to(losses.dtype) / max_episode_steps).clamp(min=1e-8)
        total = torch.where(m, losses / scale, 0.0).sum()
    else:
        raise ValueError(f"agg: expected one of {', '.join(AGGREGATIONS)}, got {agg!r}")
    if denominator is None:
        denominator = loss_denominator(counted, agg)
    return total / torch.as_tensor(denominator, dtype=total.dtype).clamp(min=1)


def loss_denominator(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """What ``aggregate_loss`` divides by, for these elements: valid elements (token-mean),
    sequences with any (the seq- modes), or every element (embodied-ratio)."""
    m = mask.bool()
    if agg == "token-mean":
        return m.sum()
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return (m.sum(-1) > 0).sum()
    if agg == "embodied-ratio":
        return torch.tensor(m.numel())
    raise ValueError(f"agg: expected one of {', '.join(AGGREGATIONS)}, got {agg!r}")


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if not mask.any():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask].max()


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r))``, then for ``A < 0`` capped at ``-c A`` (dual clip).
    Returns the per-element loss and where the clip and the dual clip were active."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip: expected a value > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual_active = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
    return loss, clip_active, dual_active


SURROGATES = ("ppo", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log-ratio on every token: the mean over the sequence's valid
    tokens (the last dim), with each token's own gradient: ``sg(mean) + lr_t - sg(lr_t)``."""
    counts = mask.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / counts
    return mean.detach() + log_ratio - log_ratio.detach()


def _surrogate(
    logp: torch.Tensor,
    anchor: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    surrogate: str,
    importance_level: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element policy loss around ``anchor`` (the policy of the trust region) and
    ``(log_ratio, ratio, clip_active, dual_active)``.

    ``ppo``: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (dual clip for ``A < 0``).
    ``cispo``: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) A log r``: every token keeps its
    gradient, weighted by its clipped importance ratio (MiniMax-M1).
    ``importance_level="sequence"``: the ratio is the sequence's (GSPO).
    """
    dtype = compute_dtype(logp)
    log_ratio = torch.where(mask, logp.to(dtype) - anchor.detach().to(dtype), 0.0)
    if importance_level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask)
    elif importance_level != "token":
        raise ValueError(
            f"importance_level: expected one of {', '.join(IMPORTANCE_LEVELS)}, got {importance_level!r}"
        )
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages.detach().to(dtype), 0.0)
    if surrogate == "ppo":
        per_elem, clip_active, dual_active = _clipped_surrogate(
            ratio, adv, clip_low, clip_high, dual_clip
        )
    elif surrogate == "cispo":
        weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
        per_elem = -weight * adv * log_ratio
        clip_active = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        dual_active = torch.zeros_like(clip_active)
    else:
        raise ValueError(f"policy_loss: expected one of {', '.join(SURROGATES)}, got {surrogate!r}")
    return per_elem, log_ratio.detach(), ratio.detach(), clip_active, dual_active


def _ratio_metrics(log_ratio, ratio, clip_active, dual_active, mask) -> dict[str, torch.Tensor]:
    dtype = ratio.dtype
    return {
        "clip_frac": masked_mean(clip_active.to(dtype), mask),
        "dual_clip_frac": masked_mean(dual_active.to(dtype), mask),
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": _masked_max(ratio, mask),
    }


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    surrogate: str = "ppo",
    importance_level: str = "token",
    weight: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate: ``r = exp(logp - old_logp)``,
    ``L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c > 1``
    the loss of ``A < 0`` elements is ``min(L, -c A)``. ``surrogate="cispo"`` and
    ``importance_level="sequence"`` as in ``_surrogate``; ``weight``: a per-element factor
    (a train–inference mismatch correction), zero where it drops an element. Metrics:
    ``clip_frac``, ``approx_kl`` (k3 of old vs new), ``ratio_mean``, ``ratio_max``,
    ``dual_clip_frac``."""
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    m = as_mask(mask, logp)
    per_elem, log_ratio, ratio, clip_active, dual_active = _surrogate(
        logp, old_logp, advantages, m, clip_low, clip_high, dual_clip, surrogate, importance_level
    )
    if weight is not None:
        per_elem = per_elem * weight.detach().to(per_elem.dtype)
    loss = aggregate_loss(per_elem, m, agg, **agg_kwargs)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, clip_active, dual_active, m)
    return loss, metrics


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behave_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    behav_weight_cap: float | None = None,
    cap_mode: str = "mask",
    dual_clip: float | None = None,
    agg: str = "token-mean",
    surrogate: str = "ppo",
    importance_level: str = "token",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO for off-policy (stale) samples.

    The clipped surrogate is taken on ``exp(logp - prox_logp)`` (trust region around the
    proximal policy) and multiplied by the behaviour weight ``w = exp(prox_logp - behave_logp)``
    (importance correction for the policy that actually sampled). Elements with
    ``w > behav_weight_cap`` are dropped from the loss (``cap_mode="mask"``: out of the sum,
    still counted in the denominator, as AReaL does, so that a minibatch's loss does not depend
    on how it is split) or have ``w`` clamped to the cap (``"clamp"``). ``surrogate`` and
    ``importance_level`` as in ``_surrogate``.
    Extra metrics: ``behave_weight_mean``, ``behave_weight_max``, ``behave_capped_frac``.
    """
    check_same_shape(
        logp=logp, prox_logp=prox_logp, behave_logp=behave_logp, advantages=advantages, mask=mask
    )
    if cap_mode not in ("mask", "clamp"):
        raise ValueError(f"cap_mode: expected 'mask' or 'clamp', got {cap_mode!r}")
    m = as_mask(mask, logp)
    dtype = compute_dtype(logp)
    prox = prox_logp.detach().to(dtype)
    behav_log = torch.where(m, prox - behave_logp.detach().to(dtype), 0.0)
    weight = torch.exp(behav_log.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    capped = torch.zeros_like(m)
    train_mask = m
    if behav_weight_cap is not None:
        capped = m & (weight > behav_weight_cap)
        if cap_mode == "mask":
            train_mask = m & ~capped
        else:
            weight = weight.clamp(max=behav_weight_cap)
    per_elem, log_ratio, ratio, clip_active, dual_active = _surrogate(
        logp,
        prox,
        advantages,
        train_mask,
        clip_low,
        clip_high,
        dual_clip,
        surrogate,
        importance_level,
    )
    loss = aggregate_loss(per_elem * weight, train_mask, agg, count_mask=m, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            **_ratio_metrics(log_ratio, ratio, clip_active, dual_active, train_mask),
            "behave_weight_mean": masked_mean(weight, m),
            "behave_weight_max": _masked_max(weight, m),
            "behave_capped_frac": masked_mean(capped.to(dtype), m),
        }
    return loss, metrics


def _elementwise_error(diff: torch.Tensor, huber_delta: float | None) -> torch.Tensor:
    """``0.5 * d^2``, or Huber with threshold delta (which equals it for ``|d| <= delta``)."""
    if huber_delta is None:
        return 0.5 * diff**2
    return torch.nn.functional.huber_loss(
        diff, torch.zeros_like(diff), reduction="none", delta=huber_delta
    )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    mask: torch.Tensor | None,
    value_clip: float | None = None,
    huber_delta: float | None = None,
    agg: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss: error of ``values`` against ``returns`` (``0.5 d^2`` or Huber). With
    ``value_clip = c`` the clipped prediction ``old + clamp(v - old, -c, c)`` is scored too and
    the larger of the two errors is taken (PPO's pessimistic value clipping).
    Metrics: ``value_clip_frac``, ``explained_variance``."""
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = as_mask(mask, values)
    dtype = compute_dtype(values)
    v = values.to(dtype)
    target = torch.where(m, returns.detach().to(dtype), 0.0)
    v = torch.where(m, v, 0.0)
    error = _elementwise_error(v - target, huber_delta)
    clip_active = torch.zeros_like(m)
    if value_clip is not None:
        if old_values is None:
            raise ValueError("value_clip: needs old_values")
        old = torch.where(m, old_values.detach().to(dtype), 0.0)
        v_clipped = old + torch.clamp(v - old, -value_clip, value_clip)
        clipped_error = _elementwise_error(v_clipped - target, huber_delta)
        clip_active = clipped_error > error
        error = torch.maximum(error, clipped_error)
    loss = aggregate_loss(error, m, agg, **agg_kwargs)
    with torch.no_grad():
        residual_var = _masked_var(target - v, m)
        target_var = _masked_var(target, m)
        explained = (
            1.0 - residual_var / target_var if target_var > 0 else torch.zeros((), dtype=dtype)
        )
        metrics = {
            "value_clip_frac": masked_mean(clip_active.to(dtype), m),
            "explained_variance": explained,
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def _masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


LOGPROB_LEVELS = ("token", "action", "chunk")


def reshape_logprobs(logp: torch.Tensor, level: str) -> torch.Tensor:
    """Per-dimension log-probs of action chunks ``[..., C, action_dim]`` at the level the loss
    works on: ``token`` keeps every action dimension (VLA token actions), ``action`` sums over
    ``action_dim`` → ``[..., C]``, ``chunk`` sums over both → ``[...]``. Entropies reshape alike."""
    if logp.dim() < 2:
        raise ValueError(f"logp: expected [..., C, action_dim], got shape {tuple(logp.shape)}")
    if level == "token":
        return logp
    if level == "action":
        return logp.sum(-1)
    if level == "chunk":
        return logp.sum((-2, -1))
    raise ValueError(f"logprob level: expected one of {', '.join(LOGPROB_LEVELS)}, got {level!r}")
