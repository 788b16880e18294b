"""Asynchronous embodied collection: the env and rollout groups collect the next training
steps' trajectories while the actor trains, admitted by the ``StalenessManager`` both halves use
(tidal.asynchrony).

A *collection* is one ``rollout.num_steps`` epoch of every env; it counts as ``total_num_envs``
trajectory segments (env x steps). Collections run one at a time (an env rank steps one epoch
at a time) and queue, in order, in the actor channel; the actor trains on the oldest. The
training step that consumes a collection is known when it finishes: ``consumed`` steps were
trained, ``len(queue)`` collections wait before it. What happens to a collection that would be
trained more than ``eta`` versions after the version it started under is ``staleness_policy``:

- ``wait`` (default): admission holds collection back until the actor catches up, so none does;
- ``drop``: collection never waits; such a collection is dropped (the actor receives and
  discards it) and counted as rejected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.asynchrony import StalenessManager
from tidal.runtime import Handle, wait_all

POLL_S = 0.005  # how often the runner looks at a running collection while the actor works


@dataclass
class Collected:
    results: list[list[Any]]  # the collection handles' per-rank results
    started_at: int  # the trainer's version when it was admitted
    dropped: bool = False


class Collection:
    def __init__(
        self,
        staleness: StalenessManager,
        segments: int,
        policy: str,
        start: Callable[[], list[Handle]],
        timeout: float,
    ):
        self.staleness, self.segments, self.policy = staleness, segments, policy
        self._start, self.timeout = start, timeout
        self.queue: deque[Collected] = deque()  # finished, not yet trained on, in channel order
        self.running: list[Handle] | None = None
        self.started_at = 0
        self.consumed = 0  # collections trained on (or discarded): the next one's position

    # -- admission ------------------------------------------------------------------------

    def admit(self) -> None:
        """Start the next collection if none runs and admission allows it."""
        if self.running is not None:
            return
        if self.policy == "wait" and self.staleness.get_capacity() < self.segments:
            return
        self.staleness.on_rollout_enqueued(self.segments)
        self.staleness.on_rollout_submitted(self.segments)
        self.started_at = self.staleness.get_version()
        self.running = self._start()

    def _finish(self) -> None:
        results = wait_all(self.running, self.timeout)
        self.running = None
        trained_at = self.consumed + sum(not c.dropped for c in self.queue)
        too_stale = trained_at - self.started_at > self.staleness.max_staleness
        dropped = self.policy == "drop" and too_stale
        if dropped:
            self.staleness.on_rollout_rejected(self.segments)
        else:
            self.staleness.on_rollout_accepted(self.segments)
        self.queue.append(Collected(results, self.started_at, dropped))

    # -- what the runner calls ------------------------------------------------------------

    def poll(self) -> None:
        """Take a finished collection and admit the next (called while the actor works)."""
        if self.running is not None and all(h.done() for h in self.running):
            self._finish()
        self.admit()

    def wait_polling(self, handles: list[Handle]) -> list[list[Any]]:
        """Wait for the actor's ``handles`` (within the timeout) while collection goes on."""
        return wait_all(handles, self.timeout, between=self.poll, every=POLL_S)

    def next(self) -> Collected:
        """The oldest finished collection, dropped or not (waits for one); the next collection
        is admitted at once, so it overlaps training."""
        self.admit()
        if not self.queue:
            if self.running is None:
                raise RuntimeError(
                    "asynchronous collection: nothing queued and admission holds collection "
                    f"back ({self.staleness.snapshot()}, version {self.staleness.get_version()})"
                )
            self._finish()
        item = self.queue.popleft()
        if not item.dropped:
            self.consumed += 1
        self.admit()
        return item

    def drain(self) -> None:
        """Let the running collection finish (before an evaluation, a checkpoint or closing)."""
        if self.running is not None:
            self._finish()
