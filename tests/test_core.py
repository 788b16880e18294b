"""The shared core: the run loop, checkpoints and the config vocabulary (the train engine:
test_engine.py)."""

import dataclasses
import json
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tidal.checkpoint import (
    complete_checkpoints,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from tidal.cli import main
from tidal.config import ActorConfig, ConfigError, EmbodiedConfig, field_help, load_config
from tidal.config.common import ClusterConfig, RunnerConfig
from tidal.config.llm import LLMConfig
from tidal.engine import TrainEngine
from tidal.runners.loop import Interrupted, RunLoop
from tidal.runners.preflight import decide_loggers
from tidal.runners.run_folder import find_resume_checkpoint
from tidal.workers import EmbodiedActor, EnvWorker, RewardWorker, RolloutWorker
from tidal.workers.llm_actor import LLMActor

ROOT = Path(__file__).parent.parent


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _mse(model, batch):
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    return loss, {"loss": loss.item()}


# ----------------------------------------------------------------------------- run loop


@dataclass
class FakeConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)


class FakeRunner(RunLoop):
    """A runner with no workers: a linear model fit by the real engine, one batch per step."""

    def __init__(self, cfg, fail_at=None, cleanup_error=False, signal_at=None, run_dir=None):
        decide_loggers(cfg)  # the preflight's decision, as a runner's checks make it
        self.fail_at, self.cleanup_error, self.signal_at = fail_at, cleanup_error, signal_at
        super().__init__(cfg, run_dir)

    def build(self):
        self.engine = TrainEngine(_model(), ActorConfig(lr=0.05), self.cfg.runner.max_steps)

    def restore(self, checkpoint):
        return self.engine.load(checkpoint)

    def train_step(self, step):
        if step == self.fail_at:
            raise ValueError(f"step {step} exploded")
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGINT)
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 4, generator=g)
        metrics = self.engine.train_batch([(x, x.sum(1, keepdim=True))], _mse)
        return {"train/loss": metrics["loss"][0], **self.engine.end_step()}

    def evaluate(self, step):
        return {"eval/return_mean": -float(step)}

    def save(self, path, meta):
        return str(self.engine.save(path, meta))

    def cleanup_steps(self, graceful):
        self.closed_gracefully = graceful

        def broken():
            raise RuntimeError("cleanup exploded")

        return [("broken", broken)] if self.cleanup_error else []


def fake(tmp_path, *overrides, **kwargs):
    cfg = load_config(
        FakeConfig,
        None,
        [f"runner.run_dir={tmp_path}", "runner.progress=false", "runner.experiment=x", *overrides],
    )
    return FakeRunner(cfg, **kwargs)


def rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run_to_end(runner):
    with runner:
        return runner.run()


def test_every_run_gets_its_own_folder(tmp_path):
    first, second = (run_to_end(fake(tmp_path, "runner.max_steps=2")) for _ in range(2))
    assert Path(first["run_dir"]).name == "x" and Path(second["run_dir"]).name == "x-2"
    assert len(rows(first["run_dir"])) == 2 and len(rows(second["run_dir"])) == 2


def test_cadence_never_saves_a_step_twice_and_keeps_the_newest(tmp_path):
    summary = run_to_end(
        fake(
            tmp_path,
            "runner.max_steps=6",
            "runner.save_interval=3",
            "runner.keep_checkpoints=2",
            "runner.eval_interval=4",
        )
    )
    folder = Path(summary["run_dir"]) / "checkpoints"
    assert [p.name for p in complete_checkpoints(folder)] == ["step_000003", "step_000006"]
    assert (
        summary["checkpoint"].endswith("step_000006")
        and (folder / "latest").read_text() == "step_000006"
    )
    assert [s for s, _ in summary["evals"]] == [4, 6]


