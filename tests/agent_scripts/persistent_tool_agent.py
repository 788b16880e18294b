"""The tool agent of ``tool_agent.py`` as a persistent process (``rollout.agent.persistent``):
one request per stdin line, ``{"session_base_url", "api_key", "record"}``, one reward line per
request. It prints a log line before each answer (tidal passes over it) and counts the requests
it has served in its reward line's ``served``."""

import json
import os
import sys

import openai
from tool_agent import tool_loop


def main() -> None:
    assert os.environ["TIDAL_AGENT_PERSISTENT"] == "1"
    for served, line in enumerate(sys.stdin, 1):
        request = json.loads(line)
        client = openai.OpenAI(
            base_url=request["session_base_url"], api_key=request["api_key"], max_retries=0
        )
        record = request["record"]
        reward = float(tool_loop(client, record["prompt"]) == record["answer"])
        print("served a request", flush=True)
        print(json.dumps({"reward": reward, "served": served, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
