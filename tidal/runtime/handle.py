"""``Handle``: the pending result of one method called on several ranks of a group."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.runtime.defaults import DEFAULT_TIMEOUT_S
from tidal.runtime.errors import WorkerError, WorkerTimeoutError


@dataclass
class CallResult:
    """What a rank sends back for one call: a value, or the error with its traceback."""

    value: Any = None
    error: str | None = None
    traceback: str = ""
    duration: float = 0.0


class Handle:
    def __init__(
        self,
        group: str,
        method: str,
        ranks: list[int],
        futures: list[cf.Future],
        where: Callable[[], str] | None = None,
    ):
        """``where``: the stacks of the ranks' running calls, for a timeout to report."""
        self.group, self.method, self.ranks = group, method, ranks
        self._futures = futures
        self._results: dict[int, CallResult] = {}
        self._where = where

    def timeout_error(self, pending, timeout: float) -> WorkerTimeoutError:
        """The ranks of ``pending`` futures named late, with where they were if this process
        can tell (the local backend's ranks)."""
        where = self._where() if self._where is not None else ""
        return WorkerTimeoutError(
            self.group, self.method, self._pending_ranks(pending), timeout, where
        )

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Per-rank results in rank order. Raises as soon as any rank fails, naming it."""
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = set(self._futures)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.timeout_error(pending, timeout)
            finished, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                self._collect(fut)
        return [self._results[r].value for r in self.ranks]

    async def async_wait(self, timeout: float | None = None) -> list[Any]:
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        wrapped = {asyncio.wrap_future(f): f for f in self._futures}
        pending = set(wrapped)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.timeout_error({wrapped[p] for p in pending}, timeout)
            finished, pending = await asyncio.wait(
                pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for fut in finished:
                self._collect(wrapped[fut])
        return [self._results[r].value for r in self.ranks]

    def __await__(self):
        return self.async_wait().__await__()

    def durations(self) -> dict[int, float]:
        """Seconds each finished rank spent in the method."""
        return {r: res.duration for r, res in self._results.items()}

    def _rank_of(self, fut: cf.Future) -> int:
        return self.ranks[self._futures.index(fut)]

    def _pending_ranks(self, pending) -> list[int]:
        return sorted(self._rank_of(f) for f in pending)

    def _collect(self, fut: cf.Future) -> None:
        rank = self._rank_of(fut)
        try:
            result: CallResult = fut.result()
        except Exception as exc:  # the rank itself died (e.g. its process was killed)
            raise WorkerError(
                self.group, rank, self.method, f"rank died: {type(exc).__name__}: {exc}"
            ) from exc
        if result.error is not None:
            raise WorkerError(self.group, rank, self.method, result.error, result.traceback)
        self._results[rank] = result


def wait_all(handles: list[Handle], timeout: float | None = None) -> list[list[Any]]:
    """Wait for several handles at once; the first failure anywhere raises at once (a rank
    waiting on a peer that failed would otherwise hold the caller until the timeout)."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while not all(h.done() for h in handles):
        wait_any([h for h in handles if not h.done()], deadline - time.monotonic(), timeout)
    for h in handles:  # every future is done: nothing blocks, a failed rank raises
        for fut in h._futures:
            h._collect(fut)
    return [[h._results[r].value for r in h.ranks] for h in handles]


def wait_any(
    handles: list[Handle], timeout: float | None = None, reported: float | None = None
) -> list[Handle]:
    """Block until at least one of ``handles`` has finished on every rank; those that have.
    A failed rank anywhere raises at once, naming it; past ``timeout`` the first handle still
    pending is named (with ``reported`` as the timeout it was given: a caller's own deadline)."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    owner = {f: h for h in handles for f in h._futures}
    pending = {f for f in owner if not f.done()}
    for fut in set(owner) - pending:
        owner[fut]._collect(fut)
    while True:
        finished = [h for h in handles if h.done()]
        if finished:
            return finished
        left = deadline - time.monotonic()
        if left <= 0:
            h = handles[0]
            late = {f for f in h._futures if f in pending}
            raise h.timeout_error(late, timeout if reported is None else reported)
        done, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_COMPLETED)
        for fut in done:
            owner[fut]._collect(fut)
