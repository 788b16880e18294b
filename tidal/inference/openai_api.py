"""An OpenAI-compatible API on tidal's server: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (the tokenizer's chat template).

Supported: ``n``, ``max_tokens`` (``max_completion_tokens``), ``temperature``, ``top_p``,
``stop``, ``seed``, ``logprobs`` / ``top_logprobs``, ``usage``, finish reasons, streaming
(server-sent events, text as it is generated; ``stream_options.include_usage``); vLLM's
extensions ``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``return_token_ids`` (the
prompt's and each choice's token ids, and tidal's per-token weight versions). A field that
would change the answer and is not implemented (``tools``, penalties, ...) is a
400 naming it; errors have OpenAI's shape. A request interrupted by a weight update
(``pause_generation`` in abort mode) is resumed on the new weights, so the answer is never
cut short by training.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import Any

from tidal.extras import needs_extra

with needs_extra("llm", "the inference server"):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

from tidal.inference.engine import GenerationEngine, GenerationResult
from tidal.inference.params import GenerationConfig
from tidal.inference.protocol import error_json, generate_all, json_body, output_text

IGNORED = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "add_special_tokens",
    }
)
# accepted only at these defaults (they would change the answer)
DEFAULT_ONLY: dict[str, tuple] = {
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "min_tokens": (0,),
    "guided_json": (),
    "guided_regex": (),
}
COMMON = {
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "return_token_ids",
    "stream",
}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "stream_options"}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "stream_options",
}


def add_openai_routes(app: FastAPI, engine: GenerationEngine, model_name: str) -> None:
    created = int(time.time())

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "tidal",
                    "max_model_len": engine.max_positions,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        if (refused := _check_model(body, model_name)) is not None:
            return refused
        _check_fields(body, COMPLETION_FIELDS)
        prompts = _completion_prompts(body.get("prompt"), engine.tokenizer)
        logprobs = _int(body, "logprobs", None, 0, 20)
        cfg = _config(body, engine, prompts, default_max_tokens=16, top_logprobs=logprobs or 0)
        n = _int(body, "n", 1, 1, 128)
        if _streaming(body, logprobs is not None):
            return _event_stream(
                engine,
                prompts,
                cfg,
                n,
                "cmpl",
                "text_completion",
                model_name,
                lambda text: {"text": text},
                _include_usage(body),
            )
        results = await _generate(engine, prompts, cfg, n)
        choices = []
        for i, (p, result) in enumerate(results):
            choice = {
                "index": i,
                "text": _text(result, engine),
                "finish_reason": _finish(result),
                "logprobs": None
                if logprobs is None
                else _completion_logprobs(result, engine.tokenizer),
            }
            choices.append(_with_ids(choice, body, prompts[p], result))
        return _envelope("cmpl", "text_completion", model_name, choices, prompts, results)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await json_body(request)
        if (refused := _check_model(body, model_name)) is not None:
            return refused
        _check_fields(body, CHAT_FIELDS)
        prompt = chat_prompt(body.get("messages"), engine.tokenizer)
        want_logprobs = body.get("logprobs") or False
        if not isinstance(want_logprobs, bool):
            raise ValueError(f"logprobs: must be true or false, got {want_logprobs!r}")
        top = _int(body, "top_logprobs", 0, 0, 20)
        if top and not want_logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        cfg = _config(body, engine, [prompt], default_max_tokens=None, top_logprobs=top)
        n = _int(body, "n", 1, 1, 128)
        if _streaming(body, want_logprobs):
            return _event_stream(
                engine,
                [prompt],
                cfg,
                n,
                "chatcmpl",
                "chat.completion.chunk",
                model_name,
                lambda text: {"delta": {"role": "assistant", "content": text}},
                _include_usage(body),
            )
        results = await _generate(engine, [prompt], cfg, n)
        choices = []
        for i, (_, result) in enumerate(results):
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": _text(result, engine)},
                "finish_reason": _finish(result),
                "logprobs": _chat_logprobs(result, engine.tokenizer) if want_logprobs else None,
            }
            choices.append(_with_ids(choice, body, prompt, result))
        return _envelope("chatcmpl", "chat.completion", model_name, choices, [prompt], results)


def _streaming(body: dict, logprobs: bool) -> bool:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ValueError(f"stream: must be true or false, got {stream!r}")
    if stream and logprobs:
        raise ValueError("stream: log-probs are not streamed by this server; ask without stream")
    if stream and body.get("return_token_ids"):
        raise ValueError("stream: token ids are not streamed by this server; ask without stream")
    if not stream and body.get("stream_options") is not None:
        raise ValueError("stream_options: only with stream: true")
    return stream


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ValueError("stream_options: supported is {include_usage: bool}")
    return bool(options.get("include_usage"))


def _event_stream(
    engine: GenerationEngine,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    n: int,
    prefix: str,
    kind: str,
    model: str,
    piece,
    include_usage: bool,
) -> StreamingResponse:
    """Server-sent events: a chunk per piece of new text as tokens arrive, a last chunk per
    choice with its finish reason, the usage when asked, then ``[DONE]``. Text that could be
    the start of a stop string is held back until it is known not to be one."""
    jobs = [(p, prompt, cfg.seeded(i)) for p, prompt in enumerate(prompts) for i in range(n)]
    for _, prompt, job_cfg in jobs:
        try:
            engine.validate(prompt, job_cfg)
        except ValueError as exc:
            raise ValueError(_openai_names(str(exc))) from None
    tok = engine.tokenizer
    hold = max((len(s) for s in cfg.stop), default=0)
    stream_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def chunk(index: int, fields: dict, finish: str | None) -> str:
        choice = {"index": index, **fields, "logprobs": None, "finish_reason": finish}
        return (
            "data: "
            + json.dumps(
                {
                    "id": stream_id,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
            )
            + "\n\n"
        )

    async def events():
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, prompt: list[int], job_cfg: GenerationConfig) -> None:
            result = await generate_resumed(
                engine, prompt, job_cfg, lambda t: queue.put_nowait((index, t, None))
            )
            queue.put_nowait((index, None, result))

        tasks = [
            asyncio.create_task(run(i, prompt, job_cfg))
            for i, (_, prompt, job_cfg) in enumerate(jobs)
        ]
        ids: list[list[int]] = [[] for _ in jobs]
        sent = [0] * len(jobs)
        results: list[GenerationResult | None] = [None] * len(jobs)
        try:
            while any(r is None for r in results):
                index, token, result = await queue.get()
                if result is not None:
                    results[index] = result
                    final = output_text(result, tok) if tok is not None else ""
                    if final[sent[index] :]:
                        yield chunk(index, piece(final[sent[index] :]), None)
                    yield chunk(index, piece(""), _finish(result))
                    continue
                ids[index].append(token)
                if tok is None:
                    continue
                text = tok.decode(ids[index], skip_special_tokens=True)
                safe = max(sent[index], len(text) - hold)
                if safe > sent[index]:
                    yield chunk(index, piece(text[sent[index] : safe]), None)
                    sent[index] = safe
            if include_usage:
                completion_tokens = sum(len(r.output_ids) for r in results)
                prompt_tokens = sum(len(p) for p in prompts)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                }
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": stream_id,
                            "object": kind,
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def _check_model(body: Any, model_name: str) -> JSONResponse | None:
    if not isinstance(body, dict):
        raise ValueError(f"body: must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str):
        raise ValueError("model: required, the name /v1/models lists")
    if model != model_name:
        return error_json(
            "/v1/",
            404,
            f"The model `{model}` does not exist; this server serves `{model_name}`",
            param="model",
        )
    return None


def _check_fields(body: dict, supported: set[str]) -> None:
    for key, value in body.items():
        if key in supported or key in IGNORED or value is None:
            continue
        if key in DEFAULT_ONLY:
            if value not in DEFAULT_ONLY[key]:
                raise ValueError(f"{key}: {value!r} is not supported by this server")
            continue
        raise ValueError(f"{key}: not a supported field")


def _int(body: dict, key: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def _config(
    body: dict,
    engine: GenerationEngine,
    prompts: list[list[int]],
    default_max_tokens: int | None,
    top_logprobs: int,
) -> GenerationConfig:
    """The request's sampling fields as tidal's ``GenerationConfig`` (validated by it). Without
    ``max_tokens``, chat generates up to the end of the context, as vLLM does."""
    max_tokens = body.get("max_tokens", default_max_tokens)
    if max_tokens is None:
        max_tokens = max(1, engine.max_positions - max(len(p) for p in prompts))
    stop = body.get("stop") or []
    stop_ids = list(body.get("stop_token_ids") or [])
    eos = getattr(engine.tokenizer, "eos_token_id", None)
    if not body.get("ignore_eos") and eos is not None and eos not in stop_ids:
        stop_ids.append(eos)  # OpenAI's servers end a completion at the end-of-sequence token
    fields = {
        "max_new_tokens": max_tokens,
        "stop": [stop] if isinstance(stop, str) else stop,
        "stop_token_ids": stop_ids,
        "top_logprobs": top_logprobs,
    }
    for key in ("temperature", "top_p", "top_k", "seed"):
        if body.get(key) is not None:
            fields[key] = body[key]
    try:
        return GenerationConfig.from_json(fields, where="request")
    except ValueError as exc:  # name the OpenAI field, not tidal's
        raise ValueError(
            str(exc).replace("request.max_new_tokens", "max_tokens").replace("request.", "")
        ) from None


async def _generate(
    engine: GenerationEngine, prompts: list[list[int]], cfg: GenerationConfig, n: int
) -> list[tuple[int, GenerationResult]]:
    """``n`` samples of every prompt (prompt-major), each resumed after an abort."""
    jobs = [(p, prompt, cfg.seeded(i)) for p, prompt in enumerate(prompts) for i in range(n)]
    for _, prompt, job_cfg in jobs:
        try:
            engine.validate(prompt, job_cfg)
        except ValueError as exc:
            raise ValueError(_openai_names(str(exc))) from None
    results = await asyncio.gather(
        *(generate_resumed(engine, prompt, job_cfg) for _, prompt, job_cfg in jobs)
    )
    return [(p, r) for (p, _, _), r in zip(jobs, results)]


def _openai_names(message: str) -> str:
    return (
        message.replace("sampling_params.max_new_tokens", "max_tokens")
        .replace("input_ids", "prompt")
        .replace("sampling_params.", "")
    )


async def generate_resumed(
    engine: GenerationEngine, prompt: list[int], cfg: GenerationConfig, on_token=None
) -> GenerationResult:
    """Generate; after an abort (a weight update) continue from the tokens so far with the rest
    of the budget (the engine holds the new request until generation resumes)."""
    rid = uuid.uuid4().hex
    (total,) = await generate_all(engine, [(prompt, cfg, rid)], on_token)
    while total.finish_reason == "abort" and len(total.output_ids) < cfg.max_new_tokens:
        done = len(total.output_ids)
        rest = replace(
            cfg,
            max_new_tokens=cfg.max_new_tokens - done,
            seed=None if cfg.seed is None else cfg.seed + done,
        )
        (more,) = await generate_all(engine, [(prompt + total.output_ids, rest, rid)], on_token)
        total = replace(
            more,
            output_ids=total.output_ids + more.output_ids,
            output_logprobs=total.output_logprobs + more.output_logprobs,
            output_versions=total.output_versions + more.output_versions,
            output_top_logprobs=total.output_top_logprobs + more.output_top_logprobs,
            prompt_tokens=len(prompt),
        )
    if total.finish_reason == "abort":
        total = replace(total, finish_reason="length")
    return total


def _completion_prompts(prompt: Any, tokenizer) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt: must be a string, a list of strings or a list of token ids")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    out = []
    for item in prompt:
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError(
                    "prompt: this server's model folder has no tokenizer; send token ids"
                )
            out.append(tokenizer(item).input_ids)
        elif isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            out.append(item)
        else:
            raise ValueError("prompt: must be a string, a list of strings or a list of token ids")
    if any(not p for p in out):
        raise ValueError("prompt: must not be empty")
    return out


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


def _text(result: GenerationResult, engine: GenerationEngine) -> str:
    return output_text(result, engine.tokenizer) if engine.tokenizer is not None else ""


def _finish(result: GenerationResult) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def _token_str(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok]) if tokenizer is not None else f"token_id:{tok}"


def _completion_logprobs(result: GenerationResult, tokenizer) -> dict:
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


def _chat_logprobs(result: GenerationResult, tokenizer) -> dict:
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


def _with_ids(choice: dict, body: dict, prompt: list[int], result: GenerationResult) -> dict:
    if body.get("return_token_ids"):
        choice.update(
            prompt_token_ids=prompt,
            token_ids=result.output_ids,
            token_versions=result.output_versions,
        )
    return choice


def _envelope(
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
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
