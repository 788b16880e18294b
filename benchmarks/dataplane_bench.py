"""Data-plane benchmark: the round trip of one chunk-step-sized item between two ranks of
different groups, through tidal's channels and through hand-written code, side by side in one
run. This is what chose the ray fast path (see BENCHMARKS.md).

  local   tidal (local backend, routed channel ops on the shared loop) against two asyncio
          coroutines handing the item over by asyncio.Queue on one loop.
  ray     tidal via the channel actor, tidal point to point (a channel bound to its reader:
          ZeroMQ), hand-written Ray actors pushing into each other's inbox, hand-written
          ZeroMQ PUSH/PULL between two Ray actors, and torch.distributed gloo send/recv
          between the same two processes.

    python benchmarks/dataplane_bench.py [--n 500] [--batch 128] [--width 4] [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dataplane_workers import Bouncer, GlooPeer, HandRayPeer, ZmqPeer, make_item  # noqa: E402

from tidal.runtime import Channel, Cluster, wait_all  # noqa: E402


def tidal_round_trip(cluster: Cluster, n: int, batch: int, width: int, bound: bool) -> float:
    ping = Bouncer.create_group().launch(cluster, placement=1, name=f"ping-{uuid.uuid4().hex[:4]}")
    pong = Bouncer.create_group().launch(cluster, placement=1, name=f"pong-{uuid.uuid4().hex[:4]}")
    try:
        to_pong = Channel.create(
            f"to-pong-{uuid.uuid4().hex[:6]}", cluster, consumer=pong if bound else None
        )
        to_ping = Channel.create(
            f"to-ping-{uuid.uuid4().hex[:6]}", cluster, consumer=ping if bound else None
        )
        seconds, _ = wait_all(
            [ping.ping(to_pong, to_ping, n, batch, width), pong.pong(to_pong, to_ping, n, batch)],
            timeout=600,
        )
        to_pong.close()
        to_ping.close()
        return seconds[0]
    finally:
        ping.shutdown()
        pong.shutdown()


def hand_asyncio_round_trip(n: int, batch: int, width: int) -> float:
    async def main():
        a, b = asyncio.Queue(), asyncio.Queue()

        async def pong():
            for _ in range(n + 1):
                b.put_nowait(await a.get())

        task = asyncio.create_task(pong())
        item = make_item(batch, width)
        a.put_nowait(item)
        item = await b.get()
        start = time.perf_counter()
        for _ in range(n):
            a.put_nowait(item)
            item = await b.get()
        seconds = (time.perf_counter() - start) / n
        await task
        return seconds

    return asyncio.run(main())


def hand_ray_round_trip(n: int, batch: int, width: int) -> float:
    cls = ray.remote(num_cpus=0)(HandRayPeer)
    a, b = cls.remote(), cls.remote()
    ray.get([a.connect.remote(b), b.connect.remote(a)])
    seconds, _ = ray.get([a.ping.remote(n, batch, width), b.pong.remote(n)], timeout=600)
    for actor in (a, b):
        ray.kill(actor)
    return seconds


def zmq_round_trip(n: int, batch: int, width: int) -> float:
    cls = ray.remote(num_cpus=0)(ZmqPeer)
    a, b = cls.remote(), cls.remote()
    address_a, address_b = ray.get([a.listen.remote(), b.listen.remote()])
    ray.get([a.connect.remote(address_b), b.connect.remote(address_a)])
    seconds, _ = ray.get([a.ping.remote(n, batch, width), b.pong.remote(n)], timeout=600)
    for actor in (a, b):
        ray.kill(actor)
    return seconds


def gloo_round_trip(n: int, batch: int, width: int) -> float:
    cls = ray.remote(num_cpus=0)(GlooPeer)
    a, b = cls.remote(), cls.remote()
    address = ray.get(a.node_address.remote())
    ray.get([a.setup.remote(0, address), b.setup.remote(1, address)], timeout=120)
    seconds, _ = ray.get(
        [a.ping.remote(n, batch, width), b.pong.remote(n, batch, width)], timeout=600
    )
    for actor in (a, b):
        ray.kill(actor)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=500, help="round trips per measurement")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/dataplane_bench.json")
    args = parser.parse_args()
    n, b, w = args.n, args.batch, args.width
    local = Cluster("local", devices_per_node=2)
    local_ms = {
        "hand_asyncio": hand_asyncio_round_trip(n, b, w) * 1e3,
        "tidal_local": tidal_round_trip(local, n, b, w, bound=False) * 1e3,
    }
    local.shutdown()
    ray_cluster = Cluster("ray", devices_per_node=2, ray_init_kwargs={"num_cpus": 2})
    ray_ms = {
        "hand_ray_actors": hand_ray_round_trip(n, b, w) * 1e3,
        "tidal_ray_channel_actor": tidal_round_trip(ray_cluster, n, b, w, bound=False) * 1e3,
        "tidal_ray_point_to_point": tidal_round_trip(ray_cluster, n, b, w, bound=True) * 1e3,
        "gloo_send_recv": gloo_round_trip(n, b, w) * 1e3,
        "hand_zmq": zmq_round_trip(n, b, w) * 1e3,
    }
    ray_cluster.shutdown()
    result = {
        "round_trip_ms": {"local": local_ms, "ray": ray_ms},
        "ratios_vs_hand": {
            "tidal_local": local_ms["hand_asyncio"] / local_ms["tidal_local"],
            "tidal_ray_channel_actor": ray_ms["hand_ray_actors"]
            / ray_ms["tidal_ray_channel_actor"],
            "tidal_ray_point_to_point": ray_ms["hand_ray_actors"]
            / ray_ms["tidal_ray_point_to_point"],
        },
        "n": n,
        "batch": b,
        "width": w,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
