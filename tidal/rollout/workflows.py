"""Episodes for language agents: ``async def run_episode(data) -> LLMBatch | None``.

An episode returns an ``LLMBatch`` (tidal.data: padded ``[n, L]`` token ids, masks, behaviour
log-probs and per-token weight versions, and ``rewards`` ``[n]``), or ``None`` to reject.
Rewards run off the event loop with a timeout (:meth:`Reward.ascore`); an exception or a
timeout rejects that group and is counted.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.data import LLMBatch, TokenSequence
from tidal.inference import GenerationConfig, InferenceClient, ModelRequest, ModelResponse
from tidal.models.llm import render_prompt
from tidal.registry import Registry
from tidal.rollout.rewards import Reward

log = logging.getLogger(__name__)
RewardFn = Callable[..., float]
PromptRenderer = Callable[
    [Any], list[int]
]  # a record's prompt (text or chat messages) -> token ids


@dataclass(frozen=True)
class WorkflowContext:
    """What a workflow is built from (``rollout.workflow``'s factory receives it): the run's
    config (an ``LLMConfig``), its inference client, tokenizer and sampling defaults, and its
    training and held-out records."""

    cfg: Any
    client: InferenceClient
    tokenizer: Any
    gconfig: GenerationConfig
    train_data: Any
    eval_data: list[dict] = field(default_factory=list)


class Workflow(ABC):
    """The contract of an episode source. ``await workflow(record)`` plays one record's episode
    (its group of samples) and returns an ``LLMBatch``, or ``None`` to reject it; the rest have
    defaults a workflow overrides where it has something to say."""

    @abstractmethod
    async def __call__(self, data: dict[str, Any]) -> LLMBatch | None: ...

    def metrics(self) -> dict[str, float]:
        """Counters the run logs each step (``rollout/...``)."""
        return {}

    async def evaluate(self, records: list[dict], gconfig: GenerationConfig) -> dict | None:
        """Held-out metrics (``eval/...``) with ``gconfig`` (greedy); ``None``: the run scores
        single completions with the configured reward (``tidal.rollout.evaluation``)."""
        return None

    async def aclose(self) -> None:
        """Release what the workflow holds (sessions, processes, clients); nothing by default."""
        return None


class EpisodeFunction(Workflow):
    """A plain ``async def episode(record) -> LLMBatch | None`` as a ``Workflow``."""

    def __init__(self, episode: Callable[[dict], Any]):
        self.episode = episode

    async def __call__(self, data: dict[str, Any]) -> LLMBatch | None:
        return await self.episode(data)


def as_workflow(made: Any, source: str) -> Workflow:
    """What a workflow factory returned, as a ``Workflow`` (a plain async callable is wrapped);
    anything else is an error naming ``source``."""
    if isinstance(made, Workflow):
        return made
    if callable(made):
        return EpisodeFunction(made)
    raise TypeError(
        f"{source} returned {type(made).__name__}, not a workflow: return a "
        "tidal.rollout.workflows.Workflow or an async function record -> LLMBatch | None"
    )


# rollout.workflow: factory(WorkflowContext) -> Workflow; the built-in ones are registered by the
# language runner (tidal.runners.llm.workflows)
WORKFLOWS: Registry[Callable[[WorkflowContext], Workflow]] = Registry(
    "workflow", "rollout.workflow"
)


def add_response(seq: TokenSequence, resp: ModelResponse) -> None:
    seq.add_generated(resp.output_tokens, resp.output_logprobs, resp.output_versions)


def plain_renderer(tokenizer) -> PromptRenderer:
    """Prompt text after BOS, no chat template (the generated tasks' layout)."""
    return lambda prompt: render_prompt(tokenizer, prompt, chat_template=False)


class RLVRWorkflow(Workflow):
    """Single-turn RL from verifiable rewards: ``group_size`` samples per prompt, each scored by
    ``reward`` (a :class:`Reward`, or a plain ``fn(completion=..., **record)``) with the record's
    fields. ``render`` turns the record's ``prompt`` into token ids (default: plain text)."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer,
        reward: Reward | RewardFn,
        gconfig: GenerationConfig,
        group_size: int = 1,
        reward_timeout_s: float = 10.0,
        render: PromptRenderer | None = None,
        length_penalty: Callable[[int], float] | None = None,
    ):
        self.client, self.tokenizer, self.gconfig = client, tokenizer, gconfig
        self.length_penalty = length_penalty  # added to each reward by completion length
        self.reward = (
            reward
            if isinstance(reward, Reward)
            else Reward(getattr(reward, "__name__", "reward"), reward)
        )
        self.group_size, self.reward_timeout_s = group_size, reward_timeout_s
        self.render = render or plain_renderer(tokenizer)

    def metrics(self) -> dict[str, float]:
        """The reward's failures: errors and timeouts."""
        counters = self.reward.counters
        return {
            "rollout/reward_errors": counters.errors,
            "rollout/reward_timeouts": counters.timeouts,
        }

    async def __call__(self, data: dict[str, Any]) -> LLMBatch | None:
        prompt_ids = self.render(data["prompt"])
        # the whole group in one request: one HTTP round trip instead of group_size
        responses = await self.client.agenerate_n(
            ModelRequest(prompt_ids, self.gconfig), self.group_size
        )
        completions = [
            self.tokenizer.decode(r.output_tokens, skip_special_tokens=True) for r in responses
        ]
        rewards = await asyncio.gather(
            *(self.reward.ascore(c, data, self.reward_timeout_s) for c in completions)
        )
        if any(r is None for r in rewards):
            return None  # a group with a missing member cannot be normalised: reject it whole
        if self.length_penalty is not None:
            rewards = [
                r + self.length_penalty(len(x.output_tokens)) for r, x in zip(rewards, responses)
            ]
        seqs = []
        for resp in responses:
            seq = TokenSequence()
            seq.add_context(prompt_ids)
            add_response(seq, resp)
            seqs.append(seq)
        return LLMBatch.from_sequences(seqs, rewards, self.tokenizer.pad_token_id)


class MultiTurnWorkflow(Workflow):
    """Several turns against an environment: ``env = make_env(data)`` answers each completion
    with ``(feedback_text, reward, done)``; the feedback joins the context with loss mask 0.
    The episode's reward is the first positive turn reward discounted by ``turn_discount`` per
    extra turn (0 when no turn succeeds)."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer,
        make_env: Callable[[dict], Any],
        gconfig: GenerationConfig,
        max_turns: int = 4,
        turn_discount: float = 0.9,
        group_size: int = 1,
    ):
        self.client, self.tokenizer, self.make_env = client, tokenizer, make_env
        self.gconfig, self.max_turns, self.turn_discount, self.group_size = (
            gconfig,
            max_turns,
            turn_discount,
            group_size,
        )

    async def play(
        self, data: dict[str, Any], gconfig: GenerationConfig | None = None
    ) -> tuple[TokenSequence, float]:
        """One episode (with ``gconfig`` instead of the workflow's, e.g. greedy for evaluation)."""
        gconfig = gconfig or self.gconfig
        env = self.make_env(data)
        seq = TokenSequence()
        seq.add_context(
            [self.tokenizer.bos_token_id]
            + self.tokenizer.encode(data["prompt"], add_special_tokens=False)
        )
        reward = 0.0
        for turn in range(self.max_turns):
            resp = await self.client.agenerate(ModelRequest(list(seq.tokens), gconfig))
            add_response(seq, resp)
            feedback, turn_reward, done = env.step(
                self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            )
            if turn_reward > 0:
                reward = turn_reward * self.turn_discount**turn
            if done:
                break
            seq.add_context(self.tokenizer.encode(feedback, add_special_tokens=False))
        return seq, reward

    async def evaluate(self, records: list[dict], gconfig: GenerationConfig) -> dict:
        """The success rate of one episode per record with ``gconfig`` (greedy)."""
        episodes = await asyncio.gather(*(self.play(d, gconfig) for d in records))
        return {"eval/success_rate": sum(r > 0 for _, r in episodes) / len(episodes)}

    async def __call__(self, data: dict[str, Any]) -> LLMBatch | None:
        results = await asyncio.gather(*(self.play(data) for _ in range(self.group_size)))
        return LLMBatch.from_sequences(
            [s for s, _ in results], [r for _, r in results], self.tokenizer.pad_token_id
        )


def has_reward_spread(episode: LLMBatch) -> bool:
    """Whether an episode's samples (a prompt's group) differ in reward: a group whose rewards
    are all equal gives every sample a zero group-relative advantage (DAPO drops it)."""
    rewards = episode.rewards
    return bool(len(rewards) > 1 and (rewards != rewards[0]).any())


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` generated tokens, then
    falling linearly to ``-factor`` at ``max_tokens`` (a completion cut off by the budget)."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -factor * min(1.0, (length - start) / buffer)
