"""The replay buffer of off-policy training: preallocated tensors on the actor rank, a ring of
``replay.capacity`` transitions, sampled uniformly, with an optional fixed set of
demonstrations sampled beside them (RLPD's symmetric sampling, ``replay.demo_fraction``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tidal.config import ConfigError

# a transition: what the critic's target needs (``steps``: actions of the chunk taken)
FIELDS = ("obs", "actions", "rewards", "terminations", "truncations", "next_obs", "steps")
DEMO_FIELDS = ("obs", "actions", "rewards", "terminations", "next_obs")


def buffer_layout(
    obs_dim: int, action_shape: tuple[int, ...]
) -> dict[str, tuple[tuple, torch.dtype]]:
    return {
        "obs": ((obs_dim,), torch.float32),
        "actions": (tuple(action_shape), torch.float32),
        "rewards": ((), torch.float32),
        "terminations": ((), torch.bool),
        "truncations": ((), torch.bool),
        "next_obs": ((obs_dim,), torch.float32),
        "steps": ((), torch.int64),
    }


PIXEL_SUFFIX = "_pixels"  # the stored uint8 image part of obs and next_obs


def storage_layout(layout: dict, image_numel: int) -> dict[str, tuple[tuple, torch.dtype]]:
    """What the buffer holds: ``layout``, with the trailing ``image_numel`` values of obs and
    next_obs (a packed observation's pixels, integers 0..255) stored apart as uint8, a quarter
    of their float32 size."""
    if not image_numel:
        return layout
    out = dict(layout)
    for key in ("obs", "next_obs"):
        (dim,), dtype = layout[key]
        out[key] = ((dim - image_numel,), dtype)
        out[key + PIXEL_SUFFIX] = ((image_numel,), torch.uint8)
    return out


class ReplayBuffer:
    """``image_numel``: observations end in that many pixel values, stored as uint8."""

    def __init__(
        self,
        capacity: int,
        obs_dim: int,
        action_shape: tuple[int, ...],
        device: torch.device | str = "cpu",
        image_numel: int = 0,
    ):
        self.capacity, self.device = capacity, torch.device(device)
        self.layout = buffer_layout(obs_dim, action_shape)
        self.image_numel = image_numel
        self.storage = storage_layout(self.layout, image_numel)
        self.data = {
            k: torch.zeros((capacity, *shape), dtype=dtype, device=self.device)
            for k, (shape, dtype) in self.storage.items()
        }
        self.pos = 0  # where the next transition goes
        self.size = 0  # transitions held (<= capacity)
        self.added = 0  # transitions ever added
        self.demos: dict[str, torch.Tensor] | None = None

    def add(self, batch: dict[str, torch.Tensor]) -> int:
        """Write a batch of transitions (every field ``[N, ...]``), wrapping around."""
        n = batch["rewards"].shape[0]
        if n == 0:
            return 0
        if n > self.capacity:  # only the newest fit
            batch = {k: v[-self.capacity :] for k, v in batch.items()}
            self.added += n - self.capacity
            n = self.capacity
        idx = (self.pos + torch.arange(n, device=self.device)) % self.capacity
        for key, (shape, _) in self.layout.items():
            value = batch[key]
            if tuple(value.shape[1:]) != shape:
                raise ValueError(
                    f"replay buffer: {key} of shape {tuple(value.shape[1:])}, expected {shape}"
                )
        for key, value in self._stored(batch).items():
            self.data[key][idx] = value.to(self.device, self.storage[key][1])
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)
        self.added += n
        return n

    def sample(
        self, batch_size: int, generator: torch.Generator, demo_fraction: float = 0.0
    ) -> dict[str, torch.Tensor]:
        """A uniform minibatch; with demonstrations, ``round(batch_size * demo_fraction)`` of it
        drawn from them."""
        demo_n = round(batch_size * demo_fraction) if self.demos is not None else 0
        # indices drawn by the (CPU) generator, so a run samples the same rows on any device
        online = torch.randint(0, self.size, (batch_size - demo_n,), generator=generator)
        out = self._unpacked({k: v[online.to(self.device)] for k, v in self.data.items()})
        if demo_n:
            size = self.demos["rewards"].shape[0]
            pick = torch.randint(0, size, (demo_n,), generator=generator).to(self.device)
            out = {k: torch.cat([out[k], self.demos[k][pick]]) for k in out}
        return out

    def load_demos(self, path: str) -> int:
        """Demonstration transitions from ``replay.demo_path`` (a ``.pt`` dict of tensors or an
        ``.npz``: obs, actions, rewards, terminations, next_obs; optional truncations, and steps:
        the env steps each took, by default the chunk's length)."""
        return self.set_demos(read_demos(path, self.layout))

    def set_demos(self, demos: dict[str, torch.Tensor]) -> int:
        """Demonstrations already in the buffer's layout (``fit_demos``)."""
        self.demos = {k: v.to(self.device) for k, v in demos.items()}
        return self.demos["rewards"].shape[0]

    def _stored(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch in the storage's fields (the pixels split off, rounded into uint8)."""
        if not self.image_numel:
            return batch
        out = dict(batch)
        for key in ("obs", "next_obs"):
            head, pixels = batch[key].split(
                [batch[key].shape[1] - self.image_numel, self.image_numel], 1
            )
            out[key], out[key + PIXEL_SUFFIX] = head, pixels.round().clamp(0, 255)
        return out

    def _unpacked(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stored rows back in the transition's fields (float observations)."""
        if not self.image_numel:
            return stored
        out = dict(stored)
        for key in ("obs", "next_obs"):
            pixels = out.pop(key + PIXEL_SUFFIX)
            out[key] = torch.cat([out[key], pixels.to(out[key].dtype)], 1)
        return out

    def summary(self) -> dict:
        """What the buffer holds: its size and whether every stored value is finite."""
        held = {k: v[: self.size] for k, v in self.data.items()}
        finite = all(bool(torch.isfinite(v).all()) for v in held.values() if v.is_floating_point())
        return {"size": self.size, "added": self.added, "finite": finite}

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self, with_data: bool) -> dict:
        state = {"pos": self.pos, "size": self.size, "added": self.added}
        if with_data:
            state["capacity"] = self.capacity
            state["data"] = {k: v[: self.size].cpu().clone() for k, v in self.data.items()}
        return state

    def load_state_dict(self, state: dict) -> bool:
        """Restore the position (and the data, when saved); returns whether the data was. Into
        another ``replay.capacity``, the newest transitions that fit come back oldest first
        (the ring's slots differ, so sampling does not repeat the saved run's)."""
        if "data" not in state:
            return False
        data, pos, size = state["data"], state["pos"], state["size"]
        if size and state.get("capacity", self.capacity) != self.capacity:
            kept = min(size, self.capacity)
            data = {k: v.roll(-(pos % size), 0)[size - kept :] for k, v in data.items()}
            pos, size = kept % self.capacity, kept
        for k, v in data.items():
            self.data[k][: v.shape[0]] = v.to(self.device)
        self.pos, self.size, self.added = pos, size, state["added"]
        return True


def read_demos(path: str, layout: dict) -> dict[str, torch.Tensor]:
    """The demo file as tensors in the buffer's layout, or a config error naming
    ``replay.demo_path`` and what does not fit."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"replay.demo_path: no file {path!r}")
    if file.suffix == ".npz":
        with np.load(file) as z:
            raw = {k: torch.from_numpy(z[k]) for k in z.files}
    else:
        raw = torch.load(file, weights_only=True)
    return fit_demos(raw, layout, f"replay.demo_path: {path!r}")


def fit_demos(raw: dict, layout: dict, source: str) -> dict[str, torch.Tensor]:
    """Demonstration transitions in the buffer's layout, or a config error naming ``source``
    (the key that supplied them) and what does not fit."""
    missing = [k for k in DEMO_FIELDS if k not in raw]
    if missing:
        raise ConfigError(f"{source} lacks {', '.join(missing)}")
    raw = dict(raw)
    n = raw["rewards"].shape[0]
    raw.setdefault("truncations", torch.zeros(n, dtype=torch.bool))
    chunk = layout["actions"][0][0]  # a chunk of actions took that many env steps, unless it ended
    raw.setdefault("steps", torch.full((n,), chunk, dtype=torch.int64))
    out = {}
    for key, (shape, dtype) in layout.items():
        value = torch.as_tensor(raw[key])
        if tuple(value.shape) != (n, *shape):
            raise ConfigError(
                f"{source}: {key} has shape {tuple(value.shape)}; this env and policy "
                f"need ({n}, {', '.join(map(str, shape))})"
            )
        if value.is_floating_point() and not (finite := torch.isfinite(value)).all():
            rows = (~finite).reshape(n, -1).any(1).nonzero().flatten()
            raise ConfigError(
                f"{source}: {key} is not finite in {len(rows)} of {n} transitions "
                f"(the first: {rows[0].item()})"
            )
        out[key] = value.to(dtype)
    return out
