"""Agents as they are: real processes against recording session endpoints (the proxy), a
plain-``openai`` tool loop, and agents that crash, hang, print garbage, call another session
or keep calling after their episode was aborted; an agent service (a real HTTP server) that
works, fails, answers garbage or hangs; the workflow as the config builds it (reward: config,
cwd, env, a command string). Whole `tidal train` runs: test_agent_runs.py."""

import asyncio
import json
import logging
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from agent_models import ADD_TOOL, QUESTION, RECORD, TOOL_AGENT, tool_loop
from aiohttp import web
from deps import require
from engine_faults import engine_with_slow_passes
from transformers import AutoTokenizer

from tidal.inference import GenerationConfig, GenerationEngine, InferenceClient, InferenceServer
from tidal.models.chat_template import chat_prompt

openai = require("openai")
from tidal.inference.sessions import SessionProxy  # noqa: E402
from tidal.rollout.agent_command import (  # noqa: E402
    AgentError,
    CommandAgent,
    ExternalAgentWorkflow,
)


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


def run_workflow(server, make_flow, body):
    """Run ``body(flow, proxy)`` with the workflow ``make_flow(inference)`` builds."""

    async def main():
        inference = InferenceClient([server.address])
        flow = make_flow(inference)
        try:
            return await body(flow, flow.proxy)
        finally:
            await flow.aclose()
            await inference.aclose()

    return asyncio.run(main())


def with_workflow(server, tok, command, body, **kwargs):
    """Run ``body(flow, proxy)`` with a workflow of ``command`` on a fresh proxy."""

    def make_flow(inference):
        proxy = SessionProxy(inference, tok, greedy(tok))
        return ExternalAgentWorkflow(CommandAgent(command, **kwargs), proxy, tok, mode="concat")

    return run_workflow(server, make_flow, body)


def with_configured_workflow(server, tok, overrides, body):
    """Run ``body(flow, proxy)`` with the workflow `tidal train` builds from ``overrides``."""
    from tidal.config.llm import LLMConfig
    from tidal.config.loader import load_config
    from tidal.runners.llm.workflows import agent_workflow

    base = ["rollout.group_size=1", "rollout.agent_mode=concat"]
    cfg = load_config(LLMConfig, None, base + overrides)

    def make_flow(inference):
        return agent_workflow(
            SimpleNamespace(cfg=cfg, client=inference, tokenizer=tok, gconfig=greedy(tok))
        )

    return run_workflow(server, make_flow, body)


def trained_text(episode, tok, row: int = 0) -> str:
    """The tokens of ``row`` that are trained on (loss mask 1), decoded."""
    n = int(episode.attention_mask[row].sum())
    return tok.decode(episode.input_ids[row, :n][episode.loss_mask[row, :n]])


TOOL_LOOP = (
    '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>7<|im_end|>'
)


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
    assert tok.decode(ids[mask]) == TOOL_LOOP
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


def test_an_agent_that_stops_waiting_frees_its_rows_in_the_engine(tool_model, tok):
    """An agent's call that times out at the session proxy is cancelled there, which closes the
    proxy's request to the server, which aborts the generation in the engine: no tokens are
    generated for nobody while the agent retries."""
    engine = engine_with_slow_passes(tool_model, 0.02)  # 200 tokens: ~4 s
    srv = InferenceServer(engine).start()

    async def main():
        inference = InferenceClient([srv.address], max_retries=0)
        proxy = SessionProxy(inference, tok, GenerationConfig(max_new_tokens=200))
        await proxy.start()
        try:
            session = proxy.open()
            async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=0.3)) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(
                        session.base_url + "/chat/completions",
                        headers={"Authorization": f"Bearer {session.api_key}"},
                        json={"model": "tidal", "messages": [{"role": "user", "content": "hi"}]},
                    )
            deadline = time.monotonic() + 5
            while engine.stats["cancelled"] < 1:
                assert time.monotonic() < deadline, f"not aborted: {engine.stats}"
                await asyncio.sleep(0.01)
        finally:
            await proxy.stop()
            await inference.aclose()

    try:
        asyncio.run(main())
        assert engine.stats["generated_tokens"] < 100  # of 200
    finally:
        srv.stop()


