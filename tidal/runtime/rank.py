"""What runs one rank, whatever the backend: its identity, its event loop and its calls."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import inspect
import itertools
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass

from tidal.runtime.faults import fault_point
from tidal.runtime.handle import CallResult


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
    shares_process: bool = False  # another group's rank runs in this rank's process

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


class RankRunner:
    """Builds one rank's worker and runs its method calls; the same for both backends."""

    def __init__(self, info: RankInfo):
        self.info = info
        self.compute_thread: int | None = None  # its ident, for ``where``
        self.compute = cf.ThreadPoolExecutor(
            1, thread_name_prefix=f"{info.group}-{info.rank}", initializer=self._name_compute_thread
        )
        self.worker = None
        self.calls: Counter[str] = Counter()  # per method (the ``call`` fault point counts them)
        self.running: dict[int, tuple[str, asyncio.Task | None]] = {}  # what ``where`` reports
        self._call_ids = itertools.count()

    def _name_compute_thread(self) -> None:
        self.compute_thread = threading.get_ident()

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
        self.calls[method] += 1
        info = self.info
        fault_point("call", group=info.group, rank=info.rank, method=method, n=self.calls[method])
        fn = getattr(self.worker, method)
        call = functools.partial(fn, *args, **kwargs)
        call_id = next(self._call_ids)
        self.running[call_id] = (method, asyncio.current_task())
        try:
            return await self._run(call, inspect.iscoroutinefunction(fn))
        finally:
            del self.running[call_id]

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

    def where(self) -> str:
        """Where this rank's running calls are now: each call's chain of awaits and the compute
        thread's stack (what a timeout reports of a rank in this process that did not answer)."""
        running = list(self.running.values())
        if not running:
            return ""
        name = f"{self.info.group}[rank {self.info.rank}]"
        lines = []
        for method, task in running:
            chain = _format_frames(_await_chain(task.get_coro()) if task else [])
            lines += [f"{name}.{method}, awaiting:", *chain] if chain else [f"{name}.{method}"]
        frame = sys._current_frames().get(self.compute_thread)
        stack = _format_frames(reversed(list(traceback.walk_stack(frame)))) if frame else []
        if stack:
            lines += [f"{name} compute thread:", *stack]
        return "\n".join(lines)

    def close(self) -> None:
        self.compute.shutdown(wait=False, cancel_futures=True)


def _await_chain(coro) -> list:
    """The frames of a suspended coroutine and of everything it awaits, outermost first."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append((frame, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


# frames of the machinery every call passes through: left out of ``where``
_PLUMBING = ("threading.py", "concurrent/futures/thread.py", "tidal/runtime/rank.py")


def _format_frames(frames, limit: int = 12) -> list[str]:
    """Outermost first, the plumbing left out, the innermost ``limit`` kept."""
    kept = [(f, n) for f, n in frames if not f.f_code.co_filename.endswith(_PLUMBING)]
    summary = traceback.StackSummary.extract(kept[-limit:], lookup_lines=True)
    return [line.rstrip() for line in traceback.format_list(summary)]


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
