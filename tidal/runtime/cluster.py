"""The cluster: nodes, their devices, and the backend that runs ranks on them.

``Cluster("local")`` runs every rank as threads of this process (one node, zero-copy,
debuggable). ``Cluster("ray")`` runs every rank as a Ray actor; it starts Ray when no
cluster is running, or joins the one at ``address``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from tidal.runtime.placement import ComponentPlacement, NodeInfo, RankPlacement, parse_devices

logger = logging.getLogger(__name__)

BACKENDS = ("local", "ray")


class Cluster:
    def __init__(
        self,
        backend: str = "local",
        *,
        address: str | None = None,
        devices_per_node: int | None = None,
        namespace: str = "tidal",
        ray_init_kwargs: Mapping | None = None,
        shared_event_loop: bool = True,
        gil_switch_interval: float | None = 2e-4,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"cluster.backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.namespace = namespace
        self._started_ray = False
        self.shared_event_loop = shared_event_loop
        self._loop_thread = None
        if backend == "ray":
            self.nodes = self._ray_nodes(address, devices_per_node, dict(ray_init_kwargs or {}))
        else:
            # ranks of the local backend are threads: hand the GIL over sooner than Python's
            # default 5 ms, or a rank woken by a peer waits on one still running Python
            if gil_switch_interval is not None:
                sys.setswitchinterval(gil_switch_interval)
            count = devices_per_node or os.cpu_count() or 1
            self.nodes = [NodeInfo(0, "local", "127.0.0.1", count, "cpu")]

    def _ray_nodes(self, address: str | None, devices_per_node: int | None, init_kwargs: dict) -> list[NodeInfo]:
        import ray

        from tidal.runtime.serialization import register_tensor_serializer

        if not ray.is_initialized():
            init_kwargs.setdefault("namespace", self.namespace)
            init_kwargs.setdefault("log_to_driver", True)
            init_kwargs.setdefault("include_dashboard", False)
            if address is not None:
                init_kwargs["address"] = address
            ray.init(**init_kwargs)
            self._started_ray = True
        register_tensor_serializer()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
        nodes = []
        for i, n in enumerate(alive):
            gpus = int(n["Resources"].get("GPU", 0))
            kind = "gpu" if gpus else "cpu"
            count = devices_per_node or gpus or int(n["Resources"].get("CPU", 1)) or 1
            nodes.append(NodeInfo(i, n["NodeID"], n["NodeManagerAddress"], count, kind))
        return nodes

    @property
    def num_devices(self) -> int:
        return sum(n.num_devices for n in self.nodes)

    def placement(self, mapping: Mapping, exclusive: bool = False) -> ComponentPlacement:
        return ComponentPlacement(mapping, self.num_devices, exclusive=exclusive)

    def rank_placements(self, devices: list[int]) -> list[RankPlacement]:
        """One ``RankPlacement`` per device, rank i on the i-th device listed."""
        out = []
        for rank, device in enumerate(devices):
            start = 0
            for node in self.nodes:
                if device < start + node.num_devices:
                    out.append(RankPlacement(rank, device, node, device - start))
                    break
                start += node.num_devices
            else:
                raise ValueError(f"device {device} is out of range 0-{self.num_devices - 1}")
        return out

    def resolve_devices(self, placement, name: str) -> list[int]:
        """Devices for a group: a ``ComponentPlacement`` (looked up by the group name), a device
        spec (``"0-3"``, ``"all"``, a list) or a plain count of ranks (``2`` → devices 0-1)."""
        if isinstance(placement, ComponentPlacement):
            return placement.devices(name)
        if isinstance(placement, int) and not isinstance(placement, bool):
            return parse_devices(list(range(placement)), self.num_devices, what=f"{name}.placement")
        return parse_devices(placement, self.num_devices, what=f"{name}.placement")

    def shared_loop(self):
        """The event loop the local backend's ranks share for their ``async`` methods (None
        when each rank has its own)."""
        if self.backend != "local" or not self.shared_event_loop:
            return None
        if self._loop_thread is None:
            from tidal.runtime.worker import EventLoopThread

            self._loop_thread = EventLoopThread("tidal-local-loop")
        return self._loop_thread

    def shutdown(self) -> None:
        if self._loop_thread is not None:
            self._loop_thread.stop()
            self._loop_thread = None
        if self.backend == "ray" and self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
