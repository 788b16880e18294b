"""One objective per loss family, called by both trainers (embodied and language).

An objective turns what a trainer computed for a micro-batch (log-probs, entropies, values,
the reference's log-probs) into the micro-batch's loss and its metrics. It owns every choice
of its family; the trainer owns only where the tensors come from. New families (SAC, ...)
register a class under ``algorithm.name``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from tidal.algorithms._tensors import masked_mean
from tidal.algorithms.correction import mismatch_metrics, rollout_correction
from tidal.algorithms.kl import kl_estimate
from tidal.algorithms.losses import (
    decoupled_ppo_loss,
    loss_denominator,
    ppo_policy_loss,
    value_loss,
)
from tidal.algorithms.prox import loglinear_prox_logp, within_staleness
from tidal.algorithms.sac import SACObjective
from tidal.registry import Registry

OBJECTIVES: Registry[type] = Registry("objective", "algorithm.name")


@dataclass
class PolicyInputs:
    """A micro-batch as the policy loss sees it, every tensor at the loss's level.

    ``behave``: the log-probs of the policy that sampled; ``prox``: the proximal policy's
    (a forward pass before the step), when the objective asked for them; ``versions``: the
    weight version that sampled each element (for the log-linear proximal approximation).
    """

    logp: torch.Tensor
    behave: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    version: int
    prox: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass
class ValueInputs:
    values: torch.Tensor
    old_values: torch.Tensor | None
    returns: torch.Tensor
    mask: torch.Tensor


@dataclass
class Denominators:
    """Counts over a whole minibatch, divided by the data-parallel ranks that DDP averages
    over: each micro-batch's loss is then its exact share of the minibatch's, however the
    minibatch is split (``minibatch_denominators``)."""

    policy: float  # the policy loss's count for ``loss_agg``
    tokens: float  # valid elements (entropy, KL)
    steps: float = 1.0  # valid critic steps (value loss)


def minibatch_denominators(
    policy_masks: list[torch.Tensor],
    value_masks: list[torch.Tensor] | None,
    agg: str,
    ranks: int = 1,
) -> Denominators:
    """The denominators of a minibatch from its micro-batches' masks (policy masks at the
    loss's level, value masks per step)."""
    policy = sum(float(loss_denominator(m, agg)) for m in policy_masks)
    tokens = sum(float(m.sum()) for m in policy_masks)
    steps = sum(float(m.sum()) for m in value_masks) if value_masks else 1.0
    return Denominators(policy / ranks, tokens / ranks, steps / ranks)


def _as_micro_mean(share: torch.Tensor, whole: float | None, count) -> torch.Tensor:
    """A micro-batch's share of a minibatch term, reported as the micro-batch's own mean
    (so that metrics read the same however the minibatch is split)."""
    if whole is None:
        return share.detach()
    return (share * whole / max(float(count), 1.0)).detach()


