"""Ranks killed on purpose during real runs on ray (``TIDAL_FAULTS``, tidal.runtime.faults): the
sender and a receiver of a collective weight update killed mid-broadcast, a process hosting env
and rollout together killed, in both halves (the language one with agent sessions open); each run
restarts from its newest checkpoint (``runner.max_restarts``) and ends with every step logged
once in one run folder. A hung rank ends its run promptly, killed, nothing left running."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tidal.config import EmbodiedConfig, load_config
from tidal.runtime import WorkerError
from tidal.runtime.errors import (
    WeightSyncError,
    WeightUpdateAborted,
    WorkerTimeoutError,
    is_restartable,
)
from tidal.runtime.faults import ENV, fault_point

ROOT = Path(__file__).parent.parent
CARTPOLE = ROOT / "examples" / "embodied" / "cartpole_ppo.yaml"
EMBODIED = [
    "runner.progress=false",
    "runner.experiment=chaos",
    "env.total_num_envs=4",
    "env.pipeline_stage_num=1",
    "env.num_action_chunks=3",
    "env.eval_num_envs=2",
    "rollout.num_steps=8",
    "rollout.weight_sync=collective",
    "actor.global_batch_size=16",
    "actor.micro_batch_size=8",
    "runner.eval_interval=0",
    "runner.target_value=null",
    "runner.timeout_s=60",
    "cluster.backend=ray",
    "cluster.devices_per_node=3",
]


def faults(tmp_path: Path, *specs: dict) -> str:
    """``TIDAL_FAULTS`` for ``specs``, each firing once (its file in ``tmp_path``)."""
    return json.dumps([{**s, "once": str(tmp_path / f"fault-{i}")} for i, s in enumerate(specs)])


def fired(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("fault-*"))


def logged_steps(run_dir: Path) -> list[int]:
    rows = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["step"] for r in rows if json.loads(r)["step"] >= 1]


def processes_with(spec: str) -> list[int]:
    """This machine's processes started with ``TIDAL_FAULTS=spec`` (the run's ranks)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(ENV) == spec and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def assert_nothing_left(spec: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while processes_with(spec) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(spec) == [], "rank processes of the run still running"


# -- without ray: the classification and the fault spec ---------------------------------------


def test_weight_link_failures_and_dead_ranks_are_restartable_and_aborts_are_not():
    broken = "WeightSyncError: weight link x (collective): receiver rank 0: broadcast failed"
    assert is_restartable(WorkerError("rollout", 0, "sync_weights", broken))
    assert is_restartable(WorkerError("env", 0, "interact", "rank died: ActorDiedError: gone"))
    assert is_restartable(WeightSyncError("vLLM http://x/reload: ReadError"))
    aborted = "WeightUpdateAborted: the sender aborted the update: RuntimeError: gather"
    assert not is_restartable(WorkerError("rollout", 0, "sync_weights", aborted))
    assert not is_restartable(WeightUpdateAborted("gather failed"))
    assert not is_restartable(WorkerError("actor", 0, "run_training", "ValueError: bad shape"))


def test_a_fault_spec_is_checked_and_a_spent_fault_does_not_fire(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "not json")
    with pytest.raises(ValueError, match="TIDAL_FAULTS: not JSON"):
        fault_point("call", group="env")
    monkeypatch.setenv(ENV, json.dumps([{"at": "call", "do": "explode"}]))
    with pytest.raises(ValueError, match="'do' must be one of"):
        fault_point("call", group="env")
    once = tmp_path / "spent"
    once.write_text("1")
    monkeypatch.setenv(ENV, json.dumps([{"at": "call", "when": {"n": 2}, "once": str(once)}]))
    fault_point("call", n=2)  # spent: this process lives on
    fault_point("call", n=3)  # no match
    monkeypatch.delenv(ENV)
    fault_point("call", n=2)


# -- on ray -----------------------------------------------------------------------------------


@pytest.mark.ray
def test_an_embodied_run_survives_its_sender_and_a_receiver_killed_mid_broadcast(
    ray_session, tmp_path
):
    """`tidal train` on the module's Ray session: the actor killed mid-broadcast (version 2),
    then the rollout (version 4); two restarts, exit 0, every step logged once in one run
    folder, no rank left running."""
    import ray

    spec = faults(
        tmp_path,
        {"at": "weights.send", "when": {"version": 2, "bucket": 0}},
        {"at": "weights.recv", "when": {"version": 4, "bucket": 0}},
    )
    runs = tmp_path / "runs"
    command = [
        sys.executable,
        "-m",
        "tidal.cli",
        "train",
        str(CARTPOLE),
        f"runner.run_dir={runs}",
        *EMBODIED,
        "runner.max_steps=6",
        "runner.save_interval=2",
        "runner.max_restarts=2",
        "cluster.placement={env: '0', rollout: '1', actor: '2'}",
        f"cluster.address={ray.get_runtime_context().gcs_address}",
    ]
    env = {**os.environ, ENV: spec, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert fired(tmp_path) == ["fault-0", "fault-1"]
    assert [p.name for p in runs.iterdir()] == ["chaos"]
    assert json.loads(done.stdout[done.stdout.index("{") :])["restarts"] == 2
    assert logged_steps(runs / "chaos") == list(range(1, 7))
    assert "restart 2 of 2 after a worker fault" in done.stderr
    assert_nothing_left(spec)


@pytest.mark.ray
def test_a_process_hosting_env_and_rollout_killed_mid_broadcast_restarts_the_run(
    ray_session, tmp_path, monkeypatch
):
    from tidal.runners import EmbodiedRunner
    from tidal.runners.loop import run_with_restarts

    spec = faults(tmp_path, {"at": "weights.recv", "when": {"version": 3, "bucket": 0}})
    monkeypatch.setenv(ENV, spec)
    cfg = load_config(
        EmbodiedConfig,
        CARTPOLE,
        [
            f"runner.run_dir={tmp_path / 'runs'}",
            *EMBODIED,
            "runner.max_steps=5",
            "runner.save_interval=2",
            "runner.max_restarts=1",
            "cluster.placement={'env,rollout': '0', actor: '1'}",
        ],
    )
    runners = []
    summary = run_with_restarts(
        lambda c, run_dir: runners.append(EmbodiedRunner(c, run_dir)) or runners[-1], cfg
    )
    assert runners[0].shared_processes() == ["env,rollout"]  # one process: both died
    assert fired(tmp_path) == ["fault-0"] and summary["restarts"] == 1
    assert runners[1].start_step == 2
    assert logged_steps(summary["run_dir"]) == list(range(1, 6))
    assert_nothing_left(spec)


@pytest.mark.ray
def test_a_language_run_with_agent_sessions_open_survives_kills_mid_broadcast(
    ray_session, tool_model, tmp_path, monkeypatch
):
    """Asynchronous (eta 2), agents as commands against the session proxy: the trainer killed
    mid-broadcast, then the inference server, while episodes' sessions are open."""
    from agent_models import QUESTION

    from tidal.config.llm import LLMConfig
    from tidal.runners.llm.train import LLMRunner
    from tidal.runners.loop import run_with_restarts

    spec = faults(
        tmp_path,
        {"at": "weights.send", "when": {"version": 2, "bucket": 0}},
        {"at": "weights.recv", "when": {"version": 3, "bucket": 0}},
    )
    monkeypatch.setenv(ENV, spec)
    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION, "answer": "7"}) + "\n")
    agent = [sys.executable, str(Path(__file__).parent / "agent_scripts" / "tool_agent.py")]
    cfg = load_config(
        LLMConfig,
        None,
        [
            f"model.path={tool_model}",
            f"data.path={data}",
            f"runner.run_dir={tmp_path / 'runs'}",
            "runner.progress=false",
            "runner.experiment=chaos",
            "runner.max_steps=4",
            "runner.eval_interval=0",
            "runner.save_interval=1",
            "runner.max_restarts=2",
            "runner.timeout_s=60",
            "rollout.batch_size=2",
            "rollout.group_size=2",
            "rollout.max_staleness=2",
            "rollout.max_concurrent_rollouts=4",
            "rollout.max_new_tokens=40",
            "rollout.weight_sync=collective",
            f"rollout.agent.command=[{', '.join(agent)}]",
            "rollout.agent.timeout_s=60",
            "cluster.backend=ray",
            "cluster.devices_per_node=2",
            "cluster.placement={rollout: '0', actor: '1'}",
        ],
    )
    summary = run_with_restarts(lambda c, run_dir: LLMRunner(c, run_dir), cfg)
    assert fired(tmp_path) == ["fault-0", "fault-1"] and summary["restarts"] == 2
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["chaos"]
    assert logged_steps(summary["run_dir"]) == list(range(1, 5))
    assert_nothing_left(spec)
    assert [p.pid for p in psutil.process_iter() if _is_agent(p, agent[1], spec)] == []


