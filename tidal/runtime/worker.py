"""Workers and worker groups.

A ``Worker`` subclass is launched as a group of ranks::

    group = MyWorker.create_group(arg, key=value).launch(cluster, placement="0-1", name="env")
    handle = group.step(3)           # calls MyWorker.step(3) on every rank
    results = handle.wait(timeout=60)

Each rank runs an event loop: ``async def`` methods run on it concurrently (so a rank can
serve channel traffic while a long method runs), plain methods run one at a time on the
rank's own compute thread. On ``local`` a rank is a pair of threads of this process; on
``ray`` it is a Ray actor (its own process, on the node its device belongs to).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.runtime.backends import backend_class
from tidal.runtime.defaults import LAUNCH_TIMEOUT_S
from tidal.runtime.handle import Handle
from tidal.runtime.placement import ComponentPlacement
from tidal.runtime.rank import RankInfo
from tidal.runtime.sections import ConfigSections

if TYPE_CHECKING:  # the cluster is only passed in: no import cycle
    from tidal.runtime.cluster import Cluster

__all__ = ["GroupSpec", "RankInfo", "Worker", "WorkerGroup"]


class Worker:
    """Base class of every tidal worker. ``self.rank``, ``self.world_size`` and
    ``self.group_name`` are set before the subclass's ``__init__`` runs.

    A worker that reads the run's config declares the sections it reads in
    ``config_sections``; ``create_group(config, ...)`` then hands each rank only those sections
    (a ``ConfigSections``) in place of the whole config."""

    _tidal: RankInfo
    config_sections: tuple[str, ...] | None = None  # None: the first argument is not a config

    @classmethod
    def create_group(cls, *args, **kwargs) -> GroupSpec:
        if cls.config_sections is not None:
            config, *rest = args
            args = (ConfigSections(cls.__name__, config, cls.config_sections), *rest)
        return GroupSpec(cls, args, kwargs)

    @property
    def rank(self) -> int:
        return self._tidal.rank

    @property
    def world_size(self) -> int:
        return self._tidal.world_size

    @property
    def group_name(self) -> str:
        return self._tidal.group

    @property
    def device(self) -> int:
        """The global device id this rank is placed on."""
        return self._tidal.device

    def torch_device(self, setting: str = "auto"):
        """This rank's ``torch.device`` for ``cluster.device`` (tidal.runtime.devices)."""
        from tidal.runtime.devices import resolve_device

        placed_on_gpu = "CUDA_VISIBLE_DEVICES" in dict(self._tidal.env)
        return resolve_device(setting, f"{self.group_name} rank {self.rank}", placed_on_gpu)

    @property
    def local_rank(self) -> int:
        return self._tidal.local_rank

    @property
    def runtime_backend(self) -> str:
        return self._tidal.backend

    @property
    def owns_event_loop(self) -> bool:
        """This rank's event loop serves no other rank (a process of its own): blocking work on
        it then holds up this rank alone, and its messages still arrive meanwhile."""
        return backend_class(self._tidal.backend).multi_process and not self._tidal.shares_process

    async def offload(self, fn, *args, **kwargs):
        """Run blocking work (a simulator step, a forward pass) on this rank's compute thread,
        so the event loop keeps serving other coroutines meanwhile (on the local backend the
        loop is shared by every rank: this is what lets pipeline stages overlap)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tidal_compute, functools.partial(fn, *args, **kwargs)
        )

    def all_reduce_mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """The mean of each metric over this group's ranks (after ``init_distributed``)."""
        if self.world_size == 1:
            return metrics
        import torch
        import torch.distributed as dist

        keys = sorted(metrics)
        on = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors only
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=on)
        dist.all_reduce(t)
        return dict(zip(keys, (t / self.world_size).tolist()))

    def init_distributed(self, backend: str | None = None, timeout_s: float = 300.0) -> None:
        """Join this group's ``torch.distributed`` process group (gloo on CPU, NCCL on GPU)."""
        import datetime

        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        multi_process = backend_class(self._tidal.backend).multi_process
        if not multi_process and self.world_size > 1:
            raise RuntimeError(
                f"{self.group_name}: torch.distributed with world size {self.world_size} needs the "
                "'ray' backend (the 'local' backend runs every rank in one process); "
                "set cluster.backend=ray"
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.world_size == 1 and not multi_process:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
            return
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class GroupSpec:
    cls: type
    args: tuple
    kwargs: dict

    def launch(
        self,
        cluster: Cluster,
        placement: Any = 1,
        name: str | None = None,
        launch_timeout: float = LAUNCH_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> WorkerGroup:
        """Start one rank per placed device and construct the worker on each.

        ``placement``: a ``ComponentPlacement`` (looked up by ``name``; with ``same_process``,
        rank ``i`` joins the process of its host group's rank ``i``), a device spec such as
        ``"0-3"`` / ``"0,2"`` / ``"all"``, or a number of ranks. ``env`` is set in every rank's
        process on the ray backend."""
        name = name or self.cls.__name__
        ranks = cluster.rank_placements(cluster.resolve_devices(placement, name))
        shares_process = isinstance(placement, ComponentPlacement) and bool(
            placement.process_partners(name)
        )
        per_node: dict[int, list[int]] = {}
        for r in ranks:
            per_node.setdefault(r.node.index, []).append(r.rank)
        infos = [
            RankInfo(
                group=name,
                rank=r.rank,
                world_size=len(ranks),
                device=r.device,
                node_index=r.node.index,
                local_rank=per_node[r.node.index].index(r.rank),
                local_world_size=len(per_node[r.node.index]),
                backend=cluster.backend,
                shares_process=shares_process,
                env=tuple(
                    {**r.device_env(cluster.backend_impl.options.pin_cpus), **(env or {})}.items()
                ),
            )
            for r in ranks
        ]
        hosts = cluster.host_ranks(placement, name)
        handles, infos = cluster.backend_impl.launch_ranks(
            name, ranks, infos, launch_timeout, hosts
        )
        cluster.launched(name, handles)
        constructing = [h.construct(self.cls, self.args, self.kwargs) for h in handles]
        group = WorkerGroup(name, self.cls, handles, cluster)
        try:
            Handle(name, "__init__", list(range(len(handles))), constructing).wait(launch_timeout)
        except BaseException:
            group.shutdown()
            raise
        return group


class WorkerGroup:
    """The ranks of one worker class. ``group.method(...)`` calls it on every rank."""

    def __init__(
        self, name: str, cls: type, ranks: list, cluster: Cluster, selected: list[int] | None = None
    ):
        self.name, self.cls, self._ranks, self.cluster = name, cls, ranks, cluster
        self._selected = selected

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def rank_handles(self) -> list:
        """The backend's handle of each rank (what a channel binds to)."""
        return list(self._ranks)

    def execute_on(self, *ranks: int) -> WorkerGroup:
        """A view of this group whose calls go to ``ranks`` only."""
        flat = [
            r
            for item in ranks
            for r in (item if isinstance(item, (list, tuple, range)) else [item])
        ]
        for r in flat:
            if not 0 <= r < self.world_size:
                raise ValueError(
                    f"{self.name}.execute_on: rank {r} is out of range 0-{self.world_size - 1}"
                )
        return WorkerGroup(self.name, self.cls, self._ranks, self.cluster, selected=flat)

    def call(self, method: str, *args, **kwargs) -> Handle:
        if not callable(getattr(self.cls, method, None)):
            raise AttributeError(
                f"{self.name}: worker class {self.cls.__name__} has no method {method!r}"
            )
        targets = self._selected if self._selected is not None else list(range(self.world_size))
        futures = [self._ranks[r].submit(method, args, kwargs) for r in targets]
        return Handle(self.name, method, targets, futures, where=self.cluster.where)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return functools.partial(self.call, method)

    def shutdown(self) -> None:
        for r in self._ranks:
            r.kill()
