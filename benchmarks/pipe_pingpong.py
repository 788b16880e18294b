"""Round trip of one small message between two processes, each an asyncio loop that drains its
inbox from a reader callback and answers at once (the pattern of an env rank and a rollout rank
at one pipeline stage): ZeroMQ PUSH/PULL, as ``tidal.runtime.backends.ray_pipe`` sends, against
a length-prefixed TCP socket written from the sending thread. A ZeroMQ message crosses the I/O
thread of each side (three wake-ups a hop); a socket write wakes the receiver alone.

  python benchmarks/pipe_pingpong.py [--n 2000] [--size 1500] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import struct
import time

LABEL = b"l" * 60  # about a routed put's label


def zmq_side(role: str, mine: mp.Queue, theirs: mp.Queue, n: int, size: int, out: mp.Queue):
    import zmq

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    mine.put(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    push = ctx.socket(zmq.PUSH)
    push.connect(theirs.get())
    payload = [LABEL, b"x" * size]
    loop = asyncio.new_event_loop()
    done, count, start = loop.create_future(), [0], [0.0]

    def drain():
        while True:
            try:
                pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            count[0] += 1
            if count[0] >= n and not done.done():
                done.set_result(time.perf_counter() - start[0])
            if count[0] < n or role == "b":
                push.send_multipart(payload)

    loop.add_reader(pull.getsockopt(zmq.FD), drain)
    loop.run_until_complete(_run(role, start, done, lambda: push.send_multipart(payload), out, n))


def tcp_side(role: str, mine: mp.Queue, theirs: mp.Queue, n: int, size: int, out: mp.Queue):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    mine.put(listener.getsockname()[1])
    conn_out = socket.create_connection(("127.0.0.1", theirs.get()))
    conn_out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn_in, _ = listener.accept()
    conn_in.setblocking(False)
    message = struct.pack("!I", len(LABEL) + size) + LABEL + b"x" * size
    loop = asyncio.new_event_loop()
    done, count, start, buf = loop.create_future(), [0], [0.0], bytearray()

    def drain():
        try:
            while chunk := conn_in.recv(1 << 16):
                buf.extend(chunk)
        except BlockingIOError:
            pass
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from("!I", buf)[0]:
            length = struct.unpack_from("!I", buf)[0]
            bytes(buf[4 : 4 + length])  # the message, as a receiver would take it
            del buf[: 4 + length]
            count[0] += 1
            if count[0] >= n and not done.done():
                done.set_result(time.perf_counter() - start[0])
            if count[0] < n or role == "b":
                conn_out.sendall(message)

    loop.add_reader(conn_in.fileno(), drain)
    loop.run_until_complete(_run(role, start, done, lambda: conn_out.sendall(message), out, n))


async def _run(role, start, done, send_first, out, n):
    await asyncio.sleep(0.3)  # both sides connected
    start[0] = time.perf_counter()
    if role == "a":
        send_first()
    seconds = await done
    if role == "a":
        out.put(seconds / n)


def round_trip(side, n: int, size: int) -> float:
    qa, qb, out = mp.Queue(), mp.Queue(), mp.Queue()
    procs = [
        mp.Process(target=side, args=(r, *q, n, size, out))
        for r, q in (("a", (qa, qb)), ("b", (qb, qa)))
    ]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--size", type=int, default=1500)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.trials):
        z = round_trip(zmq_side, args.n, args.size)
        t = round_trip(tcp_side, args.n, args.size)
        print(f"round trip: zeromq {z * 1e6:.0f} us, tcp socket {t * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    main()
