"""A plain-``openai`` agent in its own process: a multi-turn tool loop against
``OPENAI_BASE_URL``, the record on stdin, the reward on its last stdout line. With
``"mode"`` in the record it misbehaves (or checks its surroundings) the way the tests ask."""

import json
import os
import sys
import time

import openai

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a+b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


def main() -> None:
    record = json.loads(sys.stdin.read())
    assert record == json.loads(os.environ["TIDAL_RECORD"])
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from tidal
    mode = record.get("mode")
    if mode == "other_session":  # another session's URL with this session's key
        other = openai.OpenAI(base_url=record["other_url"], max_retries=0)
        for call in (
            other.models.list,
            lambda: other.chat.completions.create(
                model="tidal", messages=[{"role": "user", "content": "hi"}]
            ),
        ):
            try:
                call()
                sys.exit(5)  # the other session answered: the test fails on this exit
            except openai.AuthenticationError:
                pass
    if mode == "keep_calling":  # tell the test where it is, then call until killed
        with open(record["pid_file"], "w") as f:
            json.dump({"pid": os.getpid(), "url": os.environ["OPENAI_BASE_URL"],
                       "key": os.environ["OPENAI_API_KEY"]}, f)  # fmt: skip
        while True:
            client.chat.completions.create(
                model="tidal", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            time.sleep(0.05)
    if mode == "where":  # rollout.agent.cwd and rollout.agent.env reached the process
        where = (os.getcwd(), os.environ.get("TIDAL_AGENT_TEST"))
        if not os.path.samefile(where[0], record["cwd"]) or where[1] != "from config":
            sys.exit(f"cwd and TIDAL_AGENT_TEST are {where}")
    if mode == "no_call":
        print("nothing to do")
        return
    answer = tool_loop(client, record["prompt"])
    print("some log line")
    if mode == "quiet":  # no reward: tidal's configured reward scores the final answer
        return
    print(json.dumps({"reward": float(answer == record["answer"])}))


def tool_loop(client: openai.OpenAI, prompt: str) -> str | None:
    """Call the model with the ``add`` tool, run its calls, until it answers (4 calls at most);
    the last message's content."""
    messages = [{"role": "user", "content": prompt}]
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
    return messages[-1].get("content")


if __name__ == "__main__":
    main()