def test_pruning_keeps_the_newest_by_step_number_and_the_one_latest_names(tmp_path):
    def save(folder, step):
        save_checkpoint(folder / f"step_{step:06d}", {"w": torch.zeros(1)}, {}, {"step": step})

    def kept(folder):
        return [p.name for p in complete_checkpoints(folder)]

    for step in (5, 999_999, 1_000_000):  # the name grows past six digits
        save(tmp_path / "long", step)
    prune_checkpoints(tmp_path / "long", 1)
    assert kept(tmp_path / "long") == ["step_1000000"]

    for step in (1, 2, 3, 2):  # resumed from step 1 of a run that had reached step 3
        save(tmp_path / "resumed", step)
    prune_checkpoints(tmp_path / "resumed", 1)
    assert kept(tmp_path / "resumed") == ["step_000002", "step_000003"]  # 2: what latest names


def test_a_save_killed_between_the_renames_of_an_overwrite_keeps_the_old_checkpoint(
    tmp_path, monkeypatch
):
    folder = tmp_path / "checkpoints"
    save_checkpoint(folder / "step_000002", {"w": torch.zeros(1)}, {}, {"step": 2})
    real_replace, calls = os.replace, []

    def killed_at_the_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies here
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(folder / "step_000002", {"w": torch.ones(1)}, {}, {"step": 2})
    monkeypatch.undo()
    assert not (folder / "step_000002").exists()  # moved aside, the new one not yet in place
    resumed = find_resume_checkpoint(SimpleNamespace(resume_from=str(folder)))
    assert resumed.name == "step_000002" and not list(folder.glob(".step_*"))


def test_target_metric_stops_the_run(tmp_path):
    summary = run_to_end(
        fake(tmp_path, "runner.max_steps=50", "runner.eval_interval=1", "runner.target_value=-3")
    )
    assert (
        summary["steps"] == 1 and summary["solved_at_step"] == 1 and summary["best_value"] == -1.0
    )


def test_a_run_stopped_by_the_clock_evaluates_its_last_policy(tmp_path):
    summary = run_to_end(
        fake(tmp_path, "runner.max_steps=50", "runner.eval_interval=20", "runner.max_minutes=1e-9")
    )
    assert summary["steps"] == 1 and [s for s, _ in summary["evals"]] == [1]
    assert "eval/return_mean" in rows(summary["run_dir"])[-1]


def test_resume_drops_rows_after_the_checkpoint_and_continues_exactly(tmp_path):
    straight = run_to_end(fake(tmp_path, "runner.max_steps=6", "runner.experiment=straight"))
    # a run killed after step 5 had saved at step 3: its metrics already hold rows 1-5
    with pytest.raises(ValueError, match="step 5 exploded"):
        run_to_end(fake(tmp_path, "runner.max_steps=6", "runner.save_interval=3", fail_at=5))
    assert [r["step"] for r in rows(tmp_path / "x")] == [1, 2, 3, 4, 5]
    resumed = run_to_end(fake(tmp_path, "runner.max_steps=6", "runner.resume_from=auto"))
    assert resumed["run_dir"] == str(tmp_path / "x")
    got = rows(tmp_path / "x")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["train/loss"] for r in got] == [r["train/loss"] for r in rows(straight["run_dir"])]


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path):
    summary = run_to_end(fake(tmp_path, "runner.max_steps=1", "runner.resume_from=auto"))
    assert summary["steps"] == 1 and Path(summary["run_dir"]).name == "x"


def test_resume_falls_back_when_latest_names_a_missing_folder(tmp_path):
    summary = run_to_end(fake(tmp_path, "runner.max_steps=4", "runner.save_interval=2"))
    folder = Path(summary["run_dir"]) / "checkpoints"
    (folder / "latest").write_text("step_000009")  # a kill between the two renames of a save
    (folder / ".step_000009.tmp-123").mkdir()  # and its half-written temporary folder
    assert resolve_checkpoint(folder).name == "step_000004"
    resumed = run_to_end(fake(tmp_path, "runner.max_steps=5", f"runner.resume_from={folder}"))
    assert resumed["steps"] == 5 and not (folder / ".step_000009.tmp-123").exists()


def test_sigint_saves_then_stops(tmp_path):
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN when run as a background job)
    runner = fake(tmp_path, "runner.max_steps=10", "runner.save_interval=0", signal_at=2)
    with pytest.raises(Interrupted) as info:
        run_to_end(runner)
    assert info.value.signum == signal.SIGINT and info.value.checkpoint.endswith("step_000003")
    assert [r["step"] for r in rows(runner.run_dir)] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    # its workers answered to the end: closed as after a normal end, not abandoned as after a
    # failure (which left engine threads running into the interpreter's exit)
    assert runner.closed_gracefully


