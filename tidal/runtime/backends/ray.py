"""The ``ray`` backend: every rank is a Ray actor (its own process, on the node its device
belongs to). It starts Ray when no cluster is running, or joins the one at ``address``."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, replace

from tidal.extras import needs_extra
from tidal.runtime import faults
from tidal.runtime.backends.base import Backend, register_backend
from tidal.runtime.backends.ray_channel_actor import ChannelActorTransport, create_channel_actor
from tidal.runtime.backends.ray_pipe import INBOX, OUTBOXES, REPLIES, DeathWatch, dumps, loads
from tidal.runtime.backends.ray_routed import RoutedTransport, deliver_from_pipe
from tidal.runtime.errors import ClusterUnreachable, WorkerError
from tidal.runtime.handle import CallResult
from tidal.runtime.placement import CPU_SLOT_ENV, NodeInfo, pin_to_cpu_slot
from tidal.runtime.rank import RankInfo, RankRunner

log = logging.getLogger(__name__)
# a guest group's worker closing (envs, servers) in a shared process; a process that does not
# answer within it is killed, with every group in it (a hung rank must not hold the exit up)
RELEASE_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayRankActor:
    """The Ray actor behind one rank (an async actor: its event loop serves every call), or
    behind rank ``i`` of several groups that share its process (``same_process``)."""

    def __init__(self):
        # a rank killed by a signal prints every thread's Python stack, not only the loop's
        faulthandler.enable(all_threads=True)
        self.runners: dict[str, RankRunner] = {}  # group name -> its rank here
        if CPU_SLOT_ENV in os.environ:  # before the rank builds anything (its threads inherit)
            pin_to_cpu_slot(int(os.environ[CPU_SLOT_ENV]))

    def node_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    async def construct(self, cls, args, kwargs, info: RankInfo) -> CallResult:
        from tidal.runtime.serialization import register_tensor_serializer

        register_tensor_serializer()
        # torch.distributed is one per process: a guest group keeps its host's rendezvous
        os.environ.update(dict(info.env) if self.runners else info.dist_env())
        runner = self.runners[info.group] = RankRunner(info)
        return await runner.construct(cls, args, kwargs)

    async def call(self, group: str, method: str, args: tuple, kwargs: dict) -> CallResult:
        runner = self.runners.get(group)
        if runner is None:  # answered, so the caller does not wait out its timeout
            return CallResult(error=f"no rank of group {group!r} runs here (it was shut down)")
        return await runner.call(method, args, kwargs)

    def release(self, group: str) -> None:
        """A group sharing this process shut down; the others go on. Its worker's ``close``
        runs (envs, servers); an ``async`` call of it still waiting ends at its own timeout."""
        runner = self.runners.pop(group, None)
        if runner is None:
            return
        close = getattr(runner.worker, "close", None)
        try:
            if callable(close):
                close()
        finally:
            runner.close()

    def process(self) -> tuple[str, int]:
        """This rank's node address and process id (what a prompt kill needs)."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    async def inbox_address(self) -> str:
        """The inbox of group calls and of the items of channels bound to this rank's group
        (``ray_routed``)."""
        return await INBOX.open({"item": deliver_from_pipe, "call": self._serve_call})

    async def until_death(self) -> None:
        """Never answers: the caller's reference fails when this rank's process dies."""
        await asyncio.Event().wait()

    def _serve_call(self, call_id: int, reply_to: str, frames: list) -> None:
        request = loads(frames)
        asyncio.get_running_loop().create_task(self._answer(call_id, reply_to, *request))

    async def _answer(self, call_id: int, reply_to: str, group, method: str, args, kwargs) -> None:
        result = await self.call(group, method, args, kwargs)
        try:
            frames = dumps(result)
        except Exception as exc:  # the caller learns why, instead of waiting for its timeout
            frames = dumps(CallResult(error=f"could not send the result: {exc!r}"))
        OUTBOXES.send(reply_to, (call_id,), frames)