@dataclass(frozen=True)
class PPOSettings:
    """Every setting of the PPO family's objective, one typed object for both halves. A half's
    algorithm section supplies the ones it has (``of``); the others keep plain PPO's values
    below (the language half has no value loss or dual clip, the embodied half no rollout
    correction or sequence-level ratio)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    use_decoupled_loss: bool = False
    prox_logp_method: str = "recompute"  # recompute | loglinear | metrics
    behav_weight_cap: float | None = 5.0
    cap_mode: str = "mask"
    dual_clip: float | None = None
    recompute_logprob: bool = False  # standard PPO's old log-probs from the trainer
    policy_loss: str = "ppo"  # ppo | cispo
    importance_level: str = "token"  # token | sequence (GSPO)
    rollout_correction: str = "none"  # standard PPO's train-inference mismatch correction
    rollout_correction_cap: float = 2.0
    rollout_correction_lower: float = 0.5
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_clamp: float | None = None
    kl_in: str = "loss"  # loss | reward
    entropy_bonus: float = 0.0
    vf_coef: float = 0.0
    value_clip: float | None = None
    huber_delta: float | None = None

    @classmethod
    def of(cls, section) -> PPOSettings:
        """The settings an algorithm section holds (any object with some of these names)."""
        if isinstance(section, cls):
            return section
        names = [f.name for f in fields(cls)]
        return cls(**{n: getattr(section, n) for n in names if hasattr(section, n)})


@OBJECTIVES.register("ppo")
class PPOObjective:
    """Clipped PPO against the behaviour policy, or decoupled PPO (a trust region around the
    proximal policy, behaviour weights capped or masked), plus an entropy bonus, a KL penalty
    to a frozen reference and the value loss, as ``PPOSettings`` (or an algorithm section,
    read as them) say."""

    def __init__(self, alg):
        self.settings = s = PPOSettings.of(alg)
        self.clip = (s.clip_ratio_low, s.clip_ratio_high)
        self.decoupled = bool(s.use_decoupled_loss)
        self.prox_method = s.prox_logp_method
        self.dual_clip = s.dual_clip
        self.recompute_old = s.recompute_logprob
        self.surrogate = s.policy_loss
        self.importance_level = s.importance_level
        # train-inference mismatch correction of standard PPO (the decoupled loss has its own:
        # the behaviour weight, capped or masked)
        self.correction = s.rollout_correction
        self.correction_bounds = (s.rollout_correction_cap, s.rollout_correction_lower)
        self.kl_coef, self.kl_kind, self.kl_clamp = s.kl_coef, s.kl_kind, s.kl_clamp
        self.kl_in_loss = s.kl_in == "loss"
        self.entropy_bonus, self.vf_coef = s.entropy_bonus, s.vf_coef
        self.value_clip, self.huber_delta = s.value_clip, s.huber_delta

    @property
    def needs_prox(self) -> bool:
        """Whether the trainer must compute the proximal log-probs before the step."""
        if self.decoupled:
            return self.prox_method in ("recompute", "metrics")
        return self.recompute_old or self.correction != "none"

    def policy_loss(self, p: PolicyInputs, **agg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        agg = {"surrogate": self.surrogate, "importance_level": self.importance_level, **agg}
        if not self.decoupled:
            return self._standard(p, **agg)
        approx = None
        if self.prox_method in ("loglinear", "metrics"):
            # p.version: the weights the step starts from, which are the proximal policy; the
            # approximation's "trainer version" is the one the step makes (the policy trained)
            approx = loglinear_prox_logp(p.behave, p.logp, p.versions, p.version + 1)
        prox = approx if self.prox_method == "loglinear" else p.prox
        loss, info = decoupled_ppo_loss(
            p.logp,
            prox,
            p.behave,
            p.advantages,
            p.mask,
            *self.clip,
            behav_weight_cap=self.settings.behav_weight_cap,
            cap_mode=self.settings.cap_mode,
            dual_clip=self.dual_clip,
            **agg,
        )
        if self.prox_method == "metrics":  # how far the approximation is from the forward pass
            info["prox_approx_abs_err"] = masked_mean((approx - p.prox).abs(), p.mask)
        if p.prox is not None:
            info.update(self._mismatch(p))
        return loss, info

    def _standard(self, p: PolicyInputs, **agg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Standard PPO around the behaviour log-probs or the trainer's own (``recompute_old``),
        reweighted by the rollout correction."""
        weight, dropped = None, None
        if self.correction != "none":
            weight, dropped = rollout_correction(
                p.prox, p.behave, p.mask, self.correction, *self.correction_bounds
            )
        old = p.prox if self.recompute_old else p.behave
        loss, info = ppo_policy_loss(
            p.logp, old, p.advantages, p.mask, *self.clip, self.dual_clip, weight=weight, **agg
        )
        if p.prox is not None:
            info.update(self._mismatch(p, dropped))
        return loss, info

    @staticmethod
    def _mismatch(p: PolicyInputs, dropped: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """How the engine's log-probs differ from the trainer's under the same weights: on the
        tokens generated by the version the trainer holds (older ones differ by training too);
        ``mismatch_masked_frac``: valid tokens the correction dropped."""
        same = p.mask if p.versions is None else p.mask & (p.versions == p.version)
        info = mismatch_metrics(p.prox, p.behave, same) if same.any() else {}  # none: say nothing
        masked = torch.zeros(()) if dropped is None else masked_mean(dropped.float(), p.mask)
        info["mismatch_masked_frac"] = masked
        return info

    def loss(
        self,
        p: PolicyInputs,
        value: ValueInputs | None = None,
        critic_only: bool = False,
        norm: Denominators | None = None,
        **agg,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss and its terms: policy loss (skipped while ``critic_only``),
        entropy bonus, KL to the reference (when it is in the loss) and value loss. With
        ``norm`` every term is divided by the minibatch's count, not the micro-batch's."""
        whole = (lambda name: None) if norm is None else (lambda name: getattr(norm, name))
        if norm is not None:
            agg["denominator"] = norm.policy
        pg_loss, info = self.policy_loss(p, **agg)
        own = loss_denominator(p.mask, agg.get("agg", "token-mean"))
        info = {"policy_loss": _as_micro_mean(pg_loss, whole("policy"), own), **info}
        loss = torch.zeros((), device=pg_loss.device) if critic_only else pg_loss
        tokens = p.mask.sum()
        if p.entropy is not None:
            entropy = masked_mean(p.entropy, p.mask, whole("tokens"))
            info["entropy"] = _as_micro_mean(entropy, whole("tokens"), tokens)
            if not critic_only and self.entropy_bonus:
                loss = loss - self.entropy_bonus * entropy
        if p.ref is not None and self.kl_in_loss:
            estimate = kl_estimate(p.logp, p.ref, self.kl_kind, self.kl_clamp)
            kl = masked_mean(estimate, p.mask, whole("tokens"))
            info["kl_ref"] = _as_micro_mean(kl, whole("tokens"), tokens)
            if not critic_only:
                loss = loss + self.kl_coef * kl
        if value is not None:
            v_loss, v_info = value_loss(
                value.values,
                value.old_values,
                value.returns,
                value.mask,
                self.value_clip,
                self.huber_delta,
                denominator=whole("steps"),
            )
            loss = loss + self.vf_coef * v_loss
            steps = value.mask.sum()
            info["value_loss"] = _as_micro_mean(v_loss, whole("steps"), steps)
            info.update(v_info)
        return loss, info


def make_objective(alg):
    """The objective ``algorithm.name`` names (PPO for a section without the key)."""
    return OBJECTIVES.get(getattr(alg, "name", "ppo"))(alg)


def staleness_metrics(lag: torch.Tensor, buckets: int = 0) -> dict[str, float]:
    """``staleness/mean`` and ``/max`` of per-sample version lags (trainer version minus the
    sampling version), and ``/frac_k`` for k in 1..buckets: the names both halves log."""
    lag = lag.float()
    empty = lag.numel() == 0
    out = {
        "staleness/mean": 0.0 if empty else float(lag.mean()),
        "staleness/max": 0.0 if empty else float(lag.max()),
    }
    for k in range(1, buckets + 1):
        out[f"staleness/frac_{k}"] = 0.0 if empty else float((lag == k).float().mean())
    return out


def drop_stale(
    versions: torch.Tensor, mask: torch.Tensor, version: int, max_staleness: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mask without samples more than ``max_staleness`` versions old (asynchronous runs,
    ``max_staleness > 0``; ``versions`` per sample along dim 0), and the staleness metrics of
    the samples kept (``rollout/stale_dropped`` counts the others)."""
    if max_staleness == 0:
        return mask, staleness_metrics(version - versions)
    keep = within_staleness(versions, version, max_staleness)
    kept = mask & keep.view(-1, *([1] * (mask.dim() - 1)))
    metrics = staleness_metrics(version - versions[keep])
    return kept, {"rollout/stale_dropped": float((~keep).sum()), **metrics}


OBJECTIVES.register("sac")(SACObjective)
