"""The ray backend's channel-actor transport: a channel not bound to a reading group.

Its keys live in a small *channel actor*, reached by ZeroMQ (``ray_pipe``): a put is one
message into the actor's inbox, which keeps the item as its frames and never unpickles it;
gets and qsize are requests on the same connection, so a process reads its own writes, answered
into the asker's reply inbox. The actor enforces each get's timeout itself, so a timed-out get
takes nothing. Per connection ZeroMQ keeps the order: FIFO per producer and key. The channel is
unbounded: a put never waits for room.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Hashable
from typing import Any

from tidal.runtime.backends import ray_pipe
from tidal.runtime.backends.base import ChannelTransport
from tidal.runtime.channel import (
    PUT_DONE_WORK,
    AsyncWork,
    ChannelStore,
    _await_or_cancel,
    timeout_error,
)
from tidal.runtime.defaults import DEFAULT_TIMEOUT_S
from tidal.runtime.errors import ChannelTimeoutError

REPLY_MARGIN_S = 30.0  # extra time the caller gives the channel actor to answer


class ChannelActorTransport(ChannelTransport):
    backend = "ray"

    def __init__(self, name: str, actor):
        self.name, self.actor = name, actor
        # the actor's inbox, asked for now and read on first use (its process may be starting)
        self._inbox: str | None = None
        self._inbox_ref = actor.inbox_address.remote()
        self._watch: ray_pipe.DeathWatch | None = None  # per process: made on first use

    def put(self, key: Hashable, item: Any, weight: float, async_op: bool, timeout: float | None):
        self._send(key, ray_pipe.dumps(item), weight)
        return PUT_DONE_WORK

    def put_shared(self, item: Any, keys: list, weight: float, timeout: float | None) -> None:
        frames = ray_pipe.dumps(item)  # pickled once, queued under each key
        for key in keys:
            self._send(key, frames, weight)

    def get(self, key: Hashable, async_op: bool, timeout: float | None):
        work = self._ask("get", key, None, DEFAULT_TIMEOUT_S if timeout is None else timeout)
        return work if async_op else work.wait()

    def get_batch(self, key: Hashable, target_weight: float, async_op: bool, timeout: float | None):
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        work = self._ask("get_batch", key, target_weight, limit)
        return work if async_op else work.wait()

    def qsize(self, key: Hashable) -> int:
        return self._ask("qsize", key, None, DEFAULT_TIMEOUT_S).wait()

    def close(self) -> None:
        if self.actor is not None:
            import ray

            ray.kill(self.actor, no_restart=True)
            self.actor = None

    def _send(self, key, item_frames: list, weight: float) -> None:
        ray_pipe.OUTBOXES.send(self._address(), ("put", key, weight), item_frames)

    def _ask(self, op: str, key, target: float | None, limit: float) -> AsyncWork:
        """A get, get_batch or qsize request on the connection this process's puts took, so it
        comes after them; the actor enforces ``limit`` itself and the answer comes back into
        this process's reply inbox."""
        address = self._address()
        fut = ray_pipe.REPLIES.ask(
            self,
            self._death_watch(),
            lambda i, reply_to: ray_pipe.OUTBOXES.send(
                address, ("ask", i, reply_to, op, key, target, limit), []
            ),
            functools.partial(_decode_answer, self.name, op, key, limit),
        )
        no_answer = timeout_error(self.name, op + " (no answer from the channel actor)", key, limit)
        return AsyncWork(fut, no_answer, limit + REPLY_MARGIN_S)

    def _address(self) -> str:
        if self._inbox is None:
            import ray

            if self._inbox_ref is None:
                raise RuntimeError(f"channel {self.name!r}: its channel actor is gone")
            try:
                self._inbox = ray.get(self._inbox_ref, timeout=DEFAULT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"channel {self.name!r}: its channel actor did not start within "
                    f"{DEFAULT_TIMEOUT_S:g} s"
                ) from None
            except ray.exceptions.RayError as exc:
                raise RuntimeError(f"channel {self.name!r}: its channel actor is gone") from exc
        return self._inbox

    def _death_watch(self) -> ray_pipe.DeathWatch:
        """Requests to a channel actor that died fail at once, not at their timeout."""
        if self._watch is None:
            name = self.name
            self._watch = ray_pipe.DeathWatch(
                self.actor,
                self,
                lambda cause: RuntimeError(
                    f"channel {name!r}: its channel actor died ({cause or 'it ended'})"
                ),
            )
        return self._watch

    def __getstate__(self):
        if self._inbox_ref is not None:  # a process it goes to gets the address
            with contextlib.suppress(RuntimeError):  # (none if the actor died: its gets fail)
                self._address()
        return {**self.__dict__, "_inbox_ref": None, "_watch": None}


def _decode_answer(channel: str, op: str, key, limit: float, meta: list, frames: list) -> Any:
    """A channel actor's answer: ``meta`` is (found in time, frames per item or None for one
    pickled value)."""
    found, counts = meta
    if not found:
        raise ChannelTimeoutError(channel, op, key, limit)
    if counts is None:
        return ray_pipe.loads(frames)
    items, at = [], 0
    for n in counts:
        items.append(ray_pipe.loads(frames[at : at + n]))
        at += n
    return items[0] if op == "get" else items


class ChannelActor:
    """Holds the queues of one channel; items arrive as their producer's frames, so this actor
    never needs their classes."""

    def __init__(self, name: str):
        self.name = name
        self.store = ChannelStore(name)

    async def inbox_address(self) -> str:
        return await ray_pipe.INBOX.open({"put": self._put_frames, "ask": self._ask})

    async def until_death(self) -> None:
        """Never answers: the caller's reference fails when this actor's process dies."""
        await asyncio.Event().wait()

    def _put_frames(self, key, weight: float, frames: list) -> None:
        """Kept as the producer's frames: never unpickled here, sent on as they came."""
        self.store.put(key, [f.buffer for f in frames], weight)

    def _ask(self, request_id: int, reply_to: str, op: str, key, target, limit, frames) -> None:
        asyncio.get_running_loop().create_task(
            self._answer(request_id, reply_to, op, key, target, limit)
        )

    async def _answer(self, request_id: int, reply_to: str, op: str, key, target, limit) -> None:
        if op == "qsize":
            meta, frames = (True, None), ray_pipe.dumps(self.store.qsize(key))
        else:
            found, value = await self._take(key, target, limit)
            items = ([value] if op == "get" else value) if found else []
            meta = (found, [len(item) for item in items])
            frames = [frame for item in items for frame in item]
        ray_pipe.OUTBOXES.send(reply_to, (request_id, *meta), frames)

    async def _take(self, key, target: float | None, timeout: float) -> tuple[bool, Any]:
        """(found in time, the item or items); a get that timed out takes nothing."""
        fut = self.store.get(key) if target is None else self.store.get_batch(key, target)
        try:
            return True, await _await_or_cancel(fut, timeout, TimeoutError)
        except TimeoutError:
            return False, None


def create_channel_actor(name: str, namespace: str):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_name = f"tidal.channel.{name}"
    try:
        ray.get_actor(actor_name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise ValueError(f"channel {name!r} already exists in Ray namespace {namespace!r}")
    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(ChannelActor)
        .options(
            name=actor_name,
            namespace=namespace,
            num_cpus=0,
            max_concurrency=10000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        )
        .remote(name)
    )
