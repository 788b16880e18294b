"""Chat messages as a prompt: checked (roles, text content) and rendered by the tokenizer's chat
template; the OpenAI API and the recording OpenAI client of agents both render through it."""

from __future__ import annotations

from typing import Any


def chat_prompt(messages: Any, tokenizer) -> list[int]:
    """The token ids of ``messages`` rendered by the tokenizer's chat template."""
    ids = tokenizer(render_chat(messages, tokenizer), add_special_tokens=False).input_ids
    if not ids:
        raise ValueError("messages: the chat template rendered an empty prompt")
    return ids


def render_chat(messages: Any, tokenizer, add_generation_prompt: bool = True) -> str:
    """``messages`` (checked: roles, text content) through the tokenizer's chat template."""
    if tokenizer is None:
        raise ValueError("messages: this server's model folder has no tokenizer")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "messages: this model's tokenizer has no chat template; use /v1/completions"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise ValueError(
                f"messages[{i}].role: must be system, developer, user, assistant or tool"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string or a list of text parts")
        clean.append({"role": m["role"], "content": content})
    return tokenizer.apply_chat_template(
        clean, tokenize=False, add_generation_prompt=add_generation_prompt
    )