def _is_agent(proc: psutil.Process, script: str, spec: str) -> bool:
    """This run's agent (the other xdist worker's tests run the same script at times)."""
    try:
        mine = script in proc.cmdline() and proc.environ().get(ENV) == spec
        return mine and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


@pytest.mark.ray
def test_a_hung_rank_is_named_killed_and_the_run_exits_promptly(ray_session, tmp_path, monkeypatch):
    """The process of env and rollout stops answering (SIGSTOP) at step 3: the run names the
    rank at ``runner.timeout_s``, kills the process and ends within the timeout plus 10 s."""
    from tidal.runners import EmbodiedRunner

    timeout = 10
    spec = faults(
        tmp_path,
        {"at": "call", "when": {"group": "env", "method": "interact", "n": 3}, "do": "hang"},
    )
    monkeypatch.setenv(ENV, spec)
    cfg = load_config(
        EmbodiedConfig,
        CARTPOLE,
        [
            f"runner.run_dir={tmp_path / 'runs'}",
            *EMBODIED,
            "runner.max_steps=6",
            "runner.save_interval=0",
            f"runner.timeout_s={timeout}",
            "cluster.placement={'env,rollout': '0', actor: '1'}",
        ],
    )
    with pytest.raises(WorkerTimeoutError, match=r"env.interact: ranks \[0\] had not answered"):
        with EmbodiedRunner(cfg) as runner:
            runner.run()
    ended = time.time()
    hung = tmp_path / "fault-0"
    assert ended - hung.stat().st_mtime < timeout + 10
    pid = int(hung.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_nothing_left(spec)


def test_a_rank_killed_while_the_run_builds_restarts_it_in_the_same_folder(tmp_path):
    """A fault raised while a runner builds its groups (a rank killed as it starts) restarts the
    run like one raised while it trains, in the folder the first attempt made."""
    from test_core import FakeConfig, FakeRunner

    from tidal.runners.loop import run_with_restarts

    class DiesWhileBuilding(FakeRunner):
        attempts = 0

        def build(self):
            DiesWhileBuilding.attempts += 1
            if DiesWhileBuilding.attempts == 1:
                raise WorkerError("rollout", 0, "__init__", "rank died: ActorDiedError: gone")
            super().build()

    cfg = load_config(
        FakeConfig,
        None,
        [
            f"runner.run_dir={tmp_path}",
            "runner.progress=false",
            "runner.experiment=x",
            "runner.max_steps=3",
            "runner.max_restarts=1",
        ],
    )
    summary = run_with_restarts(lambda c, run_dir: DiesWhileBuilding(c, run_dir=run_dir), cfg)
    assert summary["restarts"] == 1 and DiesWhileBuilding.attempts == 2
    assert [p.name for p in tmp_path.iterdir()] == ["x"]
    assert logged_steps(summary["run_dir"]) == [1, 2, 3]
