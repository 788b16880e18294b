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
``n=1``. Anything else that would change the answer (tools, penalties, streaming, ``n>1``)
raises ``ValueError`` naming it: tool calls are run by the workflow from the text.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from tidal.extras import needs_extra

with needs_extra("agents", "agent workflows on the OpenAI SDK"):
    import openai
    from openai.resources.chat import AsyncChat
    from openai.resources.chat.completions import AsyncCompletions
    from openai.types.chat import ChatCompletion

from tidal.inference.chat_template import chat_prompt, render_chat
from tidal.inference.client import InferenceClient, ModelRequest, ModelResponse
from tidal.inference.params import GenerationConfig

_ABSENT = (None, openai.NOT_GIVEN)
# arguments accepted at these values only (anything else would change the answer)
_DEFAULT_ONLY = {
    "n": (1,),
    "stream": (False,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "tools": ([],),
    "tool_choice": ("none",),
    "logit_bias": ({},),
    "top_logprobs": (0,),
    "response_format": ({"type": "text"},),
    "store": (True, False),
}
_IGNORED = {"model", "user", "metadata", "extra_headers", "extra_query", "timeout", "service_tier"}


@dataclass
class Completion:
    """One recorded chat completion."""

    id: str
    messages: list[dict]
    prompt_ids: list[int]
    response: ModelResponse  # output tokens, behaviour log-probs, per-token weight versions
    text: str
    reward: float | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.response.output_tokens


class RecordingChatCompletions(AsyncCompletions):
    def __init__(self, owner: RecordingOpenAI):
        super().__init__(owner)
        self.owner = owner

    async def create(
        self,
        *,
        messages: Any,
        max_tokens: Any = None,
        max_completion_tokens: Any = None,
        temperature: Any = None,
        top_p: Any = None,
        stop: Any = None,
        seed: Any = None,
        logprobs: Any = None,
        extra_body: dict | None = None,
        **kwargs: Any,
    ) -> ChatCompletion:
        _check_unsupported({**kwargs, **(extra_body or {})})
        owner = self.owner
        messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
        prompt = owner.prompt_ids(messages)
        cfg = owner.gconfig
        budget = max_completion_tokens if max_completion_tokens not in _ABSENT else max_tokens
        overrides = {
            "max_new_tokens": budget,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": [stop] if isinstance(stop, str) else stop,
        }
        cfg = replace(cfg, **{k: v for k, v in overrides.items() if v not in _ABSENT}).validate(
            "create"
        )
        response = await owner.inference.agenerate(
            ModelRequest(prompt, cfg, session_id=owner.session_id)
        )
        text = _answer_text(owner.tokenizer, response, cfg.stop)
        record = Completion(f"chatcmpl-{uuid.uuid4().hex}", messages, prompt, response, text)
        owner.completions_made.append(record)
        return _chat_completion(record, owner.tokenizer, bool(logprobs not in _ABSENT and logprobs))


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
    ):
        # nothing goes over OpenAI's HTTP: the base URL is never contacted
        super().__init__(api_key="tidal", base_url="http://tidal.invalid/v1", max_retries=0)
        self.inference, self.tokenizer = inference, tokenizer
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.gconfig = gconfig or GenerationConfig(max_new_tokens=256, stop_token_ids=eos)
        self.session_id = session_id or uuid.uuid4().hex  # one episode's calls share a server
        self.completions_made: list[Completion] = []
        self.extend_turns = extend_turns

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The chat template's tokens for ``messages``. With ``extend_turns``, a conversation
        that continues the previous call (its messages, then its answer, then new messages)
        is the previous prompt and answer token for token, plus the template's rendering of
        what follows: the model sees its own sampled tokens, not a re-tokenisation of their
        text, and the calls concatenate into one training sequence."""
        prev = self.completions_made[-1] if self.completions_made else None
        if self.extend_turns and prev is not None and _continues(messages, prev):
            answered = prev.messages + [{"role": "assistant", "content": prev.text}]
            head = render_chat(answered, self.tokenizer, add_generation_prompt=False)
            full = render_chat(messages, self.tokenizer)
            if full.startswith(head):
                tail = self.tokenizer(full[len(head) :], add_special_tokens=False).input_ids
                return prev.prompt_ids + prev.output_ids + tail
        return chat_prompt(messages, self.tokenizer)

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
    n = len(prev.messages)
    if len(messages) <= n + 1 or [_turn(m) for m in messages[:n]] != [
        _turn(m) for m in prev.messages
    ]:
        return False
    return _turn(messages[n]) == ("assistant", prev.text)


def _turn(message: dict) -> tuple[Any, Any]:
    return message.get("role"), message.get("content")


def _check_unsupported(kwargs: dict) -> None:
    for key, value in kwargs.items():
        if key in _IGNORED or value in _ABSENT:
            continue
        if key in _DEFAULT_ONLY and value in _DEFAULT_ONLY[key]:
            continue
        raise ValueError(
            f"{key}: not supported by tidal's recording client"
            + (" (run tool calls in the workflow)" if key.startswith("tool") else "")
        )


def _answer_text(tokenizer, response: ModelResponse, stop: list[str]) -> str:
    text = tokenizer.decode(response.output_tokens, skip_special_tokens=True)
    if response.stop_reason == "stop":
        cuts = [text.find(s) for s in stop if s in text]
        text = text[: min(cuts)] if cuts else text
    return text


def _chat_completion(record: Completion, tokenizer, with_logprobs: bool) -> ChatCompletion:
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
    return ChatCompletion.model_validate(
        {
            "id": record.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "tidal",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop" if r.stop_reason == "stop" else "length",
                    "message": {"role": "assistant", "content": record.text},
                    "logprobs": logprobs,
                }
            ],
            "usage": {
                "prompt_tokens": r.input_len,
                "completion_tokens": r.output_len,
                "total_tokens": r.input_len + r.output_len,
            },
        }
    )
