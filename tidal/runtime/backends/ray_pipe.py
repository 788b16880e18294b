"""The ray backend's fast path: ZeroMQ PUSH → PULL sockets from a producer's process straight
into the consumer rank's mailbox, and group calls the same way.

Channels on ray are unbounded, so a put needs no answer and its item need not be a Ray call
at all. For a channel bound to the group that reads it (``ray_routed``) each rank's process
opens one PULL socket (its *inbox*, on its node's address) and serves it on the rank's event
loop; a producer process keeps one PUSH socket per inbox it sends to. ZeroMQ keeps each connection's messages in
order (keyed FIFO per producer, as the mailbox needs), works across nodes over TCP, and moves a
message without the receiving process running a Ray task (measured: a Ray task per item
competes with the rank's own work for the GIL). vLLM and SGLang move their engines' hot traffic
the same way. Tensors travel as out-of-band NumPy buffers (no copy into the pickle).

An unbound channel's keys live in its channel actor (``ray_channel_actor``), reached the same
way: puts one way, gets and qsize as requests answered into the asker's reply inbox
(``Replies``).

Group calls take the same road (``Replies``): the request goes into the rank's inbox, the
``CallResult`` comes back into the caller's reply inbox (a thread resolving futures), about a
Ray call's cost saved each way. Ray still watches each rank: a call the rank will never answer
because its process died fails with Ray's error (``RayRank``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import copyreg
import functools
import io
import itertools
import logging
import pickle
import threading
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import torch

from tidal.runtime.serialization import tensor_from_payload, tensor_to_payload

log = logging.getLogger(__name__)

COPY_LIMIT_BYTES = 64 * 1024  # ZeroMQ copies small frames faster than it tracks them
LINGER_MS = 5000  # how long an ending process may take to hand over what it put


def _reduce_tensor(t: torch.Tensor):
    array, dtype_name = tensor_to_payload(t)
    data = array.tobytes() if array.nbytes < COPY_LIMIT_BYTES else pickle.PickleBuffer(array)
    return _rebuild_tensor, (data, array.dtype.str, array.shape, dtype_name)


def _rebuild_tensor(data, array_dtype: str, shape: tuple, dtype_name: str) -> torch.Tensor:
    array = np.frombuffer(data, dtype=array_dtype).reshape(shape)
    return tensor_from_payload((array, dtype_name))  # a writable copy of its own


_DISPATCH = ChainMap({torch.Tensor: _reduce_tensor}, copyreg.dispatch_table)


class _CloudPickler(cloudpickle.Pickler):
    """For what the standard pickler cannot send: functions, classes defined in ``__main__``
    or inside functions (pickled by value, as Ray does)."""

    dispatch_table = ChainMap({torch.Tensor: _reduce_tensor}, cloudpickle.Pickler.dispatch_table)


def dumps(item: Any) -> list:
    """``item`` as ZeroMQ frames: the pickle, then each large buffer out of band. The C
    pickler first (cloudpickle costs ~2x on a chunk step's item); cloudpickle when it fails or
    names ``__main__``, which the receiving process does not have."""
    try:
        frames = _dump(pickle.Pickler, item, _DISPATCH)
        if b"__main__" not in frames[0]:  # (a false alarm only costs the slower pickler)
            return frames
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    return _dump(_CloudPickler, item, None)


def _dump(pickler_cls, item: Any, dispatch) -> list:
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = pickler_cls(out, protocol=5, buffer_callback=buffers.append)
    if dispatch is not None:
        pickler.dispatch_table = dispatch
    pickler.dump(item)
    return [out.getvalue(), *(b.raw() for b in buffers)]


def loads(frames: list) -> Any:
    head, *buffers = (f.buffer if hasattr(f, "buffer") else f for f in frames)
    return pickle.loads(head, buffers=buffers)


def pull_socket(context) -> tuple[Any, str]:
    """A PULL socket on this node's address (unbounded, as the channels are) and its address."""
    import ray
    import zmq

    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    host = ray.util.get_node_ip_address()
    return sock, f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"


class Inbox:
    """This process's PULL socket, served on the rank's event loop: every envelope that
    arrives is queued in the rank's mailbox at once (unbounded channels never wait for room).
    The loop watches the socket's file descriptor and a callback drains it, so a message costs
    no future and no task wake-up; measured, a ``zmq.asyncio`` receive added ~80 µs to every
    message against this."""

    def __init__(self):
        self.address: str | None = None
        self._sock = None

    async def open(self, handlers: dict[str, Callable]) -> str:
        """The inbox's address (opened on first use, on the calling event loop). A message's
        label starts with its kind; ``handlers[kind]`` takes the rest of the label and the
        payload's frames (``loads`` makes the item; a channel actor keeps them as they are)."""
        if self.address is None:
            import zmq

            self._sock, self.address = pull_socket(zmq.Context.instance())
            drain = functools.partial(self._drain, self._sock, handlers)
            asyncio.get_running_loop().add_reader(self._sock.getsockopt(zmq.FD), drain)
            drain()  # what arrived before the loop watched the descriptor
        return self.address

    @staticmethod
    def _drain(sock, handlers: dict[str, Callable]) -> None:
        """Every message waiting, until none is left: ZeroMQ signals its descriptor once per
        change of state, not once per message."""
        import zmq

        while True:
            try:
                label, *frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                kind, *rest = pickle.loads(label.buffer)
                handlers[kind](*rest, frames)
            except Exception:  # a bad message must not stop the inbox; its get times out
                log.exception("inbox %s: could not deliver a message", sock)


class Outboxes:
    """This process's PUSH sockets, one per inbox it sends to. One socket per destination and a
    lock around each send keep the process's puts to a rank in the order they were made, from
    whichever thread (ZeroMQ sockets are not thread-safe)."""

    def __init__(self):
        self._sockets: dict[str, Any] = {}
        self._lock = threading.Lock()

    def send(self, address: str, label: tuple, item_frames: list) -> None:
        """One message: ``label`` (what the inbox's ``deliver`` takes before the item), then
        the item's frames (``dumps``)."""
        frames = [pickle.dumps(label, protocol=5), *item_frames]
        copy = all(memoryview(f).nbytes < COPY_LIMIT_BYTES for f in frames)
        with self._lock:
            sock = self._sockets.get(address) or self._connect(address)
            sock.send_multipart(frames, copy=copy)

    def _connect(self, address: str):
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # a put on an unbounded channel never waits
        sock.setsockopt(zmq.LINGER, LINGER_MS)  # what was put still leaves when this process ends
        sock.connect(address)
        self._sockets[address] = sock
        return sock


def _load_answer(meta: list, frames: list) -> Any:
    return loads(frames)


class Replies:
    """This process's reply inbox: the answers to the requests it sent by ZeroMQ (group calls,
    a channel actor's gets), served by a thread (the driver has no event loop) that resolves
    each request's future."""

    def __init__(self):
        self.address: str | None = None
        self._pending: dict[int, tuple[cf.Future, object, Callable]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def expect(self, peer: object, decode: Callable = _load_answer) -> tuple[int, cf.Future]:
        """A new request to ``peer``: its id and the future its answer resolves, with
        ``decode(meta, frames)`` (``meta``: the answer's label after the id)."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self.address is None:
                self._open()
            call_id = next(self._ids)
            self._pending[call_id] = (fut, peer, decode)
        return call_id, fut

    def ask(
        self,
        peer: object,
        watch: DeathWatch,
        send: Callable[[int, str], None],
        decode: Callable = _load_answer,
    ) -> cf.Future:
        """A request to ``peer``: ``send(request_id, reply_address)`` sends it, unless ``watch``
        already knows the peer died; the future fails then, or later if it dies first."""
        request_id, fut = self.expect(peer, decode)
        if watch.error is not None:
            self.fail(peer, watch.error)
        else:
            send(request_id, self.address)
        return fut

    def fail(self, peer: object, error: BaseException) -> None:
        """Fail every request still waiting for ``peer`` (its process died)."""
        with self._lock:
            lost = [i for i, (_, p, _) in self._pending.items() if p is peer]
            futures = [self._pending.pop(i)[0] for i in lost]
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)

    def _open(self) -> None:
        import zmq

        sock, self.address = pull_socket(zmq.Context.instance())
        threading.Thread(
            target=self._serve, args=(sock,), name="tidal-replies", daemon=True
        ).start()

    def _serve(self, sock) -> None:
        while True:
            label, *frames = sock.recv_multipart(copy=False)
            call_id, *meta = pickle.loads(label.buffer)
            with self._lock:
                fut, _, decode = self._pending.pop(call_id, (None, None, None))
            if fut is None or fut.done():
                continue  # its peer was declared dead first, or the caller gave up
            try:
                fut.set_result(decode(meta, frames))
            except Exception as exc:
                fut.set_exception(exc)


class DeathWatch:
    """Ray's word that an actor's process died (its ``until_death`` call fails), turned into
    the failure of every reply this process still awaits from ``peer``: those waits end at
    once, not at their timeout. Per process: its owner does not pickle it."""

    def __init__(self, actor, peer: object, describe: Callable[[BaseException | None], Exception]):
        self.error: Exception | None = None
        self._peer, self._describe = peer, describe
        self._future = actor.until_death.remote().future()
        self._future.add_done_callback(self._died)

    def _died(self, watch: cf.Future) -> None:
        self.error = self._describe(watch.exception())
        REPLIES.fail(self._peer, self.error)


INBOX = Inbox()
OUTBOXES = Outboxes()
REPLIES = Replies()
