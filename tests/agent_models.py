"""A tiny chat model that plays a fixed tool loop (for the agent tests, the example's smoke run
and the session benchmark): asked ``QUESTION`` with the ``add`` tool it calls
``add(a=3, b=4)``; shown the tool's answer it replies ``7``. Trained in a few seconds by
overfitting these two turns (greedy decoding then follows them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.inference.tiny import TOOLS_CHATML_TEMPLATE, save_tiny_chat_model
from tidal.models.chat_template import render_chat

QUESTION = "what is 3+4?"
RECORD = {"prompt": QUESTION, "answer": "7"}
# the plain-``openai`` agent of agent_scripts/, as a command
TOOL_AGENT = [sys.executable, str(Path(__file__).parent / "agent_scripts" / "tool_agent.py")]
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
CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}


async def tool_loop(client, question: str, turns: int = 4) -> str | None:
    """A plain OpenAI-SDK tool loop with ``add`` on ``client`` (an ``openai.AsyncOpenAI``): call
    the model, run its tool calls, until it answers; its answer (None: none in ``turns`` calls)."""
    messages = [{"role": "user", "content": question}]
    for _ in range(turns):
        out = await client.chat.completions.create(
            model="tidal", messages=messages, tools=[ADD_TOOL], max_tokens=40
        )
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            result = str(args.get("a", 0) + args.get("b", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def conversation(question: str = QUESTION) -> list[dict]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", **CALL}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]


def save_tool_model(path: str | Path, steps: int = 60, seed: int = 0) -> Path:
    path = Path(path)
    messages = conversation()
    plain = AutoTokenizer.from_pretrained(
        save_tiny_chat_model(path, chat_template=TOOLS_CHATML_TEMPLATE)
    )
    text = render_chat(messages, plain, add_generation_prompt=False, tools=[ADD_TOOL])
    save_tiny_chat_model(
        path, corpus=[text] * 4, vocab_size=400, chat_template=TOOLS_CHATML_TEMPLATE, seed=seed
    )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(path)
    return path
