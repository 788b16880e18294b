"""Soft actor-critic (Haarnoja et al. 2018) as pure tensor functions, and its objective.

Q critics are an ensemble ``[E, B]``; the target takes the min over all of them (clipped double
Q) or over a random subset (RLPD's ``critic_subset``, Ball et al. 2023). A transition ends in a
termination (no bootstrap) or continues, including a truncation: its target bootstraps from
the *final* observation of the episode (``next_obs`` holds it), discounted by ``gamma ** steps``
(``steps``: the actions of a chunk actually taken, one for single actions).
"""

from __future__ import annotations

import torch


def soft_td_target(
    rewards: torch.Tensor,
    terminations: torch.Tensor,
    next_q: torch.Tensor,
    next_logp: torch.Tensor,
    alpha: torch.Tensor | float,
    gamma: float,
    steps: torch.Tensor | None = None,
) -> torch.Tensor:
    """``r + gamma^steps * (1 - term) * (Q'(s', a') - alpha * log pi(a'|s'))``, every input
    ``[B]`` (``next_q`` already reduced over the ensemble); no gradient flows through it."""
    discount = gamma if steps is None else gamma ** steps.to(rewards.dtype)
    soft_value = next_q - alpha * next_logp
    return (rewards + discount * (~terminations.bool()).to(rewards.dtype) * soft_value).detach()


def ensemble_min(
    q: torch.Tensor, subset: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The min over the ensemble ``[E, B] -> [B]``: over all critics, or over ``subset`` of them
    drawn without replacement (one draw per batch, as RLPD does)."""
    if subset is None or subset >= q.shape[0]:
        return q.min(0).values
    pick = torch.randperm(q.shape[0], generator=generator)[:subset].to(q.device)
    return q[pick].min(0).values


def critic_loss(q: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None):
    """The sum over critics of each one's mean squared TD error (``q`` ``[E, B]``, target
    ``[B]``); ``weight`` ``[B]`` (0 or 1) leaves rows out."""
    err = (q - target.unsqueeze(0)) ** 2
    if weight is None:
        return err.mean(1).sum()
    return (err * weight).sum(1).sum() / weight.sum().clamp_min(1.0)


def actor_loss(logp: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """``E[alpha * log pi(a|s) - Q(s, a)]`` with ``a`` reparameterised (``q``: the ensemble's
    reduction, ``[B]``)."""
    return (alpha * logp - q).mean()


def alpha_loss(log_alpha: torch.Tensor, logp: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """The temperature's loss: ``-log_alpha * (log pi + H_target)`` (``logp`` detached), which
    raises alpha while the entropy is below the target and lowers it above."""
    return -(log_alpha * (logp.detach() + target_entropy)).mean()


@torch.no_grad()
def polyak_update(target: torch.nn.Module, source: torch.nn.Module, tau: float) -> None:
    """``target <- (1 - tau) * target + tau * source``, parameters and float buffers alike."""
    t_params = [p for p in target.parameters()]
    s_params = [p for p in source.parameters()]
    torch._foreach_lerp_(t_params, s_params, tau)
    for t, s in zip(target.buffers(), source.buffers(), strict=True):
        if t.is_floating_point():
            t.lerp_(s, tau)
        else:
            t.copy_(s)


class SACObjective:
    """SAC's three losses on a replay minibatch. ``alg`` is the algorithm section; the actor
    worker supplies the networks' outputs and owns the optimizers."""

    def __init__(self, alg, action_dims: int | None = None):
        self.gamma, self.tau = alg.gamma, alg.tau
        self.subset = alg.critic_subset
        self.fixed_alpha = alg.alpha
        self.policy_delay = alg.policy_delay
        self.target_entropy = alg.target_entropy
        if self.target_entropy is None and action_dims is not None:
            self.target_entropy = -float(action_dims)  # the heuristic of the SAC paper

    @property
    def tunes_alpha(self) -> bool:
        return self.fixed_alpha is None

    def target(self, batch: dict, next_q: torch.Tensor, next_logp, alpha, generator=None):
        """The TD target of a batch from the target critics' ``next_q`` ``[E, B]`` at the
        actor's next actions."""
        q = ensemble_min(next_q, self.subset, generator)
        return soft_td_target(
            batch["rewards"],
            batch["terminations"],
            q,
            next_logp,
            alpha,
            self.gamma,
            batch.get("steps"),
        )

    def critic(self, q: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = critic_loss(q, target)
        return loss, {"critic_loss": loss.detach(), "q_mean": q.detach().mean()}

    def actor(self, logp: torch.Tensor, q: torch.Tensor, alpha) -> tuple[torch.Tensor, dict]:
        """``q`` ``[E, B]`` of the reparameterised actions: the actor maximises their min (clipped
        double Q), or with a ``critic_subset`` (RLPD) the mean over the ensemble."""
        reduced = q.min(0).values if self.subset is None else q.mean(0)
        loss = actor_loss(logp, reduced, alpha)
        return loss, {"actor_loss": loss.detach(), "entropy": -logp.detach().mean()}

    def alpha(self, log_alpha: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = alpha_loss(log_alpha, logp, self.target_entropy)
        return loss, {"alpha_loss": loss.detach()}

    def update(self, agent, batch: dict, alpha, step, version: int, generator=None) -> dict:
        """One SAC update of ``agent`` (``policy``, ``critics``, ``targets``, ``log_alpha``) on
        a minibatch (observations already augmented): the critics' step, every
        ``policy_delay``-th ``version`` the actor's and the temperature's, then the targets.
        ``step(part, loss)`` applies one part's optimizer step and says whether it did (the
        train engine's); returns the terms (tensors), none when the critics' step was skipped."""
        policy = agent.policy
        with torch.no_grad():  # the target critics read the online encoder (as DrQ-v2)
            next_features = policy.encode(batch["next_obs"])
            next_actions, next_logp = policy.sample_features(next_features)
            next_q = agent.targets(next_features, next_actions)
            target = self.target(batch, next_q, next_logp, alpha, generator)
        features = policy.encode(batch["obs"])
        loss, info = self.critic(agent.critics(features, batch["actions"]), target)
        if not step("critic", loss):
            return {}
        if version % self.policy_delay == 0:
            # the critics' features, detached: the actor's loss does not train the encoder
            features = features.detach()
            actions, logp = policy.sample_features(features)
            loss, actor_info = self.actor(
                logp, frozen_call(agent.critics, features, actions), alpha
            )
            if step("actor", loss):
                info.update(actor_info)
            if self.tunes_alpha:
                loss, alpha_info = self.alpha(agent.log_alpha, logp)
                if step("alpha", loss):
                    info.update(alpha_info)
        polyak_update(agent.targets, agent.critics, self.tau)
        return info


def frozen_call(module: torch.nn.Module, *args) -> torch.Tensor:
    """``module(*args)`` with its weights frozen: a loss that needs the gradient through the
    inputs only (SAC's actor through the critics) would pay a third of its backward pass for
    the weights' gradients (and the next critic step clears them anyway)."""
    module.requires_grad_(False)
    try:
        return module(*args)
    finally:
        module.requires_grad_(True)
