"""An ``openai.AsyncOpenAI`` for agents whose completions become RL training data.

``RecordingOpenAI`` is an ``openai.AsyncOpenAI`` whose ``chat.completions.create`` runs on
tidal's ``InferenceClient`` instead of HTTP to OpenAI: the messages go through the model's
chat template, generation resumes across weight updates (``agenerate``), and every
completion is recorded with its prompt and completion token ids, the behaviour log-probs
and the weight version of each token. An agent written against the OpenAI SDK runs
unchanged; afterwards the episode's reward (or one per completion) is set on the records
and ``tidal.rollout.agent_workflow`` turns them into training sequences. (AReaL's
``ArealOpenAI`` follows the same idea.)

Supported arguments: ``messages``, ``model`` (ignored), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs``,
``tools`` / ``tool_choice`` (rendered by the chat template; the answer parsed into
``tool_calls`` by ``tool_parser``, see ``tool_calls``), ``n=1``. Anything else that would change
the answer (penalties, streaming, ``n>1``) raises ``ValueError`` naming it. The session proxy
(``sessions``) serves one of these per episode over HTTP.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache, cached_property
from typing import Any

from tidal.extras import needs_extra

with needs_extra("agents", "agent workflows on the OpenAI SDK"):
    import openai
    from openai.resources.chat import AsyncChat
    from openai.resources.chat.completions import AsyncCompletions
    from openai.types.chat import ChatCompletion

from tidal.inference.client import InferenceClient, ModelRequest, ModelResponse
from tidal.inference.params import GenerationConfig
from tidal.inference.tool_calls import check_tools, parse_tool_calls
from tidal.models.chat_template import chat_prompt, render_chat

_ABSENT = (None, openai.NOT_GIVEN)
# arguments accepted at these values only (anything else would change the answer)
_DEFAULT_ONLY = {
    "n": (1,),
    "stream": (False,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "top_logprobs": (0,),
    "response_format": ({"type": "text"},),
    "store": (True, False),
}
_IGNORED = {
    "model",
    "user",
    "metadata",
    "extra_headers",
    "extra_query",
    "timeout",
    "service_tier",
    "parallel_tool_calls",
}


@dataclass
class Completion:
    """One recorded chat completion."""

    id: str
    messages: list[dict]
    prompt_ids: list[int]
    response: ModelResponse  # output tokens, behaviour log-probs, per-token weight versions
    text: str  # the answer's text (tool calls included)
    reward: float | None = None
    tools: list[dict] | None = None
    message: dict | None = None  # the assistant message returned (content, tool_calls)
    finish_reason: str = "stop"

    @property
    def content(self) -> str:
        """The answer's text without its tool calls (what a reward reads)."""
        content = (self.message or {}).get("content", self.text)
        return content or ""

    @property
    def output_ids(self) -> list[int]:
        return self.response.output_tokens


class RecordingChatCompletions(AsyncCompletions):
    def __init__(self, owner: RecordingOpenAI):
        super().__init__(owner)
        self.owner = owner

    async def create(self, **kwargs: Any) -> ChatCompletion:
        """OpenAI's ``chat.completions.create`` (the arguments of ``ChatCall.of``), recorded."""
        owner = self.owner
        call = ChatCall.of(owner, **kwargs)
        record = await owner.record(call.prompt, call.cfg, call.messages, call.tools)
        return ChatCompletion.model_validate(
            chat_completion(record, owner.tokenizer, call.logprobs)
        )


@dataclass
class ChatCall:
    """A chat completion's request, checked and rendered: what ``record`` generates from."""

    prompt: list[int]
    cfg: GenerationConfig
    messages: list[dict]
    tools: list[dict] | None
    logprobs: bool

    @classmethod
    def of(
        cls,
        owner: RecordingOpenAI,
        *,
        messages: Any,
        max_tokens: Any = None,
        max_completion_tokens: Any = None,
        temperature: Any = None,
        top_p: Any = None,
        stop: Any = None,
        seed: Any = None,
        logprobs: Any = None,
        tools: Any = None,
        tool_choice: Any = None,
        extra_body: dict | None = None,
        **kwargs: Any,
    ) -> ChatCall:
        """Raises ``ValueError`` naming an argument that is not supported."""
        _check_unsupported({**kwargs, **(extra_body or {})})
        messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
        tools = check_tools(None if tools in _ABSENT else tools, _given(tool_choice))
        budget = max_completion_tokens if max_completion_tokens not in _ABSENT else max_tokens
        cfg = owner.config(budget, temperature, top_p, stop, seed)
        prompt = owner.prompt_ids(messages, tools)
        return cls(prompt, cfg, messages, tools, bool(logprobs not in _ABSENT and logprobs))