def test_closing_never_hides_the_first_error(tmp_path, caplog):
    failing = fake(tmp_path, "runner.max_steps=3", fail_at=1, cleanup_error=True)
    with caplog.at_level(logging.WARNING, logger="tidal.train"):
        with pytest.raises(ValueError, match="step 1 exploded"):
            run_to_end(failing)
    assert not failing.closed_gracefully
    assert "closing broken failed (secondary): RuntimeError: cleanup exploded" in caplog.text


# ----------------------------------------------------------------------------- config vocabulary


@pytest.mark.parametrize("schema", [EmbodiedConfig, LLMConfig])
def test_every_config_key_has_help(schema):
    missing = [k for k, v in field_help(schema).items() if not v and k not in ("cluster", "runner")]
    assert not missing


def test_shared_concepts_have_one_key_in_both_halves():
    embodied, llm = field_help(EmbodiedConfig), field_help(LLMConfig)
    for key in (
        "algorithm.adv_type",
        "algorithm.clip_ratio_low",
        "algorithm.clip_ratio_high",
        "algorithm.loss_agg",
        "actor.lr",
        "actor.lr_schedule",
        "actor.max_grad_norm",
        "runner.seed",
        "runner.eval_interval",
        "runner.save_interval",
        "runner.timeout_s",
        "runner.loggers",
        "runner.target_metric",
    ):
        assert key in embodied and key in llm, key


@pytest.mark.parametrize(
    "worker,schema",
    [
        (EnvWorker, EmbodiedConfig),
        (RolloutWorker, EmbodiedConfig),
        (EmbodiedActor, EmbodiedConfig),
        (RewardWorker, EmbodiedConfig),
        (LLMActor, LLMConfig),
    ],
)
def test_workers_are_given_only_the_sections_they_declare(worker, schema):
    spec = worker.create_group(schema())
    sections = spec.args[0]
    assert [n for n in vars(sections) if not n.startswith("_")] == list(worker.config_sections)
    assert set(worker.config_sections) < {f.name for f in dataclasses.fields(schema)}
    with pytest.raises(AttributeError, match="did not declare the config section 'sft'"):
        sections.sft  # noqa: B018 (no worker reads the SFT section)


@pytest.mark.parametrize(
    "schema,old,new",
    [
        (LLMConfig, "actor.clip_ratio_low=0.1", "algorithm.clip_ratio_low"),
        (EmbodiedConfig, "actor.seed=3", "runner.seed"),
        (EmbodiedConfig, "runner.target_eval_return=400", "runner.target_value"),
    ],
)
def test_old_keys_name_the_new_key(schema, old, new, tmp_path):
    with pytest.raises(ConfigError, match=f"this key moved; use {new}"):
        load_config(schema, None, [old])
    key, value = old.split("=")
    section, name = key.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=f"{key}: this key moved; use {new}"):
        load_config(schema, path)


