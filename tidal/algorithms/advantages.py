"""Advantage estimators and their registry.

Layout (one contract for every estimator, embodied and language alike): **time-major**.
Per-step tensors are ``[T, B, ...]`` (T steps or tokens, B samples); ``values`` and
``dones`` carry one extra leading row, ``[T + 1, B, ...]``, where ``dones[t + 1]`` says the
episode ended after step t and ``values[T]`` bootstraps the last step. A language batch laid
out ``[B, L]`` is passed as its transpose. Groups (GRPO, RLOO, ...) are contiguous along B, or
named per sample by ``groups`` (``[B]`` ids: an agent's episodes give groups of uneven sizes).

Results are float32 (float64 for float64 inputs); nothing here normalises unless its name
or docstring says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.algorithms._tensors import as_mask, check_shape, compute_dtype
from tidal.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_ADVANTAGES: Registry[EstimatorSpec] = Registry("advantage estimator", "algorithm.adv_type")


# ----------------------------------------------------------------------------- primitives


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    dones: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation.

    rewards ``[T, B, ...]``; values and dones ``[T + 1, B, ...]``.
    ``delta_t = r_t + gamma * V_{t+1} * (1 - d_{t+1}) - V_t`` and
    ``A_t = delta_t + gamma * lam * (1 - d_{t+1}) * A_{t+1}``; ``returns = A + V[:-1]``.
    With ``values=None`` it is the critic-free reward-to-go (gamma = lam = 1), still reset
    at dones, and advantages equal returns. Returns ``(advantages, returns)``, ``[T, B, ...]``.
    """
    horizon, rest = rewards.shape[0], tuple(rewards.shape[1:])
    check_shape("dones", dones, (horizon + 1, *rest))
    dtype = compute_dtype(rewards)
    if values is None:
        gamma = lam = 1.0
        v = torch.zeros((horizon + 1, *rest), dtype=dtype, device=rewards.device)
    else:
        check_shape("values", values, (horizon + 1, *rest))
        v = values.detach().to(dtype)
    r = rewards.detach().to(dtype)
    not_done = 1.0 - dones[1:].to(dtype)
    advantages = torch.empty_like(r)
    running = torch.zeros(rest, dtype=dtype, device=rewards.device)
    for t in reversed(range(horizon)):
        delta = r[t] + gamma * v[t + 1] * not_done[t] - v[t]
        running = delta + gamma * lam * not_done[t] * running
        advantages[t] = running
    return advantages, advantages + v[:-1]