class RecordingChat(AsyncChat):
    def __init__(self, owner: RecordingOpenAI):
        super().__init__(owner)
        self.owner = owner

    @cached_property
    def completions(self) -> RecordingChatCompletions:  # type: ignore[override]
        return RecordingChatCompletions(self.owner)


class RecordingOpenAI(openai.AsyncOpenAI):
    """``client.chat.completions.create(...)`` on tidal's inference servers, recorded.

    ``gconfig`` holds the defaults (e.g. the run's ``max_new_tokens``, temperature and stop
    token ids); a call's arguments override them. One instance records one episode."""

    def __init__(
        self,
        inference: InferenceClient,
        tokenizer,
        gconfig: GenerationConfig | None = None,
        session_id: str | None = None,
        extend_turns: bool = True,
        tool_parser: str = "hermes",
    ):
        # nothing goes over OpenAI's HTTP: the base URL is never contacted, and every instance
        # shares one idle HTTP client (building one costs ~65 ms of CPU: its SSL context)
        super().__init__(
            api_key="tidal",
            base_url="http://tidal.invalid/v1",
            max_retries=0,
            http_client=_idle_http_client(),
        )
        self.inference, self.tokenizer = inference, tokenizer
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.gconfig = gconfig or GenerationConfig(max_new_tokens=256, stop_token_ids=eos)
        self.session_id = session_id or uuid.uuid4().hex  # one episode's calls share a server
        self.completions_made: list[Completion] = []
        self.extend_turns = extend_turns
        self.tool_parser = tool_parser
        self.tool_parse_errors = 0  # answers whose tool call did not parse (kept as content)

    async def close(self) -> None:
        """Nothing to close: the HTTP client is shared and never used."""

    def config(self, max_tokens=None, temperature=None, top_p=None, stop=None, seed=None):
        """The client's defaults with a call's sampling arguments over them."""
        overrides = {
            "max_new_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": [stop] if isinstance(stop, str) else stop,
        }
        given = {k: v for k, v in overrides.items() if v not in _ABSENT}
        return replace(self.gconfig, **given).validate("create")

    async def record(
        self,
        prompt: list[int],
        cfg: GenerationConfig,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        completion_id: str | None = None,
    ) -> Completion:
        """Generate from ``prompt`` (resumed across weight updates) and record the completion;
        with ``messages`` the answer is a chat message (tool calls parsed when ``tools``).
        ``on_tokens(ids)`` is called with new tokens as the server streams them."""
        req = ModelRequest(prompt, cfg, session_id=self.session_id)
        # an inference client that does not stream (a stand-in) is called as before
        streamed = () if on_tokens is None else (on_tokens,)
        response = await self.inference.agenerate(req, *streamed)
        text = _answer_text(self.tokenizer, response, cfg.stop)
        finish = "stop" if response.stop_reason == "stop" else "length"
        parsed = parse_tool_calls(text, self.tool_parser, tools)
        self.tool_parse_errors += parsed.error is not None
        record = Completion(
            completion_id or f"chatcmpl-{uuid.uuid4().hex}",
            messages or [],
            prompt,
            response,
            text,
            tools=tools,
            message=parsed.message() if messages is not None else None,
            finish_reason=parsed.finish_reason or ("stop" if parsed.error else finish),
        )
        self.completions_made.append(record)
        return record

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat template's tokens for ``messages``. With ``extend_turns``, a conversation
        that continues the previous call (its messages, then its answer, then new messages)
        is the previous prompt and answer token for token, plus the template's rendering of
        what follows: the model sees its own sampled tokens, not a re-tokenisation of their
        text, and the calls concatenate into one training sequence."""
        prev = self.completions_made[-1] if self.completions_made else None
        if (
            self.extend_turns
            and prev is not None
            and prev.tools == tools
            and _continues(messages, prev)
        ):
            asked = render_chat(prev.messages, self.tokenizer, tools=tools)
            answered = messages[: len(prev.messages) + 1]
            head = render_chat(answered, self.tokenizer, add_generation_prompt=False, tools=tools)
            full = render_chat(messages, self.tokenizer, tools=tools)
            if full.startswith(head) and head.startswith(asked):
                glue = self._after_answer(head[len(asked) :], prev.output_ids)
                tail = self.tokenizer(glue + full[len(head) :], add_special_tokens=False)
                return prev.prompt_ids + prev.output_ids + tail.input_ids
        return chat_prompt(messages, self.tokenizer, tools)

    def _after_answer(self, reply: str, output_ids: list[int]) -> str:
        """The template's text after the model's own tokens of ``reply`` (the answer as the
        template renders it): what follows its EOS (ChatML's newline), as ``tidal sft`` lays a
        conversation out; the EOS too when the model stopped without one."""
        eos, eos_id = self.tokenizer.eos_token, self.tokenizer.eos_token_id
        at = reply.rfind(eos) if eos else -1
        if at < 0:
            return ""
        ended = bool(output_ids) and output_ids[-1] == eos_id
        return reply[at + len(eos) :] if ended else reply[at:]

    @cached_property
    def chat(self) -> RecordingChat:  # type: ignore[override]
        return RecordingChat(self)

    @cached_property
    def completions(self):  # type: ignore[override]
        raise NotImplementedError(
            "RecordingOpenAI records chat completions: use client.chat.completions.create"
        )

    def set_reward(self, completion_id: str, reward: float) -> None:
        """The reward of one completion (by the ``id`` of the ``ChatCompletion`` it returned)."""
        for record in self.completions_made:
            if record.id == completion_id:
                record.reward = float(reward)
                return
        raise KeyError(
            f"completion_id: no completion {completion_id!r} was recorded by this client"
        )

    def set_final_reward(self, reward: float) -> None:
        """The episode's reward, given to its last completion (earlier ones get it discounted
        on export, unless they have their own)."""
        if not self.completions_made:
            raise ValueError("set_final_reward: the episode made no completion")
        self.completions_made[-1].reward = float(reward)


def _continues(messages: list[dict], prev: Completion) -> bool:
    """Whether ``messages`` are the previous call's, then its answer, then more."""
    n = len(prev.messages)
    if prev.message is None or len(messages) <= n + 1:
        return False
    if [_turn(m) for m in messages[:n]] != [_turn(m) for m in prev.messages]:
        return False
    return _turn(messages[n]) == _turn(prev.message)


