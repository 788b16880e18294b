"""A calculator agent written with the OpenAI Agents SDK, trained by tidal as it is.

As a command, tidal starts it once per episode with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` of
the episode's recording session and the record (``{"prompt": ..., "answer": ...}``) as JSON on
stdin; it prints ``{"reward": r}`` last. With ``rollout.agent.persistent: true`` one process per
slot reads a request per line (the session's URL and key, the record) and answers a reward per
line, so the SDK's import is paid once per process. calculator_service.py serves the same ``solve`` over
HTTP, so the SDK's imports are paid once. Nothing in it knows about tidal: point
``OPENAI_BASE_URL`` at any OpenAI-compatible server and it runs the same.
"""

import asyncio
import json
import os
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would upload traces to OpenAI otherwise


@function_tool
def add(a: int, b: int) -> int:
    """a+b"""
    return a + b


async def solve(record: dict, client: AsyncOpenAI) -> float:
    """Ask the model the record's question with the ``add`` tool; 1 for the right answer."""
    model = OpenAIChatCompletionsModel(
        model=os.environ.get("AGENT_MODEL", "tidal"), openai_client=client
    )
    agent = Agent(name="calculator", instructions=None, model=model, tools=[add])
    try:
        result = await Runner.run(agent, record["prompt"], max_turns=4)
        answer = str(result.final_output).strip()
    except Exception as exc:  # noqa: BLE001 - a fumbled episode scores 0, the run goes on
        print(f"agent failed: {exc!r}", file=sys.stderr)
        answer = ""
    return float(answer == str(record["answer"]))


async def main() -> None:
    if os.environ.get("TIDAL_AGENT_PERSISTENT"):  # rollout.agent.persistent: a request a line
        for line in sys.stdin:
            request = json.loads(line)
            client = AsyncOpenAI(
                base_url=request["session_base_url"], api_key=request["api_key"], max_retries=0
            )
            print(json.dumps({"reward": await solve(request["record"], client)}), flush=True)
        return
    record = json.loads(sys.stdin.read())
    client = AsyncOpenAI(max_retries=0)  # the session's URL and key, from the environment
    print(json.dumps({"reward": await solve(record, client)}))


if __name__ == "__main__":
    asyncio.run(main())
