"""``flow``: a flow-matching action expert (π0-style) that RL can train.

An observation encoder (the state, the mean embedding of the instruction words and, for
pixels, the ``cnn`` policy's convolutions, then an MLP trunk) conditions an action expert that
maps ``(features, noisy action chunk x, time t)`` to a velocity. ``x`` lives in the action
bounds scaled to [-1, 1]; ``t`` runs from 0 (noise) to 1 (action) on the path
``x_t = (1 - t) x_0 + t x_1``. Behaviour cloning is conditional flow matching: regress the
velocity onto ``x_1 - x_0`` (``imitation_loss``).

Acting integrates ``model.flow.steps`` (K) Euler steps from ``x_0 ~ N(0, I)``. Deterministic
(evaluation): the ODE ``x_{k+1} = x_k + v dt`` from ``x_0 = 0``. Stochastic (RL): every step
is a Gaussian transition ``x_{k+1} ~ N(mean_k, std_k^2)``, so the chain has a density:

- ``noise: sde`` (Flow-SDE): the ODE turned into the SDE with the same marginals,
  ``dx = [v + (g^2 / 2) score] dt + g dW``. The path's score is ``-(x - t v) / (1 - t)``;
  with ``g(t) = sigma sqrt(1 - t)`` the drift is ``v + sigma^2 / 2 (t v - x)`` (finite at
  every step) and the step's std ``sigma sqrt((1 - t) dt)``, shrinking towards the action.
- ``noise: learned`` (Flow-Noise): the ODE's mean with a std from a noise head over the
  expert's inputs, zero-initialised at ``sigma sqrt(dt)`` and bounded within a factor e^2
  of it.

The action's log-probability is the sum over steps of the transitions' Gaussian
log-densities, per action dimension ``[B, C, A]`` (``x_0``'s own density is left out: no
weight moves it). The chain's states ``x_0 .. x_{K-1}`` travel with the trajectory as the
forward input ``chain`` ``[B, K, C, A]`` (the action is ``x_K``), so ``evaluate`` recomputes
exactly the log-prob the rollout sampled, all K transitions in one batched pass.

Exploration: the chain has no closed-form entropy of its action, but its transitions do: the
``entropy`` reported is the path's, ``sum_k H(x_{k+1} | x_k)``, per dimension. With ``sde`` it
is fixed by ``sigma`` (no gradient: ``sigma`` sets exploration, an entropy bonus cannot); with
``learned`` the noise head learns from the PPO loss and the entropy bonus keeps it open.
"""

from __future__ import annotations

import dataclasses
import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from tidal.envs.layout import layout_of
from tidal.models.cnn import conv_encoder, packed_features, word_embedding
from tidal.models.policy import (
    ACTIVATIONS,
    EmbodiedPolicy,
    LeadingNorm,
    PolicyStep,
    _mlp,
    register_action_bounds,
    register_policy,
)

FLOW_DEFAULTS = {"steps": 10, "noise": "sde", "sigma": 0.5}
NOISES = ("sde", "learned")
CHAIN = "chain"  # the forward input holding the chain's states
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_LEARNED_RANGE = 2.0  # the learned std stays within e^-2 .. e^2 of its initial value


def flow_settings(flow: dict | None) -> dict:
    """``model.flow`` over its defaults, checked (a bad value names its key)."""
    settings = {**FLOW_DEFAULTS, **(flow or {})}
    unknown = set(settings) - set(FLOW_DEFAULTS)
    if unknown:
        raise ValueError(
            f"model.flow.{sorted(unknown)[0]}: no such setting; known: {', '.join(FLOW_DEFAULTS)}"
        )
    if int(settings["steps"]) < 1:
        raise ValueError(f"model.flow.steps: must be >= 1, got {settings['steps']}")
    if settings["noise"] not in NOISES:
        raise ValueError(f"model.flow.noise: expected sde or learned, got {settings['noise']!r}")
    if not float(settings["sigma"]) > 0:
        raise ValueError(f"model.flow.sigma: must be > 0, got {settings['sigma']}")
    return settings