def test_a_session_that_ends_during_its_calls_answers_them_409_and_frees_their_rows(
    tool_model, tok
):
    """Ending a session (the dispatcher aborting its episode) while a plain and a streamed call
    are generating: the plain one is answered 409, the stream ends with a 409 error event, and
    both generations leave the engine instead of running on to their 200 tokens."""
    engine = engine_with_slow_passes(tool_model, 0.02)  # 200 tokens: ~4 s
    srv = InferenceServer(engine).start()
    messages = [{"role": "user", "content": "hi"}]

    async def main():
        inference = InferenceClient([srv.address], max_retries=0)
        proxy = SessionProxy(inference, tok, GenerationConfig(max_new_tokens=200))
        await proxy.start()
        session = proxy.open()
        c = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                plain = asyncio.create_task(
                    http.post(
                        session.base_url + "/chat/completions",
                        headers={"Authorization": f"Bearer {session.api_key}"},
                        json={"model": "tidal", "messages": messages},
                    )
                )
                stream = await c.chat.completions.create(
                    model="tidal", messages=messages, stream=True
                )
                deadline = time.monotonic() + 10
                while engine.stats["requests"] < 2:  # both generating (~4 s each)
                    assert time.monotonic() < deadline, f"not both generating: {engine.stats}"
                    await asyncio.sleep(0.01)
                await proxy.end(session.id)
                with pytest.raises(openai.APIError, match="ended during the call"):
                    async for _ in stream:
                        pass
                answered = await plain
            deadline = time.monotonic() + 5
            while engine.stats["cancelled"] < 2:
                assert time.monotonic() < deadline, f"not aborted: {engine.stats}"
                await asyncio.sleep(0.01)
            return answered
        finally:
            await c.close()
            await proxy.stop()
            await inference.aclose()

    try:
        answered = asyncio.run(main())
        assert answered.status_code == 409
        assert "ended during the call" in answered.json()["error"]["message"]
        assert engine.stats["generated_tokens"] < 200  # of 2 x 200
    finally:
        srv.stop()


def test_with_reward_config_the_configured_reward_scores_the_final_answer(server, tok, caplog):
    """rollout.agent.reward: config: the agent prints no reward; reward.name scores its final
    assistant message against the record, and an agent that made no call is rejected."""

    async def body(flow, proxy):
        right = await flow({**RECORD, "mode": "quiet"})
        wrong = await flow({**RECORD, "mode": "quiet", "answer": "8"})
        no_call = await flow({**RECORD, "mode": "no_call"})
        return right, wrong, no_call, flow.metrics()

    caplog.set_level(logging.WARNING, "tidal.rollout.agent_command")
    command = f"rollout.agent.command=[{', '.join(TOOL_AGENT)}]"
    overrides = [command, "rollout.agent.reward=config", "reward.name=exact_match"]
    right, wrong, no_call, metrics = with_configured_workflow(server, tok, overrides, body)
    assert right.rewards.tolist() == [1.0] and trained_text(right, tok) == TOOL_LOOP
    assert wrong.rewards.tolist() == [0.0]  # the same answer, "7", against the record's "8"
    assert no_call is None and metrics["rollout/agent_errors"] == 1
    assert "made no call to its session endpoint" in caplog.text


def test_a_command_string_runs_in_its_cwd_with_its_env(server, tok):
    """rollout.agent.command as one string, relative to rollout.agent.cwd, with
    rollout.agent.env set (the script exits non-zero when its cwd or variable is not so)."""
    scripts = Path(TOOL_AGENT[1]).parent
    command = f"{shlex.quote(sys.executable)} {Path(TOOL_AGENT[1]).name}"
    overrides = [
        f"rollout.agent.command={json.dumps(command)}",
        f"rollout.agent.cwd={scripts}",
        "rollout.agent.env={TIDAL_AGENT_TEST: from config}",
    ]

    async def body(flow, proxy):
        assert flow.agent.argv == [sys.executable, "tool_agent.py"]
        return await flow({**RECORD, "mode": "where", "cwd": str(scripts)}), flow.metrics()

    episode, metrics = with_configured_workflow(server, tok, overrides, body)
    assert metrics["rollout/agent_errors"] == 0 and episode.rewards.tolist() == [1.0]
    assert trained_text(episode, tok) == TOOL_LOOP


