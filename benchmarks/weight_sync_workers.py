"""The ranks of weight_sync_bench.py: a model of a given size that sends or receives its weights."""

from __future__ import annotations

import time

import torch

from tidal.runtime import Worker
from tidal.runtime.weight_sync import WeightLinks, load_checked


def make_model(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers)))


class SyncPeer(Worker, WeightLinks):
    def __init__(self, hidden: int, layers: int, seed: int, threads: int = 1):
        torch.set_num_threads(threads)
        with torch.no_grad():
            self.model = make_model(hidden, layers, seed)
        self.flat = None

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def send(self, link, version: int) -> float:
        start = time.perf_counter()
        self.weight_end(link, "send").send(self.model.state_dict().items(), version)
        return time.perf_counter() - start

    def receive(self, link) -> float:
        start = time.perf_counter()
        end = self.weight_end(link, "recv")
        update = end.recv()
        load_checked(self.model, update.state_dict, adopt=update.owned)
        if update.owned:  # the collective's staged tensors are the model's weights now
            end.adopted()
        return time.perf_counter() - start

    def bare_broadcast(self, link, role: str) -> float:
        """One ``broadcast`` of the model's bytes as a single flat tensor over the link's own
        group: no buckets, headers, staging or checks (the limit)."""
        end = self.weight_end(link, role)
        if self.flat is None:
            self.flat = torch.empty(self.params(), dtype=torch.float32)
        start = time.perf_counter()
        end.pg.broadcast(self.flat, 0).wait()
        return time.perf_counter() - start

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.parameters()))
