"""An OpenAI-compatible API on tidal's server: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (the tokenizer's chat template).

Supported: ``n``, ``max_tokens`` (``max_completion_tokens``), ``temperature``, ``top_p``,
``stop``, ``seed``, ``logprobs`` / ``top_logprobs``, ``usage``, finish reasons, streaming
(server-sent events, text as it is generated; ``stream_options.include_usage``); vLLM's
extensions ``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``return_token_ids`` (the
prompt's and each choice's token ids, and tidal's per-token weight versions); ``tools`` and
``tool_choice`` (rendered by the chat template, the answer parsed into ``tool_calls`` by the
server's tool parser, see ``tool_calls``; streamed as one chunk when tools are offered). A
field that would change the answer and is not implemented (penalties, ...) is a 400 naming it; errors have OpenAI's shape. A request interrupted by a weight update
(``pause_generation`` in abort mode) is resumed on the new weights, so the answer is never
cut short by training.

This module holds the routes and the generation behind them; the requests are read in
``openai_request``, the responses shaped in ``openai_response``, and chat messages rendered by
``tidal.models.chat_template``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from tidal.extras import needs_extra

with needs_extra("llm", "the inference server"):
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

from tidal.inference.engine import GenerationEngine, GenerationResult
from tidal.inference.openai_request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_fields,
    check_model,
    completion_prompts,
    int_field,
    openai_names,
    sampling_config,
    wants_stream,
    wants_usage,
)
from tidal.inference.openai_response import (
    chat_choice_message,
    chat_logprobs,
    choice_text,
    completion_logprobs,
    envelope,
    finish_reason,
    server_sent_event,
    usage,
    whole_stream,
    with_token_ids,
)
from tidal.inference.params import GenerationConfig
from tidal.inference.protocol import (
    error_event,
    generate_all,
    json_body,
    output_text,
    unless_client_leaves,
)
from tidal.inference.tool_calls import check_tools
from tidal.models.chat_template import chat_prompt


def add_openai_routes(
    app: FastAPI, engine: GenerationEngine, model_name: str, tool_parser: str = "hermes"
) -> None:
    created = int(time.time())
    app.state.tool_parse_errors = 0  # answers whose tool call did not parse (sent as content)

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
        if (refused := check_model(body, model_name)) is not None:
            return refused
        check_fields(body, COMPLETION_FIELDS)
        prompts = completion_prompts(body.get("prompt"), engine.tokenizer)
        logprobs = int_field(body, "logprobs", None, 0, 20)
        cfg = sampling_config(
            body, engine, prompts, default_max_tokens=16, top_logprobs=logprobs or 0
        )
        n = int_field(body, "n", 1, 1, 128)
        if wants_stream(body, logprobs is not None):
            return _event_stream(
                engine,
                prompts,
                cfg,
                n,
                "cmpl",
                "text_completion",
                model_name,
                lambda text: {"text": text},
                wants_usage(body),
            )
        results = await unless_client_leaves(request, _generate(engine, prompts, cfg, n))
        choices = []
        for i, (p, result) in enumerate(results):
            choice = {
                "index": i,
                "text": choice_text(result, engine),
                "finish_reason": finish_reason(result),
                "logprobs": None
                if logprobs is None
                else completion_logprobs(result, engine.tokenizer),
            }
            choices.append(with_token_ids(choice, body, prompts[p], result))
        return envelope("cmpl", "text_completion", model_name, choices, prompts, results)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await json_body(request)
        if (refused := check_model(body, model_name)) is not None:
            return refused
        check_fields(body, CHAT_FIELDS)
        tools = check_tools(body.get("tools"), body.get("tool_choice"))
        prompt = chat_prompt(body.get("messages"), engine.tokenizer, tools)
        want_logprobs = body.get("logprobs") or False
        if not isinstance(want_logprobs, bool):
            raise ValueError(f"logprobs: must be true or false, got {want_logprobs!r}")
        top = int_field(body, "top_logprobs", 0, 0, 20)
        if top and not want_logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        cfg = sampling_config(body, engine, [prompt], default_max_tokens=None, top_logprobs=top)
        n = int_field(body, "n", 1, 1, 128)
        stream = wants_stream(body, want_logprobs)
        if stream and not tools:
            return _event_stream(
                engine,
                [prompt],
                cfg,
                n,
                "chatcmpl",
                "chat.completion.chunk",
                model_name,
                lambda text: {"delta": {"role": "assistant", "content": text}},
                wants_usage(body),
            )
        results = await unless_client_leaves(request, _generate(engine, [prompt], cfg, n))
        choices = []
        for i, (_, result) in enumerate(results):
            message, finish, parse_error = chat_choice_message(
                choice_text(result, engine), finish_reason(result), tool_parser, tools
            )
            app.state.tool_parse_errors += parse_error
            choice = {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": chat_logprobs(result, engine.tokenizer) if want_logprobs else None,
            }
            choices.append(with_token_ids(choice, body, prompt, result))
        answer = envelope("chatcmpl", "chat.completion", model_name, choices, [prompt], results)
        if stream:  # tool calls are known once the answer is whole
            return StreamingResponse(
                whole_stream(answer, wants_usage(body)), media_type="text/event-stream"
            )
        return answer


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
    the start of a stop string is held back until it is known not to be one. A generation that
    fails (the engine died) ends the stream with an error event naming it."""
    jobs = _jobs(engine, prompts, cfg, n)
    tok = engine.tokenizer
    hold = max((len(s) for s in cfg.stop), default=0)
    stream_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": stream_id, "object": kind, "created": created, "model": model}

    def chunk(index: int, fields: dict, finish: str | None) -> str:
        choice = {"index": index, **fields, "logprobs": None, "finish_reason": finish}
        return server_sent_event({**head, "choices": [choice]})

    async def events():
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, prompt: list[int], job_cfg: GenerationConfig) -> None:
            try:
                result = await generate_resumed(
                    engine, prompt, job_cfg, lambda t: queue.put_nowait((index, t, None))
                )
            except Exception as exc:  # noqa: BLE001  (reported in the stream, not lost)
                result = exc
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
                if isinstance(result, Exception):
                    yield error_event(500, f"{type(result).__name__}: {result}")
                    return
                if result is not None:
                    results[index] = result
                    final = output_text(result, tok) if tok is not None else ""
                    if final[sent[index] :]:
                        yield chunk(index, piece(final[sent[index] :]), None)
                    yield chunk(index, piece(""), finish_reason(result))
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
                yield server_sent_event(
                    {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
                )
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def _jobs(
    engine: GenerationEngine, prompts: list[list[int]], cfg: GenerationConfig, n: int
) -> list[tuple[int, list[int], GenerationConfig]]:
    """``(prompt index, prompt, config)`` of each of the ``n`` samples of every prompt
    (prompt-major, sample ``i`` seeded ``seed + i``), each checked by the engine before any
    starts; a refusal names the OpenAI field."""
    jobs = [(p, prompt, cfg.seeded(i)) for p, prompt in enumerate(prompts) for i in range(n)]
    for _, prompt, job_cfg in jobs:
        try:
            engine.validate(prompt, job_cfg)
        except ValueError as exc:
            raise ValueError(openai_names(str(exc))) from None
    return jobs


async def _generate(
    engine: GenerationEngine, prompts: list[list[int]], cfg: GenerationConfig, n: int
) -> list[tuple[int, GenerationResult]]:
    """``n`` samples of every prompt (prompt-major), each resumed after an abort."""
    jobs = _jobs(engine, prompts, cfg, n)
    results = await asyncio.gather(
        *(generate_resumed(engine, prompt, job_cfg) for _, prompt, job_cfg in jobs)
    )
    return [(p, r) for (p, _, _), r in zip(jobs, results)]


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
