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
import concurrent.futures as cf
import functools
import inspect
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

from tidal.runtime.cluster import Cluster
from tidal.runtime.errors import WorkerError
from tidal.runtime.handle import CallResult, Handle


@dataclass(frozen=True)
class RankInfo:
    group: str
    rank: int
    world_size: int
    device: int
    node_index: int
    local_rank: int
    local_world_size: int
    backend: str
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    env: tuple[tuple[str, str], ...] = ()

    def dist_env(self) -> dict[str, str]:
        """What ``torch.distributed``'s env:// initialisation reads, plus the device pinning."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            **dict(self.env),
        }


class Worker:
    """Base class of every tidal worker. ``self.rank``, ``self.world_size`` and
    ``self.group_name`` are set before the subclass's ``__init__`` runs."""

    _tidal: RankInfo

    @classmethod
    def create_group(cls, *args, **kwargs) -> GroupSpec:
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

    @property
    def local_rank(self) -> int:
        return self._tidal.local_rank

    @property
    def runtime_backend(self) -> str:
        return self._tidal.backend

    async def offload(self, fn, *args, **kwargs):
        """Run blocking work (a simulator step, a forward pass) on this rank's compute thread,
        so the event loop keeps serving other coroutines meanwhile (on the local backend the
        loop is shared by every rank: this is what lets pipeline stages overlap)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tidal_compute, functools.partial(fn, *args, **kwargs))

    def all_reduce_mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """The mean of each metric over this group's ranks (after ``init_distributed``)."""
        if self.world_size == 1:
            return metrics
        import torch
        import torch.distributed as dist

        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, (t / self.world_size).tolist()))

    def init_distributed(self, backend: str | None = None, timeout_s: float = 300.0) -> None:
        """Join this group's ``torch.distributed`` process group (gloo on CPU, NCCL on GPU)."""
        import datetime

        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        if self._tidal.backend != "ray" and self.world_size > 1:
            raise RuntimeError(
                f"{self.group_name}: torch.distributed with world size {self.world_size} needs the "
                "'ray' backend (the 'local' backend runs every rank in one process); "
                "set cluster.backend=ray"
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.world_size == 1 and self._tidal.backend != "ray":
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
            return
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


class RankRunner:
    """Builds one rank's worker and runs its method calls; the same for both backends."""

    def __init__(self, info: RankInfo):
        self.info = info
        self.compute = cf.ThreadPoolExecutor(1, thread_name_prefix=f"{info.group}-{info.rank}")
        self.worker: Worker | None = None

    async def construct(self, cls: type, args: tuple, kwargs: dict) -> CallResult:
        def build():
            worker = cls.__new__(cls)
            worker._tidal = self.info
            worker._tidal_compute = self.compute
            worker.__init__(*args, **kwargs)
            return worker

        result = await self._run(build, is_async=False)
        if result.error is None:
            self.worker, result.value = result.value, None
        return result

    async def call(self, method: str, args: tuple, kwargs: dict) -> CallResult:
        fn = getattr(self.worker, method)
        return await self._run(functools.partial(fn, *args, **kwargs), inspect.iscoroutinefunction(fn))

    async def _run(self, fn, is_async: bool) -> CallResult:
        start = time.perf_counter()
        try:
            if is_async:
                value = await fn()
            else:
                value = await asyncio.get_running_loop().run_in_executor(self.compute, fn)
            return CallResult(value=value, duration=time.perf_counter() - start)
        except BaseException as exc:  # reported to the caller, never swallowed
            return CallResult(
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
                duration=time.perf_counter() - start,
            )

    def close(self) -> None:
        self.compute.shutdown(wait=False, cancel_futures=True)


class EventLoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Cancel what still runs on the loop (callers already gave up on it), then stop."""

        def cancel_and_stop():
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_soon(self.loop.stop)

        self.loop.call_soon_threadsafe(cancel_and_stop)


class _LocalRank:
    """A rank in this process: its own compute thread for plain methods; its ``async``
    methods run on the cluster's shared event loop (handing an item from one rank to another
    is then a coroutine switch, not a thread wake-up) or, with ``shared_event_loop=False``,
    on an event loop thread of its own."""

    def __init__(self, info: RankInfo, shared_loop: EventLoopThread | None):
        self.runner = RankRunner(info)
        self._own_loop = None if shared_loop else EventLoopThread(f"{info.group}-{info.rank}-loop")
        self.loop = (shared_loop or self._own_loop).loop

    def construct(self, cls, args, kwargs) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(self.runner.construct(cls, args, kwargs), self.loop)

    def submit(self, method: str, args: tuple, kwargs: dict) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(self.runner.call(method, args, kwargs), self.loop)

    def kill(self) -> None:
        self.runner.close()
        if self._own_loop is not None:
            self._own_loop.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _RayRankActor:
    """The Ray actor behind one rank (an async actor: its event loop serves every call)."""

    def __init__(self):
        self.runner: RankRunner | None = None

    def node_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    async def construct(self, cls, args, kwargs, info: RankInfo) -> CallResult:
        from tidal.runtime.serialization import register_tensor_serializer

        register_tensor_serializer()
        os.environ.update(info.dist_env())
        self.runner = RankRunner(info)
        return await self.runner.construct(cls, args, kwargs)

    async def call(self, method: str, args: tuple, kwargs: dict) -> CallResult:
        return await self.runner.call(method, args, kwargs)


class _RayRank:
    def __init__(self, actor):
        self.actor = actor

    def construct(self, cls, args, kwargs, info) -> cf.Future:
        return self.actor.construct.remote(cls, args, kwargs, info).future()

    def submit(self, method: str, args: tuple, kwargs: dict) -> cf.Future:
        return self.actor.call.remote(method, args, kwargs).future()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


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
        launch_timeout: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> WorkerGroup:
        """Start one rank per placed device and construct the worker on each.

        ``placement``: a ``ComponentPlacement`` (looked up by ``name``), a device spec such as
        ``"0-3"`` / ``"0,2"`` / ``"all"``, or a number of ranks. ``env`` is set in every rank's
        process on the ray backend."""
        name = name or self.cls.__name__
        ranks = cluster.rank_placements(cluster.resolve_devices(placement, name))
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
                env=tuple({**r.device_env(), **(env or {})}.items()),
            )
            for r in ranks
        ]
        if cluster.backend == "local":
            handles = [_LocalRank(info, cluster.shared_loop()) for info in infos]
            constructing = [h.construct(self.cls, self.args, self.kwargs) for h in handles]
        else:
            handles, infos = _start_ray_actors(cluster, ranks, infos, name, launch_timeout)
            constructing = [h.construct(self.cls, self.args, self.kwargs, i) for h, i in zip(handles, infos)]
        group = WorkerGroup(name, self.cls, handles, cluster)
        try:
            Handle(name, "__init__", list(range(len(handles))), constructing).wait(launch_timeout)
        except BaseException:
            group.shutdown()
            raise
        return group


def _start_ray_actors(cluster, ranks, infos, name, timeout):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(_RayRankActor)
    actors = []
    for r, info in zip(ranks, infos):
        env_vars = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **dict(info.env)}
        if r.node.device_kind == "gpu":
            env_vars["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        actors.append(
            actor_cls.options(
                num_cpus=0,  # placement is tidal's job; Ray's CPU accounting would leave actors pending
                scheduling_strategy=NodeAffinitySchedulingStrategy(r.node.node_id, soft=False),
                runtime_env={"env_vars": env_vars},
                max_concurrency=1000,
            ).remote()
        )
    refs = [a.node_address.remote() for a in actors]
    ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if not_ready:
        for a in actors:
            ray.kill(a, no_restart=True)
        missing = [i for i, ref in enumerate(refs) if ref in not_ready]
        raise WorkerError(
            name, missing[0], "__init__",
            f"ranks {missing} could not be scheduled within {timeout:g} s (Ray resources: "
            f"{ray.available_resources()})",
        )
    try:
        master_addr, master_port = ray.get(refs[0])
    except Exception as exc:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise WorkerError(name, 0, "__init__", f"rank failed to start: {exc}") from exc
    infos = [replace(i, master_addr=master_addr, master_port=master_port) for i in infos]
    return [_RayRank(a) for a in actors], infos


class WorkerGroup:
    """The ranks of one worker class. ``group.method(...)`` calls it on every rank."""

    def __init__(self, name: str, cls: type, ranks: list, cluster: Cluster, selected: list[int] | None = None):
        self.name, self.cls, self._ranks, self.cluster = name, cls, ranks, cluster
        self._selected = selected

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    def execute_on(self, *ranks: int) -> WorkerGroup:
        """A view of this group whose calls go to ``ranks`` only."""
        flat = [r for item in ranks for r in (item if isinstance(item, (list, tuple, range)) else [item])]
        for r in flat:
            if not 0 <= r < self.world_size:
                raise ValueError(f"{self.name}.execute_on: rank {r} is out of range 0-{self.world_size - 1}")
        return WorkerGroup(self.name, self.cls, self._ranks, self.cluster, selected=flat)

    def call(self, method: str, *args, **kwargs) -> Handle:
        if not callable(getattr(self.cls, method, None)):
            raise AttributeError(f"{self.name}: worker class {self.cls.__name__} has no method {method!r}")
        targets = self._selected if self._selected is not None else list(range(self.world_size))
        futures = [self._ranks[r].submit(method, args, kwargs) for r in targets]
        return Handle(self.name, method, targets, futures)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return functools.partial(self.call, method)

    def shutdown(self) -> None:
        for r in self._ranks:
            r.kill()
