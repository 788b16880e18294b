"""Placement: which devices (GPUs, or CPU slots where there is none) each component's ranks use.

Devices are numbered globally across nodes: node 0 holds devices ``0 .. n0-1``, node 1 the
next ``n1``, and so on. A component gets one rank per device it is placed on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tidal.runtime.errors import PlacementError

CPU_SLOT_ENV = "TIDAL_CPU_SLOT"


@dataclass(frozen=True)
class NodeInfo:
    index: int
    node_id: str
    ip: str
    num_devices: int
    device_kind: str  # "gpu" or "cpu"


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs: the global device, its node, and its index on that node."""

    rank: int
    device: int
    node: NodeInfo
    local_device: int

    def device_env(self, pin_cpus: bool = False) -> dict[str, str]:
        """Environment that pins the rank to its device: CUDA_VISIBLE_DEVICES on GPU nodes; on
        CPU nodes, with ``pin_cpus``, the CPU slot its process pins itself to (``pin_to_cpu_slot``)."""
        if self.node.device_kind == "gpu":
            return {"CUDA_VISIBLE_DEVICES": str(self.local_device)}
        return {CPU_SLOT_ENV: str(self.local_device)} if pin_cpus else {}


def pin_to_cpu_slot(slot: int) -> set[int]:
    """Pin every thread of this process, and so every thread it starts later, to one core:
    slot ``s`` of a node takes the ``s mod n``-th of the ``n`` cores the process may use. Ranks
    placed on different slots then never take each other's core (the kernel otherwise moves
    them around, so an overlapped collection lands on the trainer's core)."""
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("cluster.pin_cpus: this OS cannot pin threads to cores (needs Linux)")
    allowed = sorted(os.sched_getaffinity(0))
    core = {allowed[slot % len(allowed)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:  # the thread ended meanwhile
            pass
    return core


def parse_devices(
    spec: str | int | list[int], num_devices: int, what: str = "placement"
) -> list[int]:
    """``"0-3"``, ``"0,2,5"``, ``"0-1,4"``, ``"all"``, an int or a list → sorted device ids.

    Errors name ``what`` (the config key) and the rule broken: out of range, duplicated, empty.
    """
    if isinstance(spec, bool):
        raise PlacementError(
            f"{what}: expected a device spec like '0-3', '0,2,5' or 'all', got {spec!r}"
        )
    if isinstance(spec, int):
        devices = [spec]
    elif isinstance(spec, (list, tuple)):
        devices = list(spec)
    elif isinstance(spec, str):
        devices = _parse_spec_string(spec.strip(), num_devices, what)
    else:
        raise PlacementError(
            f"{what}: expected a device spec like '0-3', '0,2,5' or 'all', got {spec!r}"
        )
    if not devices:
        raise PlacementError(f"{what}: places no device ({spec!r})")
    for d in devices:
        if not isinstance(d, int) or not 0 <= d < num_devices:
            raise PlacementError(
                f"{what}: device {d!r} is out of range; the cluster has devices 0-{num_devices - 1}"
            )
    duplicates = sorted({d for d in devices if devices.count(d) > 1})
    if duplicates:
        raise PlacementError(f"{what}: devices {duplicates} are listed more than once in {spec!r}")
    return sorted(devices)


def _parse_spec_string(spec: str, num_devices: int, what: str) -> list[int]:
    if spec == "all":
        return list(range(num_devices))
    devices: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part), int(part))
        except ValueError:
            raise PlacementError(
                f"{what}: cannot read {part!r}; expected '0-3', '0,2,5' or 'all'"
            ) from None
        if hi < lo:
            raise PlacementError(f"{what}: range {part!r} runs backwards")
        devices.extend(range(lo, hi + 1))
    return devices


class ComponentPlacement:
    """Devices per component from a mapping such as ``{"env": "0-1", "rollout": "2-3"}``,
    ``{"actor,rollout": "all"}`` (collocated) or a mix (hybrid).

    Components in one key share the devices. With ``exclusive=True`` different keys must not
    share a device (a disaggregated layout); otherwise overlap between keys is allowed.

    ``same_process``: entries such as ``"env,rollout"`` whose components run rank ``i`` in one
    process (on a backend with a process per rank): items between them then pass in memory, not
    as messages. They must be placed on the same devices; whichever is launched first starts the
    processes, the others join them.
    """

    def __init__(
        self,
        mapping: Mapping[str, str | int | list[int]],
        num_devices: int,
        exclusive: bool = False,
        same_process: list[str] | tuple[str, ...] = (),
    ):
        if not mapping:
            raise PlacementError("placement: no component is placed")
        self.num_devices = num_devices
        self._devices: dict[str, list[int]] = {}
        for key, spec in mapping.items():
            names = [n.strip() for n in str(key).split(",") if n.strip()]
            if not names:
                raise PlacementError(f"placement: key {key!r} names no component")
            devices = parse_devices(spec, num_devices, what=f"placement.{key}")
            for name in names:
                if name in self._devices:
                    raise PlacementError(
                        f"placement: component {name!r} is placed twice (in {key!r})"
                    )
                self._devices[name] = devices
        if exclusive:
            self._check_disjoint(mapping)
        self._partners = self._process_partners(same_process)

    def _process_partners(self, entries) -> dict[str, list[str]]:
        """Each component of an entry and the others it shares its processes with."""
        partners: dict[str, list[str]] = {}
        for entry in entries:
            names = [n.strip() for n in str(entry).split(",") if n.strip()]
            what = f"same_process: {entry!r}"
            if len(names) < 2:
                raise PlacementError(
                    f"{what} names {len(names)} component(s); an entry names two or more, "
                    "comma-separated, e.g. 'env,rollout'"
                )
            if len(set(names)) != len(names):
                raise PlacementError(f"{what} names a component twice")
            for name in names:
                if name not in self._devices:
                    raise PlacementError(
                        f"{what}: component {name!r} is not placed; placed: {', '.join(self._devices)}"
                    )
                if name in partners:
                    raise PlacementError(f"{what}: component {name!r} is in two entries")
                if self._devices[name] != self._devices[names[0]]:
                    raise PlacementError(
                        f"{what}: {name!r} is placed on devices {self._devices[name]}, "
                        f"{names[0]!r} on {self._devices[names[0]]}; a shared process needs the same"
                    )
            partners.update({name: [n for n in names if n != name] for name in names})
        return partners

    def process_partners(self, component: str) -> list[str]:
        """The components whose rank ``i`` shares a process with this one's rank ``i``."""
        return list(self._partners.get(component, ()))

    def _check_disjoint(self, mapping: Mapping) -> None:
        seen: dict[int, str] = {}
        for key in mapping:
            first = str(key).split(",")[0].strip()
            for d in self._devices[first]:
                if d in seen and seen[d] != key:
                    raise PlacementError(
                        f"placement: device {d} is used by both {seen[d]!r} and {key!r}, "
                        "but this placement is exclusive"
                    )
                seen[d] = key

    @property
    def components(self) -> list[str]:
        return list(self._devices)

    def devices(self, component: str) -> list[int]:
        try:
            return list(self._devices[component])
        except KeyError:
            raise PlacementError(
                f"placement: component {component!r} is not placed; placed: {', '.join(self._devices)}"
            ) from None

    def get_world_size(self, component: str) -> int:
        return len(self.devices(component))

    def is_collocated(self, a: str, b: str) -> bool:
        return self.devices(a) == self.devices(b)
