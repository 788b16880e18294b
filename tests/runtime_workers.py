"""Worker classes used by the runtime tests (importable by Ray worker processes)."""

import asyncio
import os
import threading
import time
from dataclasses import dataclass

import torch

from tidal.runtime import Worker, async_recv_batch, recv_batch, recv_weights, send_batch


class EchoWorker(Worker):
    def __init__(self, offset=0):
        self.offset = offset
        self.counter = 0

    def info(self):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "group": self.group_name,
            "device": self.device,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        }

    def add(self, x):
        return x + self.rank + self.offset

    def env(self, *names):
        return {n: os.environ.get(n) for n in names}

    def cpu_affinity(self):
        """The cores this rank's calls run on, and those of a thread it starts now."""
        seen = []
        thread = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        thread.start()
        thread.join()
        return sorted(os.sched_getaffinity(0)), seen[0]

    def node_id(self):
        import ray

        return ray.get_runtime_context().get_node_id()

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def fail_on(self, rank):
        if self.rank == rank:
            raise KeyError(f"boom on {rank}")
        return self.rank

    def die_on(self, rank):
        if self.rank == rank:
            os._exit(1)
        time.sleep(60)

    async def async_add(self, x):
        await asyncio.sleep(0.01)
        return x * 10 + self.rank

    async def consume(self, channel, key, n):
        return [await channel.get(key=key, async_op=True, timeout=30) for _ in range(n)]

    def produce(self, channel, key, n):
        for i in range(n):
            channel.put((self.rank, i), key=key)
        return n

    def produce_then_die(self, channel, key, n):
        """Puts ``n`` items, then the process dies in the middle of the transfer."""
        for i in range(n):
            channel.put((self.rank, i), key=key)
        time.sleep(0.2)
        os._exit(1)

    def long_compute_then_report(self, seconds):
        time.sleep(seconds)
        self.counter += 1
        return self.counter

    def allreduce(self):
        import torch.distributed as dist

        self.init_distributed("gloo")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    def send_shard(self, channel, src_world, dst_world, per_rank):
        base = self.rank * per_rank
        batch = {
            "x": torch.arange(base, base + per_rank),
            "meta": {"y": torch.arange(base, base + per_rank) * 2.0},
        }
        send_batch(channel, batch, self.rank, src_world, dst_world, tag="t")
        return per_rank

    def recv_shard(self, channel, src_world, dst_world, global_batch):
        out = recv_batch(
            channel, self.rank, src_world, dst_world, global_batch, tag="t", timeout=60
        )
        return out["x"].tolist(), out["meta"]["y"].tolist()

    async def async_recv_shard(self, channel, src_world, dst_world, global_batch):
        out = await async_recv_batch(
            channel, self.rank, src_world, dst_world, global_batch, tag="t", timeout=60
        )
        return out["x"].tolist()

    def owns_loop(self):
        return self.owns_event_loop

    def put_tensor(self, channel, key):
        """Put a tensor (kept, so its memory stays this one's) and return where its data is."""
        self.kept = torch.arange(4.0) + self.rank
        channel.put(self.kept, key=key)
        return self.kept.data_ptr()

    async def get_tensor(self, channel, key):
        t = await channel.get(key=key, async_op=True, timeout=30)
        return t.data_ptr(), t.tolist()

    def load_weights(self, channel):
        model = torch.nn.Linear(3, 2)
        update = recv_weights(channel, self.rank, timeout=60)
        model.load_state_dict(update.state_dict)
        return update.version, model.weight.sum().item()


class BrokenWorker(Worker):
    def __init__(self):
        raise RuntimeError("cannot start")


@dataclass
class TwoSections:
    """A run config in miniature: one section the worker reads, one it does not."""

    used: dict
    unused: str


class SectionsWorker(Worker):
    config_sections = ("used",)

    def __init__(self, cfg, offset=0):
        self.cfg, self.offset = cfg, offset

    def received(self) -> list[str]:
        return [name for name in vars(self.cfg) if not name.startswith("_")]

    def read(self, section: str):
        try:
            return getattr(self.cfg, section)
        except AttributeError as e:
            return f"AttributeError: {e}"
