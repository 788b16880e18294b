"""The interface every runtime backend implements, and the registry that finds them by name.

A backend starts and stops the machinery ranks run on, reports the nodes, launches the ranks of
a group, and creates the transport behind a channel. ``Cluster`` owns one backend; workers,
groups and channels talk to it only through this interface.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from tidal.runtime.placement import NodeInfo, RankPlacement
from tidal.runtime.rank import EventLoopThread, RankInfo


@dataclass
class BackendOptions:
    """What a cluster was asked for; each backend reads the fields that concern it."""

    namespace: str = "tidal"
    address: str | None = None
    connect_timeout_s: float = 30.0
    devices_per_node: int | None = None
    ray_init_kwargs: dict = field(default_factory=dict)
    shared_event_loop: bool = True
    gil_switch_interval: float | None = None
    pin_cpus: bool = False


class RankHandle(Protocol):
    """The driver's grip on one launched rank."""

    def construct(self, cls: type, args: tuple, kwargs: dict) -> cf.Future: ...

    def submit(self, method: str, args: tuple, kwargs: dict) -> cf.Future: ...

    def kill(self) -> None: ...


class ChannelTransport(ABC):
    """Where a channel's queues live and how items reach them. Operations with ``async_op``
    return an ``AsyncWork``; the others wait (at most ``timeout``) and return the result."""

    backend: ClassVar[str]
    direct: ClassVar[bool] = False  # routed keys go point to point to their reading rank

    @abstractmethod
    def put(
        self, key: Hashable, item: Any, weight: float, async_op: bool, timeout: float | None
    ): ...

    @abstractmethod
    def put_shared(self, item: Any, keys: list, weight: float, timeout: float | None) -> None: ...

    @abstractmethod
    def get(self, key: Hashable, async_op: bool, timeout: float | None): ...

    @abstractmethod
    def get_batch(
        self, key: Hashable, target_weight: float, async_op: bool, timeout: float | None
    ): ...

    @abstractmethod
    def qsize(self, key: Hashable) -> int: ...

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds."""


class Backend(ABC):
    name: ClassVar[str]
    # ranks are separate processes: torch.distributed across the ranks of a group works
    multi_process: ClassVar[bool]

    @classmethod
    def check_installed(cls) -> None:
        """Raise ``tidal.extras.MissingExtraError`` when a package this backend needs is not
        installed (checked before a run starts); nothing to install by default."""
        return None

    def __init__(self, options: BackendOptions):
        if options.pin_cpus and not self.multi_process:
            raise ValueError(
                f"pin_cpus: the {self.name} backend runs ranks as threads of one process; "
                "pinning needs a process per rank (e.g. ray)"
            )
        self.options = options

    @abstractmethod
    def start(self) -> list[NodeInfo]:
        """Bring the backend up and return its nodes."""

    @abstractmethod
    def stop(self) -> None:
        """Undo ``start``: stop what this backend started, restore what it changed."""

    @abstractmethod
    def launch_ranks(
        self,
        group: str,
        ranks: list[RankPlacement],
        infos: list[RankInfo],
        timeout: float,
        hosts: list[RankHandle] | None = None,
    ) -> tuple[list[RankHandle], list[RankInfo]]:
        """Start one rank per placement; returns their handles and their final ``RankInfo``s
        (a backend may fill in e.g. the rendezvous address). With ``hosts`` (another group's
        ranks, one per placement) rank ``i`` runs in the process of ``hosts[i]``."""

    @abstractmethod
    def create_channel(
        self, name: str, maxsize: int, consumer: list[RankHandle] | None
    ) -> ChannelTransport:
        """The transport of a new channel; ``consumer``: the ranks of the group that reads its
        routed keys (``RouteKey.dst`` is the rank), which a backend may deliver to directly."""

    def shared_loop(self) -> EventLoopThread | None:
        """The event loop ranks share for their ``async`` methods, if the backend has one."""
        return None

    def abandon(self) -> None:
        """The run failed: from now on a rank shut down is ended at once, never waited for
        (it may be the one that hangs). Nothing to do where ranks cannot be ended apart."""
        return None

    def where(self) -> str:
        """Where the ranks' running calls are now, for a timeout to report; empty where the
        ranks are in other processes (a stuck Ray worker: ``ray stack`` on its node)."""
        return ""


# The built-in backends, imported on first use: reading a config that names one must not load
# what running it needs (the ray backend's transports load torch and cloudpickle).
_BUILTIN = {"local": "tidal.runtime.backends.local", "ray": "tidal.runtime.backends.ray"}
_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(name: str):
    """Class decorator: make a backend available as ``Cluster(name)``."""

    def decorate(cls: type[Backend]) -> type[Backend]:
        if name in _BACKENDS or _BUILTIN.get(name, cls.__module__) != cls.__module__:
            raise ValueError(f"runtime backend {name!r} is registered twice")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return decorate


def backend_class(name: str) -> type[Backend]:
    if name not in _BACKENDS and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])  # registers it
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"cluster.backend: expected one of {', '.join(backend_names())}, got {name!r}"
        ) from None


def backend_names() -> list[str]:
    return sorted({*_BUILTIN, *_BACKENDS})
