"""Channels on the ``ray`` backend: the queues live in a small Ray actor that holds only
object references. The producer puts a large item in the object store once and the consumer
reads it from there, so payloads never pass through the channel actor."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import pickle
import threading
from collections.abc import Callable, Hashable
from typing import Any

import cloudpickle

from tidal.runtime.backends.base import ChannelTransport
from tidal.runtime.channel import AsyncWork, ChannelStore, _await_or_cancel, timeout_error
from tidal.runtime.defaults import DEFAULT_TIMEOUT_S
from tidal.runtime.errors import ChannelTimeoutError

REPLY_MARGIN_S = 30.0  # extra time the caller gives the channel actor to answer

# Payloads below this travel inline in the channel actor's call; larger ones go through the
# object store once (put by the producer, read by the consumer, never by the channel actor).
INLINE_LIMIT_BYTES = 100 * 1024


class RayTransport(ChannelTransport):
    backend = "ray"

    def __init__(self, name: str, actor):
        self.name, self.actor = name, actor

    def put(self, key: Hashable, item: Any, weight: float, async_op: bool, timeout: float | None):
        return self._call("put", key, async_op, timeout, box(item), weight)

    def put_shared(self, item: Any, keys: list, weight: float, timeout: float | None) -> None:
        boxed = box(item, force_ref=True)
        for key in keys:
            self._call("put", key, False, timeout, boxed, weight)

    def get(self, key: Hashable, async_op: bool, timeout: float | None):
        return self._call("get", key, async_op, timeout)

    def get_batch(self, key: Hashable, target_weight: float, async_op: bool, timeout: float | None):
        return self._call("get_batch", key, async_op, timeout, target_weight)

    def qsize(self, key: Hashable) -> int:
        import ray

        return ray.get(self.actor.qsize.remote(key), timeout=DEFAULT_TIMEOUT_S)

    def close(self) -> None:
        if self.actor is not None:
            import ray

            ray.kill(self.actor, no_restart=True)
            self.actor = None

    def _call(self, op: str, key, async_op: bool, timeout: float | None, *args):
        """Call the channel actor, which enforces ``timeout`` itself (atomically: a timed-out
        get takes nothing); the caller gives it a margin to answer."""
        import ray

        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        reply = getattr(self.actor, op).remote(key, *args, limit)
        no_answer = op + " (no answer from the channel actor)"
        if async_op:
            fut = _chain(reply.future(), lambda status: self._unbox_async(status, op, key, limit))
            return AsyncWork(fut, timeout_error(self.name, no_answer, key, limit), limit + REPLY_MARGIN_S)
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
    """Holds the queues of one channel on the ray backend; items are boxed object refs."""

    def __init__(self, name: str, maxsize: int):
        self.store = ChannelStore(name, maxsize)

    async def _await(self, fut: cf.Future, timeout: float):
        try:
            return True, await _await_or_cancel(fut, timeout, lambda: TimeoutError())
        except TimeoutError:
            return False, None

    async def put(self, key, boxed: tuple, weight: float, timeout: float):
        return await self._await(self.store.put(key, boxed, weight), timeout)

    async def get(self, key, timeout: float):
        return await self._await(self.store.get(key), timeout)

    async def get_batch(self, key, target_weight: float, timeout: float):
        return await self._await(self.store.get_batch(key, target_weight), timeout)

    def qsize(self, key) -> int:
        return self.store.qsize(key)


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
