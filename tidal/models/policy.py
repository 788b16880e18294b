"""Policies behind one interface, and the registry that builds them by name.

A policy acts on a batch of observations (``act``), re-evaluates stored inputs and actions
(``evaluate``) and values observations (``value``). Log-probabilities and entropies are per
action dimension, ``[B, C, A]`` (C actions per chunk, A dimensions per action; a discrete
action is one dimension), so the loss can work at token, action or chunk level.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Normal

from tidal.registry import Registry

POLICIES: Registry[Callable[..., EmbodiedPolicy]] = Registry("policy", "model.name")
register_policy = POLICIES.register


def build_policy(
    name: str,
    observation_space: gym.Space,
    action_space: gym.Space,
    num_action_chunks: int,
    **kwargs,
) -> EmbodiedPolicy:
    policy = POLICIES.get(name)(
        observation_space=observation_space,
        action_space=action_space,
        num_action_chunks=num_action_chunks,
        **kwargs,
    )
    # what `save_policy` writes so `load_policy` can rebuild it
    policy.build_spec = {
        "name": name,
        "observation_space": observation_space,
        "action_space": action_space,
        "num_action_chunks": num_action_chunks,
        "kwargs": kwargs,
    }
    return policy


def policy_arguments(name: str) -> set[str]:
    """The constructor arguments of a registered policy besides the spaces and chunk size:
    what config may pass it (each policy declares its own by its signature)."""
    import inspect

    params = inspect.signature(POLICIES.get(name)).parameters
    return set(params) - {"self", "observation_space", "action_space", "num_action_chunks"}


@dataclass
class PolicyStep:
    actions: torch.Tensor  # [B, C] (discrete) or [B, C, A] (continuous), the policy's own space
    logprobs: torch.Tensor  # [B, C, A]
    values: torch.Tensor | None  # [B]
    inputs: dict[str, torch.Tensor]  # what `evaluate` needs to recompute this step


class RunningNorm(nn.Module):
    """Running mean and variance of observations (Chan's parallel update), kept as buffers so
    they travel with the weights and the checkpoints."""

    def __init__(self, shape: tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, *self.mean.shape).to(torch.float64)
        batch_mean, batch_var, n = x.mean(0), x.var(0, correction=0), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var.copy_(
            (self.var * self.count + batch_var * n + delta**2 * self.count * n / total) / total
        )
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x - self.mean) / torch.sqrt(self.var + self.eps)
        return out.clamp(-self.clip, self.clip).to(x.dtype)


class LeadingNorm(RunningNorm):
    """A running normaliser of the first ``width`` values of each observation (the state part
    of a packed observation); the rest (tokens, pixels) passes through unchanged."""

    def __init__(self, width: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__((width,), clip, eps)
        self.width = width

    def update(self, x: torch.Tensor) -> None:
        super().update(x[..., : self.width])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x[..., : self.width]), x[..., self.width :]], -1)


class EmbodiedPolicy(nn.Module, abc.ABC):
    """The interface every embodied policy implements (MLP, CNN, VLA-style token policies)."""

    obs_norm: RunningNorm | None
    # methods the trainer calls besides forward: a sharded policy (actor.strategy=fsdp2)
    # gathers its parameters for them as for forward
    sharded_forward_methods: tuple[str, ...] = ("value",)

    def __init__(self):
        super().__init__()
        # None until a policy assigns its normaliser (then a registered sub-module). Not a
        # class attribute: nn.Module keeps sub-modules out of the instance __dict__, so a class
        # default would shadow the normaliser and every policy would skip normalisation.
        self.obs_norm = None

    def shard_units(self) -> list[nn.Module]:
        """The blocks actor.strategy=fsdp2 shards one by one (gathered in turn for compute);
        none: the whole policy is one unit."""
        return []

    def prepare(self, raw_obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the networks consume for these raw observations (normalised if enabled)."""
        obs = raw_obs.float()
        return {"obs": self.obs_norm(obs) if self.obs_norm is not None else obs}

    def augment(self, raw_obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Raw observations as behaviour cloning should see them (randomly perturbed, for
        policies that ask for augmentation); unchanged by default."""
        return raw_obs

    @abc.abstractmethod
    def act(self, inputs: dict[str, torch.Tensor], deterministic: bool = False) -> PolicyStep:
        """An action chunk for each input (sampled, or the mode when deterministic)."""

    @abc.abstractmethod
    def evaluate(
        self, inputs: dict[str, torch.Tensor], actions: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``logprobs`` and ``entropy`` ``[N, C, A]``, ``values`` ``[N]`` (if it has a critic)."""

    def forward(
        self, inputs: dict[str, torch.Tensor], actions: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Training entry point (what DDP wraps): the same as ``evaluate``."""
        return self.evaluate(inputs, actions)

    @abc.abstractmethod
    def value(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The critic's value of each input, ``[B]``."""

    @abc.abstractmethod
    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Actions as the env takes them, ``[B, C, ...]``."""

    def lora_targets(self) -> list[str]:
        """The layers ``model.lora`` adapts by default: every linear layer (a policy with a
        transformer names its attention and MLP layers)."""
        return sorted(
            {n.rsplit(".", 1)[-1] for n, m in self.named_modules() if isinstance(m, nn.Linear)}
        )

    def lora_trained_modules(self) -> list[str]:
        """Sub-modules trained whole beside the adapters (e.g. small heads); none by default."""
        return []

    def policy_actions(self, env_actions: torch.Tensor) -> torch.Tensor:
        """The inverse of ``env_actions``: env actions ``[B, C, ...]`` as this policy's own
        actions (what ``evaluate`` scores; behaviour cloning needs it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score env actions")

    def imitation_loss(
        self, inputs: dict[str, torch.Tensor], actions: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Behaviour cloning's loss on expert ``actions`` (this policy's own space) and its
        metrics: the negative log-likelihood, mean over action dimensions. A policy whose
        actions have no likelihood to maximise (flow matching) has its own."""
        out = self.evaluate(inputs, actions)
        loss = -out["logprobs"].mean()
        return loss, {"bc/loss": loss.item(), "bc/entropy": out["entropy"].mean().item()}

    # shared ``model`` fields a saved policy (``model.path``) takes from the run's config
    # rather than from its folder: settings of how it acts, not of what it learned
    run_settings: tuple[str, ...] = ()

    @classmethod
    def config_problems(cls, model, algorithm, action_space: gym.Space) -> list[tuple[str, str]]:
        """``(key, what is wrong)`` for each setting this policy cannot train with (``model``
        and ``algorithm``: the config's sections); preflight reports them as config errors."""
        return []


def register_action_bounds(module: nn.Module, action_space) -> None:
    """The Box's ``low`` and ``high`` as float32 buffers, copied: ``torch.as_tensor`` would share
    the space's arrays (read-only ones in the MuJoCo envs), and loading a checkpoint writes into
    the buffers."""
    for name in ("low", "high"):
        module.register_buffer(name, torch.tensor(getattr(action_space, name), dtype=torch.float32))


def sample_categorical(logits: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``logits`` ``[..., K]`` by the Gumbel-max trick, argmax(logits + G)
    with G = -log(E), E ~ Exp(1): the distribution of ``Categorical.sample``, at a tenth of its
    cost on the small batches of a chunk step (where that sample was a fifth of the policy's
    time). E is kept above zero so that a masked logit (-inf) is never drawn."""
    noise = torch.empty_like(logits).exponential_().clamp_min_(torch.finfo(logits.dtype).tiny)
    return (logits - noise.log()).argmax(-1)


def categorical_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """The entropy of normalised logits ``[..., K]`` (a masked, -inf logit adds nothing)."""
    finite = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    return -(finite * logprobs.exp()).sum(-1)


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def _mlp(
    n_in: int, hidden: list[int], n_out: int, activation: str, out_gain: float
) -> nn.Sequential:
    act = ACTIVATIONS.get(activation)
    if act is None:
        raise ValueError(f"model.activation: expected tanh, relu or gelu, got {activation!r}")
    layers, width = [], n_in
    for h in hidden:
        layers += [_layer(width, h, math.sqrt(2)), act()]
        width = h
    layers.append(_layer(width, n_out, out_gain))
    return nn.Sequential(*layers)


_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@register_policy("mlp")
class MLPActorCritic(EmbodiedPolicy):
    """Separate actor and critic MLPs (orthogonal init). Discrete actions: a categorical per
    chunk position. Continuous: a diagonal Gaussian with a learned, state-independent log-std,
    optionally squashed by tanh into the action bounds (with the change-of-variables term in
    the log-prob; the entropy reported is the Gaussian's, before squashing)."""

    critic_detached = False  # the MLP's features are the observation: nothing shared to guard

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        num_action_chunks: int = 1,
        hidden_sizes: tuple[int, ...] = (64, 64),
        activation: str = "tanh",
        critic: bool = True,
        obs_norm: bool = False,
        init_log_std: float = 0.0,
        squash: bool = False,
    ):
        super().__init__()
        if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
            raise ValueError(
                f"model 'mlp': needs a flat Box observation space, got {observation_space}"
            )
        obs_dim = observation_space.shape[0]
        self._init_heads(
            obs_dim,
            action_space,
            num_action_chunks,
            hidden_sizes,
            activation,
            critic,
            init_log_std,
            squash,
        )
        self.obs_norm = RunningNorm((obs_dim,)) if obs_norm else None

    def _init_heads(
        self,
        in_dim: int,
        action_space: gym.Space,
        num_action_chunks: int,
        hidden_sizes,
        activation: str,
        critic: bool,
        init_log_std: float,
        squash: bool,
    ) -> None:
        """Actor and critic MLPs over ``in_dim`` features (what ``features`` returns)."""
        self.chunks = num_action_chunks
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            self.num_actions, self.action_dim = int(action_space.n), 1
            out = self.chunks * self.num_actions
        elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
            self.action_dim = action_space.shape[0]
            out = self.chunks * self.action_dim
            self.log_std = nn.Parameter(
                torch.full((self.chunks, self.action_dim), float(init_log_std))
            )
            register_action_bounds(self, action_space)
        else:
            raise ValueError(
                f"model 'mlp': needs a Discrete or flat Box action space, got {action_space}"
            )
        self.squash = squash and not self.discrete
        self.actor = _mlp(in_dim, list(hidden_sizes), out, activation, 0.01)
        self.critic = _mlp(in_dim, list(hidden_sizes), 1, activation, 1.0) if critic else None

    def features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the actor and critic heads read (the observation itself, for the MLP)."""
        return inputs["obs"]

    def _dist(self, obs: torch.Tensor):
        """Discrete: normalised logits ``[B, C, K]`` (a few tensor ops instead of a
        ``Categorical``, whose construction and ``log_prob`` cost more than the MLP on the
        batches of a chunk step). Continuous: a ``Normal``."""
        head = self.actor(obs)
        if self.discrete:
            return head.view(-1, self.chunks, self.num_actions).log_softmax(-1)
        mean = head.view(-1, self.chunks, self.action_dim)
        return Normal(mean, self.log_std.exp().expand_as(mean), validate_args=False)

    def _logprob(self, dist, actions: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return dist.gather(-1, actions.long().unsqueeze(-1))
        logp = dist.log_prob(actions)
        return logp - self._squash_log_det(actions) if self.squash else logp

    def _squash_log_det(self, actions: torch.Tensor) -> torch.Tensor:
        """a = tanh(u) mapped into the bounds: log p(a) = log p(u) - this, stably."""
        tanh_term = 2.0 * (math.log(2.0) - actions - torch.nn.functional.softplus(-2.0 * actions))
        return tanh_term + torch.log((self.high - self.low) / 2.0)

    def _sample_gaussian(self, obs: torch.Tensor, deterministic: bool):
        """Actions ``u = mean + std * eps`` and their log-probs. Drawn by hand, the log-prob is
        ``-eps^2 / 2 - log std - log sqrt(2 pi)``, with no second pass over ``u``: a third of
        ``Normal``'s ``sample`` plus ``log_prob`` on a chunk step's batch (measured 9 against
        28 us for 16 rows, ~3% of a HalfCheetah env step). The mode: ``eps = 0``. With autograd
        on, ``Normal``'s: a sample carries no gradient, its log-prob the full one."""
        if torch.is_grad_enabled():
            dist = self._dist(obs)
            actions = dist.mean if deterministic else dist.sample()
            return actions, self._logprob(dist, actions)
        mean = self.actor(obs).view(-1, self.chunks, self.action_dim)
        noise = torch.zeros_like(mean) if deterministic else torch.randn_like(mean)
        actions = torch.addcmul(mean, self.log_std.exp(), noise)
        logp = noise.square().mul_(-0.5).sub_(self.log_std + _LOG_SQRT_2PI)
        return actions, logp - self._squash_log_det(actions) if self.squash else logp

    def act(self, inputs, deterministic=False) -> PolicyStep:
        obs = self.features(inputs)
        if self.discrete:
            logits = self._dist(obs)
            actions = logits.argmax(-1) if deterministic else sample_categorical(logits)
            logprobs = self._logprob(logits, actions)
        else:
            actions, logprobs = self._sample_gaussian(obs, deterministic)
        values = self._critic_value(obs) if self.critic is not None else None
        return PolicyStep(actions=actions, logprobs=logprobs, values=values, inputs=inputs)

    def evaluate(self, inputs, actions):
        obs = self.features(inputs)
        dist = self._dist(obs)
        out = {
            "logprobs": self._logprob(dist, actions),
            "entropy": categorical_entropy(dist).unsqueeze(-1) if self.discrete else dist.entropy(),
        }
        if self.critic is not None:
            out["values"] = self._critic_value(obs)
        return out

    def value(self, inputs) -> torch.Tensor:
        if self.critic is None:
            raise ValueError("model.critic is false: this policy has no value head")
        return self._critic_value(self.features(inputs))

    def _critic_value(self, features: torch.Tensor) -> torch.Tensor:
        """The critic over the shared features. A policy whose features are learned (an encoder
        shared with the actor) sets ``critic_detached``: the value loss then trains only the
        critic's own layers, so it cannot reshape what the actor sees (a critic still learning
        the value scale would otherwise wreck a cloned policy's features, even during
        ``critic_warmup_steps``)."""
        return self.critic(features.detach() if self.critic_detached else features).squeeze(-1)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        if self.discrete:
            return actions.numpy(force=True)
        if self.squash:
            return (self.low + (torch.tanh(actions) + 1.0) * 0.5 * (self.high - self.low)).numpy(
                force=True
            )
        return actions.clamp(self.low, self.high).numpy(force=True)

    def policy_actions(self, env_actions: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return env_actions.long()
        if self.squash:  # the inverse of the squash, kept off the asymptotes
            unit = (2.0 * (env_actions - self.low) / (self.high - self.low) - 1.0).clamp(
                -0.999, 0.999
            )
            return torch.atanh(unit)
        return env_actions.float()
