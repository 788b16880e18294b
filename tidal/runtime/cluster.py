"""The cluster: nodes, their devices, and the backend that runs ranks on them.

``Cluster("local")`` runs every rank as threads of this process (one node, zero-copy,
debuggable). ``Cluster("ray")`` runs every rank as a Ray actor; it starts Ray when no
cluster is running, or joins the one at ``address``. Backends register by name
(``tidal.runtime.backends``).
"""

from __future__ import annotations

from collections.abc import Mapping

from tidal.runtime.backends import BackendOptions, backend_class
from tidal.runtime.placement import ComponentPlacement, RankPlacement, parse_devices
from tidal.runtime.rank import EventLoopThread


class Cluster:
    def __init__(
        self,
        backend: str = "local",
        *,
        address: str | None = None,
        connect_timeout_s: float = 30.0,
        devices_per_node: int | None = None,
        namespace: str = "tidal",
        ray_init_kwargs: Mapping | None = None,
        shared_event_loop: bool = True,
        gil_switch_interval: float | None = None,
        pin_cpus: bool = False,
    ):
        """``gil_switch_interval`` (local backend, opt-in): seconds for
        ``sys.setswitchinterval`` while the cluster lives, e.g. ``2e-4`` so a rank woken by a
        peer gets the GIL sooner than Python's 5 ms; the previous value returns at shutdown.
        ``pin_cpus`` (process backends, CPU nodes): each rank's process runs on the core of its
        CPU slot only (``placement.pin_to_cpu_slot``)."""
        options = BackendOptions(
            namespace=namespace,
            address=address,
            connect_timeout_s=connect_timeout_s,
            devices_per_node=devices_per_node,
            ray_init_kwargs=dict(ray_init_kwargs or {}),
            shared_event_loop=shared_event_loop,
            gil_switch_interval=gil_switch_interval,
            pin_cpus=pin_cpus,
        )
        self.backend = backend
        self.namespace = namespace
        self.backend_impl = backend_class(backend)(options)
        self.nodes = self.backend_impl.start()
        self._launched: dict[str, list] = {}  # group name -> its rank handles (process hosts)

    @property
    def num_devices(self) -> int:
        return sum(n.num_devices for n in self.nodes)

    def placement(
        self, mapping: Mapping, exclusive: bool = False, same_process: tuple | list = ()
    ) -> ComponentPlacement:
        return ComponentPlacement(
            mapping, self.num_devices, exclusive=exclusive, same_process=same_process
        )

    def launched(self, name: str, ranks: list) -> None:
        """Record a launched group's rank handles (a later group may join their processes)."""
        self._launched[name] = list(ranks)

    def host_ranks(self, placement, name: str) -> list | None:
        """The rank handles whose processes group ``name`` joins (``same_process``): those of
        its first partner already launched; None when it starts processes of its own."""
        if not isinstance(placement, ComponentPlacement):
            return None
        for partner in placement.process_partners(name):
            if partner in self._launched:
                return self._launched[partner]
        return None

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

    def shared_loop(self) -> EventLoopThread | None:
        """The event loop the backend's ranks share for their ``async`` methods (None when
        each rank has its own)."""
        return self.backend_impl.shared_loop()

    def where(self) -> str:
        """Where the ranks' running calls are now (ranks in this process), for timeouts."""
        return self.backend_impl.where()

    def abandon(self) -> None:
        """The run failed: ranks shut down from now on are ended at once, without waiting for
        them to close (one of them may hang), so that the exit is prompt."""
        self.backend_impl.abandon()

    def shutdown(self) -> None:
        """End every rank this cluster launched that is still running (a group a failing run
        never shut down), then the backend."""
        try:
            for ranks in self._launched.values():
                for rank in ranks:
                    rank.kill()
            self._launched.clear()
        finally:
            self.backend_impl.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