def test_tidal_config_prints_help_and_honours_the_task_override(capsys):
    assert main(["config", str(ROOT / "examples/embodied/cartpole_ppo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "target_value: 475.0  # stop once target_metric reaches this value" in out
    assert (
        main(["config", str(ROOT / "examples/embodied/cartpole_ppo.yaml"), "runner.task=llm"]) == 2
    )
    assert "env: no such key (in " in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "env:\n\tid: CartPole-v1\n",
            "not valid YAML: found character '\\t' that cannot start any token; YAML indents with spaces, not tabs",
        ),
        (
            "- 1\n- 2\n",
            "expected a mapping of sections at the top level (e.g. 'runner:'), got list",
        ),
        ("env: [1, 2\n", "not valid YAML"),
    ],
)
def test_malformed_files_are_named_without_a_traceback(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_run_loop_feeds_every_logger_and_plots(tmp_path, monkeypatch):
    """Metrics, the resolved config and the summary reach W&B (offline) and MLflow (SQLite in
    the run folder) as well as the JSONL file; ``tidal plot`` draws the run."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    summary = run_to_end(
        fake(
            tmp_path,
            "runner.max_steps=3",
            "runner.eval_interval=1",
            "runner.loggers=[jsonl,tensorboard,wandb,mlflow]",
            "runner.mlflow={experiment: core}",
        )
    )
    run_dir = Path(summary["run_dir"])
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("core").experiment_id])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/return_mean")] == [
        -1.0,
        -2.0,
        -3.0,
    ]
    assert run.data.params["runner.max_steps"] == "3" and run.data.metrics["summary/steps"] == 3
    assert main(["plot", str(run_dir), "-x", "time", "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000


class DiesOnce(FakeRunner):
    """A rank dies at step 3 of the first attempt only."""

    died = False

    def train_step(self, step):
        if step == 3 and not DiesOnce.died:
            DiesOnce.died = True
            from tidal.runtime import WorkerError

            raise WorkerError(
                "env", 1, "interact", "rank died: ActorDiedError: the actor died unexpectedly"
            )
        return super().train_step(step)


def test_a_dead_worker_restarts_the_run_from_its_newest_checkpoint(tmp_path, caplog):
    from tidal.runners.loop import run_with_restarts

    cfg = load_config(
        FakeConfig,
        None,
        [
            f"runner.run_dir={tmp_path}",
            "runner.progress=false",
            "runner.experiment=x",
            "runner.max_steps=5",
            "runner.save_interval=2",
            "runner.max_restarts=1",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="tidal.train"):
        summary = run_with_restarts(DiesOnce, cfg)
    assert (
        summary["restarts"] == 1
        and summary["steps"] == 5
        and summary["run_dir"] == str(tmp_path / "x")
    )
    assert (
        "restart 1 of 1 after a worker fault (WorkerError: env[rank 1].interact failed: rank died"
        in caplog.text
    )
    assert [r["step"] for r in rows(tmp_path / "x")] == [1, 2, 3, 4, 5]
    # step 3 trained again, logged once
    DiesOnce.died = False
    cfg.runner.max_restarts = 0
    with pytest.raises(Exception, match="rank died"):
        run_with_restarts(DiesOnce, cfg)


class DiesBeforeItsFirstCheckpoint(FakeRunner):
    """A rank dies at step 1 of the first attempt, before anything was saved."""

    died = False

    def train_step(self, step):
        if step == 1 and not DiesBeforeItsFirstCheckpoint.died:
            DiesBeforeItsFirstCheckpoint.died = True
            from tidal.runtime import WorkerError

            raise WorkerError("env", 0, "interact", "rank died: ActorDiedError: gone")
        return super().train_step(step)


def test_a_restart_before_the_first_checkpoint_starts_over_in_the_same_run_folder(tmp_path):
    from tidal.runners.loop import run_with_restarts

    cfg = load_config(
        FakeConfig,
        None,
        [
            f"runner.run_dir={tmp_path}",
            "runner.progress=false",
            "runner.experiment=x",
            "runner.max_steps=3",
            "runner.save_interval=0",
            "runner.max_restarts=1",
        ],
    )
    summary = run_with_restarts(DiesBeforeItsFirstCheckpoint, cfg)
    assert summary["restarts"] == 1 and summary["run_dir"] == str(tmp_path / "x")
    assert [p.name for p in tmp_path.iterdir()] == ["x"]  # no x-2 beside it
    assert [r["step"] for r in rows(tmp_path / "x")] == [1, 2, 3]  # step 1 logged once
    log_text = (tmp_path / "x" / "train.log").read_text()
    assert log_text.count("tidal.train: step 1 ") == 2  # both attempts log to the one folder


def test_a_bug_is_not_restarted(tmp_path):
    from tidal.runners.loop import run_with_restarts

    cfg = load_config(
        FakeConfig,
        None,
        [f"runner.run_dir={tmp_path}", "runner.progress=false", "runner.max_restarts=3"],
    )
    with pytest.raises(ValueError, match="step 1 exploded"):
        run_with_restarts(lambda c, run_dir: FakeRunner(c, fail_at=1, run_dir=run_dir), cfg)
    assert len(list(tmp_path.iterdir())) == 1
