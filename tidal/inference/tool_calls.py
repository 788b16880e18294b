"""Tool calls: the model's text parsed into OpenAI ``tool_calls`` by a registered parser
(``rollout.tool_parser``), and the checks of a request's ``tools`` / ``tool_choice``.

A parser takes the completion's text and returns ``ParsedOutput``: the content before the calls
and the calls in OpenAI's shape (``arguments`` a JSON string). A call that does not parse (bad
JSON, no name, an unclosed tag) makes the whole answer plain content with finish reason
``stop``, as OpenAI-compatible servers do, and ``error`` says why (the caller counts it).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.registry import Registry


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    error: str | None = None  # why a tool call in the text did not parse

    @property
    def finish_reason(self) -> str | None:
        """``tool_calls`` when calls were parsed (else the generation's own reason)."""
        return "tool_calls" if self.tool_calls else None

    def message(self) -> dict:
        """The assistant message, as a chat completion's ``choices[i].message``."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


ToolParser = Callable[[str], ParsedOutput]
TOOL_PARSERS: Registry[ToolParser] = Registry("tool parser", "rollout.tool_parser")


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@TOOL_PARSERS.register("qwen")
@TOOL_PARSERS.register("hermes")
def hermes_tool_calls(text: str) -> ParsedOutput:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
    call, after any content."""
    opened = text.count("<tool_call>")
    if not opened:
        return ParsedOutput(text)
    bodies = _HERMES.findall(text)
    if len(bodies) != opened:
        return ParsedOutput(text, error="a <tool_call> is not closed by </tool_call>")
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedOutput(text, error=f"a tool call is not JSON: {exc}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedOutput(text, error='a tool call has no "name" string')
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, dict | str):
            return ParsedOutput(text, error='a tool call\'s "arguments" is not an object')
        calls.append(_call(obj["name"], arguments))
    content = text[: text.index("<tool_call>")].strip()
    return ParsedOutput(content or None, calls)


def parse_tool_calls(text: str, parser: str, tools: list | None) -> ParsedOutput:
    """``text`` as an assistant message: parsed by ``parser`` when the request offered tools,
    plain content otherwise."""
    if not tools:
        return ParsedOutput(text)
    return TOOL_PARSERS.get(parser)(text)


def check_tools(tools: Any, tool_choice: Any) -> list[dict] | None:
    """The tools the chat template renders (None: none offered, or ``tool_choice: none``).
    ``tool_choice`` ``auto``, ``required`` and a named function are accepted; the template says
    which tools exist, nothing constrains the decoding."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type", "function") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise ValueError("tools: must be a list of {type: function, function: {name, ...}}")
    if tool_choice in (None, "auto", "required"):
        return tools
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice: {name!r} is not one of the tools")
        return tools
    raise ValueError(
        f"tool_choice: must be none, auto, required or {{type: function, function: {{name}}}}, "
        f"got {tool_choice!r}"
    )
