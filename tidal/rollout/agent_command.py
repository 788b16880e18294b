"""Agents as they are: a program in its own process (a command per episode) or a user's service,
talking to a recording OpenAI session (``tidal.inference.sessions``) per episode.

- ``CommandAgent``: per episode the command starts (its own process group) with
  ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` of its session, the record as JSON on standard input
  and in ``TIDAL_RECORD``; the reward is its last line of standard output, ``{"reward": r}``.
  At most ``max_processes`` run at once; an episode's timeout starts when it has its slot.
  ``persistent``: one long-lived process per slot (started once, so its start-up is paid once)
  reads one request per line, ``{"session_base_url", "api_key", "record"}`` (a service's body),
  and answers one line ``{"reward": r}``; a slot whose process fails is started afresh.
- ``ServiceAgent``: tidal POSTs ``{session_base_url, api_key, record}`` to ``url`` and reads
  ``{"reward": r}`` from the answer.

A non-zero exit, a timeout, a reward that is not a finite number or output that is not JSON
rejects the episode (``rollout/agent_errors``, the stderr tail in the log); after ``max_errors``
in a row the run stops, naming the command. When an episode ends, by finishing or by being
cancelled, its session ends (later calls: 409) and its process group is killed: nothing the
agent started outlives it. The recorded calls become training sequences as in
``AgentWorkflow`` (``episode_sequences``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shlex
import signal
from typing import Any

from tidal.extras import needs_extra

with needs_extra("llm", "agents as commands"):
    import aiohttp

from tidal.data import LLMBatch
from tidal.inference.sessions import Session, SessionProxy
from tidal.rollout.agent_workflow import episode_sequences
from tidal.rollout.rewards import Reward
from tidal.rollout.workflows import Workflow

log = logging.getLogger(__name__)
STDERR_TAIL = 2000  # characters of a failed agent's stderr in the log
LINE_LIMIT = 2**24  # bytes of one stdout line a persistent agent may answer


class AgentFailure(Exception):
    """One agent run failed (the episode is rejected); ``stderr`` is the tail of its stderr."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message)
        self.stderr = stderr


class AgentError(RuntimeError):
    """The agent failed ``max_errors`` times in a row: the run stops."""


