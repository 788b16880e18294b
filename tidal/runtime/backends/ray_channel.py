"""Channels on the ``ray`` backend.

Keys in general live in a small *channel actor*; routed keys (``RouteKey``,
``"src->dst:tag"``) of a channel bound to its consumer group (``Channel.bind``) live instead in
the *mailbox* of the destination rank's own process, so the consumer's get is served there
without a call at all: one hop per item instead of two through a central actor.

Unbounded channels (no put ever waits for room) move everything by ZeroMQ (``ray_pipe``): a
put is one message into the inbox of the process holding the key (the reading rank's, or the
channel actor's, which keeps the item as its frames and never unpickles it); gets and qsize of
the channel actor's keys are requests on the same connection, so a process reads its own
writes, answered into the asker's reply inbox. Per connection ZeroMQ keeps the order: FIFO per
producer and key.

Bounded channels keep Ray calls: every put is one call carrying an envelope (channel, key,
producer, sequence number, item), answered when there is room; the channel actor holds only
object references for large items (the producer puts them in the object store once, the
consumer reads them there). Each producer numbers its puts and the mailbox admits them in that
order (Ray does not promise the order of calls to an async actor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import pickle
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

import cloudpickle

from tidal.runtime.backends import ray_pipe
from tidal.runtime.backends.base import ChannelTransport
from tidal.runtime.channel import (
    AsyncWork,
    ChannelStore,
    _await_or_cancel,
    settle,
    timeout_error,
)
from tidal.runtime.defaults import DEFAULT_TIMEOUT_S
from tidal.runtime.errors import ChannelTimeoutError
from tidal.runtime.routekey import RouteKey

REPLY_MARGIN_S = 30.0  # extra time the caller gives the channel actor to answer

# Payloads below this travel inline in the channel actor's call; larger ones go through the
# object store once (put by the producer, read by the consumer, never by the channel actor).
INLINE_LIMIT_BYTES = 100 * 1024
MAX_UNCONFIRMED = 256  # blocking puts whose answers a process may leave unread


class RayTransport(ChannelTransport):
    backend = "ray"

    def __init__(self, name: str, actor, maxsize: int):
        self.name, self.actor, self.maxsize = name, actor, maxsize
        self.home: list | None = None  # the bound consumer group's rank actors
        self.home_ids: list[str] = []
        self.inboxes: list[str] | None = None  # their ZeroMQ inboxes (unbounded channels)
        # unbounded channels reach their channel actor by ZeroMQ too: its inbox, asked for now
        # and read on first use (the actor's process may still be starting)
        self._actor_inbox: str | None = None
        self._actor_inbox_ref = actor.inbox_address.remote() if maxsize == 0 else None

    def bind(self, rank_handles: list) -> bool:
        self.home = [h.actor for h in rank_handles]
        self.home_ids = [a._actor_id.hex() for a in self.home]
        if self.maxsize == 0:  # no put waits for an answer: items go by ZeroMQ (ray_pipe)
            self.inboxes = [h.inbox for h in rank_handles]
        return True

    # -- operations: a routed key of a bound channel goes to its rank's mailbox -----------

    def put(self, key: Hashable, item: Any, weight: float, async_op: bool, timeout: float | None):
        dst = self._home_rank(key)
        if dst is None:
            if self.maxsize == 0:
                self._pipe_to_actor(key, ray_pipe.dumps(item), weight)
                return _DONE
            return self._deliver(self.actor, key, box(item), weight, async_op, timeout)
        if self._is_here(dst):
            fut = MAILBOX.store(self.name, self.maxsize).put(key, item, weight)
            return settle(fut, self.name, "put", key, async_op, timeout)
        if self.inboxes is not None:
            self._pipe(dst, key, ray_pipe.dumps(item), weight)
            return _DONE
        return self._deliver(self.home[dst], key, item, weight, async_op, timeout)

    def put_shared(self, item: Any, keys: list, weight: float, timeout: float | None) -> None:
        homes = [self._home_rank(k) for k in keys]
        if self.inboxes is not None and None not in homes:
            frames = ray_pipe.dumps(item)  # pickled once, sent to each rank
            for key, dst in zip(keys, homes):
                if self._is_here(dst):
                    self.put(key, item, weight, False, timeout)
                else:
                    self._pipe(dst, key, frames, weight)
            return
        if None not in homes:
            import ray

            shared = ByRef(ray.put(item))  # one object-store write; each rank reads it on arrival
            works = [
                self._deliver(self.home[self._home_rank(k)], k, shared, weight, True, timeout)
                for k in keys
            ]
        elif self.maxsize == 0:
            frames = ray_pipe.dumps(item)  # pickled once, queued under each key
            for key in keys:
                self._pipe_to_actor(key, frames, weight)
            return
        else:
            boxed = box(item, force_ref=True)
            works = [self._deliver(self.actor, k, boxed, weight, True, timeout) for k in keys]
        for work in works:
            work.wait()

    def get(self, key: Hashable, async_op: bool, timeout: float | None):
        return self._take("get", key, None, async_op, timeout)

    def get_batch(self, key: Hashable, target_weight: float, async_op: bool, timeout: float | None):
        return self._take("get_batch", key, target_weight, async_op, timeout)

    def qsize(self, key: Hashable) -> int:
        import ray

        self._confirm_sent()
        dst = self._home_rank(key)
        if dst is None and self.maxsize == 0:
            return self._ask_actor("qsize", key, None, DEFAULT_TIMEOUT_S).wait()
        if dst is None:
            return ray.get(self.actor.qsize.remote(key), timeout=DEFAULT_TIMEOUT_S)
        if self._is_here(dst):
            return MAILBOX.store(self.name, self.maxsize).qsize(key)
        return ray.get(
            self.home[dst].mailbox_qsize.remote(self.name, key), timeout=DEFAULT_TIMEOUT_S
        )

    def close(self) -> None:
        self.__dict__["_unacknowledged"] = []
        if self.actor is not None:
            import ray

            ray.kill(self.actor, no_restart=True)
            self.actor = None

    # -- plumbing -------------------------------------------------------------------------

    def _home_rank(self, key) -> int | None:
        if self.home is not None and isinstance(key, RouteKey) and 0 <= key.dst < len(self.home):
            return key.dst
        return None

    def _is_here(self, dst: int) -> bool:
        return current_actor_id() == self.home_ids[dst]

    def _take(self, op: str, key, target: float | None, async_op: bool, timeout: float | None):
        dst = self._home_rank(key)
        if dst is None and self.maxsize == 0:
            work = self._ask_actor(
                op, key, target, DEFAULT_TIMEOUT_S if timeout is None else timeout
            )
            return work if async_op else work.wait()
        if dst is None:
            return self._call(op, key, async_op, timeout, *(() if target is None else (target,)))
        if self._is_here(dst):
            if not async_op:
                _refuse_blocking_on_loop(self.name, op, key)
                self._confirm_sent()
            store = MAILBOX.store(self.name, self.maxsize)
            fut = store.get(key) if target is None else store.get_batch(key, target)
            return settle(fut, self.name, op, key, async_op, timeout)
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        ref = self.home[dst].mailbox_take.remote(self.name, self.maxsize, key, target, limit)
        if not async_op:
            self._confirm_sent()
        return self._reply(
            ref, op, key, limit, async_op, lambda status: self._unpack(status, op, key, limit)
        )

    def _deliver(self, target, key, item, weight: float, async_op: bool, timeout: float | None):
        """One call to the actor holding the key (a rank's mailbox, or the channel actor), its
        arguments in one envelope (Ray serialises each argument on its own). Without
        ``maxsize`` a put cannot wait, so nothing needs to come back: nobody waits
        for its reply (a dead receiver is reported by its group, a dead channel actor by the get)."""
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        acked = self.maxsize > 0 or not async_op
        target_id = target._actor_id.hex()
        with _SEQ_LOCK:  # numbers and submission together: no number is skipped
            seq = _SEQ[(self.name, key, target_id)]
            _SEQ[(self.name, key, target_id)] = seq + 1
            envelope = (self.name, self.maxsize, key, PRODUCER_ID, seq, item, weight, limit, acked)
            ref = self._deliver_method(target, target_id, acked).remote(envelope)
        if not acked:
            return _DONE
        decode = lambda status: self._unpack((status, None), "put", key, limit)  # noqa: E731
        if self.maxsize == 0:
            # a put that cannot wait for room returns once sent; this process's next get or
            # qsize on the channel reads its acknowledgement (errors surface, writes are seen)
            sent = self._sent()
            sent.append(
                RefWork(
                    ref,
                    decode,
                    timeout_error(self.name, "put (no answer)", key, limit),
                    limit + REPLY_MARGIN_S,
                )
            )
            if len(sent) >= MAX_UNCONFIRMED:  # a process that only puts: read them now and then
                self._confirm_sent()
            return _DONE
        return self._reply(ref, "put", key, limit, async_op, decode)

    def _pipe(self, dst: int, key, item_frames: list, weight: float) -> None:
        ray_pipe.OUTBOXES.send(self.inboxes[dst], ("item", self.name, key, weight), item_frames)

    # -- the channel actor by ZeroMQ (unbounded channels) -----------------------------------

    def _pipe_to_actor(self, key, item_frames: list, weight: float) -> None:
        ray_pipe.OUTBOXES.send(self._actor_address(), ("put", key, weight), item_frames)

    def _ask_actor(self, op: str, key, target: float | None, limit: float) -> AsyncWork:
        """A get, get_batch or qsize request on the connection this process's puts took, so it
        comes after them; the actor enforces ``limit`` itself (a timed-out get takes nothing)
        and the answer comes back into this process's reply inbox."""
        address = self._actor_address()
        fut = ray_pipe.REPLIES.ask(
            self,
            self._actor_watch(),
            lambda i, reply_to: ray_pipe.OUTBOXES.send(
                address, ("ask", i, reply_to, op, key, target, limit), []
            ),
            functools.partial(_decode_answer, self.name, op, key, limit),
        )
        no_answer = timeout_error(self.name, op + " (no answer from the channel actor)", key, limit)
        return AsyncWork(fut, no_answer, limit + REPLY_MARGIN_S)

    def _actor_address(self) -> str:
        if self._actor_inbox is None:
            import ray

            if self._actor_inbox_ref is None:
                raise RuntimeError(f"channel {self.name!r}: its channel actor is gone")
            try:
                self._actor_inbox = ray.get(self._actor_inbox_ref, timeout=DEFAULT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"channel {self.name!r}: its channel actor did not start within "
                    f"{DEFAULT_TIMEOUT_S:g} s"
                ) from None
            except ray.exceptions.RayError as exc:
                raise RuntimeError(f"channel {self.name!r}: its channel actor is gone") from exc
        return self._actor_inbox

    def _actor_watch(self) -> ray_pipe.DeathWatch:
        """Requests to a channel actor that died fail at once, not at their timeout."""
        watch = self.__dict__.get("_watch")
        if watch is None:
            name = self.name
            watch = self._watch = ray_pipe.DeathWatch(
                self.actor,
                self,
                lambda cause: RuntimeError(
                    f"channel {name!r}: its channel actor died ({cause or 'it ended'})"
                ),
            )
        return watch

    def _sent(self) -> list:
        return self.__dict__.setdefault("_unacknowledged", [])

    def _confirm_sent(self) -> None:
        sent, self.__dict__["_unacknowledged"] = self._sent(), []
        for work in sent:
            work.wait()

    def _deliver_method(self, target, target_id: str, acked: bool):
        # never ``num_returns=0``: Ray drops such calls made before the actor is up (measured);
        # an unread reply costs little, and Ray runs the call whether or not it is read
        return target.deliver

    def __getstate__(self):
        if self._actor_inbox_ref is not None:  # a process it goes to gets the address
            with contextlib.suppress(RuntimeError):  # (none if the actor died: its gets fail)
                self._actor_address()
        state = dict(self.__dict__)
        for per_process in ("_methods", "_unacknowledged", "_watch"):
            state.pop(per_process, None)
        state["_actor_inbox_ref"] = None
        return state

    def _reply(self, ref, op: str, key, limit: float, async_op: bool, decode):
        work = RefWork(
            ref,
            decode,
            timeout_error(self.name, op + " (no answer from the rank)", key, limit),
            limit + REPLY_MARGIN_S,
        )
        return work if async_op else work.wait()

    def _call(self, op: str, key, async_op: bool, timeout: float | None, *args):
        """Call the channel actor, which enforces ``timeout`` itself (atomically: a timed-out
        get takes nothing); the caller gives it a margin to answer."""
        import ray

        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        reply = getattr(self.actor, op).remote(key, *args, limit)
        no_answer = op + " (no answer from the channel actor)"
        if async_op:
            fut = _chain(reply.future(), lambda status: self._unbox_async(status, op, key, limit))
            return AsyncWork(
                fut, timeout_error(self.name, no_answer, key, limit), limit + REPLY_MARGIN_S
            )
        self._confirm_sent()  # while the get is under way
        try:
            status = ray.get(reply, timeout=limit + REPLY_MARGIN_S)
        except ray.exceptions.GetTimeoutError:
            raise ChannelTimeoutError(self.name, no_answer, key, limit) from None
        value = self._unpack(status, op, key, limit)
        if op == "get":
            return unbox(value)
        if op == "get_batch":
            return [unbox(v) for v in value]
        return None

    def _unbox_async(self, status, op, key, limit):
        value = self._unpack(status, op, key, limit)
        if op == "get":
            return _unbox_future(value)
        if op == "get_batch":
            return _gather([_unbox_future(v) for v in value])
        return None

    def _unpack(self, status, op, key, limit):
        ok, value = status
        if not ok:
            raise ChannelTimeoutError(self.name, op, key, limit)
        return value


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


def deliver_from_pipe(channel: str, key, weight: float, frames: list) -> None:
    """An item that arrived in this process's inbox (an unbounded channel: never waits)."""
    MAILBOX.store(channel, 0).put(key, ray_pipe.loads(frames), weight)


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


class ByRef:
    """An item sent as a reference to the object store (read by the receiving rank)."""

    def __init__(self, ref):
        self.ref = ref


class _Done:
    """The ``AsyncWork`` of a put that needs no answer."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None

    async def async_wait(self, timeout: float | None = None) -> None:
        return None

    def __await__(self):
        return self.async_wait().__await__()


_DONE = _Done()


class RefWork:
    """An ``AsyncWork`` whose reply is a Ray object ref, awaited as such (no thread-safe future
    in between). ``done()`` does not ask Ray: it says False until the reply was read."""

    def __init__(
        self, ref, decode: Callable[[Any], Any], on_timeout: Callable[[], Exception], limit: float
    ):
        self._ref, self._decode, self._on_timeout, self._limit = ref, decode, on_timeout, limit
        self._done, self._value = False, None

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        import ray

        if not self._done:
            try:
                reply = ray.get(self._ref, timeout=self._limit if timeout is None else timeout)
            except ray.exceptions.GetTimeoutError:
                raise self._on_timeout() from None
            self._value, self._done = self._decode(reply), True
        return self._value

    async def async_wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            try:
                reply = await asyncio.wait_for(
                    self._ref, self._limit if timeout is None else timeout
                )
            except TimeoutError:
                raise self._on_timeout() from None
            self._value, self._done = self._decode(reply), True
        return self._value

    def __await__(self):
        return self.async_wait().__await__()


# -- the mailbox of this process's rank -------------------------------------------------------

PRODUCER_ID = uuid.uuid4().hex  # numbers this process's puts per (channel, key)
_SEQ: dict = defaultdict(int)
_SEQ_LOCK = threading.Lock()
_ACTOR_ID: list = []


def current_actor_id() -> str | None:
    """The Ray actor this process runs (None on the driver); asked once."""
    if not _ACTOR_ID:
        import ray

        _ACTOR_ID.append(ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None)
    return _ACTOR_ID[0]


class _Gate:
    """Admits one producer's puts to one key in the order they were numbered."""

    def __init__(self):
        self.next = 0
        self.waiting: dict[int, asyncio.Future] = {}

    async def enter(self, seq: int, timeout: float) -> bool:
        if seq == self.next:
            return True
        turn = asyncio.get_running_loop().create_future()
        self.waiting[seq] = turn
        try:
            await asyncio.wait_for(turn, timeout)
            return True
        except TimeoutError:
            self.waiting.pop(seq, None)
            return False

    def leave(self) -> None:
        self.next += 1
        turn = self.waiting.pop(self.next, None)
        if turn is not None and not turn.done():
            turn.set_result(None)


class Mailbox:
    """The queues of the routed keys homed on this rank, one store per channel."""

    def __init__(self):
        self._stores: dict[str, ChannelStore] = {}
        self._gates: dict[tuple, _Gate] = {}
        # a rank's sync method (a thread) and a delivery (the event loop) may both make a
        # channel's store first: without the lock each could make its own, and a get would wait
        # on one store while the put went to the other (a test hung so, once, in CI)
        self._lock = threading.Lock()

    def store(self, channel: str, maxsize: int) -> ChannelStore:
        with self._lock:
            store = self._stores.get(channel)
            if store is None:
                store = self._stores[channel] = ChannelStore(channel, maxsize)
            return store

    async def deliver(self, envelope: tuple) -> bool | None:
        channel, maxsize, key, producer, seq, item, weight, timeout, acked = envelope
        if isinstance(item, ByRef):
            item = await item.ref
        gate = self._gates.get((channel, key, producer))
        if gate is None:
            gate = self._gates[(channel, key, producer)] = _Gate()
        if not await gate.enter(seq, timeout):
            return False
        fut = self.store(channel, maxsize).put(key, item, weight)
        gate.leave()  # queued (or waiting for room) in order: the next number may follow
        if not acked:
            return None
        try:
            await _await_or_cancel(fut, timeout, TimeoutError)
            return True
        except TimeoutError:
            return False

    async def take(self, channel: str, maxsize: int, key, target: float | None, timeout: float):
        store = self.store(channel, maxsize)
        fut = store.get(key) if target is None else store.get_batch(key, target)
        try:
            return True, await _await_or_cancel(fut, timeout, TimeoutError)
        except TimeoutError:
            return False, None

    def qsize(self, channel: str, key) -> int:
        store = self._stores.get(channel)
        return store.qsize(key) if store is not None else 0


MAILBOX = Mailbox()


def _payload_bytes(item: Any) -> int:
    import numpy as np
    import torch

    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, dict):
        return sum(_payload_bytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(_payload_bytes(v) for v in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(_payload_bytes(getattr(item, f.name)) for f in dataclasses.fields(item))
    return 0


def box(item: Any, force_ref: bool = False) -> tuple:
    import ray

    if force_ref or _payload_bytes(item) >= INLINE_LIMIT_BYTES:
        return ("ref", [ray.put(item)])  # in a list, so Ray passes the reference, not the value
    # pickled here so the channel actor never needs the item's classes
    return ("inline", cloudpickle.dumps(item))


def unbox(boxed: tuple) -> Any:
    import ray

    kind, value = boxed
    return ray.get(value[0]) if kind == "ref" else pickle.loads(value)


def _unbox_future(boxed: tuple) -> cf.Future | Any:
    kind, value = boxed
    return value[0].future() if kind == "ref" else pickle.loads(value)


def _chain(fut: cf.Future, then: Callable[[Any], Any]) -> cf.Future:
    """A future for ``then(fut.result())``; if ``then`` returns a future, its result."""
    out: cf.Future = cf.Future()

    def done(f: cf.Future):
        try:
            value = then(f.result())
        except BaseException as exc:
            out.set_exception(exc)
            return
        if isinstance(value, cf.Future):
            value.add_done_callback(lambda g: _copy_outcome(g, out))
        else:
            out.set_result(value)

    fut.add_done_callback(done)
    return out


def _copy_outcome(src: cf.Future, dst: cf.Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def _resolved(value: Any) -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_result(value)
    return fut


def _gather(items: list) -> cf.Future:
    """One future for a list of futures (or plain values), in order."""
    futures = [f if isinstance(f, cf.Future) else _resolved(f) for f in items]
    out: cf.Future = cf.Future()
    remaining = [len(futures)]
    lock = threading.Lock()
    if not futures:
        out.set_result([])

    def done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                out.set_result([f.result() for f in futures])
            except BaseException as exc:
                out.set_exception(exc)

    for f in futures:
        f.add_done_callback(done)
    return out


class ChannelActor:
    """Holds the queues of one channel on the ray backend (its keys that are not delivered to
    a rank); items arrive boxed, so this actor never needs their classes."""

    def __init__(self, name: str, maxsize: int):
        self.name, self.maxsize = name, maxsize
        self.mailbox = Mailbox()

    async def deliver(self, envelope: tuple) -> bool | None:
        return await self.mailbox.deliver(envelope)

    async def get(self, key, timeout: float):
        return await self.mailbox.take(self.name, self.maxsize, key, None, timeout)

    async def get_batch(self, key, target_weight: float, timeout: float):
        return await self.mailbox.take(self.name, self.maxsize, key, target_weight, timeout)

    def qsize(self, key) -> int:
        return self.mailbox.qsize(self.name, key)

    # an unbounded channel's traffic comes by ZeroMQ (``RayTransport._ask_actor``)
    async def inbox_address(self) -> str:
        return await ray_pipe.INBOX.open({"put": self._put_frames, "ask": self._ask})

    async def until_death(self) -> None:
        """Never answers: the caller's reference fails when this actor's process dies."""
        await asyncio.Event().wait()

    def _put_frames(self, key, weight: float, frames: list) -> None:
        """Kept as the producer's frames: never unpickled here, sent on as they came."""
        item = [f.buffer for f in frames]
        self.mailbox.store(self.name, self.maxsize).put(key, item, weight)

    def _ask(self, request_id: int, reply_to: str, op: str, key, target, limit, frames) -> None:
        asyncio.get_running_loop().create_task(
            self._answer(request_id, reply_to, op, key, target, limit)
        )

    async def _answer(self, request_id: int, reply_to: str, op: str, key, target, limit) -> None:
        if op == "qsize":
            meta, frames = (True, None), ray_pipe.dumps(self.qsize(key))
        else:
            found, value = await self.mailbox.take(self.name, self.maxsize, key, target, limit)
            items = ([value] if op == "get" else value) if found else []
            meta = (found, [len(item) for item in items])
            frames = [frame for item in items for frame in item]
        ray_pipe.OUTBOXES.send(reply_to, (request_id, *meta), frames)


def create_channel_actor(name: str, namespace: str, maxsize: int):
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
        .remote(name, maxsize)
    )
