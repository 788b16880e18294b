"""Asynchronous embodied collection: the env and rollout groups collect while the actor works,
one collection at a time, paced by an admission policy.

A *collection* is what the runner's ``start`` begins (one ``rollout.num_steps`` epoch or segment
of every env); finished ones queue in order until the runner takes them. The ``Pacer`` admits
the next collection whenever none runs and its ``Admission`` allows it, and never polls: it
blocks on whichever call finishes first (the running collection's or the actor's), within
``runner.timeout_s``. Two admissions:

- ``StalenessBudget`` (asynchronous PPO, ``rollout.max_staleness`` = eta > 0): the
  ``StalenessManager`` both halves use (tidal.asynchrony) counts a collection as ``segments``
  trajectory segments; none is trained more than eta versions after the version it started
  under. ``rollout.staleness_policy`` ``wait`` holds collection back until the actor catches up;
  ``drop`` never waits and drops (the actor receives and discards) a collection too stale.
- ``UpdateLead`` (SAC): after the warm-up ``U(E) = floor(utd_ratio * (E - warmup))`` updates are
  owed for ``E`` env steps collected; collection starts while it leads the updates done by at
  most ``replay.max_lead`` env steps.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tidal.asynchrony import StalenessManager
from tidal.runtime import Handle, wait_all, wait_any


@dataclass
class Collected:
    results: list[list[Any]]  # the collection handles' per-rank results
    started_at: int  # the admission's stamp when it started (PPO: the trainer's version)
    dropped: bool = False


class Admission(Protocol):
    def may_start(self) -> bool:
        """Whether the next collection may start now."""

    def started(self) -> int:
        """A collection starts: count it; its stamp (``Collected.started_at``)."""

    def finished(self, item: Collected) -> None:
        """A collection finished (count it; mark it ``dropped`` to have it discarded)."""

    def taken(self, item: Collected) -> None:
        """The runner took a finished collection to train on."""

    def describe(self) -> str:
        """Its counters, for an error that says why collection is held back."""


class Pacer:
    def __init__(self, admission: Admission, start: Callable[[], list[Handle]], timeout: float):
        self.admission, self._start, self.timeout = admission, start, timeout
        self.queue: deque[Collected] = deque()  # finished, not yet taken, in order
        self.running: list[Handle] | None = None
        self._stamp = 0

    def admit(self) -> None:
        """Start the next collection if none runs and admission allows it."""
        if self.running is None and self.admission.may_start():
            self._stamp = self.admission.started()
            self.running = self._start()

    def advance(self, others: list[Handle], deadline: float | None = None) -> None:
        """Block until the running collection or one of ``others`` (the actor's calls)
        finishes; a finished collection is queued and the next admitted. Past ``deadline``
        (default: ``timeout`` from now) the first call still pending is named."""
        self.admit()
        if not any(h.done() for h in others):
            watched = others + (self.running or [])
            if not watched:
                raise RuntimeError(
                    "asynchronous collection: nothing runs and admission holds collection back "
                    f"({self.admission.describe()})"
                )
            left = self.timeout if deadline is None else deadline - time.monotonic()
            wait_any(watched, left, self.timeout)
        if self.running is not None and all(h.done() for h in self.running):
            self._finish()
            self.admit()

    def wait(self, handles: list[Handle]) -> list[list[Any]]:
        """The actor's ``handles``' results (within the timeout) while collection goes on."""
        deadline = time.monotonic() + self.timeout
        while not all(h.done() for h in handles):
            self.advance(handles, deadline)
        return wait_all(handles, self.timeout)

    def next(self) -> Collected:
        """The oldest finished collection, dropped or not (waits for one); the next collection
        is admitted at once, so it overlaps training."""
        while not self.queue:
            self.advance([])
        item = self.queue.popleft()
        self.admission.taken(item)
        self.admit()
        return item

    def take_finished(self) -> list[Collected]:
        """Every finished collection not taken yet, oldest first."""
        items, self.queue = list(self.queue), deque()
        for item in items:
            self.admission.taken(item)
        return items

    def drain(self) -> None:
        """Let the running collection finish and admit none (before an evaluation, a checkpoint
        or closing)."""
        if self.running is not None:
            self._finish()

    def _finish(self) -> None:
        results = wait_all(self.running, self.timeout)
        self.running = None
        item = Collected(results, self._stamp)
        self.admission.finished(item)
        self.queue.append(item)


class StalenessBudget:
    """Admission in trajectory segments by the ``StalenessManager`` (asynchronous PPO)."""

    def __init__(self, staleness: StalenessManager, segments: int, policy: str):
        self.staleness, self.segments, self.policy = staleness, segments, policy
        self.consumed = 0  # collections trained on: the next one's position
        self.waiting = 0  # finished collections queued to be trained (not dropped)

    def may_start(self) -> bool:
        return self.policy == "drop" or self.staleness.get_capacity() >= self.segments

    def started(self) -> int:
        self.staleness.on_rollout_enqueued(self.segments)
        self.staleness.on_rollout_submitted(self.segments)
        return self.staleness.get_version()

    def finished(self, item: Collected) -> None:
        trained_at = self.consumed + self.waiting
        too_stale = trained_at - item.started_at > self.staleness.max_staleness
        item.dropped = self.policy == "drop" and too_stale
        if item.dropped:
            self.staleness.on_rollout_rejected(self.segments)
        else:
            self.staleness.on_rollout_accepted(self.segments)
            self.waiting += 1

    def taken(self, item: Collected) -> None:
        if not item.dropped:
            self.consumed += 1
            self.waiting -= 1

    def restore(self, step: int) -> None:
        """A resume at ``step``: collected but untrained segments were not saved."""
        self.staleness.restore(step)
        self.consumed = step

    def describe(self) -> str:
        return f"{self.staleness.snapshot()}, version {self.staleness.get_version()}"


class UpdateLead:
    """Admission by the update-to-data ratio (SAC): the env steps, segments and updates."""

    def __init__(self, utd_ratio: float, max_lead: int, segment_env_steps: int, warmup: int):
        self.utd_ratio, self.max_lead, self.segment_env_steps = (
            utd_ratio,
            max_lead,
            segment_env_steps,
        )
        self.env_steps = self.segments = self.updates = 0
        self.pace = (0, float(warmup))  # U0, start: U(E) = U0 + utd * (E - start)
        self.owed_at: dict[int, int] = {}  # segment -> the updates owed once it was collected

    def owed(self, env_steps: int | None = None) -> int:
        base, start = self.pace
        env_steps = self.env_steps if env_steps is None else env_steps
        return base + max(0, math.floor(self.utd_ratio * (env_steps - start)))

    def lead(self) -> float:
        """Env steps collected beyond what the updates done have consumed, in owed updates: 0
        once they caught up (a fractional ``utd_ratio`` leaves a remainder below one update's
        worth of env steps, which must not hold collection back for good)."""
        return (self.owed() - self.updates) / self.utd_ratio

    def may_start(self) -> bool:
        return self.lead() <= self.max_lead - self.segment_env_steps

    def started(self) -> int:
        return self.updates

    def finished(self, item: Collected) -> None:
        self.segments += 1
        self.env_steps += sum(r["env_steps"] for r in item.results[0])
        self.owed_at[self.segments] = self.owed()

    def taken(self, item: Collected) -> None:
        pass

    def describe(self) -> str:
        return (
            f"{self.segments} segments, {self.env_steps} env steps, {self.updates} of "
            f"{self.owed()} updates owed, lead {self.lead():.0f} of replay.max_lead {self.max_lead}"
        )