def parse_reward(stdout: str) -> float:
    """The reward of the last non-empty line of ``stdout``: ``{"reward": r}``, r finite."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise AgentFailure('printed nothing; its last stdout line must be {"reward": r}')
    try:
        reward = json.loads(lines[-1])["reward"]
    except (json.JSONDecodeError, TypeError, KeyError):
        raise AgentFailure(
            f'its last stdout line is not {{"reward": r}}: {lines[-1][:200]!r}'
        ) from None
    return finite_reward(reward)


def finite_reward(reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise AgentFailure(f"its reward is not a finite number: {reward!r}")
    return float(reward)


def default_agent_processes(persistent: bool = False) -> int:
    """Agent processes at once when ``rollout.agent.max_processes`` is unset: two per core for a
    process per episode (its start-up is CPU: more would only queue), eight per core for
    persistent ones (started once, they mostly wait on the model; ~50 MB each)."""
    return (8 if persistent else 2) * (os.cpu_count() or 1)


class CommandAgent:
    def __init__(
        self,
        command: list[str] | str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
        max_processes: int | None = None,
        persistent: bool = False,
    ):
        self.argv = shlex.split(command) if isinstance(command, str) else list(command)
        self.cwd, self.env, self.timeout_s = cwd, dict(env or {}), timeout_s
        self.name = shlex.join(self.argv)
        self.max_processes = max_processes or default_agent_processes(persistent)
        self.persistent = persistent
        self._slots: asyncio.Queue[_Slot] | None = None  # made on the event loop that runs it

    parse_reward = staticmethod(parse_reward)  # its last stdout line

    async def run(self, session: Session, record: dict) -> str:
        """Run the agent for one episode once a slot is free; its stdout (per-episode mode) or
        its answer line (persistent mode). The timeout counts from the slot, not the queue."""
        if self._slots is None:
            self._slots = asyncio.Queue()
            for _ in range(self.max_processes):
                self._slots.put_nowait(_Slot())
        slot, answered = await self._slots.get(), False
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.persistent:
                    answer = await slot.ask(self, session, record)
                else:
                    answer = await self._run_once(session, record)
            answered = True
            return answer
        except TimeoutError:
            raise AgentFailure(f"timed out after {self.timeout_s:g} s") from None
        finally:
            if answered:
                self._slots.put_nowait(slot)
            else:  # failed, timed out or cancelled mid-request: its process cannot be reused
                self._slots.put_nowait(_Slot())
                await asyncio.shield(slot.stop())

    async def _run_once(self, session: Session, record: dict) -> str:
        data = json.dumps(record)
        env = {
            **self._environment(),
            "OPENAI_BASE_URL": session.base_url,
            "OPENAI_API_KEY": session.api_key,
            "TIDAL_RECORD": data,
        }
        proc = await self._start(env)
        try:
            out, err = await proc.communicate(data.encode())
        finally:
            await _kill_group(proc)
        stderr = err.decode(errors="replace")[-STDERR_TAIL:]
        if proc.returncode != 0:
            raise AgentFailure(f"exited with status {proc.returncode}", stderr)
        return out.decode(errors="replace")

    def _environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    async def _start(self, env: dict[str, str]) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.cwd,
            env=env,
            start_new_session=True,  # its own process group: killed whole, never orphaned
            limit=LINE_LIMIT,
        )

    async def aclose(self) -> None:
        """End every persistent process."""
        while self._slots is not None and not self._slots.empty():
            await self._slots.get_nowait().stop()
        self._slots = None


class _Slot:
    """One of ``max_processes`` places to run an agent; in persistent mode it keeps the
    process that answers its requests, and the tail of that process's stderr."""

    def __init__(self):
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr = ""
        self._drain: asyncio.Task | None = None

    async def ask(self, agent: CommandAgent, session: Session, record: dict) -> str:
        """Send one request line; the first stdout line that is a JSON object with a reward
        (lines before it are the agent's own output, passed over)."""
        if self.proc is None:
            env = {**agent._environment(), "TIDAL_AGENT_PERSISTENT": "1"}
            self.proc = await agent._start(env)
            self._drain = asyncio.create_task(self._keep_stderr_tail())
        request = {
            "session_base_url": session.base_url,
            "api_key": session.api_key,
            "record": record,
        }
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            await self.proc.stdin.drain()
            while line := await self.proc.stdout.readline():
                if _is_reward_line(line):
                    return line.decode(errors="replace")
        except (BrokenPipeError, ConnectionResetError, ValueError):
            pass  # it died, or wrote a line past LINE_LIMIT: failed below
        status = await self.stop()
        raise AgentFailure(f"persistent agent exited with status {status}", self.stderr)

    async def _keep_stderr_tail(self) -> None:
        while chunk := await self.proc.stderr.read(4096):
            self.stderr = (self.stderr + chunk.decode(errors="replace"))[-STDERR_TAIL:]

    async def stop(self) -> int | None:
        """Kill the slot's process (if any); its exit status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        await _kill_group(proc)
        if self._drain is not None:
            await asyncio.wait([self._drain], timeout=5)
        return proc.returncode


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """End the agent's process group (it and whatever it started), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
    await asyncio.shield(proc.wait())


def _is_reward_line(line: bytes) -> bool:
    try:
        answer = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(answer, dict) and "reward" in answer


class ServiceAgent:
    def __init__(self, url: str, timeout_s: float = 300.0):
        self.url, self.timeout_s, self.name = url, timeout_s, url
        self._http: aiohttp.ClientSession | None = None

    async def run(self, session: Session, record: dict) -> str:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        body = {"session_base_url": session.base_url, "api_key": session.api_key, "record": record}
        try:
            async with self._http.post(self.url, json=body) as resp:
                text = await resp.text()
        except TimeoutError:
            raise AgentFailure(f"timed out after {self.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise AgentFailure(f"{type(exc).__name__}: {exc}") from None
        if resp.status >= 400:
            raise AgentFailure(f"answered HTTP {resp.status}", text[-STDERR_TAIL:])
        return text

    @staticmethod
    def parse_reward(answer: str) -> float:
        """The reward of the answer's whole body (however it is laid out): ``{"reward": r}``."""
        try:
            reward = json.loads(answer)["reward"]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise AgentFailure(f'its answer is not {{"reward": r}}: {answer[:200]!r}') from None
        return finite_reward(reward)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()


class ExternalAgentWorkflow(Workflow):
    """Runs ``agent`` (a ``CommandAgent`` or ``ServiceAgent``) ``group_size`` times per record,
    each against its own session of ``proxy``; the reward is the agent's (``reward is None``)
    or ``reward`` scoring the final assistant message with the record."""

    def __init__(
        self,
        agent: CommandAgent | ServiceAgent,
        proxy: SessionProxy,
        tokenizer,
        group_size: int = 1,
        mode: str = "auto",
        turn_discount: float = 1.0,
        max_errors: int = 10,
        reward: Reward | None = None,
        reward_timeout_s: float = 10.0,
        max_concurrent: int = 16,
    ):
        self.agent, self.proxy, self.tokenizer = agent, proxy, tokenizer
        self.group_size, self.mode, self.turn_discount = group_size, mode, turn_discount
        self.max_errors, self.reward, self.reward_timeout_s = max_errors, reward, reward_timeout_s
        self.agent_errors = self.failures_in_a_row = self.tool_parse_errors = 0
        self.max_concurrent = max_concurrent  # evaluation's agents at once
        self._starting = asyncio.Lock()

    def metrics(self) -> dict:
        return {
            "rollout/agent_errors": self.agent_errors,
            "rollout/tool_parse_errors": self.tool_parse_errors,
        }

    async def run(self, data: dict):
        """One agent run: its sequences and rewards, or None when it failed."""
        try:
            session, reward = await self.play(data)
        except AgentFailure as exc:
            return self._failed(exc)
        self.failures_in_a_row = 0
        self.tool_parse_errors += session.client.tool_parse_errors
        return episode_sequences(session.completions, reward, self.mode, self.turn_discount)

    async def play(self, data: dict, gconfig=None) -> tuple[Session, float]:
        """Run the agent once on its own session; its ended session (the recorded calls) and
        reward. Raises ``AgentFailure``."""
        async with self._starting:
            await self.proxy.start()
        session = self.proxy.open(gconfig)
        try:
            answer = await self.agent.run(session, data)
            session = await self.proxy.end(session.id)  # a call still in flight: refused
            return session, await self._reward(answer, session, data)
        finally:
            session = await self.proxy.end(session.id)
            self.proxy.forget(session.id)

    async def evaluate(self, records: list[dict], gconfig) -> dict:
        """One run per record with ``gconfig``'s defaults (greedy): ``eval/success_rate`` (reward
        > 0; a failed run counts as 0) and ``eval/reward_mean``."""
        limit = asyncio.Semaphore(self.max_concurrent)

        async def one(record: dict) -> float:
            async with limit:
                try:
                    return (await self.play(record, gconfig))[1]
                except AgentFailure as exc:
                    log.warning("agent %s in evaluation: %s", self.agent.name, exc)
                    return 0.0

        rewards = await asyncio.gather(*(one(r) for r in records))
        return {
            "eval/success_rate": sum(r > 0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards),
        }

    async def _reward(self, answer: str, session: Session, data: dict) -> float:
        reward = self.agent.parse_reward(answer) if self.reward is None else None
        if not session.completions:
            raise AgentFailure("made no call to its session endpoint")
        if reward is not None:
            return reward
        score = await self.reward.ascore(
            session.completions[-1].content, data, self.reward_timeout_s
        )
        if score is None:
            raise AgentFailure(f"the reward {self.reward.name} failed on its final answer")
        return finite_reward(score)

    def _failed(self, exc: AgentFailure) -> None:
        self.agent_errors += 1
        self.failures_in_a_row += 1
        log.warning(
            "agent %s: %s (episode rejected)%s",
            self.agent.name,
            exc,
            f"; stderr tail:\n{exc.stderr}" if exc.stderr else "",
        )
        if self.failures_in_a_row >= self.max_errors:
            raise AgentError(
                f"rollout.agent: {self.agent.name!r} failed {self.failures_in_a_row} times in a "
                f"row (rollout.agent.max_errors); the last: {exc}"
                + (f"\nits stderr ends:\n{exc.stderr}" if exc.stderr else "")
            )
        return None

    async def __call__(self, data: dict) -> LLMBatch | None:
        runs = await asyncio.gather(*(self.run(data) for _ in range(self.group_size)))
        if any(r is None for r in runs):
            return None  # a group with a missing member cannot be normalised: reject it whole
        seqs = [s for r in runs for s in r[0]]
        rewards = [x for r in runs for x in r[1]]
        return LLMBatch.from_sequences(seqs, rewards, self.tokenizer.pad_token_id)

    async def aclose(self) -> None:
        """Stop the proxy (ending every open session) and the service client."""
        await self.proxy.stop()
        await self.agent.aclose()
