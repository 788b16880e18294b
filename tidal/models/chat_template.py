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
    uses_tools = tools or any("tool_calls" in m for m in clean)
    if uses_tools and not knows_tools(tokenizer.chat_template):
        clean, tools = hermes_messages(clean, tools), None
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        clean, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def knows_tools(template: str | dict) -> bool:
    """Whether a chat template renders tools and tool calls itself (it reads ``tools`` and
    ``tool_calls``); many instruct models' templates (e.g. SmolLM2's) drop both silently."""
    text = json.dumps(template) if isinstance(template, dict) else template
    return "tools" in text and "tool_calls" in text


HERMES_TOOLS = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Tools, tool calls and tool results written into plain messages the Hermes way (Qwen 2.5's
    layout), for a template that has no tool syntax of its own: the tools' schemas in a system
    turn (after the conversation's own system text), each call as
    ``<tool_call>{json}</tool_call>`` after the assistant's content, each result as a user turn
    ``<tool_response>...</tool_response>`` (only where tools are offered or called: a plain
    conversation renders as the template writes it). ``rollout.tool_parser: hermes`` reads the
    calls back."""
    out = [dict(m) for m in messages]
    if tools:
        listed = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        preamble = HERMES_TOOLS.format(tools=listed)
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{preamble}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": preamble})
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            written = [
                "<tool_call>\n" + json.dumps(c["function"]) + "\n</tool_call>" for c in calls
            ]
            m["content"] = "\n".join(filter(None, [m["content"], *written]))
        if m["role"] == "tool":
            m.pop("tool_call_id", None), m.pop("name", None)
            m.update(role="user", content=f"<tool_response>\n{m['content']}\n</tool_response>")
    return out


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
