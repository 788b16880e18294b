"""Workers for benchmarks/dataplane_bench.py (importable by Ray worker processes): one item
bounced between two ranks of different groups, through tidal and through hand-written code."""

from __future__ import annotations

import asyncio
import time

import torch

from tidal.runtime import Outbox, Worker, async_recv_batch


def make_item(batch: int, width: int) -> dict:
    """About what one chunk step of CartPole carries: observations and a few flags."""
    return {"obs": torch.randn(batch, width), "done": torch.zeros(batch, 1, dtype=torch.bool)}


class Bouncer(Worker):
    """Rank 0 of group "ping" sends, rank 0 of group "pong" sends it back, ``n`` times."""

    async def ping(self, out_ch, in_ch, n: int, batch: int, width: int) -> float:
        item, outbox = make_item(batch, width), Outbox()
        await self._bounce(outbox, out_ch, in_ch, item, batch)  # warm-up
        start = time.perf_counter()
        for _ in range(n):
            item = await self._bounce(outbox, out_ch, in_ch, item, batch)
        await outbox.flush()
        return (time.perf_counter() - start) / n

    async def pong(self, in_ch, out_ch, n: int, batch: int) -> int:
        outbox = Outbox()
        for _ in range(n + 1):
            item = await async_recv_batch(in_ch, 0, 1, 1, batch, tag="ping", timeout=60)
            await outbox.send(out_ch, item, 0, 1, 1, tag="pong")
        await outbox.flush()
        return n

    @staticmethod
    async def _bounce(outbox, out_ch, in_ch, item, batch):
        await outbox.send(out_ch, item, 0, 1, 1, tag="ping")
        return await async_recv_batch(in_ch, 0, 1, 1, batch, tag="pong", timeout=60)


class HandRayPeer:
    """Hand-written Ray: an async actor with an inbox; the peer pushes into it directly."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.peer = None

    def connect(self, peer) -> None:
        self.peer = peer

    async def push(self, item) -> None:
        self.inbox.put_nowait(item)

    async def ping(self, n: int, batch: int, width: int) -> float:
        item = make_item(batch, width)
        self.peer.push.remote(item)
        item = await self.inbox.get()
        start = time.perf_counter()
        for _ in range(n):
            self.peer.push.remote(item)
            item = await self.inbox.get()
        return (time.perf_counter() - start) / n

    async def pong(self, n: int) -> int:
        for _ in range(n + 1):
            self.peer.push.remote(await self.inbox.get())
        return n


class ZmqPeer:
    """Hand-written ZeroMQ: an async actor with a PULL socket on its event loop; the peer
    pushes pickled items into it (what tidal's fast path does, without tidal)."""

    async def listen(self) -> str:
        import ray
        import zmq
        import zmq.asyncio

        self.pull = zmq.asyncio.Context.instance().socket(zmq.PULL)
        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{self.pull.bind_to_random_port(f'tcp://{host}')}"

    def connect(self, address: str) -> None:
        import zmq

        self.push = zmq.Context.instance().socket(zmq.PUSH)
        self.push.connect(address)

    async def ping(self, n: int, batch: int, width: int) -> float:
        import pickle

        item = make_item(batch, width)
        for i in range(n + 1):
            if i == 1:
                start = time.perf_counter()
            self.push.send(pickle.dumps(item, protocol=5))
            item = pickle.loads(await self.pull.recv())
        return (time.perf_counter() - start) / n

    async def pong(self, n: int) -> int:
        for _ in range(n + 1):
            self.push.send(await self.pull.recv())
        return n


class GlooPeer:
    """``torch.distributed`` send/recv over gloo between two processes (the same tensors)."""

    def setup(self, rank: int, address: str) -> None:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=address,
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )

    def node_address(self) -> str:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def ping(self, n: int, batch: int, width: int) -> float:
        import torch.distributed as dist

        item = make_item(batch, width)
        obs, done = item["obs"], item["done"].to(torch.uint8)
        for i in range(n + 1):
            if i == 1:
                start = time.perf_counter()
            dist.send(obs, 1)
            dist.send(done, 1)
            dist.recv(obs, 1)
            dist.recv(done, 1)
        return (time.perf_counter() - start) / n

    def pong(self, n: int, batch: int, width: int) -> int:
        import torch.distributed as dist

        item = make_item(batch, width)
        obs, done = item["obs"], item["done"].to(torch.uint8)
        for _ in range(n + 1):
            dist.recv(obs, 0)
            dist.recv(done, 0)
            dist.send(obs, 0)
            dist.send(done, 0)
        return n