@pytest.fixture(scope="module")
def agent_service():
    """A user's agent service: an aiohttp server on 127.0.0.1 (its own thread and event loop).
    ``/agent`` runs a plain-``openai`` tool loop against the session it is posted and answers
    its reward; ``/crash`` answers HTTP 500 with a long traceback, ``/garbage`` a body that is
    not JSON, ``/hang`` nothing for a minute. ``posted`` holds the bodies it received."""
    posted = []

    async def agent(request):
        body = await request.json()
        posted.append(body)
        client = openai.AsyncOpenAI(
            base_url=body["session_base_url"], api_key=body["api_key"], max_retries=0
        )
        async with client:
            answer = await tool_loop(client, body["record"]["prompt"])
        reward = float(answer == body["record"]["answer"])
        # laid out over lines, as some servers answer: the whole body is the JSON
        return web.json_response({"reward": reward}, dumps=lambda x: json.dumps(x, indent=2))

    async def crash(request):
        trace = "Traceback (most recent call last):\n" + "  File 'agent.py'\n" * 400
        return web.Response(status=500, text=trace + "KeyError: 'service broke'")

    async def garbage(request):
        return web.Response(text="<html>hello</html>")

    async def hang(request):
        await asyncio.sleep(60)

    app = web.Application()
    for name, handler in (("agent", agent), ("crash", crash), ("garbage", garbage), ("hang", hang)):
        app.router.add_post(f"/{name}", handler)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="agent-service", daemon=True)
    thread.start()
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", posted=posted)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_an_agent_service_runs_its_tool_loop_on_the_session_it_is_posted(
    server, tok, agent_service
):
    async def body(flow, proxy):
        await proxy.start()
        return await flow(RECORD), proxy.address, proxy.sessions

    url = f"rollout.agent.url={agent_service.url}/agent"
    episode, address, live = with_configured_workflow(server, tok, [url], body)
    (posted,) = agent_service.posted
    assert set(posted) == {"session_base_url", "api_key", "record"} and posted["record"] == RECORD
    assert posted["session_base_url"].startswith(f"{address}/sessions/")
    assert live == {}  # its session ended and was let go
    assert episode.rewards.tolist() == [1.0] and episode.input_ids.shape[0] == 1
    assert trained_text(episode, tok) == TOOL_LOOP  # both recorded calls, as one sequence


def test_an_agent_service_that_fails_answers_garbage_or_hangs_is_rejected(
    server, tok, agent_service, caplog
):
    cases = [
        ("crash", "answered HTTP 500"),
        ("garbage", "its answer is not {\"reward\": r}: '<html>hello</html>'"),
        ("hang", "timed out after 5 s"),
    ]

    async def body(flow, proxy):
        results = []
        for path, _ in cases:
            flow.agent.url = flow.agent.name = f"{agent_service.url}/{path}"
            results.append(await flow(RECORD))
        return results, flow.metrics()

    caplog.set_level(logging.WARNING, "tidal.rollout.agent_command")
    overrides = [f"rollout.agent.url={agent_service.url}", "rollout.agent.timeout_s=5"]
    results, metrics = with_configured_workflow(server, tok, overrides, body)
    assert results == [None] * 3 and metrics["rollout/agent_errors"] == 3
    for path, why in cases:
        assert f"agent {agent_service.url}/{path}: {why} (episode rejected)" in caplog.text
    assert "KeyError: 'service broke'" in caplog.text  # the tail of the 500's body
    assert "Traceback" not in caplog.text  # ... and only its tail


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


def test_a_stopped_session_proxy_refuses_to_serve_again():
    """An episode outliving its run must not reopen the proxy on a new port nobody stops."""

    async def main():
        proxy = SessionProxy(None, None, None)
        address = await proxy.start()
        assert address.startswith("http://127.0.0.1:")
        await proxy.stop()
        with pytest.raises(RuntimeError, match="was stopped"):
            await proxy.start()

    asyncio.run(main())
