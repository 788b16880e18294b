"""Agents as they are: real processes against recording session endpoints (the proxy), a
plain-``openai`` tool loop, and agents that crash, hang, print garbage, call another session
or keep calling after their episode was aborted."""

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from agent_models import ADD_TOOL, QUESTION
from transformers import AutoTokenizer

from tidal.inference import GenerationConfig, GenerationEngine, InferenceClient, InferenceServer
from tidal.models.chat_template import chat_prompt

openai = pytest.importorskip("openai")
from tidal.inference.sessions import SessionProxy  # noqa: E402
from tidal.rollout.agent_command import (  # noqa: E402
    AgentError,
    CommandAgent,
    ExternalAgentWorkflow,
)

TOOL_AGENT = [sys.executable, str(Path(__file__).parent / "agent_scripts" / "tool_agent.py")]
RECORD = {"prompt": QUESTION, "answer": "7"}


@pytest.fixture(scope="module")
def server(tool_model):
    srv = InferenceServer(GenerationEngine(tool_model)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(tool_model):
    return AutoTokenizer.from_pretrained(tool_model)


def greedy(tok):
    return GenerationConfig(max_new_tokens=40, temperature=1e-6, stop_token_ids=[tok.eos_token_id])


def with_workflow(server, tok, command, body, **kwargs):
    """Run ``body(flow, proxy)`` with a workflow of ``command`` on a fresh proxy."""

    async def main():
        inference = InferenceClient([server.address])
        proxy = SessionProxy(inference, tok, greedy(tok))
        flow = ExternalAgentWorkflow(CommandAgent(command, **kwargs), proxy, tok, mode="concat")
        try:
            return await body(flow, proxy)
        finally:
            await flow.aclose()
            await inference.aclose()

    return asyncio.run(main())


def test_a_plain_openai_agent_runs_its_tool_loop_into_one_training_sequence(server, tok):
    async def body(flow, proxy):
        flow.group_size = 2
        episode = await flow(RECORD)
        return episode, proxy.sessions

    episode, live = with_workflow(server, tok, TOOL_AGENT, body)
    assert live == {}  # every session ended and was let go
    assert episode.rewards.tolist() == [1.0, 1.0] and episode.input_ids.shape[0] == 2
    n = int(episode.attention_mask[0].sum())
    ids, mask = episode.input_ids[0, :n], episode.loss_mask[0, :n]
    # the prompt exactly as the chat template tokenised it, tools included
    first = chat_prompt([{"role": "user", "content": QUESTION}], tok, [ADD_TOOL])
    assert ids[: len(first)].tolist() == first
    assert tok.decode(ids[mask]) == (
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>7<|im_end|>'
    )
    assert (episode.versions[0, :n][mask] == 0).all() and (
        episode.versions[0, :n][~mask] == -1
    ).all()
    assert (episode.logprobs[0, :n][mask] < 0).all()


def test_the_session_endpoint_serves_the_openai_api_and_refuses_other_keys(server, tok):
    async def main():
        inference = InferenceClient([server.address])
        proxy = SessionProxy(inference, tok, greedy(tok))
        await proxy.start()
        mine, other = proxy.open(), proxy.open()
        c = openai.AsyncOpenAI(base_url=mine.base_url, api_key=mine.api_key, max_retries=0)
        try:
            assert [m.id for m in (await c.models.list()).data] == ["tidal"]
            messages = [{"role": "user", "content": QUESTION}]
            stream = await c.chat.completions.create(
                model="tidal", messages=messages, tools=[ADD_TOOL], stream=True
            )
            deltas = [ch.choices[0] async for ch in stream if ch.choices]
            assert deltas[0].delta.tool_calls[0].function.name == "add"
            assert deltas[-1].finish_reason == "tool_calls"
            done = await c.completions.create(model="tidal", prompt="ab", max_tokens=3)
            assert done.usage.completion_tokens == len(mine.completions[-1].output_ids)
            resp = await c.responses.create(model="tidal", input=QUESTION, tools=[
                {"type": "function", "name": "add", "parameters": ADD_TOOL["function"]["parameters"]}
            ])  # fmt: skip
            assert [o.type for o in resp.output] == ["function_call"]
            assert json.loads(resp.output[0].arguments) == {"a": 3, "b": 4}
            wrong = openai.AsyncOpenAI(base_url=other.base_url, api_key=mine.api_key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="tidal", messages=messages)
            await wrong.close()
            await proxy.end(mine.id)
            with pytest.raises(openai.ConflictError):
                await c.chat.completions.create(model="tidal", messages=messages)
            return mine, other, proxy.refused
        finally:
            await c.close()
            await proxy.stop()
            await inference.aclose()

    mine, other, refused = asyncio.run(main())
    assert len(mine.completions) == 3 and other.completions == [] and refused == 2
    first = mine.completions[0]
    assert first.prompt_ids == chat_prompt([{"role": "user", "content": QUESTION}], tok, [ADD_TOOL])
    assert first.response.output_versions == [0] * len(first.output_ids)


def test_a_call_the_server_refuses_is_a_400_naming_the_argument(server, tok):
    """A prompt and max_tokens past the model's context: the agent gets the server's reason as
    an OpenAI 400 (not a 500), and nothing is recorded."""

    async def main():
        inference = InferenceClient([server.address])
        proxy = SessionProxy(inference, tok, greedy(tok))
        await proxy.start()
        session = proxy.open()
        c = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await c.chat.completions.create(
                    model="tidal", messages=[{"role": "user", "content": QUESTION}],
                    max_tokens=100_000,
                )  # fmt: skip
            return refused.value, session
        finally:
            await c.close()
            await proxy.stop()
            await inference.aclose()

    error, session = asyncio.run(main())
    assert error.status_code == 400 and "max_tokens" in error.message
    assert "context" in error.message and session.completions == []


def test_a_streamed_session_call_sends_text_while_it_is_generated(server, tok):
    """The first text chunk arrives while the server is still generating: with the engine held
    there, nothing is recorded yet; the rest follows and adds up to the recorded completion."""
    budget = 200  # many decode steps: the first chunk comes long before the last token

    async def main():
        inference = InferenceClient([server.address])
        proxy = SessionProxy(inference, tok, greedy(tok))
        await proxy.start()
        exact = GenerationConfig(max_new_tokens=budget, temperature=1e-6, stop_token_ids=[])
        session = proxy.open(exact)
        c = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        try:
            stream = await c.chat.completions.create(
                model="tidal",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks, recorded_at_first_text = [], None
            async for ch in stream:
                chunks.append(ch)
                if recorded_at_first_text is None and ch.choices and ch.choices[0].delta.content:
                    await asyncio.to_thread(server.engine.pause, "in_place")
                    recorded_at_first_text = len(session.completions)
                    server.engine.resume()
            return chunks, recorded_at_first_text, session.completions
        finally:
            server.engine.resume()
            await c.close()
            await proxy.stop()
            await inference.aclose()

    chunks, recorded_at_first_text, completions = asyncio.run(main())
    assert recorded_at_first_text == 0  # text came before the generation ended
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices]
    assert sum(bool(t) for t in texts) > 1
    (record,) = completions
    assert "".join(t or "" for t in texts) == record.text
    assert {ch.id for ch in chunks} == {record.id}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == budget == len(record.output_ids)
    assert len(record.response.output_logprobs) == budget
    assert record.response.output_versions == [0] * budget


def test_crashing_hanging_and_garbage_agents_are_rejected_then_stop_the_run(
    server, tok, tmp_path, caplog
):
    child = tmp_path / "child.pid"
    hang = (
        "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']);"
        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    cases = [
        ("import sys; print('boom', file=sys.stderr); sys.exit(3)", "exited with status 3"),
        (hang, "timed out after 2 s"),
        ("print('hello')", 'is not {"reward": r}'),
        ("print('{\"reward\": NaN}')", "not a finite number"),
    ]

    async def body(flow, proxy):
        flow.max_errors = 5
        results = []
        for code, _ in cases:
            flow.agent.argv = [sys.executable, "-c", code]
            results.append(await flow(RECORD))
        return results, flow.metrics()

    caplog.set_level(logging.WARNING, "tidal.rollout.agent_command")
    results, metrics = with_workflow(server, tok, [sys.executable], body, timeout_s=2)
    assert results == [None] * 4 and metrics["rollout/agent_errors"] == 4
    for _, why in cases:
        assert why in caplog.text
    assert "boom" in caplog.text  # the stderr tail of the crash
    _assert_dead(int(child.read_text()))  # the hanging agent's child went with its group

    async def in_a_row(flow, proxy):
        flow.max_errors = 2
        assert await flow(RECORD) is None
        with pytest.raises(AgentError, match="rollout.agent: .*false.* failed 2 times in a row"):
            await flow(RECORD)

    with_workflow(server, tok, ["false"], in_a_row)


def test_an_agent_calling_another_sessions_url_is_refused(server, tok):
    async def body(flow, proxy):
        await proxy.start()
        victim = proxy.open()
        episode = await flow({**RECORD, "mode": "other_session", "other_url": victim.base_url})
        return episode, victim.completions, proxy.refused

    episode, victim_calls, refused = with_workflow(server, tok, TOOL_AGENT, body)
    assert episode.rewards.tolist() == [1.0]  # it went on with its own session
    assert victim_calls == [] and refused == 2


def test_an_aborted_episode_kills_its_agent_and_refuses_later_calls(server, tok, tmp_path):
    pid_file = tmp_path / "agent.json"

    async def body(flow, proxy):
        task = asyncio.create_task(
            flow({**RECORD, "mode": "keep_calling", "pid_file": str(pid_file)})
        )
        deadline = time.monotonic() + 60
        while not any(s.completions for s in proxy.sessions.values()):
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        task.cancel()  # the dispatcher aborting the episode
        with pytest.raises(asyncio.CancelledError):
            await task
        agent = json.loads(pid_file.read_text())
        _assert_dead(agent["pid"])  # its process group was killed with the episode
        async with httpx.AsyncClient() as http:  # its key, its session, which has ended
            late = await http.post(
                agent["url"] + "/chat/completions",
                headers={"Authorization": f"Bearer {agent['key']}"},
                json={"model": "tidal", "messages": [{"role": "user", "content": "hi"}]},
            )
        return late, proxy.sessions

    late, live = with_workflow(server, tok, TOOL_AGENT, body)
    assert late.status_code == 409 and "ended" in late.json()["error"]["message"]
    assert live == {}  # nothing of the session is kept: the late call recorded nothing


def _assert_dead(pid: int) -> None:
    deadline = time.monotonic() + 5
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if _zombie(pid) or time.monotonic() > deadline:
            assert _zombie(pid), f"process {pid} outlived its episode"
            return
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.ray
def test_an_agent_command_trains_a_step_on_ray(tool_model, tmp_path):
    """The whole loop on Ray: a server process, a trainer process, the agents as commands
    against the session proxy of the runner's process; their calls train one step."""
    from tidal.config.llm import LLMConfig
    from tidal.config.loader import load_config
    from tidal.runners.llm.train import LLMRunner

    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps(RECORD) + "\n")
    overrides = [
        f"model.path={tool_model}",
        f"data.path={data}",
        f"data.eval_path={data}",
        "data.eval_size=1",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=1",
        "runner.eval_interval=1",
        "rollout.batch_size=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=40",
        "rollout.max_concurrent_rollouts=1",
        f"rollout.agent.command=[{TOOL_AGENT[0]}, {TOOL_AGENT[1]}]",
        "rollout.agent.timeout_s=60",
        "cluster.backend=ray",
        "cluster.devices_per_node=2",
        "cluster.placement={rollout: '0', actor: '1'}",
    ]
    with LLMRunner(load_config(LLMConfig, None, overrides)) as runner:
        summary = runner.run()
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    step = [r for r in rows if r["step"] >= 0][-1]
    assert step["version"] == 1 and step["rollout/agent_errors"] == 0
    assert step["rollout/accepted"] == 1 and "rollout/tool_parse_errors" in step
    # the greedy agent calls the tool and answers right (sampled ones may fumble the call)
    assert step["eval/success_rate"] == 1.0 and "train/policy_loss" in step
