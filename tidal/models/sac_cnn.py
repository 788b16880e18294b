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
from torch.nn import functional as F

from tidal.envs.layout import ObsLayout, layout_of
from tidal.models.cnn import conv_encoder
from tidal.models.policy import register_policy
from tidal.models.sac import ObsEncoder, SquashedGaussianPolicy, mlp


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
    """``sac_mlp``'s squashed-Gaussian head over an ``ObsEncoder`` with ``cnn``'s convolutions
    (and the instruction words and the state, when the observation carries them)."""

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
        self.layout = layout
        convs, conv_dim = conv_encoder(layout.image_size, tuple(channels), feature_dim)
        self.encoder = ObsEncoder(layout, word_dim, convs, conv_dim)
        self.obs_dim = self.encoder.out_dim  # what the critics read
        self.net = mlp(self.obs_dim, hidden_sizes, 2 * self.chunks * self.action_dim, activation)
