"""EXPERIMENT (``TIDAL_RAY_PIPE=tcp``): ``ray_pipe``'s inbox, outboxes and reply inbox over
plain TCP sockets written from the sending thread, without ZeroMQ's I/O thread on either side.

A message is ``!I`` body length, then the body: ``!H`` frame count, ``!Q`` per frame length,
the frames. A send writes what the kernel takes at once; the rest waits in a backlog that a
writer thread flushes, so a put never waits and one destination's messages keep their order.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import pickle
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
_LEN = struct.Struct("!I")
_COUNT = struct.Struct("!H")
_FRAME = struct.Struct("!Q")
LINGER_S = 5.0


def _host() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _listen() -> tuple[socket.socket, str]:
    host = _host()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(256)
    return sock, f"tcp://{host}:{sock.getsockname()[1]}"


class _Parser:
    """Cuts a byte stream into messages: ``on_message(frames)`` per complete one."""

    def __init__(self, on_message: Callable[[list], None]):
        self.buf = bytearray()
        self.on_message = on_message

    def feed(self, data: bytes) -> None:
        self.buf += data
        buf = self.buf
        start = 0
        while len(buf) - start >= 4:
            (length,) = _LEN.unpack_from(buf, start)
            if len(buf) - start - 4 < length:
                break
            body = memoryview(bytes(buf[start + 4 : start + 4 + length]))
            start += 4 + length
            (count,) = _COUNT.unpack_from(body, 0)
            offset, sizes = 2 + 8 * count, []
            for i in range(count):
                sizes.append(_FRAME.unpack_from(body, 2 + 8 * i)[0])
            frames = []
            for size in sizes:
                frames.append(body[offset : offset + size])
                offset += size
            try:
                self.on_message(frames)
            except Exception:  # a bad message must not stop the inbox; its get times out
                log.exception("socket inbox: could not deliver a message")
        if start:
            del buf[:start]


def _encode(frames: list) -> list:
    views = [memoryview(f).cast("B") for f in frames]
    head = _COUNT.pack(len(views)) + b"".join(_FRAME.pack(v.nbytes) for v in views)
    total = len(head) + sum(v.nbytes for v in views)
    return [memoryview(_LEN.pack(total) + head), *views]


def _dispatch(handlers: dict[str, Callable]) -> Callable[[list], None]:
    def deliver(frames: list) -> None:
        label, *item = frames
        kind, *rest = pickle.loads(label)
        handlers[kind](*rest, item)

    return deliver


class SocketInbox:
    """``ray_pipe.Inbox`` over TCP: the rank's event loop accepts and drains connections."""

    def __init__(self):
        self.address: str | None = None
        self._sock = None

    async def open(self, handlers: dict[str, Callable]) -> str:
        if self.address is None:
            self._sock, self.address = _listen()
            self._sock.setblocking(False)
            loop = asyncio.get_running_loop()
            loop.add_reader(self._sock.fileno(), self._accept, loop, _dispatch(handlers))
        return self.address

    def _accept(self, loop, deliver) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            parser = _Parser(deliver)
            loop.add_reader(conn.fileno(), self._read, loop, conn, parser)

    @staticmethod
    def _read(loop, conn: socket.socket, parser: _Parser) -> None:
        while True:
            try:
                data = conn.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(conn.fileno())
                conn.close()
                return
            parser.feed(data)


class _Peer:
    def __init__(self, address: str):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.backlog: collections.deque = collections.deque()


class SocketOutboxes:
    """``ray_pipe.Outboxes`` over TCP: one connection per inbox, written from the caller's
    thread; what the kernel cannot take at once waits for the writer thread (in order)."""

    def __init__(self):
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        atexit.register(self.flush, LINGER_S)

    def send(self, address: str, label: tuple, item_frames: list) -> None:
        views = _encode([pickle.dumps(label, protocol=5), *item_frames])
        with self._lock:
            try:
                peer = self._peers.get(address) or self._connect(address)
                if not peer.backlog:
                    views = self._write(peer.sock, views)
            except OSError as exc:  # the inbox's process is gone: as ZeroMQ, the put is lost
                log.debug("socket outbox: %s unreachable (%s); message dropped", address, exc)
                self._peers.pop(address, None)
                return
            if views:
                peer.backlog.extend(views)
                self._start_writer()
                self._wake.notify()

    @staticmethod
    def _write(sock: socket.socket, views: list) -> list:
        """Write what the kernel takes now; returns what is left."""
        while views:
            try:
                sent = sock.sendmsg(views)
            except BlockingIOError:
                return views
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]
        return views

    def _connect(self, address: str) -> _Peer:
        peer = self._peers[address] = _Peer(address)
        return peer

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._flush_forever, daemon=True)
            self._writer.start()

    def _flush_forever(self) -> None:
        sel = selectors.DefaultSelector()
        while True:
            with self._lock:
                waiting = [p for p in self._peers.values() if p.backlog]
                if not waiting:
                    self._wake.wait()
                    continue
                for p in waiting:
                    try:
                        left = self._write(p.sock, list(p.backlog))
                    except OSError:  # the peer is gone: what waited for it is lost
                        left = []
                    p.backlog.clear()
                    p.backlog.extend(left)
                waiting = [p for p in waiting if p.backlog]
            if waiting:
                for p in waiting:
                    sel.register(p.sock, selectors.EVENT_WRITE)
                sel.select(0.05)
                for p in waiting:
                    sel.unregister(p.sock)

    def flush(self, timeout: float) -> None:
        """What was put still leaves when this process ends (ZeroMQ's linger)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not any(p.backlog for p in self._peers.values()):
                    return
            time.sleep(0.01)


class SocketReplies:
    """``ray_pipe.Replies``' socket: a thread accepts and drains the reply connections."""

    def open(self, on_message: Callable[[list], None]) -> str:
        sock, address = _listen()
        threading.Thread(
            target=self._serve, args=(sock, on_message), name="tidal-replies", daemon=True
        ).start()
        return address

    @staticmethod
    def _serve(lst: socket.socket, on_message: Callable[[list], None]) -> None:
        sel = selectors.DefaultSelector()
        sel.register(lst, selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select():
                if key.data is None:
                    conn, _ = lst.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sel.register(conn, selectors.EVENT_READ, _Parser(on_message))
                    continue
                try:
                    data = key.fileobj.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    continue
                key.data.feed(data)
