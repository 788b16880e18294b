"""A minimal OpenAI Responses API over chat completions (for the session proxy): ``input`` (a
string, or message / ``function_call`` / ``function_call_output`` items), ``instructions``,
function ``tools``, ``tool_choice``, ``max_output_tokens``, ``temperature``, ``top_p``; the
answer as ``output_text`` message and ``function_call`` items. Nothing is stored: send the
whole conversation as ``input`` each call (``previous_response_id`` is refused)."""

from __future__ import annotations

import time
from typing import Any

SUPPORTED = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "store",
    "user",
    "metadata",
}


def chat_arguments(body: dict) -> dict:
    """A Responses request as ``chat.completions.create`` arguments."""
    for key, value in body.items():
        if key not in SUPPORTED and value is not None:
            raise ValueError(f"{key}: not supported by the session proxy's responses endpoint")
    messages = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("input: must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        message = _message(i, item, messages)
        if message is not None:
            messages.append(message)
    out: dict[str, Any] = {"messages": messages}
    if body.get("tools"):
        out["tools"] = [_chat_tool(t) for t in body["tools"]]
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        out["tool_choice"] = choice
    for key, chat_key in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
    ):
        if body.get(key) is not None:
            out[chat_key] = body[key]
    return out


def _message(i: int, item: Any, messages: list) -> dict | None:
    if not isinstance(item, dict):
        raise ValueError(f"input[{i}]: must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return {"role": item.get("role"), "content": content}
    if kind == "function_call":  # joins the assistant turn before it, or starts one
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
    raise ValueError(f"input[{i}].type: {kind!r} is not supported (message, function_call, ...)")


def _chat_tool(tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError("tools: only function tools are supported")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def response_object(completion, model: str) -> dict:
    """A chat completion as a Responses API ``response``."""
    message = completion.choices[0].message
    output: list[dict] = []
    if message.content:
        output.append(
            {
                "type": "message",
                "id": f"msg_{completion.id}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": message.content, "annotations": []}],
            }
        )
    for call in message.tool_calls or []:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{call.id}",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "completed",
            }
        )
    u = completion.usage
    return {
        "id": completion.id.replace("chatcmpl", "resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "completed",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
