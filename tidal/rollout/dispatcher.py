"""A producer/consumer dispatcher for asynchronous episodes, bounded by the staleness manager.

A producer thread submits pending inputs to an event loop (where episodes run as coroutines)
while the staleness capacity is positive and the dispatcher is not paused; a consumer thread
collects finished episodes. ``prepare_batch`` keeps the data stream flowing across training
steps and returns the oldest accepted results first, waiting for running episodes when taking
the batch now would leave more episodes near the end of their staleness budget than the next
batches hold (so no result is trained more than ``max_staleness`` versions after the one it
started under, even when later episodes finish first).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tidal.asynchrony import StalenessManager
from tidal.inference.params import EPISODE_SEEDS, EpisodeSeeds

log = logging.getLogger(__name__)

EpisodeFn = Callable[[Any], Awaitable[Any]]
_END = object()


class EpisodeError(RuntimeError):
    """An episode (or a dispatcher thread) failed; the message names it."""


@dataclass
class _Finished:
    task_id: int
    result: Any
    error: str | None
    started_version: int
    finished_at: float


class RolloutDispatcher:
    def __init__(
        self,
        episode_fn: EpisodeFn,
        staleness: StalenessManager,
        max_queue_size: int = 4096,
        should_accept: Callable[[Any], bool] | None = None,
        sampling_seed: int | None = None,
    ):
        """``sampling_seed``: each episode's unseeded sampling draws its seeds from this and the
        episode's place in the data stream (``stream_offset`` + its task id; a resumed run sets
        the offset to the records it had used), so a run repeats its rollouts."""
        self.episode_fn, self.staleness = episode_fn, staleness
        self.sampling_seed, self.stream_offset = sampling_seed, 0
        self.should_accept = should_accept
        self.filtered = 0  # finished episodes should_accept turned away (e.g. dynamic sampling)
        self.max_queue_size = max_queue_size
        self._submitted = 0  # also the next task id: ids follow submission order
        self._pending: deque[tuple[int, Any]] = deque()
        self._cv = threading.Condition()
        self._finished: queue.Queue[_Finished] = queue.Queue()
        self._accepted: dict[int, _Finished] = {}
        self._running: dict[int, int] = {}  # task id → the version it started under
        self._tasks: set[asyncio.Task] = set()  # the episodes running on the loop
        self._unconsumed: set[int] = set()  # submitted, neither trained on nor turned away
        self._result_cv = threading.Condition()
        self._paused = threading.Event()
        self._shutdown = threading.Event()
        self._thread_error: str | None = None
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="tidal-episodes", daemon=True
        )
        self._producer = threading.Thread(
            target=self._guard(self._produce), name="tidal-producer", daemon=True
        )
        self._consumer = threading.Thread(
            target=self._guard(self._consume), name="tidal-consumer", daemon=True
        )
        for t in (self._loop_thread, self._producer, self._consumer):
            t.start()
        self._data_iter: Iterator | None = None
        self._data_source: Iterable | None = None

    # -- inputs ---------------------------------------------------------------------------

    def submit(self, data: Any) -> int:
        with self._result_cv, self._cv:  # this order everywhere: wait_results submits (refill)
            if len(self._pending) >= self.max_queue_size:
                raise EpisodeError(f"the dispatcher's input queue is full ({self.max_queue_size})")
            task_id = self._submitted
            self._submitted += 1
            self._unconsumed.add(task_id)
            self._pending.append((task_id, data))
            self.staleness.on_rollout_enqueued()
            self._cv.notify_all()
        return task_id

    def pause(self) -> None:
        """Stop submitting new episodes (running ones go on)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self.wake()

    def run_coroutine(self, coro: Awaitable[Any], timeout: float) -> Any:
        """Run ``coro`` on the episodes' event loop (where their clients live) and wait for its
        result, e.g. an evaluation, or closing the client."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def wake(self) -> None:
        """Capacity may have changed (e.g. the trainer's version moved on)."""
        with self._cv:
            self._cv.notify_all()

    # -- threads --------------------------------------------------------------------------

    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException:  # surfaced to the trainer on its next wait
                self._thread_error = traceback.format_exc()
                with self._result_cv:
                    self._result_cv.notify_all()

        return run

    def _produce(self) -> None:
        while not self._shutdown.is_set():
            with self._cv:
                self._cv.wait_for(
                    lambda: (
                        self._shutdown.is_set()
                        or (
                            not self._paused.is_set()
                            and self._pending
                            and self.staleness.get_capacity() > 0
                        )
                    ),
                    timeout=0.5,
                )
                if self._shutdown.is_set() or self._paused.is_set() or not self._pending:
                    continue
                if self.staleness.get_capacity() <= 0:
                    continue
                task_id, data = self._pending.popleft()
                self.staleness.on_rollout_submitted()
            version = self.staleness.get_version()
            with self._result_cv:
                self._running[task_id] = version
            fut = asyncio.run_coroutine_threadsafe(self._episode(task_id, data), self._loop)
            fut.add_done_callback(
                lambda f, t=task_id, v=version: self._finished.put(self._record(t, v, f))
            )

    async def _episode(self, task_id: int, data: Any) -> Any:
        if self.sampling_seed is not None:  # this task's context: its calls, not another's
            EPISODE_SEEDS.set(EpisodeSeeds(self.sampling_seed, self.stream_offset + task_id))
        task = asyncio.current_task()
        self._tasks.add(task)  # only the loop's thread touches the set
        try:
            return await self.episode_fn(data)
        finally:
            self._tasks.discard(task)

    @staticmethod
    def _record(task_id: int, version: int, fut) -> _Finished:
        error = None
        result = None
        try:
            result = fut.result()
        except BaseException as exc:  # its own line first: the traceback can be long
            error = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc))
        return _Finished(task_id, result, error, version, time.monotonic())

    def _consume(self) -> None:
        while not self._shutdown.is_set():
            try:
                item = self._finished.get(timeout=0.05)
            except queue.Empty:
                continue
            finished = item.error is None and item.result is not None
            accepted = finished and (self.should_accept is None or self.should_accept(item.result))
            self.filtered += finished and not accepted
            if accepted:
                self.staleness.on_rollout_accepted()
            else:
                self.staleness.on_rollout_rejected()
            with self._result_cv:
                del self._running[item.task_id]
                if accepted or item.error is not None:
                    self._accepted[item.task_id] = item
                else:
                    self._unconsumed.discard(item.task_id)
                self._result_cv.notify_all()
            self.wake()

    # -- results --------------------------------------------------------------------------

    def wait_results(
        self, count: int, timeout: float = 600.0, refill: Callable[[], None] | None = None
    ) -> list[_Finished]:
        """The ``count`` oldest accepted results (by submission order), waiting for them and for
        every running episode that would be too stale for the next batch; ``refill`` runs
        between waits (episodes turned away leave room for more inputs)."""
        deadline = time.monotonic() + timeout
        with self._result_cv:
            while True:
                if refill is not None:
                    refill()
                self._raise_failures()
                ready = [r for r in self._accepted.values() if r.error is None]
                chosen = sorted(ready, key=lambda r: r.task_id)[:count]
                if len(chosen) == count and not self._leaves_some_too_stale(chosen, count):
                    for r in chosen:
                        del self._accepted[r.task_id]
                        self._unconsumed.discard(r.task_id)
                    return chosen
                left = deadline - time.monotonic()
                if left <= 0:
                    waited = (
                        f"only {len(ready)} of {count} episodes finished"
                        if len(ready) < count
                        else f"{len(self._running)} running episode(s) near the end of their "
                        f"staleness budget (max_staleness {self.staleness.max_staleness}) "
                        "did not finish"
                    )
                    raise TimeoutError(
                        f"{waited} within {timeout:g} s "
                        f"(staleness counters: {self.staleness.snapshot()})"
                    )
                self._result_cv.wait(min(left, 0.5))

    def _leaves_some_too_stale(self, chosen: list[_Finished], count: int) -> bool:
        """Whether training ``chosen`` now leaves more episodes whose staleness budget ends
        within the next ``j`` batches than ``j`` batches hold (for any ``j`` up to
        ``max_staleness``): one of them would be trained too late, so the batch waits for the
        running ones. ``chosen`` is the oldest ready (submission order is start order), so the
        batch takes those with the earliest end first."""
        eta = self.staleness.max_staleness
        last_chance = self.staleness.get_version() - eta  # started then: this batch or never
        taken = {r.task_id for r in chosen}
        left = [r.started_version for r in self._accepted.values() if r.task_id not in taken]
        left += self._running.values()
        return any(sum(s <= last_chance + j for s in left) > j * count for j in range(eta + 1))

    def _raise_failures(self) -> None:
        if self._thread_error is not None:
            raise EpisodeError(f"a dispatcher thread failed:\n{self._thread_error}")
        failed = [r for r in self._accepted.values() if r.error is not None]
        if failed:
            raise EpisodeError(f"episode {failed[0].task_id} failed: {failed[0].error}")

    def prepare_batch(self, data: Iterable, batch_size: int, timeout: float = 600.0) -> list[Any]:
        """Keep enough episodes in flight and return ``batch_size`` accepted results, oldest
        first. The data stream carries on across calls (a list is cycled; an iterator is read
        until it ends); passing another data source switches to it."""
        if data is not self._data_source:
            self._data_source = data
            self._data_iter = data if isinstance(data, Iterator) else itertools.cycle(data)

        def refill() -> None:  # inputs enough to fill the batch and every slot in flight
            target = self.staleness.max_concurrent_rollouts + batch_size
            with self._cv:
                backlog = len(self._pending)
            for _ in range(max(0, target - backlog - self.staleness.stat.running)):
                item = next(self._data_iter, _END)
                if item is _END:
                    break
                self.submit(item)

        return [r.result for r in self.wait_results(batch_size, timeout, refill)]

    @property
    def submitted(self) -> int:
        """Episodes taken from the data stream so far."""
        return self._submitted

    def inputs_to_reread(self) -> int:
        """How many of the inputs read so far a resume must read again: the oldest one that no
        batch has used (nor turned away) and every one read after it. A checkpoint rewinds the
        data stream by this many, so a resume skips no input (one that a batch used out of
        order, past an older one still running, is used again)."""
        with self._result_cv:
            return self._submitted - min(self._unconsumed) if self._unconsumed else 0

    def stop_episodes(self, timeout: float = 30.0) -> None:
        """Start no more episodes and cancel the running ones (waiting up to ``timeout`` for
        them to unwind: their agents killed, their sessions ended), keeping the loop for what
        lives on it (the client, the session proxy) to be closed on it next."""
        self._shutdown.set()
        self.wake()
        for t in (self._producer, self._consumer):
            t.join(timeout=5)
        asyncio.run_coroutine_threadsafe(self._cancel_episodes(), self._loop).result(timeout)

    async def _cancel_episodes(self) -> None:
        running = list(self._tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)  # unwound, not just asked to

    def shutdown(self) -> None:
        self.stop_episodes()
        self._loop.call_soon_threadsafe(self._cancel_and_stop)
        self._loop_thread.join(timeout=5)

    def _cancel_and_stop(self) -> None:
        """Episodes still running are abandoned: cancel them (and let them unwind) before the
        loop stops, so none is destroyed while pending."""
        tasks = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if not tasks:
            self._loop.stop()
            return
        gathered = asyncio.gather(*tasks, return_exceptions=True)
        gathered.add_done_callback(lambda _: self._loop.stop())
