"""Non-finite values where they enter: an env's observations and rewards, a reward model's
rewards. One NaN would otherwise poison a whole training step (every optimizer step of it
skipped) or crash the policy's sampling without naming the env."""

from __future__ import annotations

import logging

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
    non-finite values ``limit`` chunk steps in a row."""

    def __init__(self, rank: int, first_env: int, num_envs: int, limit: int):
        self.rank, self.first_env, self.limit = rank, first_env, limit
        self.streak = torch.zeros(num_envs, dtype=torch.int64)
        self.found = 0  # (env, chunk step) pairs with a non-finite value, since the last drain

    def check(
        self, out: EnvOutput, fields: tuple[str, ...], source: str, where: str
    ) -> torch.Tensor:
        """Zero the non-finite entries of ``out``'s ``fields`` (in place of the tensors, not in
        them: they may be shared); returns ``[B]`` bool: the copies that had one. ``where``
        names the step (e.g. "training step 3, chunk step 5")."""
        bad = torch.zeros_like(self.streak, dtype=torch.bool)
        for field in fields:
            x = getattr(out, field)
            rows = nonfinite_rows(x)
            if rows is None or not rows.any():
                continue
            setattr(out, field, torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype)))
            for i in rows.nonzero().flatten().tolist():
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

    def count(self, bad: torch.Tensor, where: str) -> None:
        """One chunk step done: a copy with ``limit`` bad steps in a row ends the run."""
        self.streak = torch.where(bad, self.streak + 1, torch.zeros_like(self.streak))
        self.found += int(bad.sum())
        worst = int(self.streak.argmax())
        if int(self.streak[worst]) >= self.limit:
            raise NonFiniteEnvError(
                f"env rank {self.rank}, env {self.first_env + worst}: non-finite observations or "
                f"rewards {int(self.streak[worst])} chunk steps in a row (up to {where}; "
                f"env.max_nonfinite_steps={self.limit})"
            )

    def drain(self) -> int:
        found, self.found = self.found, 0
        return found


def _show(row: torch.Tensor) -> str:
    flat = row.flatten()
    bad = flat[~torch.isfinite(flat)]
    return f"{len(bad)} of {flat.numel()} values, e.g. {bad[0].item()}"