def group_normalize(
    scores: torch.Tensor,
    group_size: int,
    std: bool = True,
    leave_one_out: bool = False,
    unbiased: bool = True,
    eps: float = 1e-6,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise scores within contiguous groups of ``group_size`` along dim 0, or within the
    rows that share an id of ``groups`` (``[n]``; groups of any sizes, in any order).

    ``(s - mean_g) / (std_g + eps)``. ``std=False`` only centres (the Dr.GRPO form);
    ``leave_one_out=True`` subtracts the mean of the *other* members (RLOO). A group of one
    has no baseline to learn from and yields 0; a zero-variance group yields 0, never NaN.
    """
    n = scores.shape[0]
    if groups is not None:
        check_shape("groups", groups, (n,))
        ids, inverse = torch.unique(groups, return_inverse=True)
        contiguous = (
            group_size >= 1
            and n % group_size == 0
            and torch.equal(inverse, torch.arange(n, device=groups.device) // group_size)
        )
        if not contiguous:  # else: the blocks below, bit for bit
            return _normalize_by_id(scores, inverse, len(ids), std, leave_one_out, unbiased, eps)
    if group_size < 1 or n % group_size != 0:
        raise ValueError(
            f"group_size: expected a positive divisor of the batch size {n}, got {group_size}"
        )
    g = (
        scores.detach()
        .to(compute_dtype(scores))
        .reshape(n // group_size, group_size, *scores.shape[1:])
    )
    if leave_one_out and group_size > 1:
        baseline = (g.sum(1, keepdim=True) - g) / (group_size - 1)
    else:
        baseline = g.mean(1, keepdim=True)
    out = g - baseline
    if std:
        if group_size > 1:
            spread = g.std(1, keepdim=True, correction=1 if unbiased else 0)
        else:
            spread = torch.zeros_like(baseline)
        out = out / (spread + eps)
    return out.reshape(scores.shape)


def _normalize_by_id(scores, inverse, count, std, leave_one_out, unbiased, eps) -> torch.Tensor:
    """``group_normalize`` over groups of any sizes: row i is in group ``inverse[i]`` (of
    ``count``), the same formulas as the contiguous blocks', by scatter sums (the way verl
    groups GRPO samples by their prompt's uid)."""
    if scores.dim() != 1:
        raise ValueError(f"groups: scores must be [n] to group by id, got {tuple(scores.shape)}")
    x = scores.detach().to(compute_dtype(scores))
    size = torch.bincount(inverse, minlength=count).to(x.dtype)[inverse]
    total = torch.zeros(count, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)[inverse]
    alone = size < 2  # a group of one has no baseline: 0, as a block of one
    mean = total / size
    if leave_one_out:
        baseline = torch.where(alone, x, (total - x) / (size - 1).clamp(min=1))
    else:
        baseline = mean
    out = x - baseline
    if std:
        sq = torch.zeros(count, dtype=x.dtype, device=x.device)
        sq = sq.index_add_(0, inverse, (x - mean) ** 2)[inverse]
        spread = (sq / (size - 1 if unbiased else size).clamp(min=1)).sqrt()
        out = out / (torch.where(alone, 0.0, spread) + eps)
    return out


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    eps: float = 1e-8,
    shift_mean: bool = True,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (population) variance taken over the
    masked elements only. Elements outside the mask come back as 0; an empty mask gives 0s.
    ``shift_mean=False`` adds the mean back (scale only)."""
    m = as_mask(mask, x)
    xf = x.detach().to(compute_dtype(x))
    count = m.sum()
    if count == 0:
        return torch.zeros_like(xf)
    mean = torch.where(m, xf, 0.0).sum() / count
    var = torch.where(m, (xf - mean) ** 2, 0.0).sum() / count
    out = (xf - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


# ----------------------------------------------------------------------------- embodied helpers


def reduce_chunk_level(
    rewards: torch.Tensor, dones: torch.Tensor, reward_type: str = "chunk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn per-action rewards of action chunks into per-step rewards.

    rewards ``[T, B, C]`` and dones ``[T + 1, B, C]`` (C actions per chunk).
    ``"chunk"``: one step per chunk, rewards summed over the chunk, dones max-reduced →
    ``[T, B]`` and ``[T + 1, B]``. ``"action"``: every action is a step, in time order →
    ``[T * C, B]`` and ``[T * C + 1, B]`` (the first row keeps the last action's done).
    """
    if rewards.dim() != 3:
        raise ValueError(f"rewards: expected [T, B, C], got shape {tuple(rewards.shape)}")
    horizon, batch, chunk = rewards.shape
    check_shape("dones", dones, (horizon + 1, batch, chunk))
    if reward_type == "chunk":
        return rewards.sum(-1), dones.amax(-1)
    if reward_type == "action":
        flat_r = rewards.permute(0, 2, 1).reshape(horizon * chunk, batch)
        flat_d = dones[1:].permute(0, 2, 1).reshape(horizon * chunk, batch)
        return flat_r, torch.cat([dones[:1, :, -1], flat_d], 0)
    raise ValueError(f"reward_type: expected 'chunk' or 'action', got {reward_type!r}")


def loss_mask_from_dones(dones: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rollouts without auto-reset: steps after each env's first done are masked.

    dones ``[T + 1, B, ...]`` (``dones[0]`` belongs to the previous rollout and is ignored).
    Returns ``loss_mask`` ``[T, B, ...]`` (bool; the step that ends the episode is valid) and
    ``loss_mask_sum`` ``[T, B, ...]``: each env's count of valid steps, repeated along T so it
    survives flattening and shuffling.
    """
    if dones.shape[0] < 2:
        raise ValueError(f"dones: expected [T + 1, B] with T >= 1, got shape {tuple(dones.shape)}")
    d = dones[1:].long()
    ended_before = torch.cumsum(d, 0) - d
    loss_mask = ended_before == 0
    loss_mask_sum = loss_mask.sum(0, keepdim=True).expand_as(loss_mask).to(torch.float32)
    return loss_mask, loss_mask_sum


def episode_scores(rewards: torch.Tensor, dones: torch.Tensor) -> torch.Tensor:
    """Sum of each env's rewards up to and including its first done: ``[T, B]`` → ``[B]``."""
    check_shape("dones", dones, (rewards.shape[0] + 1, *rewards.shape[1:]))
    loss_mask, _ = loss_mask_from_dones(dones)
    return torch.where(loss_mask, rewards.to(compute_dtype(rewards)), 0.0).sum(0)


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class EstimatorSpec:
    """What an estimator needs, declared at registration so generic code asks instead of
    testing names: a critic (values), groups of samples (``group_size`` > 1, whole episodes),
    bootstrap values of truncated episodes, and whether its output is whitened over the batch
    when ``normalize_advantages`` is on."""

    fn: AdvantageFn
    needs_critic: bool = False
    needs_groups: bool = False
    needs_bootstrap: bool = False
    whiten: bool = False


def register_advantage(
    name: str,
    *,
    needs_critic: bool = False,
    needs_groups: bool = False,
    needs_bootstrap: bool = False,
    whiten: bool = False,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under ``name``. It is called with keyword arguments only
    (``rewards``, ``mask``, ``values``, ``dones``, ``gamma``, ``lam``, ``group_size``,
    ``groups``, ...; time-major as this module describes), must accept ``**kwargs`` it does not
    use, and returns ``(advantages, returns)`` shaped like ``rewards``."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        spec = EstimatorSpec(fn, needs_critic, needs_groups, needs_bootstrap, whiten)
        _ADVANTAGES.register(name)(spec)
        return fn

    return decorator


def get_advantage(name: str) -> AdvantageFn:
    return _ADVANTAGES.get(name).fn


def advantage_spec(name: str) -> EstimatorSpec:
    return _ADVANTAGES.get(name)


def list_advantages(**needs: bool) -> list[str]:
    """Registered names, optionally only those whose spec matches, e.g. ``needs_critic=False``."""
    return [
        n
        for n in _ADVANTAGES.names()
        if all(getattr(_ADVANTAGES.get(n), k) == v for k, v in needs.items())
    ]


def _outcome_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One score per sample: the sum of its valid rewards, ``[T, B]`` → ``[B]``."""
    return torch.where(mask, rewards.to(compute_dtype(rewards)), 0.0).sum(0)


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, per_sample.unsqueeze(0), 0.0)


def _reinforce_pp(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    dones: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: each valid step's discounted return-to-go of the per-step rewards, whitened
    over all valid steps of the batch. Rewards on masked steps (a tool's or an environment's
    tokens between two answers) count as 0 and the discount runs through them, as OpenRLHF's
    ``get_cumulative_returns`` does, so earlier turns get the episode's outcome; a KL penalty
    shaped into the per-token rewards stays per token. ``dones`` ``[T + 1, B]`` (embodied
    rollouts) restart the return after each episode's end."""
    dtype = compute_dtype(token_rewards)
    r = torch.where(mask, token_rewards.to(dtype), 0.0)
    keep = torch.ones_like(r) if dones is None else 1.0 - dones[1:].to(dtype)
    returns = torch.empty_like(r)
    running = torch.zeros_like(r[0])
    for t in reversed(range(r.shape[0])):
        running = r[t] + gamma * keep[t] * running
        returns[t] = running
    returns = torch.where(mask, returns, 0.0)
    return masked_whiten(returns, mask), returns


@register_advantage("gae", needs_critic=True, needs_bootstrap=True, whiten=True)
def _gae(*, rewards, values=None, dones=None, gamma=1.0, lam=1.0, **_):
    if dones is None:
        dones = torch.zeros((rewards.shape[0] + 1, *rewards.shape[1:]), dtype=torch.bool)
    return compute_gae(rewards, values, dones, gamma, lam)


def _group_estimator(**norm_kwargs) -> AdvantageFn:
    def estimator(*, rewards, mask=None, group_size=1, groups=None, eps=1e-6, **_):
        m = as_mask(mask, rewards)
        scores = _outcome_scores(rewards, m)
        adv = group_normalize(scores, group_size, eps=eps, groups=groups, **norm_kwargs)
        return _broadcast(adv, m), _broadcast(scores, m)

    return estimator


register_advantage("grpo", needs_groups=True)(_group_estimator(std=True))
register_advantage("dr_grpo", needs_groups=True)(_group_estimator(std=False))
register_advantage("rloo", needs_groups=True)(_group_estimator(std=False, leave_one_out=True))


@register_advantage("raw")
def _raw(*, rewards, mask=None, **_):
    """Plain REINFORCE: each sample's score, no baseline, on every valid step."""
    m = as_mask(mask, rewards)
    scores = _broadcast(_outcome_scores(rewards, m), m)
    return scores, scores


@register_advantage("reinpp")
def _reinpp(*, rewards, mask=None, gamma=1.0, dones=None, **_):
    return _reinforce_pp(rewards, as_mask(mask, rewards), gamma, dones)


@register_advantage("reinpp_baseline", needs_groups=True)
def _reinpp_baseline(*, rewards, mask=None, group_size=1, groups=None, gamma=1.0, dones=None, **_):
    """REINFORCE++ with the group's mean total reward subtracted at each sample's last valid
    step (the baseline of OpenRLHF's ``reinforce_baseline``)."""
    m = as_mask(mask, rewards)
    scores = _outcome_scores(rewards, m)
    baseline = scores - group_normalize(scores, group_size, std=False, groups=groups)
    last = m.shape[0] - 1 - torch.flip(m.long(), [0]).argmax(0)
    shaped = torch.where(m, rewards.to(scores.dtype), 0.0)
    shaped[last, torch.arange(m.shape[1])] -= baseline * m.any(0)
    return _reinforce_pp(shaped, m, gamma, dones)
