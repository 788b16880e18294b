"""``sac_cnn``: SAC from pixels as DrQ does it (Kostrikov et al. 2020; Yarats et al. 2021).

One convolutional encoder (``cnn``'s ``conv_encoder``), owned by the policy so that weight syncs
carry it to the rollout, serves the actor and the critics. The critics' loss trains it; the
actor's head reads its features detached, so the actor's loss never reaches it. The target
critics read the online encoder's features (no gradient) as DrQ-v2 does, rather than keeping
a Polyak copy of it as DrQ-v1 does: one encoder pass over ``next_obs`` then serves both the
next actions and the target Q, and the encoder passes are most of an update's cost.

``random_shift`` is DrQ-v2's ``RandomShiftsAug``: pad by replicating the border, then crop back
at a random integer offset per image, by ``F.grid_sample`` at exact pixel centres.
"""

from __future__ import annotations

import gymnasium as gym
import torch
from torch import nn
from torch.nn import functional as F

from tidal.envs.layout import ObsLayout, layout_of
from tidal.models.cnn import conv_encoder
from tidal.models.policy import register_policy
from tidal.models.sac import SquashedGaussianPolicy, mlp


class PixelEncoder(nn.Module):
    """Convolutions over the image; the mean embedding of the instruction words and the state
    (when the observation carries them) concatenated to its features: ``[B, out_dim]``."""

    def __init__(self, layout: ObsLayout, channels, feature_dim: int, word_dim: int):
        super().__init__()
        self.layout = layout
        self.convs, self.out_dim = conv_encoder(layout.image_size, tuple(channels), feature_dim)
        self.words = None
        if layout.num_tokens:
            self.words = nn.EmbeddingBag(layout.vocab_size, word_dim, mode="mean", padding_idx=0)
            self.out_dim += word_dim
        self.out_dim += layout.state_dim

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        parts = self.layout.split(obs)
        out = [self.convs(parts["image"])]
        if self.words is not None:
            out.append(self.words(parts["tokens"]))
        if "state" in parts:
            out.append(parts["state"])
        return torch.cat(out, -1)


def random_shift(images: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Each image of ``[B, C, H, H]`` translated by its own integer offset in ``[-pad, pad]``
    along each axis, the border replicated into the gap (DrQ-v2's ``RandomShiftsAug``). The
    offsets are drawn by ``generator`` (CPU), so a run shifts alike on any device."""
    if pad == 0:
        return images
    b, _, h, w = images.shape
    if h != w:
        raise ValueError(f"random_shift: needs square images, got {h}x{w}")
    padded = F.pad(images, (pad,) * 4, mode="replicate")
    # the centres of the crop's pixels in the padded image's [-1, 1] coordinates
    eps = 1.0 / (h + 2 * pad)
    arange = torch.linspace(-1.0 + eps, 1.0 - eps, h + 2 * pad, device=images.device)[:h]
    base = torch.stack(torch.meshgrid(arange, arange, indexing="xy"), -1)  # [H, W, (x, y)]
    shift = torch.randint(0, 2 * pad + 1, (b, 1, 1, 2), generator=generator)
    grid = base + shift.to(images.device, images.dtype) * (2.0 / (h + 2 * pad))
    return F.grid_sample(padded, grid, padding_mode="zeros", align_corners=False)


def shift_observations(obs: torch.Tensor, layout: ObsLayout, pad: int, generator) -> torch.Tensor:
    """Packed observations ``[B, size]`` with their images randomly shifted; state and tokens
    unchanged."""
    if pad == 0 or not layout.image_size:
        return obs
    size, numel = layout.image_size, layout.image_numel
    head, pixels = obs[:, :-numel], obs[:, -numel:]
    images = pixels.reshape(-1, size, size, 3).movedim(-1, 1)
    shifted = random_shift(images, pad, generator).movedim(1, -1).reshape(len(obs), numel)
    return torch.cat([head, shifted], 1)


@register_policy("sac_cnn")
class PixelSquashedGaussianPolicy(SquashedGaussianPolicy):
    """``sac_mlp``'s squashed-Gaussian head over ``PixelEncoder`` features. ``encode`` gives the
    features the critics read (with the encoder's gradient); ``sample_features`` and ``act``
    run the head on them detached (the actor's loss does not train the encoder)."""

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        num_action_chunks: int = 1,
        hidden_sizes: tuple[int, ...] = (256, 256),
        activation: str = "relu",
        channels: tuple[int, ...] = (32, 64, 64),
        feature_dim: int = 256,
        word_dim: int = 32,
    ):
        layout = layout_of(observation_space)
        if not layout.image_size:
            raise ValueError(
                "model 'sac_cnn': needs pixel observations (env.obs_mode pixels or "
                f"state+pixels), got {observation_space}"
            )
        # the base checks the action space; its MLP over the raw observation is replaced
        flat = gym.spaces.Box(-1.0, 1.0, (1,))
        super().__init__(flat, action_space, num_action_chunks, (), activation)
        self.encoder = PixelEncoder(layout, channels, feature_dim, word_dim)
        self.obs_dim = self.encoder.out_dim  # what the critics read
        self.net = mlp(self.obs_dim, hidden_sizes, 2 * self.chunks * self.action_dim, activation)

    @property
    def layout(self) -> ObsLayout:
        return self.encoder.layout

    def encode(self, obs: torch.Tensor) -> torch.Tensor:
        return self.encoder(obs)

    def encoder_parameters(self) -> list[nn.Parameter]:
        return list(self.encoder.parameters())

    def _head(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super()._head(self.encoder(obs).detach())

    def sample_features(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample_from(*super()._head(features.detach()))
