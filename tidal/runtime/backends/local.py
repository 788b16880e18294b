"""The ``local`` backend: every rank is threads of this process; channels are in-process
queues and items pass by reference (zero-copy)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import sys
import weakref
from collections.abc import Hashable
from typing import Any

from tidal.runtime.backends.base import Backend, ChannelTransport, register_backend
from tidal.runtime.channel import ChannelStore, settle
from tidal.runtime.placement import NodeInfo
from tidal.runtime.rank import EventLoopThread, RankInfo, RankRunner


class LocalRank:
    """A rank in this process: its own compute thread for plain methods; its ``async``
    methods run on the cluster's shared event loop (handing an item from one rank to another
    is then a coroutine switch, not a thread wake-up) or, with ``shared_event_loop=False``,
    on an event loop thread of its own."""

    def __init__(self, info: RankInfo, shared_loop: EventLoopThread | None):
        self.runner = RankRunner(info)
        self._own_loop = None if shared_loop else EventLoopThread(f"{info.group}-{info.rank}-loop")
        self.loop = (shared_loop or self._own_loop).loop

    def construct(self, cls, args, kwargs) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(self.runner.construct(cls, args, kwargs), self.loop)

    def submit(self, method: str, args: tuple, kwargs: dict) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(self.runner.call(method, args, kwargs), self.loop)

    def kill(self) -> None:
        self.runner.close()
        if self._own_loop is not None:
            self._own_loop.stop()


class LocalTransport(ChannelTransport):
    backend = "local"

    def __init__(self, name: str, maxsize: int):
        self.name = name
        self.store = ChannelStore(name, maxsize)

    def put(self, key: Hashable, item: Any, weight: float, async_op: bool, timeout: float | None):
        return settle(self.store.put(key, item, weight), self.name, "put", key, async_op, timeout)

    def put_shared(self, item: Any, keys: list, weight: float, timeout: float | None) -> None:
        for key in keys:
            self.put(key, item, weight, False, timeout)

    def get(self, key: Hashable, async_op: bool, timeout: float | None):
        return settle(self.store.get(key), self.name, "get", key, async_op, timeout)

    def get_batch(self, key: Hashable, target_weight: float, async_op: bool, timeout: float | None):
        fut = self.store.get_batch(key, target_weight)
        return settle(fut, self.name, "get_batch", key, async_op, timeout)

    def qsize(self, key: Hashable) -> int:
        return self.store.qsize(key)

    def close(self) -> None:
        """Nothing to release: the queues go with the last reference to the channel."""


@register_backend("local")
class LocalBackend(Backend):
    multi_process = False

    def __init__(self, options):
        super().__init__(options)
        self._loop_thread: EventLoopThread | None = None
        self._saved_switch_interval: float | None = None
        self._ranks: weakref.WeakSet[LocalRank] = weakref.WeakSet()

    def start(self) -> list[NodeInfo]:
        interval = self.options.gil_switch_interval
        if interval is not None:
            # opt-in: ranks are threads, so hand the GIL over sooner than Python's default 5 ms
            # (a rank woken by a peer otherwise waits on one still running Python)
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(interval)
        count = self.options.devices_per_node or os.cpu_count() or 1
        return [NodeInfo(0, "local", "127.0.0.1", count, "cpu")]

    def stop(self) -> None:
        if self._loop_thread is not None:
            self._loop_thread.stop()
            self._loop_thread = None
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    def launch_ranks(self, group, ranks, infos, timeout, hosts=None):
        # every rank is in this process: a host changes nothing
        ranks = [LocalRank(info, self.shared_loop()) for info in infos]
        self._ranks.update(ranks)
        return ranks, infos

    def where(self) -> str:
        """Every rank's running calls (the one a wait names may be waiting on another)."""
        stacks = [r.runner.where() for r in list(self._ranks)]
        return "\n".join(s for s in stacks if s)

    def create_channel(self, name: str, maxsize: int, consumer: list | None) -> LocalTransport:
        return LocalTransport(name, maxsize)  # every rank is here: binding changes nothing

    def shared_loop(self) -> EventLoopThread | None:
        if not self.options.shared_event_loop:
            return None
        if self._loop_thread is None:
            self._loop_thread = EventLoopThread("tidal-local-loop")
        return self._loop_thread