class RayRank:
    """The driver's grip on one rank: calls go by ZeroMQ into its inbox (``ray_pipe``), or as a
    Ray call when their arguments cannot be pickled that way; Ray watches the process.
    ``tenants``: the groups whose rank runs in this process (one set per process)."""

    def __init__(
        self,
        actor,
        info: RankInfo,
        inbox: str,
        teardown: Teardown,
        tenants: set[str] | None = None,
        process: tuple[str, int] | None = None,
    ):
        self.actor, self.info, self.inbox, self.teardown = actor, info, inbox, teardown
        self.process = process  # (node address, pid)
        self.tenants = {info.group} if tenants is None else tenants
        self.tenants.add(info.group)
        self._watch: DeathWatch | None = None  # per process: made on first use
        self._killed = False

    def construct(self, cls, args, kwargs) -> cf.Future:
        return self.actor.construct.remote(cls, args, kwargs, self.info).future()

    def submit(self, method: str, args: tuple, kwargs: dict) -> cf.Future:
        group = self.info.group
        try:
            request = dumps((group, method, args, kwargs))
        except Exception:  # e.g. an object only Ray's serializer handles
            return self.actor.call.remote(group, method, args, kwargs).future()
        if self._watch is None:
            self._watch = DeathWatch(self.actor, self, _rank_death)
        return REPLIES.ask(
            self,
            self._watch,
            lambda i, reply_to: OUTBOXES.send(self.inbox, ("call", i, reply_to), request),
        )

    def __getstate__(self):
        return {**self.__dict__, "_watch": None}

    def kill(self) -> None:
        """End this rank (once); its process ends with the last group in it, or at once after
        a failure (``Teardown.abandoned``: the rank may be the one that hangs)."""
        if self._killed:
            return
        self._killed = True
        self.tenants.discard(self.info.group)
        if not self.tenants or self.teardown.abandoned:
            self._kill_process()
            return
        import ray

        # waited for: the release is a Ray call and later calls go by ZeroMQ, so unwaited, a
        # call made after shutdown could overtake it and be cancelled half-run by the release
        try:
            ray.get(self.actor.release.remote(self.info.group), timeout=RELEASE_TIMEOUT_S)
        except Exception as exc:  # its process already ended, or the close hangs: kill it
            others = ", ".join(sorted(self.tenants))
            log.warning(
                "%s rank %d: release: %r; its process is killed (with %s)",
                self.info.group,
                self.info.rank,
                exc,
                others,
            )
            self._kill_process()

    def _kill_process(self) -> None:
        """End this rank's process, every group in it. Ray asks the process to exit first and
        kills it only later (seconds, measured); one on this node that may hang gets SIGKILL
        at once (``Teardown.abandoned``)."""
        import ray

        self.tenants.clear()
        ray.kill(self.actor, no_restart=True)
        if self.teardown.abandoned and self.process is not None:
            node, pid = self.process
            if node == ray.util.get_node_ip_address():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


@dataclass
class Teardown:
    """Shared by a backend's ranks: ``abandoned`` once the run failed (``Backend.abandon``)."""

    abandoned: bool = False


def _rank_death(cause: BaseException | None) -> BaseException:
    return cause or RuntimeError("the rank's process ended")


