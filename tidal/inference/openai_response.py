"""The OpenAI API's response bodies from tidal's ``GenerationResult``: choices' text, finish
reasons, log-probs in the completions and the chat shapes, token ids, and the envelope."""

from __future__ import annotations

import time
import uuid

from tidal.inference.engine import GenerationEngine, GenerationResult
from tidal.inference.protocol import output_text, server_sent_event  # noqa: F401 (re-exported)
from tidal.inference.tool_calls import parse_tool_calls


def choice_text(result: GenerationResult, engine: GenerationEngine) -> str:
    return output_text(result, engine.tokenizer) if engine.tokenizer is not None else ""


def finish_reason(result: GenerationResult) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def _token_str(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok]) if tokenizer is not None else f"token_id:{tok}"


def completion_logprobs(result: GenerationResult, tokenizer) -> dict:
    tokens = [_token_str(tokenizer, t) for t in result.output_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = [
        {_token_str(tokenizer, t): lp for t, lp in step} for step in result.output_top_logprobs
    ] or None
    return {
        "tokens": tokens,
        "token_logprobs": result.output_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(result: GenerationResult, tokenizer) -> dict:
    def entry(tok: int, lp: float) -> dict:
        s = _token_str(tokenizer, tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    steps = result.output_top_logprobs or [[] for _ in result.output_ids]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
            for t, lp, alts in zip(result.output_ids, result.output_logprobs, steps)
        ]
    }


def with_token_ids(choice: dict, body: dict, prompt: list[int], result: GenerationResult) -> dict:
    if body.get("return_token_ids"):
        choice.update(
            prompt_token_ids=prompt,
            token_ids=result.output_ids,
            token_versions=result.output_versions,
        )
    return choice


def envelope(
    prefix: str,
    kind: str,
    model: str,
    choices: list[dict],
    prompts: list[list[int]],
    results: list[tuple[int, GenerationResult]],
) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(r.output_ids) for _, r in results)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_choice_message(
    text: str, finish: str, tool_parser: str, tools: list | None
) -> tuple[dict, str, bool]:
    """A chat choice's assistant message from its text: tool calls parsed when tools were
    offered (finish reason ``tool_calls``); a call that does not parse stays content (finish
    ``stop``). Returns ``(message, finish_reason, whether a tool call failed to parse)``."""
    parsed = parse_tool_calls(text, tool_parser, tools)
    if parsed.error is not None:
        finish = "stop"
    return parsed.message(), parsed.finish_reason or finish, parsed.error is not None


def whole_stream(answer: dict, include_usage: bool):
    """A whole chat completion as server-sent events: per choice one chunk with its message
    (tool calls indexed, as streamed deltas are) and its finish reason, the usage when asked,
    then ``[DONE]``."""
    head = {k: answer[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    for choice in answer["choices"]:
        delta = dict(choice["message"])
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
        fields = {"index": choice["index"], "delta": delta, "logprobs": None}
        yield server_sent_event({**head, "choices": [{**fields, "finish_reason": None}]})
        end = {"index": choice["index"], "delta": {}, "logprobs": None}
        yield server_sent_event(
            {**head, "choices": [{**end, "finish_reason": choice["finish_reason"]}]}
        )
    if include_usage:
        yield server_sent_event({**head, "choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"
