"""Per-update time of the weight transports: actor -> 2 rollout processes on ray.

For each model size (a stack of Linear layers of ~10M, ~100M, ~400M parameters) and each
transport (``channel``, ``collective``, ``disk``, and a bare ``broadcast`` of the same bytes over
the collective's group: the limit), the driver times ``updates`` full updates (send on the actor,
receive + check + load on both rollout ranks) and reports the median. Targets (issue 27):
collective >= 3x faster than channel at >= 100M, and within 1.5x of the bare broadcast.

    PYTHONPATH=$PWD python benchmarks/weight_sync_bench.py --sizes 10M 100M --out /tmp/ws.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync_workers import SyncPeer  # noqa: E402

from tidal.runtime import Cluster, wait_all  # noqa: E402
from tidal.runtime.weight_sync import open_weight_link  # noqa: E402

SIZES = {"10M": (1024, 10), "100M": (2048, 24), "400M": (4096, 24)}  # hidden, layers
TRANSPORTS = ("channel", "collective", "disk", "bare")


def time_updates(
    cluster, sender, receivers, transport: str, updates: int, folder: str, bucket_mb: float
) -> dict:
    link = open_weight_link(
        "collective" if transport == "bare" else transport,
        cluster,
        sender,
        receivers,
        f"bench-{transport}",
        timeout_s=600,
        folder=folder,
        bucket_mb=bucket_mb,
    )
    walls, sends, recvs = [], [], []
    for version in range(updates + 1):  # the first is a warm-up
        start = time.perf_counter()
        if transport == "bare":
            sent, got = wait_all(
                [sender.bare_broadcast(link, "send"), receivers.bare_broadcast(link, "recv")], 600
            )
        else:
            sent, got = wait_all([sender.send(link, version), receivers.receive(link)], 600)
        if version:
            walls.append(time.perf_counter() - start)
            sends.append(sent[0])
            recvs.append(max(got))
    return {
        "update_s": statistics.median(walls),
        "send_s": statistics.median(sends),
        "recv_s": statistics.median(recvs),
        "all_update_s": walls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["10M", "100M"], choices=list(SIZES))
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--out", default="weight_sync_bench.json")
    args = parser.parse_args()
    cluster = Cluster("ray", devices_per_node=3, ray_init_kwargs={"num_cpus": 2})
    results = []
    try:
        for size in args.sizes:
            hidden, layers = SIZES[size]
            sender = SyncPeer.create_group(hidden, layers, 0).launch(cluster, [0], name="actor")
            receivers = SyncPeer.create_group(hidden, layers, 1).launch(
                cluster, [1, 2], name="rollout"
            )
            params = sender.params().wait(60)[0]
            with tempfile.TemporaryDirectory() as folder:
                for transport in args.transports:
                    row = {"size": size, "params": params, "mb": params * 4 / 2**20}
                    row.update(transport=transport)
                    row.update(
                        time_updates(
                            cluster,
                            sender,
                            receivers,
                            transport,
                            args.updates,
                            folder,
                            args.bucket_mb,
                        )
                    )
                    if transport != "bare":
                        want = sender.checksum().wait(60)[0]
                        assert receivers.checksum().wait(60) == [want, want], transport
                    results.append(row)
                    print(
                        json.dumps({k: v for k, v in row.items() if k != "all_update_s"}),
                        flush=True,
                    )
            sender.shutdown()
            receivers.shutdown()
    finally:
        cluster.shutdown()
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