def gaussian_logp(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return -0.5 * ((x - mean) / std).square() - std.log() - _LOG_SQRT_2PI


def time_embedding(t: torch.Tensor, width: int) -> torch.Tensor:
    """Sines and cosines of ``t`` ``[N]`` at geometric frequencies 1 .. 1000: ``[N, width]``."""
    freqs = torch.exp(torch.linspace(0.0, math.log(1000.0), width // 2, device=t.device))
    angles = t[:, None] * freqs
    return torch.cat([angles.sin(), angles.cos()], -1)


@register_policy("flow")
class FlowMatchingPolicy(EmbodiedPolicy):
    run_settings = ("flow",)  # RL from a cloned policy sets its own steps, noise and sigma

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        num_action_chunks: int = 1,
        hidden_sizes: tuple[int, ...] = (256, 256),
        activation: str = "gelu",
        critic: bool = True,
        obs_norm: bool = False,
        flow: dict | None = None,
        expert_sizes: tuple[int, ...] = (256, 256),
        time_dim: int = 32,
        channels: tuple[int, ...] = (32, 64, 64),
        feature_dim: int = 256,
        word_dim: int = 32,
        critic_detached: bool = True,
    ):
        super().__init__()
        settings = flow_settings(flow)
        self.steps, self.noise, self.sigma = (
            int(settings["steps"]),
            settings["noise"],
            float(settings["sigma"]),
        )
        if not isinstance(action_space, gym.spaces.Box) or len(action_space.shape) != 1:
            raise ValueError(
                f"model.name: flow needs a flat, continuous (Box) action space, got {action_space}"
            )
        if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError("model.name: flow acts in the action bounds, which must be finite")
        if not hidden_sizes:
            raise ValueError("model.hidden_sizes: flow's trunk needs at least one layer width")
        if time_dim < 2 or time_dim % 2:
            raise ValueError(f"model.kwargs.time_dim: must be even and >= 2, got {time_dim}")
        register_action_bounds(self, action_space)
        self.chunks, self.action_dim = num_action_chunks, action_space.shape[0]
        self.critic_detached, self.time_dim = critic_detached, time_dim
        self.layout = layout = layout_of(observation_space)
        self.encoder = None
        width = layout.state_dim
        if layout.image_size:
            self.encoder, image_width = conv_encoder(
                layout.image_size, tuple(channels), feature_dim
            )
            width += image_width
        self.words, word_width = word_embedding(layout, word_dim)
        hidden = list(hidden_sizes)
        self.trunk = nn.Sequential(
            _mlp(width + word_width, hidden[:-1], hidden[-1], activation, math.sqrt(2)),
            ACTIVATIONS[activation](),
        )
        flat = self.chunks * self.action_dim
        expert_in = hidden[-1] + flat + time_dim
        self.expert = _mlp(expert_in, list(expert_sizes), flat, "gelu", 0.01)
        # built (zero-initialised) whatever the noise, so that a policy cloned with one noise
        # loads with the other; frozen when unused (no gradient, not optimised)
        self.noise_head = _mlp(expert_in, list(expert_sizes[:1]), flat, "gelu", 0.0)
        self.noise_head.requires_grad_(self.noise == "learned")
        self.critic = _mlp(hidden[-1], hidden[-1:], 1, activation, 1.0) if critic else None
        self.obs_norm = LeadingNorm(layout.state_dim) if obs_norm and layout.state_dim else None

    # -- the networks --------------------------------------------------------------------

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """The trunk's features of (normalised) observations ``[B, H]``."""
        return self.trunk(packed_features(self.layout.split(obs), self.encoder, self.words))

    def _expert_input(self, h: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, x.flatten(1), time_embedding(t, self.time_dim)], -1)

    def velocity(self, h: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The expert's velocity at chunks ``x`` ``[N, C, A]`` and times ``t`` ``[N]``."""
        return self.expert(self._expert_input(h, x, t)).view_as(x)

    def transition(
        self, h: torch.Tensor, x: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step from ``x`` at ``t``: the ODE's next state, and the stochastic step's mean
        and std, ``[N, C, A]`` each."""
        dt = 1.0 / self.steps
        v = self.velocity(h, x, t)
        ode = x + dt * v
        if self.noise == "sde":  # the drift whose SDE keeps the ODE's marginals
            tt = t.view(-1, 1, 1)
            mean = ode + dt * 0.5 * self.sigma**2 * (tt * v - x)
            std = (self.sigma * torch.sqrt((1.0 - tt) * dt)).expand_as(x)
            return ode, mean, std
        raw = self.noise_head(self._expert_input(h, x, t)).view_as(x)
        std = self.sigma * math.sqrt(dt) * torch.exp(_LEARNED_RANGE * torch.tanh(raw))
        return ode, ode, std

    def times(self, device=None) -> torch.Tensor:
        """``[K]``: the time each step starts at."""
        return torch.arange(self.steps, device=device, dtype=torch.float32) / self.steps

    def ode_actions(self, h: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The Euler ODE's action from ``x0`` ``[B, C, A]``."""
        x = x0
        for t in self.times(x0.device):
            x = x + self.velocity(h, x, t.expand(len(x))) / self.steps
        return x

    # -- the policy interface ------------------------------------------------------------

    def act(self, inputs, deterministic=False) -> PolicyStep:
        h = self.features(inputs["obs"])
        batch = h.shape[0]
        shape = (batch, self.chunks, self.action_dim)
        x = torch.zeros(shape, device=h.device)
        if not deterministic:
            x.normal_()
        chain, logp = [], torch.zeros(shape, device=h.device)
        for t in self.times(h.device):
            chain.append(x)
            ode, mean, std = self.transition(h, x, t.expand(batch))
            # deterministic: the ODE's step, scored under the chain's kernel
            nxt = ode if deterministic else torch.addcmul(mean, std, torch.randn_like(mean))
            logp = logp + gaussian_logp(nxt, mean, std)
            x = nxt
        values = self._value(h) if self.critic is not None else None
        return PolicyStep(
            actions=x,
            logprobs=logp,
            values=values,
            inputs={**inputs, CHAIN: torch.stack(chain, 1)},
        )

    def evaluate(self, inputs, actions):
        if CHAIN not in inputs:
            raise ValueError(
                "flow: evaluate needs the chain the action was sampled with (the forward input "
                f"{CHAIN!r} that act returns); behaviour cloning uses imitation_loss"
            )
        h = self.features(inputs["obs"])
        chain = inputs[CHAIN]  # [N, K, C, A]
        n, k = chain.shape[:2]
        nxt = torch.cat([chain[:, 1:], actions[:, None].to(chain.dtype)], 1)
        t = self.times(h.device).repeat(n)  # row-major: sample i's K steps together
        _, mean, std = self.transition(
            h.repeat_interleave(k, 0), chain.reshape(n * k, *chain.shape[2:]), t
        )
        mean, std = mean.view_as(chain), std.view_as(chain)
        out = {
            "logprobs": gaussian_logp(nxt, mean, std).sum(1),
            "entropy": (0.5 + _LOG_SQRT_2PI + std.log()).sum(1),
        }
        if self.critic is not None:
            out["values"] = self._value(h)
        return out

    def imitation_loss(self, inputs, actions):
        """Conditional flow matching: the velocity at ``x_t`` regressed onto ``x_1 - x_0``."""
        h = self.features(inputs["obs"])
        x1 = actions.float()
        x0 = torch.randn_like(x1)
        t = torch.rand(len(x1), device=x1.device)
        xt = torch.lerp(x0, x1, t.view(-1, 1, 1))
        loss = (self.velocity(h, xt, t) - (x1 - x0)).square().mean()
        return loss, {"bc/loss": loss.item()}

    def value(self, inputs) -> torch.Tensor:
        if self.critic is None:
            raise ValueError("model.critic is false: this policy has no value head")
        return self._value(self.features(inputs["obs"]))

    def _value(self, h: torch.Tensor) -> torch.Tensor:
        """Detached (``critic_detached``): the value loss trains only the critic's layers."""
        return self.critic(h.detach() if self.critic_detached else h).squeeze(-1)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        unit = actions.float().clamp(-1.0, 1.0)
        return (self.low + (unit + 1.0) * 0.5 * (self.high - self.low)).numpy(force=True)

    def policy_actions(self, env_actions: torch.Tensor) -> torch.Tensor:
        return 2.0 * (env_actions.float() - self.low) / (self.high - self.low) - 1.0

    @classmethod
    def config_problems(cls, model, algorithm, action_space) -> list[tuple[str, str]]:
        problems = []
        if not isinstance(action_space, gym.spaces.Box):
            problems.append(
                (
                    "model.name",
                    f"flow needs a continuous action space; this env's is {action_space}",
                )
            )
        if getattr(algorithm, "name", "ppo") != "ppo":
            problems.append(
                (
                    "algorithm.name",
                    f"{algorithm.name} needs the action's entropy in closed form, which a flow "
                    "chain's action does not have: train flow with ppo (adv_type gae or grpo)",
                )
            )
        noise = flow_settings(_as_dict(getattr(model, "flow", None)))["noise"]
        if noise == "sde" and getattr(algorithm, "entropy_bonus", 0.0):
            problems.append(
                (
                    "algorithm.entropy_bonus",
                    "with model.flow.noise sde the chain's noise is fixed by model.flow.sigma, so "
                    "its entropy has no gradient: set 0 (sigma sets exploration) or use noise "
                    "learned",
                )
            )
        return problems


def _as_dict(section) -> dict | None:
    return dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section
