"""Metrics: per-phase timers, and a logger that fans metrics out to named sinks (``metrics.jsonl``,
TensorBoard, Weights & Biases, MLflow), each on its own thread so the training loop never waits
on disk or network and one broken sink cannot stop training or the other sinks."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tidal.extras import needs_extra
from tidal.files import atomic_write
from tidal.registry import Registry

log = logging.getLogger("tidal.metrics")


class Timer:
    """``with timer("train"): ...`` records seconds per phase; ``pop()`` returns and clears them."""

    def __init__(self):
        self._durations: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._durations[name] = self._durations.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self._durations = {f"time/{k}": v for k, v in self._durations.items()}, {}
        return out


# -- sinks ------------------------------------------------------------------------------------


class MetricSink:
    """One destination for metrics. Every method runs on the sink's own thread, the constructor
    included, so a slow start (a database migration, a network login) never blocks training.

    ``options`` names the keys a sink accepts in ``settings[<sink name>]``; they are checked
    before any thread starts so that a typo is an error, not a silent default."""

    options: frozenset[str] = frozenset()

    def __init__(self, run_dir: Path, config: dict, options: dict):
        self.run_dir = run_dir

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        raise NotImplementedError

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


SINKS: Registry[type[MetricSink]] = Registry("metric logger", config_key="runner.loggers")


def register_sink(name: str) -> Callable[[type[MetricSink]], type[MetricSink]]:
    """Class decorator: ``@register_sink("mine")`` makes ``runner.loggers: [mine]`` valid."""
    return SINKS.register(name)


@register_sink("jsonl")
class JsonlSink(MetricSink):
    """``metrics.jsonl``: one ``{"step": ..., **metrics}`` row per call; ``summary.json``."""

    def __init__(self, run_dir: Path, config: dict, options: dict):
        super().__init__(run_dir, config, options)
        self._file = open(run_dir / "metrics.jsonl", "a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        text = json.dumps({k: _finite_or_none(v) for k, v in summary.items()}, indent=2)
        atomic_write(self.run_dir / "summary.json", text + "\n")

    def close(self) -> None:
        self._file.close()


@register_sink("tensorboard")
class TensorBoardSink(MetricSink):
    """TensorBoard events under ``<run_dir>/tensorboard``; config and summary as text."""

    def __init__(self, run_dir: Path, config: dict, options: dict):
        super().__init__(run_dir, config, options)
        with needs_extra("trackers", "the tensorboard logger"):
            from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if config:
            self._writer.add_text("config", _as_markdown_code(config), 0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in _finite_numbers(metrics).items():
            self._writer.add_scalar(key, value, step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._writer.add_text("summary", _as_markdown_code(summary), 0)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@register_sink("wandb")
class WandbSink(MetricSink):
    """A W&B run writing under ``<run_dir>/wandb/``. ``WANDB_MODE`` in the environment wins over
    ``mode`` in the settings: the machine, not the experiment, knows whether it has a network."""

    options = frozenset({"project", "entity", "mode", "name", "group", "tags", "notes", "job_type"})

    def __init__(self, run_dir: Path, config: dict, options: dict):
        super().__init__(run_dir, config, options)
        with needs_extra("trackers", "the wandb logger"):
            import wandb

        kwargs = {"name": run_dir.name, **options}
        kwargs["mode"] = os.environ.get("WANDB_MODE") or options.get("mode")
        self._run = wandb.init(
            dir=str(run_dir),
            config=config,
            reinit="create_new",  # a run of its own, never the process's global wandb.run
            settings=wandb.Settings(console="off"),  # train.log already has the console
            **kwargs,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log(_finite_numbers(metrics), step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._run.summary.update({k: v for k, v in summary.items() if v is not None})

    def close(self) -> None:
        self._run.finish()


@register_sink("mlflow")
class MlflowSink(MetricSink):
    """An MLflow run in ``MLFLOW_TRACKING_URI``, else in ``<run_dir>/mlflow.db`` (SQLite; the
    plain folder store refuses to start without ``MLFLOW_ALLOW_FILE_STORE``). The config goes in
    as flattened ``a.b.c`` parameters; the summary as ``summary/<key>`` metrics and tags."""

    options = frozenset({"experiment", "run_name", "tracking_uri"})

    def __init__(self, run_dir: Path, config: dict, options: dict):
        super().__init__(run_dir, config, options)
        with needs_extra("trackers", "the mlflow logger"):
            from mlflow.tracking import MlflowClient

        uri = options.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(options.get("experiment") or "tidal", local)
        run = self.client.create_run(
            experiment_id, run_name=options.get("run_name") or run_dir.name
        )
        self.run_id = run.info.run_id
        self._last_step = 0
        self._log_params(flatten_config(config))

    def _experiment_id(self, name: str, local: bool) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # The default artifact root is ./mlruns under the working directory; keep it in the run.
        artifacts = (self.run_dir / "mlartifacts").resolve().as_uri() if local else None
        return self.client.create_experiment(name, artifact_location=artifacts)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        entries = [Param(mlflow_name(k), v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
        for start in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(
                self.run_id, params=entries[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._log_metrics(_finite_numbers(metrics), step)
        self._last_step = step

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        entries = [Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(entries), MAX_METRICS_PER_BATCH):
            self.client.log_batch(
                self.run_id, metrics=entries[start : start + MAX_METRICS_PER_BATCH]
            )

    def log_summary(self, summary: dict[str, Any]) -> None:
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        numbers = _finite_numbers(summary)
        self._log_metrics({f"summary/{k}": v for k, v in numbers.items()}, self._last_step)
        for key, value in summary.items():
            if key not in numbers and value is not None:
                text = value if isinstance(value, str) else json.dumps(value)
                self.client.set_tag(
                    self.run_id, mlflow_name(f"summary/{key}"), text[:MAX_TAG_VAL_LENGTH]
                )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# -- the facade -------------------------------------------------------------------------------


class _SinkWorker:
    """Runs one sink on its own thread, from a queue of calls. The first exception disables the
    sink with one warning naming it; later calls are dropped so the others keep going."""

    def __init__(self, name: str, make: Callable[[], MetricSink]):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._failed = False
        self._thread = threading.Thread(
            target=self._run, args=(make,), name=f"metric-sink-{name}", daemon=True
        )
        self._thread.start()

    def submit(self, method: str, *args) -> None:
        self._queue.put((method, args))

    def stop(self) -> None:
        self._queue.put(None)

    def join(self, timeout: float) -> bool:
        self._thread.join(max(timeout, 0.0))
        return not self._thread.is_alive()

    def _run(self, make: Callable[[], MetricSink]) -> None:
        sink = self._guard(make)
        while (item := self._queue.get()) is not None:
            method, args = item
            if sink is not None and not self._failed:
                self._guard(getattr(sink, method), *args)
        if sink is not None:
            self._guard(sink.close)

    def _guard(self, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as exc:
            if not self._failed:
                self._failed = True
                log.warning(
                    "metric logger %r failed and is off for the rest of this run "
                    "(the other loggers keep going): %s: %s",
                    self.name,
                    type(exc).__name__,
                    exc,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
            return None


class MetricLogger:
    """What the run loop logs through. ``loggers`` are sink names (``runner.loggers``);
    ``settings`` holds per-sink options, e.g. ``{"wandb": {"project": "p", "mode": "offline"},
    "mlflow": {"experiment": "e"}}``; ``config`` is the resolved run config."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: Iterable[str] = ("jsonl", "tensorboard"),
        config: dict | None = None,
        settings: dict | None = None,
    ):
        names = _logger_names(loggers)
        settings = _checked_settings(settings)
        config = _plain_config(config)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._closed = False
        self._workers = [
            _SinkWorker(
                name,
                _sink_factory(
                    SINKS.get(name), self.run_dir, config, dict(settings.get(name) or {})
                ),
            )
            for name in names
        ]

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queue one row; returns at once."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"MetricLogger.log: step must be an int, got {step!r}")
        self._submit("log", step, _plain_values(metrics, "metrics"))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._submit("log_summary", _plain_values(summary, "summary"))

    def _submit(self, method: str, *args) -> None:
        if self._closed:
            raise RuntimeError(f"MetricLogger.{method}: the logger is closed")
        for worker in self._workers:
            worker.submit(method, *args)

    def close(self, timeout: float = 30.0) -> None:
        """Flush and close every sink, waiting at most ``timeout`` seconds in all."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.stop()
        deadline = time.monotonic() + timeout
        stuck = [w.name for w in self._workers if not w.join(deadline - time.monotonic())]
        if stuck:
            log.warning(
                "metric loggers %s did not close within %.0f s; leaving them behind",
                ", ".join(stuck),
                timeout,
            )


def _sink_factory(cls: type[MetricSink], run_dir: Path, config: dict, options: dict):
    return lambda: cls(run_dir, config, options)


def _logger_names(loggers: Iterable[str]) -> list[str]:
    if isinstance(loggers, str) or not isinstance(loggers, Iterable):
        raise TypeError(f"runner.loggers: expected a list of names, got {loggers!r}")
    names = list(dict.fromkeys(loggers))  # de-duplicated, in order
    for name in names:
        SINKS.get(name)  # raises ValueError naming runner.loggers and the known names
    return names


def _checked_settings(settings: dict | None) -> dict:
    settings = dict(settings or {})
    for name, options in settings.items():
        if name not in SINKS.names():
            raise ValueError(
                f"logger settings: unknown logger {name!r}; known: {', '.join(SINKS.names())}"
            )
        known = SINKS.get(name).options
        if options is None:
            continue
        if not isinstance(options, Mapping):
            raise TypeError(f"logger settings for {name!r}: expected a mapping, got {options!r}")
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"logger settings for {name!r}: unknown option(s) {unknown}; "
                f"known: {sorted(known) or 'none'}"
            )
    return settings


def _plain_config(config) -> dict:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"MetricLogger: config must be a mapping, got {type(config).__name__}")
    return json.loads(json.dumps(config, default=str))  # plain, detached from the caller's


def _plain_values(values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Copy with NumPy/PyTorch scalars as Python numbers; anything else unloggable is an error."""
    if not isinstance(values, Mapping):
        raise TypeError(f"MetricLogger: {what} must be a mapping, got {type(values).__name__}")
    out = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise TypeError(f"MetricLogger: {what} keys must be strings, got {key!r}")
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise TypeError(
                f"MetricLogger: {what}[{key!r}] must be a number, string or None, "
                f"got {type(value).__name__}"
            )
        out[key] = value
    return out


