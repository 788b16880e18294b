"""SAC's networks: a tanh-squashed Gaussian actor (a policy behind the common interface, so the
rollout runs it as any other) and an ensemble of Q critics.

Actions live in ``[-1, 1]`` (the tanh's range) in the policy's own space, which is also what the
critics read; ``env_actions`` maps them affinely into the env's bounds. An action chunk of ``C``
actions is one action of the critic (``C x A`` inputs).

An observation that carries instruction words (tidal.envs.layout: MT10's task) is read through an
``ObsEncoder``: the words' mean embedding beside the state. The hashed word ids are names, not
quantities; read as numbers (up to the vocabulary's size) they swamp the state and saturate the
actor's tanh. The critics' loss trains the encoder, the actor reads its features detached (as
DrQ does for pixels, sac_cnn).
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tidal.envs.layout import ObsLayout, layout_of
from tidal.models.cnn import packed_features, word_embedding
from tidal.models.policy import (
    EmbodiedPolicy,
    PolicyStep,
    register_action_bounds,
    register_policy,
)

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def mlp(n_in: int, hidden, n_out: int, activation: str, layer_norm: bool = False) -> nn.Sequential:
    layers, width = [], n_in
    for h in hidden:
        layers.append(nn.Linear(width, h))
        if layer_norm:
            layers.append(nn.LayerNorm(h))
        layers.append(ACTIVATIONS[activation]())
        width = h
    layers.append(nn.Linear(width, n_out))
    return nn.Sequential(*layers)


def squashed_logp(u: torch.Tensor, dist_logp: torch.Tensor) -> torch.Tensor:
    """Per-dimension log-prob of ``a = tanh(u)``: ``log N(u) - log(1 - tanh(u)^2)``, stably."""
    return dist_logp - 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))


class ObsEncoder(nn.Module):
    """What SAC's networks read of a packed observation: an image's features (``convs``, when
    given: sac_cnn's convolutions, ``conv_dim`` wide), the mean embedding of the instruction
    words and the state, concatenated: ``[B, out_dim]``."""

    def __init__(
        self, layout: ObsLayout, word_dim: int, convs: nn.Module | None = None, conv_dim: int = 0
    ):
        super().__init__()
        self.layout, self.convs = layout, convs
        self.words, word_width = word_embedding(layout, word_dim)
        self.out_dim = conv_dim + word_width + layout.state_dim

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return packed_features(self.layout.split(obs), self.convs, self.words)


@register_policy("sac_mlp")
class SquashedGaussianPolicy(EmbodiedPolicy):
    """An MLP with a state-dependent mean and log-std per action dimension, squashed by tanh.
    ``uniform`` (a buffer, so weight syncs carry it) makes sampled actions uniform in the
    bounds: the replay buffer's warm-up."""

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        num_action_chunks: int = 1,
        hidden_sizes: tuple[int, ...] = (256, 256),
        activation: str = "relu",
        word_dim: int = 32,
    ):
        super().__init__()
        if not isinstance(action_space, gym.spaces.Box) or len(action_space.shape) != 1:
            raise ValueError(
                f"algorithm.name: sac needs a flat continuous (Box) action space, got "
                f"{action_space} (a discrete env needs algorithm.name ppo)"
            )
        if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
            raise ValueError(
                f"model 'sac_mlp': needs a flat Box observation space, got {observation_space}"
            )
        self.layout = layout_of(observation_space)
        if self.layout.image_size:
            raise ValueError("model 'sac_mlp': pixel observations need model.name sac_cnn")
        self.encoder = ObsEncoder(self.layout, word_dim) if self.layout.num_tokens else None
        self.obs_dim = observation_space.shape[0] if self.encoder is None else self.encoder.out_dim
        self.chunks, self.action_dim = num_action_chunks, action_space.shape[0]
        self.net = mlp(self.obs_dim, hidden_sizes, 2 * self.chunks * self.action_dim, activation)
        register_action_bounds(self, action_space)
        self.register_buffer("uniform", torch.tensor(True))

    @property
    def critic_action_dim(self) -> int:
        return self.chunks * self.action_dim

    def _head(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and log-std of an observation (through the encoder, detached)."""
        return self._head_on(self.encode(obs).detach())

    def _head_on(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.net(features).view(-1, self.chunks, 2 * self.action_dim).chunk(2, -1)
        # a smooth bound on the log-std (CleanRL's), so its gradient never vanishes at a clip
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        return mean, log_std

    def encode(self, obs: torch.Tensor) -> torch.Tensor:
        """What the critics read of an observation: the encoder's features (with its gradient),
        or the observation itself when there is no encoder."""
        return obs if self.encoder is None else self.encoder(obs)

    def encoder_parameters(self) -> list[nn.Parameter]:
        """Parameters the critics' optimizer trains with them (the encoder's)."""
        return [] if self.encoder is None else list(self.encoder.parameters())

    def sample_features(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample`` from ``encode``'s output, detached (the actor's loss reuses the critics'
        pass and does not train the encoder)."""
        return self.sample_from(*self._head_on(features.detach()))

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions ``[B, C, A]`` in [-1, 1] and their log-probs ``[B]`` (the sum
        over the chunk's dimensions: the critic's one action)."""
        return self.sample_from(*self._head(obs))

    def sample_from(self, mean: torch.Tensor, log_std: torch.Tensor):
        std = log_std.exp()
        u = mean + std * torch.randn_like(mean)
        dist_logp = -0.5 * ((u - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        return torch.tanh(u), squashed_logp(u, dist_logp).sum((-2, -1))

    def act(self, inputs, deterministic=False) -> PolicyStep:
        obs = inputs["obs"]
        if deterministic:
            actions = torch.tanh(self._head(obs)[0])
            logp = torch.zeros_like(actions)
        elif bool(self.uniform):
            actions = (
                torch.rand(obs.shape[0], self.chunks, self.action_dim, device=obs.device) * 2 - 1
            )
            logp = torch.full_like(actions, -math.log(2.0))
        else:
            actions, total = self.sample(obs)
            logp = (total / self.critic_action_dim)[:, None, None].expand_as(actions)
        return PolicyStep(actions=actions, logprobs=logp, values=None, inputs=inputs)

    def evaluate(self, inputs, actions):
        raise NotImplementedError("sac_mlp is trained by the SAC actor, not by PPO")

    def value(self, inputs) -> torch.Tensor:
        raise ValueError("sac_mlp has no value head (its critics are Q critics)")

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        unit = actions.clamp(-1, 1)
        return (self.low + (unit + 1.0) * 0.5 * (self.high - self.low)).numpy(force=True)

    def policy_actions(self, env_actions: torch.Tensor) -> torch.Tensor:
        return (2.0 * (env_actions - self.low) / (self.high - self.low) - 1.0).clamp(-1, 1)


class EnsembleLinear(nn.Module):
    """``E`` independent linear layers applied at once (one batched matmul): ``[E, B, in] ->
    [E, B, out]``, each initialised as ``nn.Linear`` is."""

    def __init__(self, members: int, n_in: int, n_out: int):
        super().__init__()
        bound = 1.0 / math.sqrt(n_in)
        self.weight = nn.Parameter(torch.empty(members, n_in, n_out).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(members, 1, n_out).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class EnsembleLayerNorm(nn.Module):
    """LayerNorm with each member's own scale and shift."""

    def __init__(self, members: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(members, 1, width))
        self.bias = nn.Parameter(torch.zeros(members, 1, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:]) * self.weight + self.bias


class QEnsemble(nn.Module):
    """``num_critics`` independent Q MLPs over (observation, flattened action chunk), evaluated
    together in batched matmuls: ``forward`` returns ``[E, B]``."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        num_critics: int,
        hidden_sizes,
        activation: str = "relu",
        layer_norm: bool = False,
    ):
        super().__init__()
        self.members = num_critics
        layers, width = [], obs_dim + action_dim
        for h in hidden_sizes:
            layers.append(EnsembleLinear(num_critics, width, h))
            if layer_norm:
                layers.append(EnsembleLayerNorm(num_critics, h))
            layers.append(ACTIVATIONS[activation]())
            width = h
        layers.append(EnsembleLinear(num_critics, width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, actions.flatten(1)], -1)
        return self.net(x.expand(self.members, *x.shape)).squeeze(-1)
