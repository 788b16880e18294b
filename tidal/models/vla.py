"""``vla``: a small vision-language-action transformer with token actions.

The sequence is ``[instruction words | state tokens | image patches | action queries | value
query]`` (the value query only when ``critic_detached`` is off). Every action dimension is one token over 256 bins spread evenly across the action
bounds (OpenVLA's discretisation). All ``num_action_chunks x action_dim`` action tokens are
decoded at once from learned queries with bidirectional attention (OpenVLA-OFT's parallel
decoding), so a chunk costs one forward pass. Log-probabilities are per token ``[B, C, A]``
(the loss sums them per action or per chunk when asked). An optional critic head for PPO
reads the trunk's pooled output, detached so that the value loss cannot move the actor
(``critic_detached``; off: a value query in the sequence, trained end to end). Evaluation's
deterministic action is each token's most likely bin (``greedy: argmax``) or the bin nearest its
distribution's mean (``greedy: mean``).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from tidal.envs.layout import layout_of
from tidal.models.policy import (
    EmbodiedPolicy,
    LeadingNorm,
    PolicyStep,
    register_action_bounds,
    register_policy,
    sample_categorical,
)


def mean_bin(logits: torch.Tensor) -> torch.Tensor:
    """The bin nearest the distribution's mean: bins are ordered values of one action
    dimension, so this is the Gaussian policy's deterministic action for binned actions."""
    bins = torch.arange(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    return (logits.softmax(-1) @ bins).round().long()


# the deterministic action (evaluation): argmax is OpenVLA's; mean is steadier when the bins'
# distribution is broad (BENCHMARKS.md, issue 14: button-press 0% -> 90% for the same weights)
GREEDY = {"argmax": lambda logits: logits.argmax(-1), "mean": mean_bin}


@register_policy("vla")
class TokenActionPolicy(EmbodiedPolicy):
    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        num_action_chunks: int = 1,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        num_bins: int = 256,
        state_tokens: int = 4,
        patch_size: int = 8,
        critic: bool = True,
        obs_norm: bool = False,
        dropout: float = 0.0,
        critic_detached: bool = True,
        greedy: str = "argmax",
    ):
        super().__init__()
        if greedy not in GREEDY:
            raise ValueError(
                f"model.kwargs.greedy: expected one of {', '.join(GREEDY)}, got {greedy!r}"
            )
        self.greedy = GREEDY[greedy]
        self.layout = layout = layout_of(observation_space)
        if not isinstance(action_space, gym.spaces.Box) or len(action_space.shape) != 1:
            raise ValueError(f"model 'vla': needs a flat Box action space, got {action_space}")
        if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError("model 'vla': action bins need finite action bounds")
        if layout.image_size and layout.image_size % patch_size:
            raise ValueError(
                f"model.patch_size: {patch_size} must divide env.image_size {layout.image_size}"
            )
        self.chunks, self.action_dim, self.num_bins = (
            num_action_chunks,
            action_space.shape[0],
            num_bins,
        )
        register_action_bounds(self, action_space)
        d = hidden_size
        self.words = (
            nn.Embedding(layout.vocab_size, d, padding_idx=0) if layout.num_tokens else None
        )
        self.state_tokens = state_tokens if layout.state_dim else 0
        self.state_proj = (
            nn.Linear(layout.state_dim, self.state_tokens * d) if self.state_tokens else None
        )
        self.patches = nn.Conv2d(3, d, patch_size, stride=patch_size) if layout.image_size else None
        num_patches = (layout.image_size // patch_size) ** 2 if layout.image_size else 0
        self.num_queries = self.chunks * self.action_dim
        self.action_queries = nn.Parameter(torch.randn(self.num_queries, d) * 0.02)
        # a value query attends to the trunk and the action queries attend to it: its loss
        # would move the actor. Detached, the critic reads the pooled trunk output instead.
        self.value_query = (
            nn.Parameter(torch.randn(1, d) * 0.02) if critic and not critic_detached else None
        )
        self.prefix = (
            layout.num_tokens + self.state_tokens + num_patches
        )  # tokens before the queries
        self.positions = nn.Parameter(
            torch.randn(self.prefix + self.num_queries + int(self.value_query is not None), d)
            * 0.02
        )
        layer = nn.TransformerEncoderLayer(
            d, num_heads, 4 * d, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.trunk = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.action_head = nn.Linear(d, num_bins)
        nn.init.zeros_(self.action_head.weight)  # start from uniform bins: maximal entropy
        nn.init.zeros_(self.action_head.bias)
        self.value_head = (
            nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1)) if critic else None
        )
        self.obs_norm = LeadingNorm(layout.state_dim) if obs_norm and layout.state_dim else None

    def shard_units(self) -> list[nn.Module]:
        return list(self.trunk.layers)  # the transformer blocks

    # -- the network ---------------------------------------------------------------------

    def _sequence(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings ``[B, L, d]`` and the padding mask ``[B, L]`` (True: ignore)."""
        parts, batch = self.layout.split(obs), obs.shape[0]
        seq, pad = [], []
        if self.words is not None:
            seq.append(self.words(parts["tokens"]))
            pad.append(parts["tokens"] == 0)
        if self.state_proj is not None:
            seq.append(self.state_proj(parts["state"]).view(batch, self.state_tokens, -1))
        if self.patches is not None:
            seq.append(self.patches(parts["image"] * 2.0 - 1.0).flatten(2).transpose(1, 2))
        seq.append(self.action_queries.expand(batch, -1, -1))
        if self.value_query is not None:
            seq.append(self.value_query.expand(batch, -1, -1))
        x = torch.cat(seq, 1) + self.positions
        mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        if pad:
            mask[:, : pad[0].shape[1]] = pad[0]
        return x, mask

    def _forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bin logits ``[B, C, A, bins]`` and values ``[B]`` (None without a critic)."""
        x, mask = self._sequence(obs)
        h = self.norm(self.trunk(x, src_key_padding_mask=mask))
        queries = h[:, self.prefix : self.prefix + self.num_queries]
        logits = self.action_head(queries).view(-1, self.chunks, self.action_dim, self.num_bins)
        return logits, self._values(h, mask)

    def _values(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        if self.value_head is None:
            return None
        if self.value_query is not None:
            return self.value_head(h[:, -1]).squeeze(-1)
        keep = (~mask).unsqueeze(-1).to(h.dtype)  # the mean over every token but padding
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.value_head(pooled.detach()).squeeze(-1)

    # -- the policy interface ------------------------------------------------------------

    def lora_targets(self) -> list[str]:
        """The trunk's feed-forward layers. Its attention is ``nn.MultiheadAttention``, whose
        projections are raw weights: PEFT adapts it by merging into them at every forward, which
        drifts the frozen base (no exact resume, no exact reference)."""
        return ["linear1", "linear2"]

    def lora_trained_modules(self) -> list[str]:
        """The bin head and the critic train whole (small, and the critic may start fresh)."""
        return [n for n in ("action_head", "value_head") if getattr(self, n) is not None]

    def act(self, inputs, deterministic=False) -> PolicyStep:
        logits, values = self._forward(inputs["obs"])
        dist = Categorical(logits=logits, validate_args=False)
        actions = self.greedy(logits) if deterministic else sample_categorical(logits)
        return PolicyStep(
            actions=actions, logprobs=dist.log_prob(actions), values=values, inputs=inputs
        )

    def evaluate(self, inputs, actions):
        logits, values = self._forward(inputs["obs"])
        dist = Categorical(logits=logits, validate_args=False)
        out = {"logprobs": dist.log_prob(actions.long()), "entropy": dist.entropy()}
        if values is not None:
            out["values"] = values
        return out

    def value(self, inputs) -> torch.Tensor:
        if self.value_head is None:
            raise ValueError("model.critic is false: this policy has no value head")
        return self._forward(inputs["obs"])[1]

    def _bin_width(self) -> torch.Tensor:
        return (self.high - self.low) / self.num_bins

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Each bin's centre."""
        return (self.low + (actions.float() + 0.5) * self._bin_width()).numpy(force=True)

    def policy_actions(self, env_actions: torch.Tensor) -> torch.Tensor:
        bins = torch.floor((env_actions.float() - self.low) / self._bin_width())
        return bins.clamp(0, self.num_bins - 1).long()