@register_backend("ray")
class RayBackend(Backend):
    multi_process = True

    def __init__(self, options):
        super().__init__(options)
        self._started_ray = False
        self.teardown = Teardown()

    def abandon(self) -> None:
        self.teardown.abandoned = True

    @classmethod
    def check_installed(cls) -> None:
        with needs_extra("ray", "the ray backend"):
            import ray  # noqa: F401
            import zmq  # noqa: F401  (the point-to-point path, ray_pipe)

    def start(self) -> list[NodeInfo]:
        self.check_installed()
        import ray

        from tidal.runtime.serialization import register_tensor_serializer

        if ray.is_initialized():
            _check_same_session(self.options.address)
        else:
            init_kwargs = dict(self.options.ray_init_kwargs)
            init_kwargs.setdefault("namespace", self.options.namespace)
            init_kwargs.setdefault("log_to_driver", True)
            init_kwargs.setdefault("include_dashboard", False)
            if self.options.address is not None:
                _check_reachable(self.options.address, self.options.connect_timeout_s)
                init_kwargs["address"] = self.options.address
            elif "RAY_ADDRESS" not in os.environ:  # a cluster of its own: tidal sets it up
                # "local", not None: None joins the newest cluster `ray start` (or Ray's test
                # cluster) left on this machine, which refuses the system config below
                init_kwargs.setdefault("address", "local")
                # Ray runs workers at nice 15, so a rank loses its core to any ordinary process
                # (measured at load 11-18: a chunk step 21 ms at nice 15, 11 ms at 0); the ranks
                # are the job here. (A cluster started with `ray start`: RAY_worker_niceness=0.)
                system = init_kwargs.setdefault("_system_config", {})
                system.setdefault("worker_niceness", 0)
                # Ray starts a worker per CPU for tasks at the first driver; every tidal rank
                # has a runtime env of its own and so a process of its own: those would only
                # take CPU beside the first steps
                system.setdefault("prestart_worker_first_driver", False)
            ray.init(**init_kwargs)
            self._started_ray = True
        register_tensor_serializer()
        return self._nodes()

    def _nodes(self) -> list[NodeInfo]:
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive")]
        alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
        nodes = []
        for i, n in enumerate(alive):
            gpus = int(n["Resources"].get("GPU", 0))
            kind = "gpu" if gpus else "cpu"
            count = self.options.devices_per_node or gpus or int(n["Resources"].get("CPU", 1)) or 1
            nodes.append(NodeInfo(i, n["NodeID"], n["NodeManagerAddress"], count, kind))
        return nodes

    def stop(self) -> None:
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def create_channel(self, name: str, maxsize: int, consumer: list | None):
        if maxsize:
            raise ValueError(
                f"channel {name!r}: maxsize={maxsize}, but channels on the ray backend are "
                "unbounded (a put never waits for room); back-pressure needs the local backend"
            )
        if consumer is not None:
            return RoutedTransport(name, consumer)
        return ChannelActorTransport(name, create_channel_actor(name, self.options.namespace))

    def launch_ranks(self, group, ranks, infos, timeout, hosts=None):
        import ray

        if hosts is not None:
            return self._join_processes(infos, hosts)

        actors = [self._start_actor(r, info) for r, info in zip(ranks, infos)]
        refs = [a.node_address.remote() for a in actors]
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if not_ready:
            _kill_all(actors)
            missing = [i for i, ref in enumerate(refs) if ref in not_ready]
            raise WorkerError(
                group,
                missing[0],
                "__init__",
                f"ranks {missing} could not be scheduled within {timeout:g} s (Ray resources: "
                f"{ray.available_resources()})",
            )
        try:
            master_addr, master_port = ray.get(refs[0])
        except Exception as exc:
            _kill_all(actors)
            # its process ended before it could answer (killed, out of memory): a death
            raise WorkerError(group, 0, "__init__", f"rank died while starting: {exc}") from exc
        infos = [replace(i, master_addr=master_addr, master_port=master_port) for i in infos]
        inboxes = ray.get([a.inbox_address.remote() for a in actors], timeout=timeout)
        processes = ray.get([a.process.remote() for a in actors], timeout=timeout)
        ranks = [
            RayRank(a, i, box, self.teardown, process=p)
            for a, i, box, p in zip(actors, infos, inboxes, processes)
        ]
        return ranks, infos

    def _join_processes(self, infos: list[RankInfo], hosts: list[RayRank]):
        """Ranks in their hosts' processes: no process to start, the host's inbox serves both
        (no rendezvous of their own: torch.distributed is the host's)."""
        ranks = [
            RayRank(h.actor, i, h.inbox, self.teardown, h.tenants, h.process)
            for i, h in zip(infos, hosts)
        ]
        return ranks, infos

    @staticmethod
    def _start_actor(placement, info: RankInfo):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        env_vars = {
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            # asyncio's loop even where uvloop is installed: under uvloop a rank process died of
            # heap corruption mid-training (CI, once), for 2-3% of a chunk step (collect.md)
            "RAY_USE_UVLOOP": "0",
            **{k: os.environ[k] for k in (faults.ENV,) if k in os.environ},
            **dict(info.env),
        }
        if placement.node.device_kind == "gpu":
            env_vars["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        return (
            ray.remote(RayRankActor)
            .options(
                num_cpus=0,  # placement is tidal's job; Ray's CPU accounting would leave actors pending
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    placement.node.node_id, soft=False
                ),
                runtime_env={"env_vars": env_vars},
                max_concurrency=1000,
            )
            .remote()
        )


def _kill_all(actors) -> None:
    import ray

    for a in actors:
        ray.kill(a, no_restart=True)


def _check_same_session(address: str | None) -> None:
    """A process already in a Ray session stays in it (``ray.init`` runs once per process), so
    an address naming another cluster is refused rather than silently trained on the session's."""
    import ray

    # a Ray Client's address (ray://) names its server's port, not the GCS's: not comparable
    if address in (None, "auto") or address.startswith("ray://"):
        return
    session = ray.get_runtime_context().gcs_address
    if not _same_address(address, session):
        raise ClusterUnreachable(
            f"cluster.address: this process is already in a Ray session at {session!r} "
            f"(ray.init runs once per process), not {address!r}: call ray.shutdown() first, "
            f"or set cluster.address to {session!r} or null"
        )


def _same_address(a: str, b: str) -> bool:
    """host:port pairs naming one endpoint (a loopback host matches any host of that port)."""
    (host_a, _, port_a), (host_b, _, port_b) = a.rpartition(":"), b.rpartition(":")
    loopback = {"127.0.0.1", "localhost", ""}
    return port_a == port_b and (host_a == host_b or bool({host_a, host_b} & loopback))


def _check_reachable(address: str, timeout: float) -> None:
    """Fail fast, naming the address, when nothing answers there: ``ray.init`` itself retries
    an unreachable address for minutes."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        raise ClusterUnreachable(
            f"cluster.address: cannot reach a Ray cluster at {address!r} "
            f"within {timeout:g} s: {exc}"
        ) from None
