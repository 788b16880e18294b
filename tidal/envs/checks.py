"""Non-finite values where they enter: an env's observations and rewards, a reward model's
rewards. One NaN would otherwise poison a whole training step (every optimizer step of it
skipped) or crash the policy's sampling without naming the env."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from tidal.data import EnvOutput

log = logging.getLogger("tidal.envs")
LABELS = {"obs": "observation", "final_obs": "final observation", "rewards": "reward"}


class NonFiniteEnvError(RuntimeError):
    """An env copy kept returning non-finite values (``env.max_nonfinite_steps`` in a row)."""


def nonfinite_rows(x: torch.Tensor | None) -> torch.Tensor | None:
    """``[B]`` bool: the rows of ``x`` that hold a NaN or an infinity (None: nothing to check)."""
    if x is None or not x.is_floating_point():
        return None
    return ~torch.isfinite(x).reshape(x.shape[0], -1).all(1)


class NonFiniteGuard:
    """The env copies of one pipeline stage of one env rank: names every non-finite value with
    the env rank, the env's global index and the step, replaces it by zero (the caller restarts
    the copy and masks its samples up to that step), and aborts once a copy has returned
    non-finite values ``limit`` chunk steps in a row. Cheap when all is finite: one reduction
    per field (it runs on every chunk step)."""

    def __init__(self, rank: int, first_env: int, num_envs: int, limit: int):
        self.rank, self.first_env, self.limit = rank, first_env, limit
        self.streak = np.zeros(num_envs, dtype=np.int64)
        self.found = 0  # (env, chunk step) pairs with a non-finite value, since the last drain

    def check(self, out: EnvOutput, fields: tuple[str, ...], source: str, where: str) -> np.ndarray:
        """Zero the non-finite entries of ``out``'s ``fields`` (new tensors: the old ones may be
        shared); returns ``[B]`` bool: the copies that had one. ``where`` names the step (e.g.
        "training step 3, chunk step 5")."""
        bad = np.zeros(len(self.streak), dtype=bool)
        for field in fields:
            x = getattr(out, field)
            if x is None or not x.is_floating_point() or _all_finite(x):
                continue
            rows = nonfinite_rows(x).numpy()
            setattr(out, field, torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype)))
            for i in np.flatnonzero(rows):
                log.warning(
                    "env rank %d, env %d: non-finite %s from the %s at %s (%s)",
                    self.rank,
                    self.first_env + i,
                    LABELS[field],
                    source,
                    where,
                    _show(x[i]),
                )
            bad |= rows
        return bad

    def count(self, bad: np.ndarray, where: str) -> None:
        """One chunk step done: a copy with ``limit`` bad steps in a row ends the run."""
        if not bad.any() and not self.streak.any():
            return
        self.streak = np.where(bad, self.streak + 1, 0)
        self.found += int(bad.sum())
        worst = int(self.streak.argmax())
        if self.streak[worst] >= self.limit:
            raise NonFiniteEnvError(
                f"env rank {self.rank}, env {self.first_env + worst}: non-finite observations or "
                f"rewards {self.streak[worst]} chunk steps in a row (up to {where}; "
                f"env.max_nonfinite_steps={self.limit})"
            )

    def drain(self) -> int:
        found, self.found = self.found, 0
        return found


def _all_finite(x: torch.Tensor) -> bool:
    """By NumPy, a few times cheaper than torch on the small tensors of one chunk step: the
    minimum and the maximum are finite exactly when every value is (a NaN carries through
    both, an infinity is one of them), and two reductions make no temporary array."""
    if not x.is_cpu or x.dtype == torch.bfloat16:  # NumPy has no view of these
        return bool(torch.isfinite(x).all())
    values = x.detach().numpy()
    return values.size == 0 or (math.isfinite(values.min()) and math.isfinite(values.max()))


def _show(row: torch.Tensor) -> str:
    flat = row.flatten()
    bad = flat[~torch.isfinite(flat)]
    return f"{len(bad)} of {flat.numel()} values, e.g. {bad[0].item()}"
