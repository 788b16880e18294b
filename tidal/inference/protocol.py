"""SGLang's ``/generate`` request and response, as tidal implements them.

A request names its prompt as token ids or as text (one prompt, or a batch), its sampling
parameters and ``n``. Fields SGLang's clients send by default and that change nothing here
(the router adds ``model``, ``log_metrics``, ...) are accepted and ignored; a field that
would change what is generated is accepted only at its default value, otherwise the request
is refused with an error naming it: tidal never silently ignores what a client asked for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tidal.extras import needs_extra

with needs_extra("llm", "the inference server"):
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

from tidal.inference.engine import EngineDied, GenerationResult
from tidal.inference.params import GenerationConfig

log = logging.getLogger(__name__)

# top-level fields that do not change the result here
IGNORED_FIELDS = frozenset(
    {
        "model",
        "log_metrics",
        "background",
        "no_logs",
        "return_bytes",
        "logprob_start_len",
        "data_parallel_rank",
        "priority",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    }
)
# top-level fields accepted only when unset or false (at their default)
DEFAULT_ONLY_FIELDS = frozenset(
    {
        "return_hidden_states",
        "return_entropy",
        "token_ids_logprob",
        "lora_path",
        "image_data",
        "video_data",
        "audio_data",
        "input_embeds",
        "custom_logit_processor",
        "session_params",
        "return_routed_experts",
    }
)
# sampling fields that only shape the text of the answer (handled here, not by the engine)
TEXT_FIELDS = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
}
# sampling fields tidal does not implement: accepted only at these defaults
DEFAULT_ONLY_SAMPLING = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "stop_regex": None,
    "custom_params": None,
}
IGNORED_SAMPLING = frozenset({"stream_interval"})


@dataclass
class GenerateCall:
    """One parsed ``/generate`` request: ``len(prompts) * n`` generations."""

    prompts: list[list[int]]
    configs: list[GenerationConfig]
    rids: list[str | None]
    n: int = 1
    batched: bool = False
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    text_options: list[dict[str, bool]] = field(default_factory=list)
    stream: bool = False  # server-sent events as tokens arrive (one prompt, n = 1)

    def expanded(self) -> list[tuple[int, list[int], GenerationConfig, str | None]]:
        """``(prompt index, prompt, config, rid)`` per generation, prompt-major (SGLang's order);
        sample ``i`` of a seeded prompt is seeded ``seed + i``."""
        out = []
        for p, (prompt, cfg, rid) in enumerate(zip(self.prompts, self.configs, self.rids)):
            for i in range(self.n):
                sample_rid = rid if self.n == 1 or rid is None else f"{rid}-{i}"
                out.append((p, prompt, cfg.seeded(i), sample_rid))
        return out


def parse_generate(body: Any, tokenizer) -> GenerateCall:
    if not isinstance(body, dict):
        raise ValueError(f"body: must be a JSON object, got {type(body).__name__}")
    known = {
        "input_ids",
        "text",
        "sampling_params",
        "return_logprob",
        "rid",
        "return_text_in_logprobs",
        "top_logprobs_num",
        "stream",
    }
    for key, value in body.items():
        if key in known or key in IGNORED_FIELDS:
            continue
        if key in DEFAULT_ONLY_FIELDS:
            if value:
                raise ValueError(
                    f"{key}: {value!r} is not supported by this server (only its default)"
                )
            continue
        raise ValueError(f"{key}: not a supported field")
    prompts, batched = _prompts(body, tokenizer)
    samplings = body.get("sampling_params") or {}
    if isinstance(samplings, list):
        if len(samplings) != len(prompts):
            raise ValueError(
                f"sampling_params: a list of {len(samplings)} for {len(prompts)} prompts"
            )
    else:
        samplings = [samplings] * len(prompts)
    top = body.get("top_logprobs_num") or 0
    eos = getattr(tokenizer, "eos_token_id", None)
    parsed = [
        _sampling(sp, f"sampling_params{f'[{i}]' if batched else ''}", eos, top)
        for i, sp in enumerate(samplings)
    ]
    ns = {n for _, n, _ in parsed}
    if len(ns) > 1:
        raise ValueError("sampling_params.n: must be the same for every prompt of a batch")
    rids = body.get("rid")
    if rids is None or isinstance(rids, str):
        rids = (
            [rids]
            if not batched
            else [None if rids is None else f"{rids}-{i}" for i in range(len(prompts))]
        )
    elif not (
        isinstance(rids, list)
        and len(rids) == len(prompts)
        and all(isinstance(r, str) for r in rids)
    ):
        raise ValueError("rid: must be a string, or a list of strings with one per prompt")
    n, stream = ns.pop(), _flag(body, "stream")
    if stream and (batched or n > 1):
        raise ValueError("stream: streams one prompt with n = 1")
    return GenerateCall(
        prompts,
        [c for c, _, _ in parsed],
        rids,
        n=n,
        stream=stream,
        batched=batched,
        return_logprob=_flag(body, "return_logprob"),
        return_text_in_logprobs=_flag(body, "return_text_in_logprobs"),
        text_options=[t for _, _, t in parsed],
    )


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: must be true or false, got {value!r}")
    return value


def _prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise ValueError("input_ids: give exactly one of input_ids and text")
    if text is not None:
        if tokenizer is None:
            raise ValueError("text: this server's model folder has no tokenizer; send input_ids")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("text: must be a string or a non-empty list of strings")
        return [tokenizer(t).input_ids for t in texts], not isinstance(text, str)
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return [_token_ids(x, f"input_ids[{i}]") for i, x in enumerate(ids)], True
    return [_token_ids(ids, "input_ids")], False


def _token_ids(ids: Any, where: str) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ValueError(f"{where}: must be a list of token ids (integers)")
    if not ids:
        raise ValueError(f"{where}: must not be empty")
    return ids


def _sampling(
    sp: Any, where: str, eos: int | None, top_logprobs: int
) -> tuple[GenerationConfig, int, dict[str, bool]]:
    """SGLang's sampling parameters: like SGLang, generation stops at the tokenizer's EOS unless
    ``ignore_eos`` (tidal's client sends ``ignore_eos: true`` and its own stop ids)."""
    if not isinstance(sp, dict):
        raise ValueError(f"{where}: must be a JSON object")
    sp = dict(sp)
    ignore_eos = sp.pop("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"{where}.ignore_eos: must be true or false, got {ignore_eos!r}")
    n = sp.pop("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
        raise ValueError(f"{where}.n: must be an integer in [1, 256], got {n!r}")
    text_options = {k: sp.pop(k, default) for k, default in TEXT_FIELDS.items()}
    for key, value in text_options.items():
        if not isinstance(value, bool):
            raise ValueError(f"{where}.{key}: must be true or false, got {value!r}")
    for key, default in DEFAULT_ONLY_SAMPLING.items():
        value = sp.pop(key, default)
        if value is not None and value != default:
            raise ValueError(
                f"{where}.{key}: {value!r} is not supported by this server (only {default!r})"
            )
    if sp.get("stop") is None:
        sp.pop("stop", None)
    if sp.get("stop_token_ids") is None:
        sp.pop("stop_token_ids", None)
    cfg = GenerationConfig.from_json(sp, where, ignored=IGNORED_SAMPLING)
    if not ignore_eos and eos is not None and eos not in cfg.stop_token_ids:
        cfg.stop_token_ids = [*cfg.stop_token_ids, eos]
    cfg.top_logprobs = top_logprobs
    return cfg.validate(where), n, text_options


def result_json(
    result: GenerationResult,
    tokenizer,
    return_logprob: bool,
    text_options: dict[str, bool],
    return_text_in_logprobs: bool = False,
) -> dict:
    meta = {
        "id": result.rid,
        "finish_reason": finish_reason_json(result),
        "weight_version": result.weight_version,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "output_token_versions": result.output_versions,
    }
    if return_logprob:
        texts = (
            [tokenizer.decode([t]) for t in result.output_ids]
            if return_text_in_logprobs and tokenizer
            else [None] * len(result.output_ids)
        )
        meta["output_token_logprobs"] = [
            [lp, tok, txt] for lp, tok, txt in zip(result.output_logprobs, result.output_ids, texts)
        ]
        if result.output_top_logprobs:
            meta["output_top_logprobs"] = [
                [
                    [
                        lp,
                        tok,
                        tokenizer.decode([tok]) if return_text_in_logprobs and tokenizer else None,
                    ]
                    for tok, lp in step
                ]
                for step in result.output_top_logprobs
            ]
    out = {"output_ids": result.output_ids, "meta_info": meta}
    if tokenizer is not None:
        out["text"] = output_text(
            result,
            tokenizer,
            text_options.get("skip_special_tokens", True),
            trim_stop=not text_options.get("no_stop_trim", False),
        )
    return out


def output_text(
    result: GenerationResult, tokenizer, skip_special_tokens: bool = True, trim_stop: bool = True
) -> str:
    """The decoded completion; a matched stop string and what follows it are cut off."""
    text = tokenizer.decode(result.output_ids, skip_special_tokens=skip_special_tokens)
    if trim_stop and isinstance(result.matched_stop, str):
        cut = text.find(result.matched_stop)
        text = text if cut < 0 else text[:cut]
    return text


def finish_reason_json(result: GenerationResult) -> dict:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.matched_stop}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    return {"type": "abort", "message": "generation was paused"}


async def generate_all(
    engine, jobs: list[tuple[list[int], GenerationConfig, str | None]], on_token=None
) -> list[GenerationResult]:
    """Run ``(prompt, config, rid)`` jobs on the engine from an event loop. Every job is
    validated before any is submitted, so a refused batch starts nothing. ``on_token(token)``
    is called on the event loop for every token of a single job (streaming). Cancelled, it
    aborts its jobs in the engine: nobody waits for them any more."""
    for prompt, cfg, _ in jobs:
        engine.validate(prompt, cfg)
    loop = asyncio.get_running_loop()
    futures, submitted = [], []
    for prompt, cfg, rid in jobs:
        fut: asyncio.Future[GenerationResult] = loop.create_future()
        token_cb = None if on_token is None else (lambda t: loop.call_soon_threadsafe(on_token, t))
        submitted.append(
            engine.submit(
                prompt,
                cfg,
                lambda r, f=fut: loop.call_soon_threadsafe(_settle, f, r),
                rid=rid,
                on_token=token_cb,
            )
        )
        futures.append(fut)
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:  # the caller went away (a closed stream): free its rows
        for request in submitted:
            request.abort()
        raise


def stream_generate(engine, call: GenerateCall) -> StreamingResponse:
    """``/generate`` with ``stream: true``: an event per batch of new tokens (``output_ids`` the
    new ones, ``meta_info.completion_tokens`` the count so far, ``finish_reason`` null), then the
    whole result as the unstreamed answer has it, then ``[DONE]``. The request is checked before
    the stream starts, so a bad one is still a 400."""
    ((p, prompt, cfg, rid),) = call.expanded()
    engine.validate(prompt, cfg)
    rid = rid or uuid.uuid4().hex

    async def events():
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(generate_all(engine, [(prompt, cfg, rid)], queue.put_nowait))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        count, done = 0, False
        try:
            while not done:
                fresh = []  # every token that has arrived: one event
                item = await queue.get()
                while True:
                    if item is None:
                        done = True
                        break
                    fresh.append(item)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                if fresh:
                    count += len(fresh)
                    meta = {"id": rid, "finish_reason": None, "completion_tokens": count}
                    yield server_sent_event({"output_ids": fresh, "meta_info": meta})
            try:
                (result,) = task.result()
            except EngineDied as exc:  # the answer's status is sent: the error is an event
                yield server_sent_event({"error": str(exc)})
                return
            whole = result_json(
                result,
                engine.tokenizer,
                call.return_logprob,
                call.text_options[p],
                call.return_text_in_logprobs,
            )
            yield server_sent_event(whole)
            yield "data: [DONE]\n\n"
        finally:
            task.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def server_sent_event(data: dict) -> str:
    """One event of a streamed response (``data: {json}`` and a blank line)."""
    return "data: " + json.dumps(data) + "\n\n"


def error_event(status: int, message: str) -> str:
    """An error after an OpenAI-style stream's headers went out (its status was already 200):
    an event with OpenAI's error object, which the ``openai`` client raises as ``APIError``."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return server_sent_event({"error": {"message": message, "type": kind, "code": status}})


def _settle(fut: asyncio.Future, result: GenerationResult | EngineDied) -> None:
    if fut.done():
        return
    if isinstance(result, EngineDied):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def error_json(path: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    """tidal's ``{"error": message}``; OpenAI's error object under ``/v1``."""
    if path.startswith("/v1/"):
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        if status >= 500:
            kind = "server_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
        return JSONResponse(body, status_code=status)
    return JSONResponse({"error": message}, status_code=status)


T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its answer was ready (answered 499)."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """``work`` (a generation), cancelled if the client disconnects before it is done: nobody
    would read the answer, and its requests leave the engine's batch (``generate_all`` aborts
    them when cancelled) instead of running on, as a timed-out client's retry arrives. The
    request's body must have been read (the watch reads what the client sends next)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done and watch.exception() is not None:  # cannot tell: only wait
            log.warning(
                "%s: cannot watch for a disconnect: %r", request.url.path, watch.exception()
            )
            done, _ = await asyncio.wait({task})
    finally:
        watch.cancel()
        if not task.done():  # the client left, or this handler itself was cancelled
            task.cancel()
    if task in done:
        return task.result()  # its answer, its error, or its cancellation by another party
    raise ClientGone(f"{request.url.path}: the client closed its connection")


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body already read, ``receive`` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def json_body(request: Request):
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"body: not valid JSON ({exc})") from None