def _turn(message: dict) -> tuple[Any, ...]:
    """What identifies a turn: role, text and tool calls (by name and parsed arguments; their
    ids and the arguments' spelling may differ between the answer and the agent's copy)."""
    calls = tuple(
        (c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
        for c in message.get("tool_calls") or ()
    )
    return message.get("role"), message.get("content") or "", calls


def _arguments(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return args
    return json.dumps(args, sort_keys=True)


def _given(value: Any) -> Any:
    return None if value in _ABSENT else value


def _check_unsupported(kwargs: dict) -> None:
    for key, value in kwargs.items():
        if key in _IGNORED or value in _ABSENT:
            continue
        if key in _DEFAULT_ONLY and value in _DEFAULT_ONLY[key]:
            continue
        raise ValueError(f"{key}: not supported by tidal's recording client")


def _answer_text(tokenizer, response: ModelResponse, stop: list[str]) -> str:
    text = tokenizer.decode(response.output_tokens, skip_special_tokens=True)
    if response.stop_reason == "stop":
        cuts = [text.find(s) for s in stop if s in text]
        text = text[: min(cuts)] if cuts else text
    return text


@cache
def _idle_http_client():
    return openai.DefaultAsyncHttpxClient()


def chat_completion(record: Completion, tokenizer, with_logprobs: bool) -> dict:
    """A recorded completion as an OpenAI ``chat.completion`` body."""
    r = record.response
    logprobs = None
    if with_logprobs:
        content = []
        for tok, lp in zip(r.output_tokens, r.output_logprobs):
            s = tokenizer.decode([tok])
            content.append(
                {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            )
        logprobs = {"content": content}
    return {
        "id": record.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "tidal",
        "choices": [
            {
                "index": 0,
                "finish_reason": record.finish_reason,
                "message": record.message,
                "logprobs": logprobs,
            }
        ],
        "usage": {
            "prompt_tokens": r.input_len,
            "completion_tokens": r.output_len,
            "total_tokens": r.input_len + r.output_len,
        },
    }
