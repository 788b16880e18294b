"""Channels: named, keyed FIFO queues between the driver and workers of any group.

Per key, items come out in the order they went in. ``put`` waits while a key holds
``maxsize`` items (back-pressure); ``get`` waits for an item; ``get_batch`` waits until the
queued weight reaches a target and takes that many items at once. Every wait has a timeout;
a timed-out operation takes nothing and loses nothing.

Backends: on ``local`` the queues live in this process and items pass by reference
(zero-copy). On ``ray`` channels are unbounded; a channel bound to the group that reads it
(``consumer``) keeps each routed key in the reading rank's own process
(``tidal.runtime.backends.ray_routed``), any other channel in a small channel actor
(``tidal.runtime.backends.ray_channel_actor``); items reach either by ZeroMQ.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from tidal.runtime.defaults import DEFAULT_TIMEOUT_S
from tidal.runtime.errors import ChannelTimeoutError

DEFAULT_KEY = "default"


class Waiter:
    """A light stand-in for ``concurrent.futures.Future`` (the subset the channel uses): set
    from any thread, waited on from any thread, awaited from any loop. A ``cf.Future`` builds
    a Condition per instance; this builds a lock, and an Event only if a thread blocks on it."""

    __slots__ = ("_lock", "_state", "_value", "_error", "_callbacks", "_event", "_follower")
    _PENDING, _RUNNING, _DONE, _CANCELLED = range(4)

    def __init__(self):
        self._lock = threading.Lock()
        self._state = self._PENDING
        self._value = self._error = self._event = self._follower = None
        self._callbacks: list = []

    def set_running_or_notify_cancel(self) -> bool:
        with self._lock:
            if self._state == self._CANCELLED:
                return False
            self._state = self._RUNNING
            return True

    def cancel(self) -> bool:
        with self._lock:
            if self._state != self._PENDING:
                return self._state == self._CANCELLED
            self._state = self._CANCELLED
        self._finish()
        return True

    def set_result(self, value) -> None:
        self._settle(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, value, error) -> None:
        with self._lock:
            self._value, self._error, self._state = value, error, self._DONE
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            event, follower = self._event, self._follower
        if event is not None:
            event.set()
        if follower is not None:
            loop, thread, out = follower
            if threading.get_ident() == thread:
                _copy_outcome(self, out)  # only schedules the awaiting task: safe under a lock
            else:
                loop.call_soon_threadsafe(_copy_outcome, self, out)
        for fn in callbacks:
            fn(self)

    def follow_on(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """An asyncio future on ``loop`` (the running one) that takes this waiter's outcome:
        in place when the waiter settles on the loop's own thread (ranks sharing one loop hand
        items over without an extra turn of the loop), through ``call_soon_threadsafe``
        otherwise. What ``_bridge`` does for any future, without its closures: this is the
        local hot path."""
        with self._lock:
            if not self.done() and self._follower is None:
                out = loop.create_future()
                self._follower = (loop, threading.get_ident(), out)
                return out
        return _follow_by_callback(self, loop)  # settled, or awaited a second time

    def done(self) -> bool:
        return self._state in (self._DONE, self._CANCELLED)

    def cancelled(self) -> bool:
        return self._state == self._CANCELLED

    def add_done_callback(self, fn) -> None:
        with self._lock:
            if not self.done():
                self._callbacks.append(fn)
                return
        fn(self)

    def exception(self, timeout: float | None = None):
        self._wait(timeout)
        if self._state == self._CANCELLED:
            raise cf.CancelledError()
        return self._error

    def result(self, timeout: float | None = None):
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._value

    def _wait(self, timeout: float | None) -> None:
        if self.done():
            return
        with self._lock:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if not self.done() and not event.wait(timeout):
            raise cf.TimeoutError()


# What every put that is admitted at once returns: a settled waiter never changes, so one
# instance serves them all (no lock and no waiter made per put on the hot path).
_PUT_DONE = Waiter()
_PUT_DONE.set_result(None)


@dataclass
class _Getter:
    future: Waiter
    target_weight: float | None  # None: one item


class ChannelStore:
    """Thread-safe keyed queues whose waits are ``Waiter``s, so that any thread can wait on
    them and any event loop can await them."""

    def __init__(self, name: str, maxsize: int = 0):
        if maxsize < 0:
            raise ValueError(f"channel {name!r}: maxsize must be >= 0, got {maxsize}")
        self.name, self.maxsize = name, maxsize
        self._lock = threading.Lock()
        self._items: dict[Hashable, deque] = defaultdict(deque)
        self._weights: dict[Hashable, float] = defaultdict(float)
        self._getters: dict[Hashable, deque[_Getter]] = defaultdict(deque)
        self._putters: dict[Hashable, deque] = defaultdict(deque)

    def put(self, key: Hashable, item: Any, weight: float = 1.0) -> Waiter:
        with self._lock:
            if self.maxsize and len(self._items[key]) >= self.maxsize:
                fut = Waiter()
                self._putters[key].append((fut, item, weight))
                return fut
            self._append(key, item, weight)
            self._serve(key)
        return _PUT_DONE

    def get(self, key: Hashable) -> Waiter:
        return self._add_getter(key, None)

    def get_batch(self, key: Hashable, target_weight: float) -> Waiter:
        if target_weight <= 0:
            raise ValueError(
                f"channel {self.name!r}: get_batch target_weight must be > 0, got {target_weight}"
            )
        return self._add_getter(key, float(target_weight))

    def qsize(self, key: Hashable) -> int:
        with self._lock:
            return len(self._items.get(key, ()))

    def _add_getter(self, key: Hashable, target: float | None) -> Waiter:
        fut = Waiter()
        with self._lock:
            self._getters[key].append(_Getter(fut, target))
            self._serve(key)
        return fut

    def _append(self, key, item, weight) -> None:
        self._items[key].append((item, weight))
        self._weights[key] += weight

    def _pop(self, key):
        item, weight = self._items[key].popleft()
        self._weights[key] -= weight
        return item, weight

    def _serve(self, key) -> None:
        """Hand queued items to waiting getters (FIFO), then admit waiting putters; repeat."""
        getters, items, putters = self._getters[key], self._items[key], self._putters[key]
        progress = True
        while progress:
            progress = False
            while getters and items:
                head = getters[0]
                if (
                    head.target_weight is not None
                    and self._weights[key] < head.target_weight - 1e-12
                ):
                    break
                getters.popleft()
                if not head.future.set_running_or_notify_cancel():
                    continue  # the waiter gave up; its place goes to the next one
                if head.target_weight is None:
                    head.future.set_result(self._pop(key)[0])
                else:
                    taken, total = [], 0.0
                    while total < head.target_weight - 1e-12:
                        item, weight = self._pop(key)
                        taken.append(item)
                        total += weight
                    head.future.set_result(taken)
                progress = True
            while putters and (not self.maxsize or len(items) < self.maxsize):
                fut, item, weight = putters.popleft()
                if not fut.set_running_or_notify_cancel():
                    continue
                self._append(key, item, weight)
                fut.set_result(None)
                progress = True


def _wait_or_cancel(fut: cf.Future, timeout: float, on_timeout: Callable[[], Exception]):
    """Wait for a store future; on timeout withdraw it, unless it was served meanwhile."""
    if fut.done():
        return fut.result()
    try:
        return fut.result(timeout)
    except cf.TimeoutError:
        if fut.cancel():
            raise on_timeout() from None
        return fut.result()


def _copy_outcome(fut, out: asyncio.Future) -> None:
    if out.done():
        return
    if fut.cancelled():
        out.cancel()
    elif (exc := fut.exception()) is not None:
        out.set_exception(exc)
    else:
        out.set_result(fut.result())


def _bridge(fut: cf.Future) -> asyncio.Future:
    """An asyncio future on the running loop that follows ``fut``. Unlike
    ``asyncio.wrap_future`` it is resolved in place when ``fut`` is resolved on the loop's own
    thread (ranks sharing one loop hand items over without an extra turn of the loop), and
    through ``call_soon_threadsafe`` otherwise."""
    loop = asyncio.get_running_loop()
    if isinstance(fut, Waiter):
        return fut.follow_on(loop)
    return _follow_by_callback(fut, loop)


def _follow_by_callback(fut, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    loop_thread = threading.get_ident()
    out = loop.create_future()

    def on_done(f: cf.Future) -> None:
        if threading.get_ident() == loop_thread:
            _copy_outcome(f, out)  # only schedules the awaiting task: safe under the store's lock
        else:
            loop.call_soon_threadsafe(_copy_outcome, f, out)

    fut.add_done_callback(on_done)
    return out


async def _await_or_cancel(
    fut: cf.Future, timeout: float | None, on_timeout: Callable[[], Exception]
):
    return await _Following(fut, timeout, on_timeout)


class _Following:
    """``await`` it: ``_follow`` of its arguments."""

    __slots__ = ("args",)

    def __init__(self, *args):
        self.args = args

    def __await__(self):
        return _follow(*self.args)


def _follow(fut, timeout: float | None, on_timeout: Callable[[], Exception]):
    """Await ``fut`` (a generator, for ``__await__``: no coroutine object per wait) for at
    most ``timeout``; on timeout withdraw it, unless it was served meanwhile."""
    if fut.done():  # the common case when producers run ahead: no task, no timer
        return fut.result()
    waiter = _bridge(fut)
    timer = (
        asyncio.get_running_loop().call_later(timeout, _expire, waiter)
        if timeout is not None
        else None
    )
    try:
        return (yield from waiter.__await__())
    except _Expired:
        if fut.cancel():
            raise on_timeout() from None
        return fut.result()
    finally:
        if timer is not None:
            timer.cancel()


class _Expired(Exception):
    """A channel wait ran out of time (a timer handle is cheaper than ``asyncio.timeout``)."""


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(_Expired())


class AsyncWork:
    """The result of an ``async_op=True`` channel operation: ``wait()`` it or ``await`` it."""

    __slots__ = ("_future", "_on_timeout", "_timeout")

    def __init__(
        self, future: cf.Future, on_timeout: Callable[[], Exception], timeout: float | None
    ):
        self._future, self._on_timeout, self._timeout = future, on_timeout, timeout

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        timeout = timeout if timeout is not None else (self._timeout or DEFAULT_TIMEOUT_S)
        return _wait_or_cancel(self._future, timeout, self._on_timeout)

    async def async_wait(self, timeout: float | None = None) -> Any:
        timeout = timeout if timeout is not None else (self._timeout or DEFAULT_TIMEOUT_S)
        return await _Following(self._future, timeout, self._on_timeout)

    def __await__(self):  # no coroutine in between: this is the hot path
        return _follow(self._future, self._timeout or DEFAULT_TIMEOUT_S, self._on_timeout)


# Every async put admitted at once: one settled work serves them all.
PUT_DONE_WORK = AsyncWork(_PUT_DONE, ChannelTimeoutError, None)


def timeout_error(channel: str, op: str, key, timeout: float) -> Callable[[], Exception]:
    return functools.partial(ChannelTimeoutError, channel, op, key, timeout)


def settle(fut, channel: str, op: str, key, async_op: bool, timeout: float | None):
    """Wait for a store future (at most ``timeout``), or hand it back as an ``AsyncWork``."""
    if async_op and fut is _PUT_DONE:
        return PUT_DONE_WORK
    limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
    on_timeout = timeout_error(channel, op, key, limit)
    if async_op:
        return AsyncWork(fut, on_timeout, limit)
    return _wait_or_cancel(fut, limit, on_timeout)


class Channel:
    """A named channel. Create it on the driver with ``Channel.create(name, cluster)`` and pass
    it to workers as an argument; it works the same from the driver and from any rank. Where
    the queues live is the backend's business (its ``ChannelTransport``)."""

    def __init__(self, name: str, transport):
        self.name, self._transport = name, transport

    @classmethod
    def create(cls, name: str, cluster, maxsize: int = 0, consumer=None) -> Channel:
        """``consumer``: the group (a ``WorkerGroup``) that reads this channel's routed keys
        (``CommMapper.build_channel_key(src, dst, tag)``: rank ``dst`` of ``consumer``). Where
        the backend can, those items then travel point to point to that rank (on ray: by
        ZeroMQ straight into its process, and only that rank reads them); the backend picks the
        transport here, once. Keyed FIFO per producer and timeouts that take nothing hold
        either way."""
        if maxsize < 0:
            raise ValueError(f"channel {name!r}: maxsize must be >= 0, got {maxsize}")
        handles = consumer.rank_handles if consumer is not None else None
        return cls(name, cluster.backend_impl.create_channel(name, maxsize, handles))

    @property
    def direct(self) -> bool:
        """Whether routed keys go point to point to their reading rank."""
        return self._transport.direct

    @property
    def backend(self) -> str:
        return self._transport.backend

    def put(
        self,
        item: Any,
        key: Hashable = DEFAULT_KEY,
        weight: float = 1.0,
        async_op: bool = False,
        timeout: float | None = None,
    ):
        """Append ``item`` under ``key``; waits while the key is full (``maxsize``)."""
        return self._transport.put(key, item, weight, async_op, timeout)

    def put_shared(
        self, item: Any, keys: list[Hashable], weight: float = 1.0, timeout: float | None = None
    ) -> None:
        """Deliver one item under several keys with a single object-store write (e.g. the same
        weights to every rank of a group). Receivers must treat it as read-only."""
        self._transport.put_shared(item, keys, weight, timeout)

    def get(
        self, key: Hashable = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None
    ):
        """Take the oldest item under ``key``, waiting for one."""
        return self._transport.get(key, async_op, timeout)

    def get_batch(
        self,
        target_weight: float,
        key: Hashable = DEFAULT_KEY,
        async_op: bool = False,
        timeout: float | None = None,
    ):
        """Take, at once, the oldest items whose weights add up to at least ``target_weight``."""
        if target_weight <= 0:
            raise ValueError(
                f"channel {self.name!r}: get_batch target_weight must be > 0, got {target_weight}"
            )
        return self._transport.get_batch(key, target_weight, async_op, timeout)

    def qsize(self, key: Hashable = DEFAULT_KEY) -> int:
        return self._transport.qsize(key)

    def empty(self, key: Hashable = DEFAULT_KEY) -> bool:
        return self.qsize(key) == 0

    def close(self) -> None:
        self._transport.close()
