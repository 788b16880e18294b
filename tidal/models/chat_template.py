"""Chat messages as a prompt: checked (roles, text content, tool calls) and rendered by the
tokenizer's chat template, with the request's ``tools``; the OpenAI API, the session proxy, the
recording OpenAI client of agents and ``tidal sft`` all render through it, so that a warm start
learns the prompts exactly as training sees them."""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_prompt(messages: Any, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """The token ids of ``messages`` (and ``tools``) rendered by the tokenizer's chat template."""
    ids = tokenizer(
        render_chat(messages, tokenizer, tools=tools), add_special_tokens=False
    ).input_ids
    if not ids:
        raise ValueError("messages: the chat template rendered an empty prompt")
    return ids


def render_chat(
    messages: Any, tokenizer, add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> str:
    """``messages`` (checked: roles, text content) through the tokenizer's chat template."""
    if tokenizer is None:
        raise ValueError("messages: this server's model folder has no tokenizer")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "messages: this model's tokenizer has no chat template; use /v1/completions"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    clean = [_clean(i, m) for i, m in enumerate(messages)]
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        clean, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _clean(i: int, m: Any) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ValueError(f"messages[{i}].role: must be system, developer, user, assistant or tool")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text
        if not all(
            isinstance(p, dict) and p.get("type") in ("text", "input_text") for p in content
        ):
            raise ValueError(f"messages[{i}].content: only text parts are supported")
        content = "".join(p.get("text", "") for p in content)
    calls = m.get("tool_calls") if m["role"] == "assistant" else None
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content: must be a string or a list of text parts")
    out = {"role": m["role"], "content": content}
    if calls:
        out["tool_calls"] = [_template_call(i, c) for c in calls]
    if m["role"] == "tool":
        out.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
    return out


def _template_call(i: int, call: Any) -> dict:
    """An OpenAI tool call as chat templates read it: ``arguments`` a mapping, not a string
    (Qwen's and Hermes' templates write ``arguments | tojson``)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls: each needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # rendered as the string the model wrote
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
