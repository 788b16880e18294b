"""The tool agent of ``tool_agent.py`` as a persistent process (``rollout.agent.persistent``):
one request per stdin line, ``{"session_base_url", "api_key", "record"}``, one reward line per
request. It prints a log line before each answer (tidal passes over it) and counts the requests
it has served in its reward line's ``served``."""

import json
import os
import sys

import openai
from tool_agent import ADD_TOOL


def answer(client: openai.OpenAI, record: dict) -> float:
    messages = [{"role": "user", "content": record["prompt"]}]
    for _ in range(4):
        out = client.chat.completions.create(
            model="tidal", messages=messages, tools=[ADD_TOOL], max_tokens=40
        )
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            result = str(args.get("a", 0) + args.get("b", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return float(messages[-1].get("content") == record["answer"])


def main() -> None:
    assert os.environ["TIDAL_AGENT_PERSISTENT"] == "1"
    for served, line in enumerate(sys.stdin, 1):
        request = json.loads(line)
        client = openai.OpenAI(
            base_url=request["session_base_url"], api_key=request["api_key"], max_retries=0
        )
        reward = answer(client, request["record"])
        print("served a request", flush=True)
        print(json.dumps({"reward": reward, "served": served, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
