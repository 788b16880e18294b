"""Agents as commands on a small machine: at most ``rollout.agent.max_processes`` run at once,
an episode's timeout counts from its slot (not from the queue before it), and a persistent
agent (one process per slot, a request per line) pays its start-up once; a persistent process
that dies, hangs or is cancelled mid-request is replaced, never reused."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidal.rollout.agent_command import AgentFailure, CommandAgent, default_agent_processes

SCRIPTS = Path(__file__).parent / "agent_scripts"
SESSION = SimpleNamespace(base_url="http://127.0.0.1:9/unused", api_key="k")


def scripted(log: Path, seconds: float, *mode: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "scripted_agent.py"), str(log), str(seconds), *mode]


def intervals(log: Path) -> list[tuple[int, float, float]]:
    """(pid, start, end) of every run the agent logged."""
    starts, out = {}, []
    for line in log.read_text().splitlines():
        kind, pid, t = line.split()
        if kind == "start":
            starts[pid] = float(t)
        else:
            out.append((int(pid), starts.pop(pid), float(t)))
    return out


def most_at_once(runs: list[tuple[int, float, float]]) -> int:
    events = sorted([(s, 1) for _, s, _ in runs] + [(e, -1) for _, _, e in runs])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


async def run_all(agent: CommandAgent, n: int) -> list:
    try:
        return await asyncio.gather(
            *(agent.run(SESSION, {"i": i}) for i in range(n)), return_exceptions=True
        )
    finally:
        await agent.aclose()


def test_the_default_is_two_processes_per_core_or_eight_when_persistent():
    assert default_agent_processes() == 2 * os.cpu_count()
    assert CommandAgent(["true"]).max_processes == 2 * os.cpu_count()
    assert CommandAgent(["true"], persistent=True).max_processes == 8 * os.cpu_count()
    assert CommandAgent(["true"], max_processes=3, persistent=True).max_processes == 3


def test_processes_are_bounded_and_the_timeout_counts_from_the_slot(tmp_path):
    log = tmp_path / "runs.log"
    # 6 episodes of ~1 s on 2 slots take ~3 s, beyond the 2.5 s timeout of each one
    agent = CommandAgent(scripted(log, 1.0), timeout_s=2.5, max_processes=2)
    results = asyncio.run(run_all(agent, 6))
    assert [agent.parse_reward(r) for r in results] == [1.0] * 6, results
    runs = intervals(log)
    assert len(runs) == 6 and most_at_once(runs) == 2
    assert max(e for _, _, e in runs) - min(s for _, s, _ in runs) > 2.5


def test_a_persistent_agent_serves_every_request_from_one_process(tmp_path):
    log = tmp_path / "runs.log"
    agent = CommandAgent(scripted(log, 0.05), timeout_s=20, max_processes=2, persistent=True)
    answers = asyncio.run(run_all(agent, 8))
    pids = {json.loads(a)["pid"] for a in answers}
    assert len(answers) == 8 and len(pids) == 2  # two slots, each started once
    assert {pid for pid, _, _ in intervals(log)} == pids and most_at_once(intervals(log)) <= 2
    for pid in pids:  # aclose ended them
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)


def test_a_persistent_agent_that_dies_or_hangs_fails_its_episode_and_is_started_afresh(tmp_path):
    for mode, cause in [("exit_on_2", "persistent agent exited with status 4"),
                        ("hang_on_2", "timed out after 3 s")]:  # fmt: skip
        log = tmp_path / f"{mode}.log"
        agent = CommandAgent(
            scripted(log, 0.01, mode), timeout_s=3, max_processes=1, persistent=True
        )

        async def three(agent=agent):
            out = []
            try:
                for i in range(3):
                    try:
                        out.append(json.loads(await agent.run(SESSION, {"i": i}))["pid"])
                    except AgentFailure as exc:
                        out.append(exc)
            finally:
                await agent.aclose()
            return out

        first, failed, third = asyncio.run(three())
        assert isinstance(failed, AgentFailure) and cause in str(failed), failed
        if mode == "exit_on_2":
            assert "scripted agent gives up" in failed.stderr
        assert first != third  # the slot's next request went to a new process
        assert not Path(f"/proc/{first}").exists() or _zombie(first)


def test_a_cancelled_request_never_leaves_its_answer_to_the_next_one(tmp_path):
    log = tmp_path / "runs.log"
    agent = CommandAgent(scripted(log, 1.0), timeout_s=20, max_processes=1, persistent=True)

    async def main():
        try:
            first = asyncio.create_task(agent.run(SESSION, {"i": 0}))
            await asyncio.sleep(0.5)  # its process is mid-request
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            t0 = time.monotonic()
            answer = json.loads(await agent.run(SESSION, {"i": 1}))
            return answer, time.monotonic() - t0
        finally:
            await agent.aclose()

    answer, took = asyncio.run(main())
    started = [int(line.split()[1]) for line in log.read_text().splitlines() if "start" in line]
    [(done, _, _)] = intervals(log)  # the cancelled request never ended: its process was killed
    assert len(set(started)) == 2 and answer["pid"] == done == started[1]
    assert took >= 1.0  # the second request ran in full on the fresh process


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_persistent_tool_agent_trains_a_step(tool_model, tmp_path):
    """`tidal train` with a persistent plain-openai agent: its calls train, evaluation scores it."""
    from tidal.config.llm import LLMConfig
    from tidal.config.loader import load_config
    from tidal.runners.llm.train import LLMRunner

    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps({"prompt": "what is 3+4?", "answer": "7"}) + "\n")
    command = [sys.executable, str(SCRIPTS / "persistent_tool_agent.py")]
    overrides = [
        f"model.path={tool_model}",
        f"data.path={data}",
        f"data.eval_path={data}",
        "data.eval_size=1",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=2",
        "runner.eval_interval=2",
        "rollout.batch_size=1",
        "rollout.group_size=4",
        "rollout.max_new_tokens=40",
        "rollout.max_concurrent_rollouts=1",
        f"rollout.agent.command=[{', '.join(command)}]",
        "rollout.agent.persistent=true",
        "rollout.agent.max_processes=2",
        "rollout.agent.timeout_s=60",
        "cluster.devices_per_node=2",
        "cluster.placement={rollout: '0', actor: '1'}",
    ]
    runner = LLMRunner(load_config(LLMConfig, None, overrides))
    try:
        summary = runner.run()
    finally:
        runner.close()
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    last = [r for r in rows if r["step"] >= 1][-1]
    assert last["version"] == 2 and last["rollout/agent_errors"] == 0
    assert last["eval/success_rate"] == 1.0
