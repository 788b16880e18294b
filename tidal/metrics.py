"""Metrics: per-phase timers, and a logger that writes ``metrics.jsonl`` and TensorBoard events
from a background thread so the training loop never waits on disk."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


def truncate_metrics(run_dir: str | Path, after_step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` logged after ``after_step`` (a resumed run logs them
    again); returns how many were dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= after_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


class MetricLogger:
    def __init__(self, run_dir: str | Path, loggers=("jsonl", "tensorboard"), config=None, settings=None):
        tensorboard = "tensorboard" in loggers
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue()
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._thread = threading.Thread(target=self._drain, name="metric-logger", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._queue.put((step, dict(metrics)))

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                step, metrics = item
                record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
                if self._writer is not None:
                    for k, v in metrics.items():
                        if isinstance(v, (int, float)) and math.isfinite(v):
                            self._writer.add_scalar(k, v, step)
            finally:
                self._queue.task_done()

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self._jsonl.close()
        if self._writer is not None:
            self._writer.close()


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def attach_file_log(path: Path) -> logging.Handler:
    """Send the ``tidal`` loggers to a run's log file as well."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("tidal")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler
