"""``rollout.agent``: an agent in its own process (a command per episode, a persistent
process per slot, or a service) talking to a recording OpenAI session endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config.common import one_of
from tidal.config.loader import require
from tidal.config.schema import setting


@dataclass
class AgentConfig:
    """An agent in its own process (rollout.workflow: agent): a command per episode, or a
    service, talking to a recording OpenAI session endpoint."""

    command: Any = setting(
        None,
        "the agent's command (an argv list, or a string split like a shell's), started per "
        "episode with OPENAI_BASE_URL / OPENAI_API_KEY of its session and the record as JSON on "
        'stdin and in TIDAL_RECORD; its last stdout line is {"reward": r}',
    )
    url: str | None = setting(
        None,
        "instead of a command: an agent service; tidal POSTs {session_base_url, api_key, "
        'record} and reads {"reward": r}',
    )
    cwd: str | None = setting(None, "the command's working folder; None: tidal's")
    env: dict[str, str] = setting(factory=dict, help="extra environment variables of the command")
    timeout_s: float = setting(
        300.0,
        "bound on one episode's agent run, counted from when its process has a slot (it is "
        "killed after it)",
    )
    max_processes: int | None = setting(
        None,
        "agent processes running at once (episodes beyond wait for a slot); None: two per core, "
        "eight per core when persistent",
    )
    persistent: bool = setting(
        False,
        "one long-lived process per slot instead of one per episode: it reads one request per "
        'stdin line, {"session_base_url", "api_key", "record"}, and answers one line '
        '{"reward": r}; its start-up is paid once',
    )
    reward: str = setting(
        "stdout",
        "stdout: the agent's own reward; config: reward.name scores the final assistant message "
        "with the record",
    )
    max_errors: int = setting(
        10, "agent failures in a row (exit, timeout, bad output) before the run stops"
    )
    host: str = setting(
        "127.0.0.1", "where the session proxy listens (an agent service must reach it)"
    )


def validate_agent(agent: AgentConfig) -> None:
    c = agent.command
    require(
        c is None
        or isinstance(c, str)
        and c.strip()
        or (isinstance(c, list) and c and all(isinstance(a, str) for a in c)),
        "rollout.agent.command",
        f"must be a non-empty argv list of strings or a command string, got {c!r}",
    )
    require(
        c is None or agent.url is None,
        "rollout.agent.url",
        "give rollout.agent.command or rollout.agent.url, not both",
    )
    one_of(agent.reward, ("stdout", "config"), "rollout.agent.reward")
    require(agent.timeout_s > 0, "rollout.agent.timeout_s", f"must be > 0, got {agent.timeout_s}")
    require(
        agent.max_processes is None or agent.max_processes >= 1,
        "rollout.agent.max_processes",
        f"must be >= 1 (or null: two per core), got {agent.max_processes}",
    )
    require(
        not agent.persistent or c is not None,
        "rollout.agent.persistent",
        "keeps agent processes: it needs rollout.agent.command",
    )
    require(
        agent.max_errors >= 1, "rollout.agent.max_errors", f"must be >= 1, got {agent.max_errors}"
    )
