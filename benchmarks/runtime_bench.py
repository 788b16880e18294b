"""Runtime benchmark: channel throughput against plain ray.put/ray.get, and group-call latency.

    python benchmarks/runtime_bench.py [--repeats 30] [--out benchmarks/results/runtime_bench.json]

Every figure of one table is measured in the same run, side by side, so ratios are fair on a
noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_workers import PingWorker, Sink  # noqa: E402

from tidal.runtime import Channel, Cluster, CommMapper  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def channel_throughput(cluster: Cluster, payload, repeats: int, remote_sink=None) -> float:
    ch = Channel.create(f"bench-{cluster.backend}-{time.monotonic_ns()}", cluster)

    def round_trip():
        ch.put(payload)
        ch.get()

    seconds = timed(round_trip, repeats)
    ch.close()
    return seconds


def cross_process_throughput(cluster: Cluster, payload, repeats: int) -> tuple[float, float, float]:
    """A worker process consumes what the driver puts: channel (through the channel actor, and
    bound to the worker's group: point to point) vs ray.put + actor call."""
    sink = Sink.create_group().launch(cluster, placement=1, name="sink")
    ch = Channel.create(f"bench-x-{time.monotonic_ns()}", cluster)
    bound = Channel.create(f"bench-p2p-{time.monotonic_ns()}", cluster, consumer=sink)
    key = CommMapper.build_channel_key(0, 0, "x")

    def via_channel():
        handle = sink.take(ch)
        ch.put(payload)
        handle.wait(timeout=60)

    def via_bound_channel():
        handle = sink.take(bound, key)
        bound.put(payload, key=key)
        handle.wait(timeout=60)

    actor = ray.remote(num_cpus=0)(_PlainSink).remote()

    def via_plain_ray():
        ray.get(actor.take.remote([ray.put(payload)]))

    results = (
        timed(via_channel, repeats),
        timed(via_bound_channel, repeats),
        timed(via_plain_ray, repeats),
    )
    ch.close()
    bound.close()
    sink.shutdown()
    ray.kill(actor)
    return results


class _PlainSink:
    def take(self, boxed):
        return ray.get(boxed[0]).shape[0]


def call_latency(cluster: Cluster, repeats: int) -> float:
    group = PingWorker.create_group().launch(cluster, placement=1, name=f"ping-{cluster.backend}")
    seconds = timed(lambda: group.ping().wait(timeout=30), repeats)
    group.shutdown()
    return seconds


class _PlainPing:
    def ping(self):
        return 0


def plain_ray_call_latency(repeats: int) -> float:
    """The hand-written reference: one plain Ray actor method call and ``ray.get``."""
    actor = ray.remote(num_cpus=0)(_PlainPing).remote()
    seconds = timed(lambda: ray.get(actor.ping.remote(), timeout=30), repeats)
    ray.kill(actor)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/runtime_bench.json")
    args = parser.parse_args()

    local = Cluster("local")
    ray_cluster = Cluster("ray", ray_init_kwargs={"num_cpus": 2})
    rows = []
    for mb in (1, 10):
        tensor = torch.randn(mb * 1024 * 1024 // 4)
        array = tensor.numpy()
        plain_tensor = timed(lambda t=tensor: ray.get(ray.put(t)), args.repeats)
        plain_numpy = timed(lambda a=array: ray.get(ray.put(a)), args.repeats)
        chan_ray = channel_throughput(ray_cluster, tensor, args.repeats)
        chan_local = channel_throughput(local, tensor, args.repeats)
        x_chan, x_bound, x_plain = cross_process_throughput(ray_cluster, tensor, args.repeats)
        rows.append(
            {
                "payload_mb": mb,
                "ray_put_get_tensor_ms": plain_tensor * 1e3,
                "ray_put_get_numpy_ms": plain_numpy * 1e3,
                "channel_ray_put_get_ms": chan_ray * 1e3,
                "channel_local_put_get_ms": chan_local * 1e3,
                "channel_ray_MBps": mb / chan_ray,
                "ratio_channel_vs_ray_put_get_tensor": plain_tensor / chan_ray,
                "ratio_channel_vs_ray_put_get_numpy": plain_numpy / chan_ray,
                "driver_to_worker_channel_ms": x_chan * 1e3,
                "driver_to_worker_bound_channel_ms": x_bound * 1e3,
                "driver_to_worker_plain_ray_ms": x_plain * 1e3,
                "ratio_driver_to_worker_channel_vs_plain": x_plain / x_chan,
                "ratio_driver_to_worker_bound_channel_vs_plain": x_plain / x_bound,
            }
        )
    latency = {
        "local_call_round_trip_ms": call_latency(local, args.repeats * 10) * 1e3,
        "ray_call_round_trip_ms": call_latency(ray_cluster, args.repeats * 10) * 1e3,
        "plain_ray_actor_call_ms": plain_ray_call_latency(args.repeats * 10) * 1e3,
    }
    latency["ratio_ray_call_vs_plain"] = (
        latency["plain_ray_actor_call_ms"] / latency["ray_call_round_trip_ms"]
    )
    result = {"channel": rows, "latency": latency, "repeats": args.repeats, "cpus": os.cpu_count()}
    ray_cluster.shutdown()

    print(
        f"{'MB':>4} {'ray.put/get tensor':>19} {'ray.put/get numpy':>18} {'channel ray':>12} "
        f"{'ratio(tensor)':>14} {'channel local':>14} {'drv→worker chan':>16} {'drv→worker p2p':>15} "
        f"{'drv→worker ray':>15}"
    )
    for r in rows:
        print(
            f"{r['payload_mb']:>4} {r['ray_put_get_tensor_ms']:>16.2f} ms {r['ray_put_get_numpy_ms']:>15.2f} ms "
            f"{r['channel_ray_put_get_ms']:>9.2f} ms {r['ratio_channel_vs_ray_put_get_tensor']:>13.2f}x "
            f"{r['channel_local_put_get_ms']:>11.3f} ms {r['driver_to_worker_channel_ms']:>13.2f} ms "
            f"{r['driver_to_worker_bound_channel_ms']:>12.2f} ms {r['driver_to_worker_plain_ray_ms']:>12.2f} ms"
        )
    print(
        f"group call round trip: local {latency['local_call_round_trip_ms']:.3f} ms, "
        f"ray {latency['ray_call_round_trip_ms']:.3f} ms, plain Ray actor call "
        f"{latency['plain_ray_actor_call_ms']:.3f} ms"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
