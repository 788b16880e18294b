"""``cnn``: an actor-critic over pixels (plus the state and a bag of instruction words when the
observation carries them), with the MLP actor-critic's heads and action distributions."""

from __future__ import annotations

import gymnasium as gym
import torch
from torch import nn

from tidal.envs.layout import ObsLayout, layout_of
from tidal.models.policy import EmbodiedPolicy, LeadingNorm, MLPActorCritic, register_policy


def conv_encoder(image_size: int, channels: tuple[int, ...], out_dim: int) -> tuple[nn.Module, int]:
    """Stride-2 3x3 convolutions (the image halves at each), flattened into ``out_dim``
    features: flattening keeps where things are, which reaching needs."""
    layers, width, size = [], 3, image_size
    for c in channels:
        layers += [nn.Conv2d(width, c, 3, stride=2, padding=1), nn.ReLU()]
        width, size = c, (size + 1) // 2
    layers += [nn.Flatten(), nn.Linear(width * size * size, out_dim), nn.ReLU()]
    return nn.Sequential(*layers), out_dim


def word_embedding(layout: ObsLayout, word_dim: int) -> tuple[nn.EmbeddingBag | None, int]:
    """The mean embedding of a layout's instruction words and its width (None, 0: no words)."""
    if not layout.num_tokens:
        return None, 0
    return nn.EmbeddingBag(layout.vocab_size, word_dim, mode="mean", padding_idx=0), word_dim


def packed_features(parts: dict, image_encoder: nn.Module | None, words) -> torch.Tensor:
    """A split observation (``ObsLayout.split``) as one feature vector: the image's features,
    the words' embedding, the state, those it has, concatenated in that order."""
    out = [] if image_encoder is None else [image_encoder(parts["image"])]
    if words is not None:
        out.append(words(parts["tokens"]))
    if "state" in parts:
        out.append(parts["state"])
    return torch.cat(out, -1)


@register_policy("cnn")
class CNNActorCritic(MLPActorCritic):
    """A shared encoder (convolutions over the image; the state and the mean embedding of the
    instruction words concatenated to its features) under the MLP actor-critic's heads.

    ``critic_detached``: the encoder learns from the actor's loss only (see ``_critic_value``).
    ``augment_shift``: behaviour cloning sees each image shifted by up to this many pixels
    (DrQ's random shift: pad by replicating the border, crop back at a random offset), which
    keeps a few demonstrations from being memorised pixel by pixel."""

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        num_action_chunks: int = 1,
        hidden_sizes: tuple[int, ...] = (256,),
        activation: str = "relu",
        critic: bool = True,
        obs_norm: bool = False,
        init_log_std: float = 0.0,
        squash: bool = False,
        channels: tuple[int, ...] = (32, 64, 64),
        feature_dim: int = 256,
        word_dim: int = 32,
        critic_detached: bool = True,
        augment_shift: int = 0,
    ):
        EmbodiedPolicy.__init__(self)
        self.critic_detached = critic_detached
        self.augment_shift = augment_shift
        self.layout = layout_of(observation_space)
        if not self.layout.image_size:
            raise ValueError(
                "model 'cnn': needs pixel observations (env.obs_mode pixels or state+pixels)"
            )
        self.encoder, width = conv_encoder(self.layout.image_size, tuple(channels), feature_dim)
        self.words, word_width = word_embedding(self.layout, word_dim)
        width += word_width + self.layout.state_dim
        self._init_heads(
            width,
            action_space,
            num_action_chunks,
            hidden_sizes,
            activation,
            critic,
            init_log_std,
            squash,
        )
        self.obs_norm = (
            LeadingNorm(self.layout.state_dim) if obs_norm and self.layout.state_dim else None
        )

    def features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return packed_features(self.layout.split(inputs["obs"]), self.encoder, self.words)

    def augment(self, raw_obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        pad = self.augment_shift
        if not pad:
            return raw_obs
        size, numel = self.layout.image_size, self.layout.image_numel
        head, pixels = raw_obs[:, :-numel], raw_obs[:, -numel:]
        images = pixels.reshape(-1, size, size, 3).movedim(-1, 1)
        padded = nn.functional.pad(images, (pad,) * 4, mode="replicate")
        dy, dx = torch.randint(0, 2 * pad + 1, (2, len(raw_obs)), generator=generator)
        rows = (dy[:, None] + torch.arange(size))[:, None, :, None]  # [B, 1, H, 1]
        cols = (dx[:, None] + torch.arange(size))[:, None, None, :]  # [B, 1, 1, W]
        batch = torch.arange(len(raw_obs))[:, None, None, None]
        channel = torch.arange(3)[None, :, None, None]
        shifted = padded[batch, channel, rows, cols]
        return torch.cat([head, shifted.movedim(1, -1).reshape(len(raw_obs), -1)], 1)
