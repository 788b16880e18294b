"""MetricLogger and its sinks, against the real packages: each test reads back what was written
(the JSONL file, TensorBoard events, the W&B offline-run file, MLflow through its client)."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tidal.metrics import (
    MetricLogger,
    MetricSink,
    flatten_config,
    mlflow_name,
    register_sink,
    truncate_metrics,
)

CONFIG = {
    "algorithm": {"adv_type": "gae", "clip_ratio_low": 0.2},
    "runner": {"seed": 3},
    "env": {"ids": [1, 2]},
    "note": "x" * 7000,
}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- jsonl and tensorboard ----------------------------------------------------------------------


def test_jsonl_and_tensorboard_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricLogger(tmp_path, config=CONFIG)
    logger.log(0, {"loss": 1.5, "eval/return_mean": float("nan"), "n": np.int64(4)})
    logger.log(1, {"loss": np.float32(0.5), "phase": "train"})
    logger.log_summary({"best_eval_return": 7.0, "checkpoint": "ckpt/1", "solved_at": None})
    logger.close()

    assert _rows(tmp_path) == [
        {"step": 0, "loss": 1.5, "eval/return_mean": None, "n": 4},
        {"step": 1, "loss": 0.5, "phase": "train"},
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"best_eval_return": 7.0, "checkpoint": "ckpt/1", "solved_at": None}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 1.5), (1, 0.5)]
    assert "eval/return_mean" not in events.Tags()["scalars"]  # NaN is not plotted
    assert [e.step for e in events.Scalars("n")] == [0]


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"runner\.loggers.*'nope'") as error:
        MetricLogger(tmp_path, loggers=["jsonl", "nope"])
    assert all(name in str(error.value) for name in ("jsonl", "mlflow", "tensorboard", "wandb"))
    with pytest.raises(TypeError, match="list of names"):
        MetricLogger(tmp_path, loggers="wandb")
    with pytest.raises(ValueError, match=r"'wandb'.*\['projec'\].*project"):
        MetricLogger(tmp_path, loggers=["jsonl"], settings={"wandb": {"projec": "p"}})
    with pytest.raises(ValueError, match=r"logger settings: unknown logger 'wandbb'"):
        MetricLogger(tmp_path, loggers=["jsonl"], settings={"wandbb": {"project": "p"}})
    logger = MetricLogger(tmp_path, loggers=["jsonl"])
    with pytest.raises(TypeError, match=r"metrics\['x'\] must be a number"):
        logger.log(0, {"x": [1, 2]})
    with pytest.raises(TypeError, match="step must be an int"):
        logger.log(1.0, {"x": 1})
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(2, {"x": 1})


# -- failures and closing -------------------------------------------------------------------------


@register_sink("test-broken-log")
class _BrokenOnLog(MetricSink):
    def log(self, step, metrics):
        raise OSError(f"disk gone at step {step}")


@register_sink("test-broken-start")
class _BrokenOnStart(MetricSink):
    def __init__(self, run_dir, config, options):
        raise ConnectionError("no server")


_release = threading.Event()


@register_sink("test-hangs-on-close")
class _HangsOnClose(MetricSink):
    def log(self, step, metrics):
        pass

    def close(self):
        _release.wait(30)


def test_a_failing_sink_warns_once_and_the_others_keep_going(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tidal.metrics")
    logger = MetricLogger(tmp_path, loggers=["test-broken-log", "test-broken-start", "jsonl"])
    for step in range(3):
        logger.log(step, {"x": step})
    logger.close(timeout=10)
    assert [row["step"] for row in _rows(tmp_path)] == [0, 1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.name == "tidal.metrics"]
    assert len(warnings) == 2, warnings
    assert "'test-broken-log'" in warnings[0] or "'test-broken-log'" in warnings[1]
    assert any("'test-broken-start'" in w and "no server" in w for w in warnings)
    assert any("disk gone at step 0" in w for w in warnings)  # the first failure, only


def test_close_is_bounded_when_a_sink_hangs(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tidal.metrics")
    logger = MetricLogger(tmp_path, loggers=["jsonl", "test-hangs-on-close"])
    logger.log(0, {"x": 1})
    start = time.monotonic()
    try:
        logger.close(timeout=0.5)
        elapsed = time.monotonic() - start
    finally:
        _release.set()  # let the sink's thread end
    assert elapsed < 3
    assert _rows(tmp_path) == [{"step": 0, "x": 1}]
    assert any("test-hangs-on-close" in r.getMessage() for r in caplog.records)


# -- W&B -------------------------------------------------------------------------------------------


def _wandb_records(path: Path):
    """Records of a ``.wandb`` file: a 7-byte header, then LevelDB-log chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full or last chunk
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _complete_wandb_records(path: Path, timeout: float = 60.0) -> list:
    """The file's records once W&B's service has written the exit record: ``finish()`` can
    return before the service (another process) flushes its buffered writes."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.2)


def test_wandb_offline_run_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "cartpole-1"
    logger = MetricLogger(
        run_dir,
        loggers=["wandb"],
        config=CONFIG,
        settings={"wandb": {"project": "tidal-test", "mode": "online"}},
    )
    for step in range(3):
        logger.log(step, {"rollout/return_mean": 10.0 * step, "bad": math.inf, "tag": "s"})
    logger.log_summary({"best_eval_return": 20.0, "checkpoint": None})
    logger.close(timeout=180)  # W&B's finish writes the run record; a loaded machine is slow

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # offline despite "online"
    history, summary, config, run = [], {}, {}, None
    for record in _complete_wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "summary":
            summary.update({i.key: json.loads(i.value_json) for i in record.summary.update})
        elif kind == "run":
            run = record.run
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    assert run.project == "tidal-test" and run.display_name == "cartpole-1"
    assert [(h["_step"], h["rollout/return_mean"]) for h in history] == [
        (0, 0.0),
        (1, 10.0),
        (2, 20.0),
    ]
    assert not any("bad" in h or "tag" in h for h in history)
    assert summary["best_eval_return"] == 20.0
    assert config["algorithm"] == CONFIG["algorithm"], config


def test_a_real_wandb_failure_leaves_the_jsonl_log_going(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    caplog.set_level(logging.WARNING, logger="tidal.metrics")
    (tmp_path / "wandb").write_text("")  # a file where W&B needs its folder
    logger = MetricLogger(tmp_path, loggers=["wandb", "jsonl"])
    logger.log(0, {"x": 1.0})
    logger.close(timeout=20)
    assert _rows(tmp_path) == [{"step": 0, "x": 1.0}]
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "tidal.metrics"]
    assert "'wandb' failed" in warning and "Not a directory" in warning


# -- MLflow ----------------------------------------------------------------------------------------


def test_mlflow_local_store_in_the_run_folder_then_the_tracking_uri(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    run_dir = tmp_path / "runs" / "pendulum-1"
    logger = MetricLogger(
        run_dir, loggers=["mlflow"], config=CONFIG, settings={"mlflow": {"experiment": "pendulum"}}
    )
    logger.log(0, {"eval/return_mean": -900.0, "loss@actor": 1.0, "nan": math.nan})
    logger.log(5, {"eval/return_mean": -200.0, "loss@actor": 0.5})
    logger.log_summary({"best_eval_return": -200.0, "checkpoint": "ckpt/5", "solved_at": None})
    logger.close()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pendulum").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "pendulum-1"
    params = run.data.params
    assert params["algorithm.adv_type"] == "gae" and params["runner.seed"] == "3"
    assert params["algorithm.clip_ratio_low"] == "0.2" and params["env.ids"] == "[1, 2]"
    assert params["note"] == "x" * 6000  # MLflow's limit
    history = client.get_metric_history(run.info.run_id, "eval/return_mean")
    assert [(m.step, m.value) for m in history] == [(0, -900.0), (5, -200.0)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss_actor")] == [1.0, 0.5]
    assert "nan" not in run.data.metrics
    assert run.data.metrics["summary/best_eval_return"] == -200.0
    assert run.data.tags["summary/checkpoint"] == "ckpt/5"

    # With MLFLOW_TRACKING_URI set (here: the store above, as a stand-in for a server), the next
    # run goes there and makes no store of its own. Reusing the store saves a second migration.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    second = tmp_path / "runs" / "pendulum-2"
    logger = MetricLogger(second, loggers=["mlflow"])
    logger.log(1, {"x": 2.0})
    logger.close()
    assert not (second / "mlflow.db").exists()
    (run,) = client.search_runs([client.get_experiment_by_name("tidal").experiment_id])
    assert run.info.run_name == "pendulum-2" and run.data.metrics == {"x": 2.0}


@pytest.mark.parametrize(
    "key, name",
    [
        ("eval/return_mean", "eval/return_mean"),
        ("loss@actor", "loss_actor"),
        ("a//b/", "a/b"),
        ("/abs", "abs"),
        ("a/../b", "a/__/b"),
        ("é:x", "__x"),
        ("", "_"),
        ("k" * 300, "k" * 250),
    ],
)
def test_mlflow_names_are_sanitised_deterministically(key, name):
    from mlflow.utils.validation import _validate_metric_name

    assert mlflow_name(key) == name == mlflow_name(key)
    _validate_metric_name(name)  # MLflow's own check accepts it


def test_flatten_config():
    assert flatten_config({"a": {"b": {"c": 1}, "d": "x"}, "e": None, "f": {}}) == {
        "a.b.c": "1",
        "a.d": "x",
        "e": "null",
        "f": "{}",
    }


# -- truncation ------------------------------------------------------------------------------------


def test_truncate_metrics_drops_later_rows_and_a_torn_line(tmp_path):
    rows = [json.dumps({"step": s, "x": s}) for s in range(6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 6, "x"')
    assert truncate_metrics(tmp_path, after_step=2) == 4
    assert _rows(tmp_path) == [{"step": s, "x": s} for s in range(3)]
    assert truncate_metrics(tmp_path, after_step=2) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left
    assert truncate_metrics(tmp_path / "missing", after_step=0) == 0
    with pytest.raises(TypeError, match="after_step"):
        truncate_metrics(tmp_path, after_step="2")


def test_the_run_log_rotates_and_keeps_its_newest_lines(tmp_path, monkeypatch):
    import logging

    from tidal.runners import run_folder

    monkeypatch.setattr(run_folder, "LOG_MAX_BYTES", 2000)
    handler = run_folder.attach_file_log(tmp_path / "train.log")
    try:
        for step in range(200):
            logging.getLogger("tidal.train").info("step %d %s", step, "x" * 40)
    finally:
        logging.getLogger("tidal").removeHandler(handler)
        handler.close()
    logs = sorted(p.name for p in tmp_path.iterdir())
    assert logs == ["train.log", "train.log.1", "train.log.2", "train.log.3"]
    assert all((tmp_path / name).stat().st_size <= 2000 for name in logs)
    assert "step 199 " in (tmp_path / "train.log").read_text()
