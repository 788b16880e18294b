"""uvicorn's HTTP/1.1 protocol with bounds on what a client may hold: the time to send a
request's headers, the time to send its body, and the number of open connections.

Without them a client that opens connections and sends nothing (or half a request) holds a
file descriptor each for ever; at the descriptor limit the server can accept nothing, not
even ``/health``. Here a request must arrive within its time or its connection is closed,
and at the connection limit a new connection evicts the connection that has waited longest
for its request (one with a request being served is never evicted), so the newcomer is
served. When every connection is serving a request the newcomer gets a 503.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time

from tidal.extras import needs_extra

with needs_extra("llm", "the inference server"):
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

_WAITING = (h11.IDLE, h11.SEND_BODY)  # the client has not finished sending its request
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
FD_RESERVE = 16  # descriptors kept free for the process itself (weight files, logs, pipes)
ACCEPT_SLACK = 8  # connections accepted but not yet set up, and evicted but not yet closed


def default_max_connections(cap: int = 1024) -> int:
    """What the descriptor limit leaves, after the descriptors already open, a reserve and the
    slack, at most ``cap``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return cap
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a busy process
        open_now = soft // 2
    return max(4, min(cap, soft - open_now - FD_RESERVE - 2 * ACCEPT_SLACK))


class ConnectionGuard:
    """The bounds, the listening socket that respects them, and the protocol that enforces them.

    asyncio accepts every queued connection in one go (up to the listen backlog) before any of
    them is set up, so at a descriptor limit it fails with EMFILE and stops accepting for a
    second. The listener here stops accepting once ``max_connections`` plus a small slack are
    open or being set up; the rest wait in the kernel's queue until evictions make room."""

    def __init__(
        self,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 120.0,
        max_connections: int | None = None,
    ):
        for name, value in (
            ("header_timeout_s", header_timeout_s),
            ("body_timeout_s", body_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {max_connections}")
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.max_connections = max_connections or default_max_connections()
        self.open = 0  # connections set up and not yet closed or evicted
        self.pending = 0  # accepted, not yet set up

    def listener(self, family: int = socket.AF_INET) -> socket.socket:
        return _Listener(self, family, socket.SOCK_STREAM)

    def protocol(self) -> type[H11Protocol]:
        """A protocol class for ``uvicorn.Config(http=...)``."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})


class _Listener(socket.socket):
    def __init__(self, guard: ConnectionGuard, *args):
        super().__init__(*args)
        self.guard = guard

    def accept(self):
        g = self.guard
        if g.open + g.pending >= g.max_connections + ACCEPT_SLACK:
            raise BlockingIOError  # "nothing to accept" for now: asyncio tries again next tick
        conn = super().accept()
        g.pending += 1
        return conn


class GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        g = self.guard
        self._read_timer: asyncio.TimerHandle | None = None
        self._waiting_since = time.monotonic()
        self._counted = True
        g.pending = max(0, g.pending - 1)
        g.open += 1
        super().connection_made(transport)
        if g.open > g.max_connections and not self._evict_one():
            transport.write(_BUSY)
            self._uncount()
            transport.close()
            return
        self._arm(g.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._uncount()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            self.guard.open -= 1

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            # the first bytes of a request on a kept-alive connection (uvicorn just stopped
            # its keep-alive timer): the headers must now arrive in time
            self._waiting_since = time.monotonic()
            self._arm(self.guard.header_timeout_s)
        super().data_received(data)

    def handle_events(self) -> None:
        had_headers = self.conn.their_state is not h11.IDLE
        super().handle_events()
        state = self.conn.their_state
        if state is h11.SEND_BODY and not had_headers:
            self._arm(self.guard.body_timeout_s)  # headers done: the body has its own bound
        elif state not in _WAITING:
            self._disarm()  # the request is complete (or the connection is closing)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_read_timer", None) is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            log.info("closing %s: its request did not arrive in time", self.client)
            self.transport.close()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for its request; False if none waits."""
        waiting = [
            c
            for c in self.connections
            if c is not self and isinstance(c, GuardedH11Protocol) and c._is_waiting()
        ]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: c._waiting_since)
        victim._disarm()
        victim._uncount()
        victim.transport.close()
        return True

    def _is_waiting(self) -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        serving = self.cycle is not None and not self.cycle.response_complete
        return self.conn.their_state in _WAITING and not (
            serving and self.conn.their_state is h11.IDLE
        )
