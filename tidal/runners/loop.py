"""The run loop both runners share. It owns what every run has: the run folder, the resolved
``config.yaml``, ``train.log``, the metric loggers, timers, the evaluation and save cadence,
the stop rules, resume, signals, the summary and closing.

A runner supplies what is its own::

    class MyRunner(RunLoop):
        def build(self): ...                    # worker groups, channels, clients
        def restore(self, checkpoint): ...      # load what the checkpoint holds; returns its meta
        def train_step(self, step): ...         # one training step; returns its metrics
        def evaluate(self, step): ...           # evaluation metrics
        def save(self, path, meta): ...         # write a checkpoint; returns its path
        def cleanup_steps(self, graceful): ...  # [(name, fn)] that shut down what build made

Closing never hides the first error: cleanup failures are logged as secondary, and the
original error is what propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.checkpoint import (
    clean_stale,
    complete_checkpoints,
    prune_checkpoints,
    resolve_checkpoint,
)
from tidal.metrics import MetricLogger, Timer, truncate_metrics
from tidal.runners.run_folder import RunFolder, find_resume_checkpoint
from tidal.runtime.errors import is_restartable

log = logging.getLogger("tidal.train")


class Interrupted(RuntimeError):
    """The run was stopped by a signal after saving a checkpoint."""

    def __init__(self, signum: int, checkpoint: str | None):
        self.signum, self.checkpoint = signum, checkpoint
        super().__init__(
            f"stopped by {signal.Signals(signum).name}; checkpoint saved at {checkpoint}"
        )


class RunLoop(ABC):
    initial_evaluation = False  # evaluate once before the first step of a fresh run

    def __init__(self, cfg: Any, run_dir: Path | None = None):
        """``run_dir``: the folder of an earlier attempt of this run to continue in (a restart
        before the first checkpoint starts over there); by default a resumed run continues in
        its checkpoint's folder and any other run gets a new one."""
        self.cfg = cfg
        r = cfg.runner
        self.checkpoint_to_resume = find_resume_checkpoint(r)
        if self.checkpoint_to_resume is not None:
            self.check_checkpoint(self.checkpoint_to_resume)
        self.folder = RunFolder(cfg, "train", self.checkpoint_to_resume, run_dir)
        self.run_dir = self.folder.path
        if run_dir is not None and self.checkpoint_to_resume is None:
            truncate_metrics(self.run_dir, -1)  # the earlier attempt's steps are trained again
        self.timer = Timer()
        self.start_step = 0
        self.last_saved_step: int | None = None
        self.evals: list[tuple[int, dict]] = []
        self.logger: MetricLogger | None = None
        self._signal: int | None = None
        self._closed = False
        try:
            self.build()
            if self.checkpoint_to_resume is not None:
                meta = self.restore(self.checkpoint_to_resume)
                self.start_step = self.last_saved_step = meta["step"]
                dropped = truncate_metrics(self.run_dir, meta["step"])
                log.info(
                    "resumed from %s at step %d (%d metric rows after it dropped)",
                    self.checkpoint_to_resume,
                    self.start_step,
                    dropped,
                )
            self.logger = MetricLogger(
                self.run_dir,
                r.loggers,
                config=cfg,
                settings={"wandb": dict(r.wandb), "mlflow": dict(r.mlflow)},
            )
        except BaseException as exc:
            with contextlib.suppress(AttributeError):  # the folder a restart continues in
                exc.tidal_run_dir = self.run_dir
            self.close(graceful=False)
            raise

    # -- what a runner supplies ------------------------------------------------------------

    @abstractmethod
    def build(self) -> None: ...

    @abstractmethod
    def restore(self, checkpoint: Path) -> dict: ...

    def check_checkpoint(self, checkpoint: Path) -> None:
        """The checkpoint to resume fits this config (before any worker starts); any does
        unless a runner says otherwise."""
        return None

    @abstractmethod
    def train_step(self, step: int) -> dict: ...

    @abstractmethod
    def evaluate(self, step: int) -> dict: ...

    @abstractmethod
    def save(self, path: Path, meta: dict) -> str: ...

    @abstractmethod
    def cleanup_steps(self, graceful: bool) -> list[tuple[str, Callable[[], Any]]]:
        """What closing does, in order; each step runs even when an earlier one failed."""

    def checkpoint_meta(self) -> dict:
        """Counters a checkpoint carries besides the step (env steps, data position, ...)."""
        return {}

    def should_stop(self, metrics: dict) -> bool:
        """A runner's own stop rule (e.g. env steps), checked after every step."""
        return False

    def progress_info(self, metrics: dict) -> str:
        return ""

    def summarize(self) -> dict:
        return {}

    def start_cluster(self):
        """The cluster ``cluster.*`` describes (the one place a runner makes it)."""
        from tidal.runtime import Cluster
        from tidal.runtime.devices import check_device_setting

        c = self.cfg.cluster
        cluster = Cluster(
            c.backend,
            address=c.address,
            connect_timeout_s=c.connect_timeout_s,
            devices_per_node=c.devices_per_node,
            gil_switch_interval=c.gil_switch_interval,
            pin_cpus=c.pin_cpus,
        )
        # a joined cluster's nodes are known only now, before any worker starts; the local
        # backend's ranks are threads of this process, so this process's CUDA is theirs
        gpu_nodes = sum(n.device_kind == "gpu" for n in cluster.nodes)
        try:
            check_device_setting(
                c.device, gpu_nodes if cluster.backend_impl.multi_process else None
            )
        except Exception:
            cluster.shutdown()
            raise
        return cluster

    def place(self, components: list[str]):
        """Where each worker group runs (``cluster.placement``, ``shared_processes``)."""
        placement, shared = self.cfg.cluster.resolved_placement(components), self.shared_processes()
        if shared and self.cfg.cluster.backend == "ray":
            log.info("groups sharing processes (cluster.same_process): %s", ", ".join(shared))
        return self.cluster.placement(placement, same_process=shared)

    def shared_processes(self) -> list[str]:
        """``cluster.same_process`` entries; a runner with a default of its own overrides it."""
        return self.cfg.cluster.same_process_entries()

    @contextlib.contextmanager
    def actor_offloaded(self, actor):
        """``actor.offload``: the actor's state in host memory for the block (the rollout has
        the device meanwhile), back on the device after it; timed as ``offload``, ``onload``."""
        if not self.cfg.actor.offload:
            yield
            return
        timeout = self.cfg.runner.timeout_s
        with self.timer("offload"):
            actor.offload_engine().wait(timeout)
        try:
            yield
        finally:
            with self.timer("onload"):
                actor.onload_engine().wait(timeout)

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> dict:
        r = self.cfg.runner
        start = time.perf_counter()
        progress = Progress(r.max_steps, self.start_step, enabled=r.progress)
        best, solved_at, step = None, None, self.start_step - 1
        restore_signals = self._catch_signals()
        try:
            if self.initial_evaluation and self.start_step == 0 and r.eval_interval:
                first = self.evaluate(0)
                self.evals.append((0, first))
                self.logger.log(0, first)
            for step in range(self.start_step, r.max_steps):
                metrics = self.train_step(step)
                # a run stopped by its own rule or by the clock evaluates its last policy too
                stopping = self.should_stop(metrics) or (
                    r.max_minutes is not None and time.perf_counter() - start > r.max_minutes * 60
                )
                last = step + 1 == r.max_steps or stopping
                if r.eval_interval and ((step + 1) % r.eval_interval == 0 or last):
                    evaluation = self.evaluate(step + 1)
                    metrics.update(evaluation)
                    self.evals.append((step + 1, evaluation))
                metrics["time/elapsed"] = time.perf_counter() - start
                self.logger.log(step + 1, metrics)
                line = self.progress_info(metrics)
                log.info("step %d %s", step + 1, line)
                progress.update(step, line)
                if r.save_interval and (step + 1) % r.save_interval == 0:
                    self.checkpoint(step + 1)
                value = metrics.get(r.target_metric)
                if value is not None:
                    best = value if best is None else max(best, value)
                    if r.target_value is not None and value >= r.target_value:
                        solved_at = step + 1
                        break
                if stopping:
                    break
                if self._signal is not None:
                    raise Interrupted(self._signal, self.checkpoint(step + 1))
            checkpoint = self.checkpoint(step + 1) if step >= self.start_step else None
        finally:
            progress.close()
            restore_signals()
        summary = {
            "steps": step + 1,
            "wall_time": time.perf_counter() - start,
            "run_dir": str(self.run_dir),
            "checkpoint": checkpoint,
            "target_metric": r.target_metric,
            "best_value": best,
            "solved_at_step": solved_at,
            "evals": self.evals,
            **self.summarize(),
        }
        self.logger.log_summary({k: v for k, v in summary.items() if k != "evals"})
        return summary

    def checkpoint(self, step: int) -> str:
        """Save the state after ``step`` steps, once: a step already saved is not written again."""
        folder = self.run_dir / "checkpoints"
        if self.last_saved_step == step:
            return str(resolve_checkpoint(folder))
        with self.timer("save"):
            path = self.save(folder / f"step_{step:06d}", {"step": step, **self.checkpoint_meta()})
        self.last_saved_step = step
        prune_checkpoints(folder, self.cfg.runner.keep_checkpoints)
        return path

    def _catch_signals(self):
        """SIGINT/SIGTERM finish the current step, save, and stop with ``Interrupted``; a
        second signal stops at once. Only the main thread can install handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum, frame):
            if self._signal is not None:
                raise KeyboardInterrupt
            self._signal = signum
            log.warning(
                "%s received: saving a checkpoint after this step, then stopping (again to stop now)",
                signal.Signals(signum).name,
            )

        for s in previous:
            signal.signal(s, handler)
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    # -- closing ---------------------------------------------------------------------------

    def close(self, graceful: bool = True) -> None:
        """Shut everything down; a failure here is logged, never raised over an earlier error.
        ``graceful=False`` (after an error) skips waits on workers that may be hung."""
        if self._closed:
            return
        self._closed = True
        cluster = getattr(self, "cluster", None)  # what ``start_cluster`` made
        if not graceful and cluster is not None:
            cluster.abandon()  # end ranks without waiting on them: one may hang
        steps = self.cleanup_steps(graceful)
        if self.logger is not None:
            steps.append(("metric loggers", self.logger.close))
        for what, fn in steps:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - secondary to whatever ended the run
                log.warning("closing %s failed (secondary): %s: %s", what, type(exc).__name__, exc)
        self.folder.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # a run stopped by a signal saved its checkpoint with every worker answering: close
        # them as after a normal end (abandoning them left the engine's threads running into
        # the interpreter's exit: "terminate called without an active exception")
        self.close(graceful=exc_type is None or issubclass(exc_type, Interrupted))


def is_worker_fault(exc: BaseException) -> bool:
    """A fault a restart can cure (``tidal.runtime.errors.RESTARTABLE``): a rank that died or
    stopped answering, a lost connection (an inference server gone, or a supervised server
    process that exited: ``ServerDied``), a weight link broken mid-transfer — not a bug that
    would fail again the same way."""
    return is_restartable(exc)


def run_with_restarts(make_runner: Callable[..., RunLoop], cfg: Any) -> dict:
    """Run to the end; on a worker fault, restart every group and resume from the run's newest
    checkpoint, up to ``runner.max_restarts`` times (each restart logged), in the same run
    folder. ``make_runner(cfg, run_dir=...)`` builds a runner (``run_dir``: None at first, then
    the folder to continue in); a fault while it builds (a rank killed as it starts) restarts
    too."""
    restarts, run_dir = 0, None
    while True:
        runner = None
        try:
            runner = make_runner(cfg, run_dir=run_dir)
            with runner:
                summary = runner.run()
            return {**summary, "restarts": restarts}
        except Exception as exc:
            if restarts >= cfg.runner.max_restarts or not is_worker_fault(exc):
                raise
            folder = runner.run_dir if runner is not None else getattr(exc, "tidal_run_dir", None)
            restarts, run_dir = restarts + 1, folder or run_dir
            cfg = _resume_after_fault(cfg, run_dir, restarts, exc)


def _resume_after_fault(cfg: Any, run_dir: Path | None, restarts: int, exc: Exception) -> Any:
    """The config of the next attempt: resuming from the run's newest complete checkpoint."""
    resume = None
    if run_dir is not None:
        clean_stale(run_dir / "checkpoints")  # a save the fault cut short
        if complete_checkpoints(run_dir / "checkpoints"):
            resume = str(run_dir / "checkpoints")
    log.warning(
        "restart %d of %d after a worker fault (%s: %s); resuming from %s",
        restarts,
        cfg.runner.max_restarts,
        type(exc).__name__,
        str(exc).splitlines()[0],
        resume or "nothing (no checkpoint yet): starting over",
    )
    return dataclasses.replace(cfg, runner=dataclasses.replace(cfg.runner, resume_from=resume))


def fmt(v) -> str:
    return (
        "-"
        if v is None
        else f"{v:.3g}"
        if isinstance(v, float) and abs(v) < 10
        else f"{v:.1f}"
        if isinstance(v, float)
        else str(v)
    )


class Progress:
    """A live progress bar (step, the runner's line, ETA) when stderr is a terminal; elsewhere the
    log line of each step says the same."""

    def __init__(self, total: int, start: int, enabled: bool):
        from rich.console import Console

        self.live = None
        console = Console(stderr=True)
        if enabled and console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.live = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.live.add_task("train", total=total, completed=start, info="")
            self.live.start()

    def update(self, step: int, info: str) -> None:
        if self.live is not None:
            self.live.update(self.task, completed=step + 1, info=info)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
