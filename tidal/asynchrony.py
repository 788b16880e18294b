"""Admission control for asynchronous rollouts, bounded by policy staleness: the one staleness
manager of both halves (language episodes in tidal.rollout's dispatcher, embodied trajectory
segments in tidal.runners.embodied.pacer), and its run's owner of the trainer's weight version.

With trainer version ``v``, consumer batch size ``b`` and ``eta = max_staleness``, at most
``(eta + v + 1) * b`` samples may ever be accepted or running: a sample admitted now is
consumed by a training step at most ``eta`` versions after the one it started under.
``eta = 0`` is synchronous RL. A "rollout" is whatever the consumer counts its batch in: a
language episode, or an embodied trajectory segment (one env's chunk steps of one training
step; the hooks take a count, a whole collection at once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RolloutStat:
    enqueued: int = 0
    running: int = 0
    accepted: int = 0
    rejected: int = 0


class StalenessManager:
    def __init__(
        self,
        max_staleness: int,
        consumer_batch_size: int,
        max_concurrent_rollouts: int,
        version_provider: Callable[[], int] | None = None,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        if consumer_batch_size < 1 or max_concurrent_rollouts < 1:
            raise ValueError("consumer_batch_size and max_concurrent_rollouts must be >= 1")
        self.max_staleness = max_staleness
        self.consumer_batch_size = consumer_batch_size
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self._version_provider = version_provider
        self._version = 0
        self.stat = RolloutStat()
        self.lock = threading.Lock()

    # the trainer's version ------------------------------------------------------------

    def set_version(self, version: int) -> None:
        with self.lock:
            self._version = version

    def get_version(self) -> int:
        return self._version_provider() if self._version_provider is not None else self._version

    def restore(self, version: int) -> None:
        """After resuming at ``version``: that many full batches were consumed."""
        with self.lock:
            self._version = version
            self.stat = RolloutStat(accepted=version * self.consumer_batch_size)

    # capacity -------------------------------------------------------------------------

    def get_capacity(self) -> int:
        """New rollouts that may start now (may be negative: over budget)."""
        with self.lock:
            version = self.get_version()
            concurrency = self.max_concurrent_rollouts - self.stat.running
            staleness = (self.max_staleness + version + 1) * self.consumer_batch_size - (
                self.stat.accepted + self.stat.running
            )
            return min(concurrency, staleness)

    # hooks ----------------------------------------------------------------------------

    def on_rollout_enqueued(self, count: int = 1) -> None:
        with self.lock:
            self.stat.enqueued += count

    def on_rollout_submitted(self, count: int = 1) -> None:
        with self.lock:
            self.stat.enqueued -= count
            self.stat.running += count

    def on_rollout_accepted(self, count: int = 1) -> None:
        with self.lock:
            self.stat.running -= count
            self.stat.accepted += count

    def on_rollout_rejected(self, count: int = 1) -> None:
        with self.lock:
            self.stat.running -= count
            self.stat.rejected += count

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "enqueued": self.stat.enqueued,
                "running": self.stat.running,
                "accepted": self.stat.accepted,
                "rejected": self.stat.rejected,
            }
