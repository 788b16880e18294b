"""The OpenAI API's requests as tidal's: which fields are supported, ignored or accepted only at
their defaults, and the checks and conversions of the fields (prompts, sampling) that fail
naming the OpenAI field."""

from __future__ import annotations

from typing import Any

from tidal.extras import needs_extra

with needs_extra("llm", "the inference server"):
    from fastapi.responses import JSONResponse

from tidal.inference.engine import GenerationEngine
from tidal.inference.params import GenerationConfig
from tidal.inference.protocol import error_json

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
    "tools",
    "tool_choice",
}


def check_model(body: Any, model_name: str) -> JSONResponse | None:
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


def check_fields(body: dict, supported: set[str]) -> None:
    for key, value in body.items():
        if key in supported or key in IGNORED or value is None:
            continue
        if key in DEFAULT_ONLY:
            if value not in DEFAULT_ONLY[key]:
                raise ValueError(f"{key}: {value!r} is not supported by this server")
            continue
        raise ValueError(f"{key}: not a supported field")


def int_field(body: dict, key: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def wants_stream(body: dict, logprobs: bool) -> bool:
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


def wants_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ValueError("stream_options: supported is {include_usage: bool}")
    return bool(options.get("include_usage"))


def sampling_config(
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


def completion_prompts(prompt: Any, tokenizer) -> list[list[int]]:
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


def openai_names(message: str) -> str:
    return (
        message.replace("sampling_params.max_new_tokens", "max_tokens")
        .replace("input_ids", "prompt")
        .replace("sampling_params.", "")
    )