def _finite_numbers(values: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)
    }


def _finite_or_none(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _as_markdown_code(values: dict) -> str:
    # TensorBoard renders text as Markdown; indenting makes it a code block.
    text = json.dumps(values, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())


def flatten_config(config: Mapping, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` → ``{"a.b": "1"}``; lists stay whole, as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


_MLFLOW_FORBIDDEN = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_name(key: str) -> str:
    """A metric, parameter or tag name MLflow accepts, the same for the same key: characters it
    forbids become ``_``, path segments that are empty, ``.`` or ``..`` go, at most 250 long."""
    segments = _MLFLOW_FORBIDDEN.sub("_", key).split("/")
    kept = [s.replace(".", "_") if s.strip(".") == "" else s for s in segments if s]
    return "/".join(kept)[:250] or "_"


# -- files ------------------------------------------------------------------------------------


def truncate_metrics(run_dir: str | Path, after_step: int) -> int:
    """Drop the rows of ``<run_dir>/metrics.jsonl`` with ``step > after_step`` (and any line that
    is not a JSON row, such as one cut short by a crash); returns how many went. Used on resume,
    so that the steps about to be redone are not logged twice. A missing file drops nothing."""
    if isinstance(after_step, bool) or not isinstance(after_step, int):
        raise TypeError(f"truncate_metrics: after_step must be an int, got {after_step!r}")
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _row_at_or_before(line, after_step)]
    if len(kept) < len(lines):
        atomic_write(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept))
    return len(lines) - len(kept)


def _row_at_or_before(line: str, after_step: int) -> bool:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= after_step
