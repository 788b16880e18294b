"""The ray backend's point-to-point transport: a channel bound to the group that reads it.

Every key of such a channel is routed (``RouteKey``, ``"src->dst:tag"``) and lives in the
*mailbox* of rank ``dst``'s own process. A put is one ZeroMQ message from the producer's
process into that rank's inbox (``ray_pipe``), with no Ray task and no answer: the channel is
unbounded, so a put never waits for room. ZeroMQ keeps each connection's order, so items come
out FIFO per producer and key. The rank's gets and qsize read its mailbox in place, without a
call at all; no other process reads them. A producer in the reading rank's own process (groups
that share it, ``same_process``) puts straight into the mailbox: the item passes by reference,
as on the local backend.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Hashable
from typing import Any

from tidal.runtime.backends import ray_pipe
from tidal.runtime.backends.base import ChannelTransport
from tidal.runtime.channel import PUT_DONE_WORK, ChannelStore, settle
from tidal.runtime.routekey import RouteKey


class RoutedTransport(ChannelTransport):
    backend = "ray"
    direct = True

    def __init__(self, name: str, rank_handles: list):
        self.name = name
        # the mailboxes' key: two channels of one name never share queues
        self.channel_id = f"{name}-{uuid.uuid4().hex}"
        self.group = rank_handles[0].info.group
        self.inboxes = [h.inbox for h in rank_handles]
        self.home_ids = [h.actor._actor_id.hex() for h in rank_handles]

    def put(self, key: Hashable, item: Any, weight: float, async_op: bool, timeout: float | None):
        dst = self._home_rank(key)
        if self.home_ids[dst] == current_actor_id():
            MAILBOX.store(self.channel_id).put(key, item, weight)
        else:
            self._send(dst, key, ray_pipe.dumps(item), weight)
        return PUT_DONE_WORK

    def put_shared(self, item: Any, keys: list, weight: float, timeout: float | None) -> None:
        homes = [self._home_rank(key) for key in keys]  # every key checked before any is sent
        frames = None  # pickled once, for the ranks in other processes
        for key, dst in zip(keys, homes):
            if self.home_ids[dst] == current_actor_id():
                MAILBOX.store(self.channel_id).put(key, item, weight)
                continue
            frames = frames or ray_pipe.dumps(item)
            self._send(dst, key, frames, weight)

    def get(self, key: Hashable, async_op: bool, timeout: float | None):
        fut = self._mailbox("get", key, async_op).get(key)
        return settle(fut, self.name, "get", key, async_op, timeout)

    def get_batch(self, key: Hashable, target_weight: float, async_op: bool, timeout: float | None):
        fut = self._mailbox("get_batch", key, async_op).get_batch(key, target_weight)
        return settle(fut, self.name, "get_batch", key, async_op, timeout)

    def qsize(self, key: Hashable) -> int:
        return self._mailbox("qsize", key, True).qsize(key)

    def close(self) -> None:
        """Nothing to release: the queues live in the reading ranks' processes."""

    def _home_rank(self, key) -> int:
        if isinstance(key, RouteKey) and 0 <= key.dst < len(self.inboxes):
            return key.dst
        raise ValueError(
            f"channel {self.name!r} is bound to group {self.group!r}: its keys are routed to a "
            f"rank, CommMapper.build_channel_key(src, dst, tag) with dst in "
            f"0-{len(self.inboxes) - 1}; got {key!r}"
        )

    def _send(self, dst: int, key, item_frames: list, weight: float) -> None:
        label = ("item", self.channel_id, key, weight)
        ray_pipe.OUTBOXES.send(self.inboxes[dst], label, item_frames)

    def _mailbox(self, op: str, key, async_op: bool) -> ChannelStore:
        """This process's queues of the channel, where ``key`` lives if this is its rank."""
        dst = self._home_rank(key)
        if current_actor_id() != self.home_ids[dst]:
            raise RuntimeError(
                f"channel {self.name!r}: {op}(key={key!r}) outside rank {dst} of group "
                f"{self.group!r}; a bound channel's key is read only by the rank it is routed to"
            )
        if not async_op:
            _refuse_blocking_on_loop(self.name, op, key)
        return MAILBOX.store(self.channel_id)


def _refuse_blocking_on_loop(channel: str, op: str, key) -> None:
    """A blocking get of a key held by this rank, on the rank's event loop, would wait for a
    delivery that needs that very loop: fail at once instead of at the timeout."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"channel {channel!r}: blocking {op}(key={key!r}) inside an async method; "
        f"use `await channel.{op}(..., async_op=True)`"
    )


_ACTOR_ID: list = []


def current_actor_id() -> str | None:
    """The Ray actor this process runs (None on the driver); asked once."""
    if not _ACTOR_ID:
        import ray

        _ACTOR_ID.append(ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None)
    return _ACTOR_ID[0]


class Mailbox:
    """The queues of the routed keys homed on this process's rank, one store per channel."""

    def __init__(self):
        self._stores: dict[str, ChannelStore] = {}
        # a rank's sync method (a thread) and a delivery (the event loop) may both make a
        # channel's store first: without the lock each could make its own, and a get would wait
        # on one store while the put went to the other (a test hung so, once, in CI)
        self._lock = threading.Lock()

    def store(self, channel_id: str) -> ChannelStore:
        with self._lock:
            store = self._stores.get(channel_id)
            if store is None:
                store = self._stores[channel_id] = ChannelStore(channel_id)
            return store


MAILBOX = Mailbox()


def deliver_from_pipe(channel_id: str, key, weight: float, frames: list) -> None:
    """An item that arrived in this rank's inbox (the channel is unbounded: it never waits)."""
    MAILBOX.store(channel_id).put(key, ray_pipe.loads(frames), weight)
