"""Packed observations: state, instruction tokens and pixels in one flat float vector.

Everything downstream of an env (chunked stepping, channels, trajectories, batch split/merge,
the observation normaliser) moves one tensor per env. An adapter that offers more than a state
vector packs ``[state | instruction tokens | pixels (H*W*3, values 0..255)]`` into that vector
and describes the packing with an ``ObsLayout`` carried by its observation space
(``LayoutBox``); a policy that knows about layouts unpacks it, any other sees a flat Box.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import asdict, dataclass

import gymnasium as gym
import numpy as np
import torch

PAD_TOKEN = 0


@dataclass(frozen=True)
class ObsLayout:
    state_dim: int = 0
    num_tokens: int = 0  # instruction token ids (0 pads)
    vocab_size: int = 0
    image_size: int = 0  # square RGB images; 0: no pixels

    @property
    def image_numel(self) -> int:
        return self.image_size * self.image_size * 3

    @property
    def size(self) -> int:
        return self.state_dim + self.num_tokens + self.image_numel

    def split(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """``obs`` ``[B, size]`` -> ``state`` ``[B, S]``, ``tokens`` ``[B, L]`` (long),
        ``image`` ``[B, 3, H, W]`` in [0, 1]; parts the layout lacks are absent."""
        if obs.shape[-1] != self.size:
            raise ValueError(
                f"observation has {obs.shape[-1]} values, the layout {self} needs {self.size}"
            )
        state, tokens, pixels = torch.split(
            obs, [self.state_dim, self.num_tokens, self.image_numel], -1
        )
        out = {}
        if self.state_dim:
            out["state"] = state
        if self.num_tokens:
            out["tokens"] = tokens.round().long()
        if self.image_size:
            hwc = pixels.reshape(*obs.shape[:-1], self.image_size, self.image_size, 3)
            out["image"] = hwc.movedim(-1, -3) / 255.0
        return out

    def to_dict(self) -> dict:
        return asdict(self)


class LayoutBox(gym.spaces.Box):
    """A flat float32 Box whose values follow ``layout``."""

    def __init__(self, layout: ObsLayout, seed: int | None = None):
        low = np.concatenate(
            [np.full(layout.state_dim, -np.inf), np.zeros(layout.num_tokens + layout.image_numel)]
        )
        high = np.concatenate(
            [
                np.full(layout.state_dim, np.inf),
                np.full(layout.num_tokens, layout.vocab_size - 1),
                np.full(layout.image_numel, 255.0),
            ]
        )
        super().__init__(
            low.astype(np.float32), high.astype(np.float32), dtype=np.float32, seed=seed
        )
        self.layout = layout

    def __repr__(self) -> str:
        return f"LayoutBox({self.layout})"


def layout_of(space: gym.Space) -> ObsLayout:
    """The layout of a packed observation space; a plain flat Box is all state."""
    layout = getattr(space, "layout", None)
    if layout is not None:
        return layout
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 1:
        return ObsLayout(state_dim=space.shape[0])
    raise ValueError(f"needs a flat Box observation space (or a LayoutBox), got {space}")


def tokenize(text: str, length: int, vocab_size: int) -> np.ndarray:
    """Lower-cased words hashed (CRC32, stable across processes) into ids ``1..vocab_size-1``,
    padded with 0 or cut to ``length``. Needs no vocabulary file, so any instruction works."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    ids = [
        1 + zlib.crc32(w.encode()) % (vocab_size - 1)
        for w in re.findall(r"[a-z0-9]+", text.lower())
    ]
    out = np.full(length, PAD_TOKEN, dtype=np.int64)
    out[: min(length, len(ids))] = ids[:length]
    return out
