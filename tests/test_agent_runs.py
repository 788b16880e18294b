"""Agents as they are in whole `tidal train` runs on both backends: a command agent trains a
step, and one that always crashes stops the run naming its command."""

import json
import shlex
import sys
from pathlib import Path

import pytest
from agent_models import RECORD, TOOL_AGENT
from deps import require

from tidal.rollout.dispatcher import EpisodeError

require("openai")  # the agent script is a plain-``openai`` client


@pytest.fixture(params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def backend(request):
    """cluster.backend of a runner test; the ray cases share the module's one Ray session."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


def agent_runner(tool_model, tmp_path, backend, command, *extra):
    """A `tidal train` run (LLMRunner) of one step with ``command`` as the agent: the inference
    server and the trainer as workers of ``backend``, the agents as commands against the session
    proxy of the runner's process."""
    from tidal.config.llm import LLMConfig
    from tidal.config.loader import load_config
    from tidal.runners.llm.train import LLMRunner

    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps(RECORD) + "\n")
    overrides = [
        f"model.path={tool_model}",
        f"data.path={data}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=1",
        "rollout.batch_size=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=40",
        "rollout.max_concurrent_rollouts=1",
        f"rollout.agent.command=[{', '.join(command)}]",
        "rollout.agent.timeout_s=60",
        f"cluster.backend={backend}",
        "cluster.devices_per_node=2",
        "cluster.placement={rollout: '0', actor: '1'}",
        *extra,
    ]
    return LLMRunner(load_config(LLMConfig, None, overrides))


def test_an_agent_command_trains_a_step(backend, tool_model, tmp_path):
    """The whole loop: its calls train one step, and the greedy agent succeeds in evaluation."""
    eval_every_step = [f"data.eval_path={tmp_path / 'questions.jsonl'}", "data.eval_size=1",
                       "runner.eval_interval=1"]  # fmt: skip
    with agent_runner(tool_model, tmp_path, backend, TOOL_AGENT, *eval_every_step) as runner:
        summary = runner.run()
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    step = [r for r in rows if r["step"] >= 1][-1]
    assert step["version"] == 1 and step["rollout/agent_errors"] == 0
    assert step["rollout/accepted"] == 1 and "rollout/tool_parse_errors" in step
    # the greedy agent calls the tool and answers right (sampled ones may fumble the call)
    assert step["eval/success_rate"] == 1.0 and "train/policy_loss" in step


def test_an_agent_that_always_crashes_stops_the_run_naming_its_command(
    backend, tool_model, tmp_path
):
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('agent broke', file=sys.stderr)\nsys.exit(3)\n")
    command = [sys.executable, str(crash)]
    runner = agent_runner(tool_model, tmp_path, backend, command, "rollout.agent.max_errors=2")
    with runner, pytest.raises(EpisodeError) as stopped:  # the episode's AgentError
        runner.run()
    message = str(stopped.value)
    first = message.splitlines()[0]  # the cause leads, the traceback follows
    assert f"rollout.agent: {shlex.join(command)!r} failed 2 times in a row" in first
    assert "exited with status 3" in message and "agent broke" in message
