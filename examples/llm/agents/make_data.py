"""Write the calculator example's data: addition questions for RL (training and held out, no
pair in both) and tool-call demonstrations for ``tidal sft`` on some of the training questions.

A demonstration is the conversation the agent (calculator_agent.py) has when the model does
the task: the question, a call of ``add`` with the question's numbers, the tool's result, the
result as the answer. Its ``tools`` are the ``add`` tool exactly as the Agents SDK sends it, so
the warm start sees the prompts training will.

    python examples/llm/agents/make_data.py runs/data/calculator --demos 200
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def questions(n_train: int, n_eval: int, high: int, seed: int) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(high + 1) for b in range(high + 1)]
    random.Random(seed).shuffle(pairs)
    if n_train + n_eval > len(pairs):
        raise SystemExit(f"only {len(pairs)} distinct questions with numbers up to {high}")
    rows = [
        {"id": f"q{i}", "prompt": f"what is {a}+{b}?", "answer": str(a + b), "a": a, "b": b}
        for i, (a, b) in enumerate(pairs[: n_train + n_eval])
    ]
    return rows[:n_train], rows[n_train:]


def demonstration(row: dict, tools: list[dict]) -> dict:
    args = json.dumps({"a": row["a"], "b": row["b"]})
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": args}}
    messages = [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": row["answer"]},
        {"role": "assistant", "content": row["answer"]},
    ]
    return {"id": row["id"], "messages": messages, "tools": tools}


def sdk_tools() -> list[dict]:
    """The agent's tools as the Agents SDK puts them in a chat completion request."""
    from agents.models.chatcmpl_converter import Converter
    from calculator_agent import add

    return [Converter.tool_to_openai(add)]


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=2000, help="RL training questions")
    p.add_argument("--eval", type=int, default=200, help="held-out questions")
    p.add_argument("--demos", type=int, default=200, help="demonstrations (of training questions)")
    p.add_argument("--high", type=int, default=99, help="the largest operand")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    train, held_out = questions(a.train, a.eval, a.high, a.seed)
    tools = sdk_tools()
    a.out.mkdir(parents=True, exist_ok=True)
    write(a.out / "train.jsonl", train)
    write(a.out / "eval.jsonl", held_out)
    write(a.out / "demos.jsonl", [demonstration(r, tools) for r in train[: a.demos]])
    print(
        json.dumps(
            {"out": str(a.out), "train": len(train), "eval": len(held_out), "demos": a.demos}
        )
    )


if __name__ == "__main__":
    main()
